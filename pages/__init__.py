"""kvviz's pages (app.py lists them). Every page script imports this package first, so a fresh server's very first
request (a deep link such as /split runs as a plain pages/ app: ensure_navigation) is handed to app.py here, before
the page's own imports (seconds) keep Streamlit's raw list of pages/ file names on screen."""
import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

try:
    from streamlit.runtime.pages_manager import PagesManager
except ImportError:  # pragma: no cover - other Streamlit versions
    PagesManager = None

# Streamlit's plain pages/ navigation (a flat list of file names, no section headers) is never shown; app.py's
# sectioned one is. A style-only st.html takes no room on the page.
HIDE_RAW_NAV = ('<style>[data-testid="stSidebarNav"]:not(:has([data-testid="stNavSectionHeader"]))'
                '{visibility:hidden}</style>')


def ensure_navigation() -> None:
    """Call first in every page. Streamlit runs a fresh server's very first request, when it is a deep link such as
    /split, as a plain pages/ app (the script on its own, without app.py); app.py's st.navigation switches that off
    for good. Here it is switched off and the page reruns inside app.py, with the shared sidebar."""
    if PagesManager is None:  # other Streamlit versions
        return
    if PagesManager.uses_pages_directory or "model_choice" not in st.session_state:
        PagesManager.uses_pages_directory = False
        st.rerun()


def _in_a_plain_pages_run() -> bool:
    if PagesManager is None:  # other Streamlit versions
        return False
    return bool(PagesManager.uses_pages_directory) and get_script_run_ctx(suppress_warning=True) is not None


if _in_a_plain_pages_run():
    st.html(HIDE_RAW_NAV)  # at once: the rerun into app.py takes a moment on a busy machine
    ensure_navigation()
