"""kvviz — a Streamlit explorer of how a model's numbers change with a KV cache. Start with `make run`."""
import os

import streamlit as st

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

st.set_page_config(page_title="kvviz", page_icon=":material/troubleshoot:", layout="wide")

PAGES = [
    st.Page("pages/home.py", title="About kvviz", icon=":material/home:", default=True),
    st.Page("pages/split_point.py", title="Split point", icon=":material/content_cut:"),
    st.Page("pages/greedy_paths.py", title="Greedy paths", icon=":material/call_split:"),
    st.Page("pages/dtypes_lab.py", title="Dtypes side by side", icon=":material/stacked_line_chart:"),
    st.Page("pages/padding_lab.py", title="Padding and batching", icon=":material/grid_on:"),
    st.Page("pages/cache_reuse.py", title="Prompt-cache reuse", icon=":material/recycling:"),
    st.Page("pages/loading_trap.py", title="Loading trap", icon=":material/swap_horiz:"),
    st.Page("pages/backends.py", title="Backends & compile", icon=":material/memory:"),
    st.Page("pages/kv_cache.py", title="KV cache", icon=":material/database:"),
    st.Page("pages/quantized.py", title="Quantized cache & weights", icon=":material/compress:"),
    st.Page("pages/cache_safety.py", title="Is my model cache-safe?", icon=":material/verified_user:"),
    st.Page("pages/serving.py", title="Serving", icon=":material/dns:"),
    st.Page("pages/open_result.py", title="Open a result", icon=":material/folder_open:"),
    st.Page("pages/guide.py", title="Guide", icon=":material/menu_book:"),
    st.Page("pages/glossary.py", title="Glossary", icon=":material/dictionary:"),
]

nav = st.navigation(PAGES)
from pages.common import remember, sidebar  # noqa: E402  (after set_page_config)

st.session_state.pop("_top_slot", None)  # each page makes its own (pages.common.page)
st.session_state["_stop_seq"] = 0  # the Stop buttons of this run's progress bars
remember()  # page controls survive page switches and come from a link
st.session_state["model_choice"] = sidebar()
try:
    nav.run()
finally:
    st.session_state.pop("_stop_requested", None)  # a Stop clicked after its run ended stops nothing later
