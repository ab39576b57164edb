"""kvviz — a Streamlit explorer of how a model's numbers change with a KV cache. Start with `make run`."""
import os

import streamlit as st

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

st.set_page_config(page_title="kvviz", page_icon=":material/troubleshoot:", layout="wide")
# A fresh server's first run starts as Streamlit's plain pages/ app (its flat list of pages/*.py file names) until
# st.navigation below takes over, seconds later (kvviz's imports): that list is hidden meanwhile (pages/__init__.py).
from pages import HIDE_RAW_NAV  # noqa: E402  (light: streamlit only)

st.html(HIDE_RAW_NAV)
from pages.common import NAV, OLD_URLS, PAGE_TITLES, nav_page, show_notes, sidebar  # noqa: E402  (after set_page_config)
from pages.state import remember, scenario_guard  # noqa: E402
from pages.runner import freeze_what_lives  # noqa: E402

freeze_what_lives()  # the imports' objects are not walked by the collection after every rerun (pages.runner)

# Navigation in sections (pages.common.NAV: one place for every page's file, title and icon), always expanded:
# no page hidden behind "View more". A view's page is at its view's name (PAGE_URLS: /split for pages/split.py).
BY_STEM = {stem: nav_page(stem) for items in NAV.values() for stem, _, _ in items}


def _moved() -> None:  # never drawn: app.py sends an older URL on before any page runs
    pass


# An older URL of a page (a saved link to /split_point, the page's URL before the pages took their views' names): a hidden page, so that Streamlit does not answer "page not
# found"; below, it sends the browser on to the page's own URL with the link's settings.
OLD = {old: st.Page(_moved, title=PAGE_TITLES[stem], url_path=old, visibility="hidden")
       for old, stem in OLD_URLS.items()}
PAGES = {section: [BY_STEM[stem] for stem, _, _ in items]
         + [page for old, page in OLD.items() if OLD_URLS[old] in {stem for stem, _, _ in items}]
         for section, items in NAV.items()}
STEM = {p.url_path: stem for stem, p in BY_STEM.items()}
# .streamlit/config.toml starts with the sidebar navigation off, so that a fresh server's first run (Streamlit's plain
# pages/ app, before app.py) draws no flat list of file names; app.py's own navigation is drawn.
st.set_option("client.showSidebarNavigation", True)
nav = st.navigation(PAGES, expanded=True)
if nav.url_path in OLD_URLS:
    link = st.query_params
    st.switch_page(BY_STEM[OLD_URLS[nav.url_path]], query_params=[(k, v) for k in link for v in link.get_all(k)])

st.session_state.pop("_top_slot", None)  # each page makes its own (pages.common.page)
st.session_state.pop("_msg_slot", None)
st.session_state["_stop_seq"] = 0  # the Stop buttons of this run's progress bars
remember()  # page controls survive page switches and come from a link
st.session_state["_page"] = STEM.get(nav.url_path, "")  # the page this run draws (pages.common.page reads it)
st.session_state["_page_title"] = nav.title if nav.url_path in STEM else ""  # its title (a run names it to others)
scenario_guard(st.session_state["_page"])  # leaving a one-click scenario brings the defaults back
st.session_state["model_choice"] = sidebar()
try:
    nav.run()
    show_notes()  # a run's side notes that no verdict box drew (pages.common.show_notes)
finally:
    st.session_state.pop("_stop_requested", None)  # a Stop clicked after its run ended stops nothing later
