"""Page: a view without a page script of its own (kvviz/views/<folder>/ with a Page entry and no pages/<folder>.py).
Its config's fields are its controls (kvviz.core.protocol.config_fields); its run goes through the protocol; its verdict,
figures and tables come from its registry entry; its downloads are every page's."""
import dataclasses

import streamlit as st

from kvviz import views
from kvviz.core.protocol import RunContext, config_fields, config_from
from pages.common import controls, page, show_verdict, verdict_and_chart, verdict_style
from pages.exporting import exports
from pages.runner import progress_bar, run_cached, show_error

view = views.for_page(st.session_state.get("_page", ""))
cls = view.config_type()
choice, lm = page(view.title, (cls.__doc__ or view.title).strip().split("\n\n")[0])
prefix, defaults = view.page.prefix, view.page.defaults
values = {}
with controls(expanded=True):
    for f in config_fields(cls):
        key, label, value = prefix + f.name, f.name.replace("_", " ").capitalize(), defaults.get(f.name, f.default)
        if f.kind == "bool":
            values[f.name] = st.checkbox(label, bool(value), key=key)
        elif f.kind == "choice":
            values[f.name] = st.radio(label, f.choices, index=f.choices.index(value), horizontal=True, key=key)
        elif f.kind == "list" and f.choices:
            values[f.name] = st.multiselect(label, f.choices, list(value), key=key)
        elif f.kind == "list":
            values[f.name] = st.text_input(label + " (comma-separated)", ",".join(value), key=key)
        elif f.kind in ("int", "float"):
            values[f.name] = st.number_input(label, value=value, step=1 if f.kind == "int" else None, key=key)
        else:
            values[f.name] = st.text_area(label, value, key=key, height=70) if f.name == "prompt" else \
                st.text_input(label, value, key=key)

try:
    cfg = config_from(cls, values)
except Exception as e:  # noqa: BLE001 - a bad control value: one line, the controls stay
    show_error(e)
    st.stop()


def compute():
    with progress_bar(f"{view.title}…") as report:
        return view.runner()(lm, cfg, RunContext(settings=choice.settings, progress=report))


try:
    res = run_cached(view.run_names()[0], {"model": choice.key, "cfg": dataclasses.asdict(cfg)}, compute)
except Exception as e:  # noqa: BLE001
    show_error(e)
    st.stop()
verdict, text = view.verdict_text(res)
left, right = verdict_and_chart()
with left:
    if view.verdict_is_html:
        st.html(text)
    show_verdict(str(verdict), "" if view.verdict_is_html else text, style=verdict_style(str(verdict)) or "info")
with right:
    for i, fig in enumerate(view.main_figures(res)):
        st.plotly_chart(fig, width="stretch", key=f"{view.name}_figure_{i}")
for table in view.main_tables(res):
    st.dataframe(table, hide_index=True, width="stretch")
exports(res, view.name, lm)
