"""Page: a view without a page script of its own (kvviz/views/<folder>/ with a Page entry). Its config's fields are its
controls (kvviz.core.protocol.config_fields, a field's `help` metadata their tooltip); under its title, its config's
`ABOUT` (a ClassVar written for users; the docstring is for developers); its run goes through the protocol; its verdict,
figures and tables come from its registry entry; its downloads are every page's.

Give such a view pages/<folder>.py, the three lines of docs/example_view/pages/next_token.py that run this page: a
fresh server looks its very first request's URL up among the pages/ file names before app.py runs ("Page not found"
without one; from the second request on app.py's navigation serves the view's URL with or without the file)."""
import dataclasses

import streamlit as st

from kvviz import views
from kvviz.core.protocol import config_fields, config_from
from pages.common import VERDICT_STYLE, controls, page, show_notes, show_verdict, verdict_and_chart, verdict_style
from pages.exporting import exports
from pages.runner import run_or_stop, show_error

view = views.for_page(st.session_state.get("_page", ""))
cls = view.config_type()
choice, lm = page(view.title, getattr(cls, "ABOUT", ""))
prefix, defaults = view.page.prefix, view.page.defaults
values = {}
# collapsed, as on every page that runs when it opens: the verdict and the chart keep the first screen (a config of five
# fields pushed them below it at 1280x720)
with controls():
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}
    for f in config_fields(cls):
        key, label, value = prefix + f.name, f.name.replace("_", " ").capitalize(), defaults.get(f.name, f.default)
        # its help: the field's own (`field(metadata={"help": ...})`), then the CLI option it is and its default
        shown = ",".join(f.default) if f.kind == "list" else f.default
        tip = " ".join(t for t in (meta[f.name].get("help", ""), f"The CLI's `kvviz {view.command} --"
                                   f"{f.name.replace('_', '-')}`; default: `{shown}`.") if t)
        # the value goes through session state, never `value=`: after Reset to defaults (which drops the keys) a
        # widget drawn with `value=` kept showing its old value in the browser while the run took the default
        if f.kind == "list":
            value = list(value) if f.choices else ",".join(value)
        st.session_state.setdefault(key, {"bool": bool, "int": int, "float": float}.get(f.kind, lambda v: v)(value))
        if f.kind == "bool":
            values[f.name] = st.checkbox(label, key=key, help=tip)
        elif f.kind == "choice":
            values[f.name] = st.radio(label, f.choices, horizontal=True, key=key, help=tip)
        elif f.kind == "list" and f.choices:
            values[f.name] = st.multiselect(label, f.choices, key=key, help=tip)
        elif f.kind == "list":
            values[f.name] = st.text_input(label + " (comma-separated)", key=key, help=tip)
        elif f.kind in ("int", "float"):
            values[f.name] = st.number_input(label, step=1 if f.kind == "int" else None, key=key, help=tip)
        else:
            values[f.name] = st.text_area(label, key=key, height=70, help=tip) if f.name == "prompt" else \
                st.text_input(label, key=key, help=tip)

try:
    cfg = config_from(cls, values)
except Exception as e:  # noqa: BLE001 - a bad control value: one line, the controls stay
    show_error(e)
    st.stop()

res = run_or_stop(view, lm, cfg)
verdict, text = view.verdict_text(res)


def verdict_box(verdict: str, text: str) -> None:
    """The verdict box. In presenter mode its headline is the view's own first sentence (the rest one click away):
    the library's headlines claim checks this page never ran ("Precision: the gap closes in float64.") or only repeat
    a view's own word ("Verdict: differs. Differs.")."""
    style = verdict_style(verdict) or "info"
    if not st.session_state.get("presenter") or view.verdict_is_html:
        show_verdict(verdict, "" if view.verdict_is_html else text, style=style)
        return
    first, _, rest = text.strip().partition(". ")
    {**VERDICT_STYLE, "info": st.info}[style](f"**Verdict: {verdict}.** {first.rstrip('.')}.")
    if rest:
        with st.expander("Why (the evidence)"):
            st.markdown(text)
    show_notes()


left, right = verdict_and_chart()
with left:
    if view.verdict_is_html:
        st.html(text)
    verdict_box(str(verdict), text)
with right:
    for i, fig in enumerate(view.main_figures(res)):
        # tick labels and axis titles push the margins; presenter mode's CSS draws a figure's text at 15 px after
        # plotly measured it at its own size: a figure made without kvviz.core.plotting.fit_text lost its y ticks'
        # first digits there ("00n" for 400n), so room for them is kept
        fig.update_xaxes(automargin=True)
        fig.update_yaxes(automargin=True)
        if st.session_state.get("presenter"):
            fig.update_layout(margin_l=max(fig.layout.margin.l or 0, 56))
        st.plotly_chart(fig, width="stretch", key=f"{view.name}_figure_{i}")
for table in view.main_tables(res):
    st.dataframe(table, hide_index=True, width="stretch")
exports(res, view.name, lm)
