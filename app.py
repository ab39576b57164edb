"""kvviz — a Streamlit explorer of how a model's numbers change with a KV cache. Start with `make run`."""
import os

import streamlit as st

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

st.set_page_config(page_title="kvviz", page_icon=":material/troubleshoot:", layout="wide")
from pages.common import NAV, sidebar  # noqa: E402  (after set_page_config)
from pages.state import remember, scenario_guard  # noqa: E402

# Navigation in sections (pages.common.NAV: one place for every page's file, title and icon), always expanded:
# no page hidden behind "View more".
BY_STEM = {stem: st.Page(f"pages/{stem}.py", title=title, icon=icon, default=stem == "home")
           for items in NAV.values() for stem, title, icon in items}
PAGES = {section: [BY_STEM[stem] for stem, _, _ in items] for section, items in NAV.items()}
STEM = {p.url_path: stem for stem, p in BY_STEM.items()}
nav = st.navigation(PAGES, expanded=True)

st.session_state.pop("_top_slot", None)  # each page makes its own (pages.common.page)
st.session_state.pop("_msg_slot", None)
st.session_state["_stop_seq"] = 0  # the Stop buttons of this run's progress bars
remember()  # page controls survive page switches and come from a link
st.session_state["_page"] = STEM.get(nav.url_path, "")  # the page this run draws (pages.common.page reads it)
scenario_guard(st.session_state["_page"])  # leaving a one-click scenario brings the defaults back
st.session_state["model_choice"] = sidebar()
try:
    nav.run()
finally:
    st.session_state.pop("_stop_requested", None)  # a Stop clicked after its run ended stops nothing later
