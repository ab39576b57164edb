"""Page: open a result exported by kvviz (JSON) and look at it again - no model is loaded or run."""
import streamlit as st

from kvviz import views
from kvviz.core.errors import KvvizError, first_line
from kvviz.io.export import open_result
from kvviz.core.plotting import plain_index
from pages.common import page, show_verdict, verdict_style
from pages.runner import show_error
from pages.exporting import exports

page("Open a result",
     "A result downloaded from any page (Result JSON) opens here as it was: verdict, charts and tables, without "
     "loading or running any model. If it was computed with other versions or on another device, it says so.",
     needs_model=False)
from kvviz.teach.meeting import default_dir, prepared  # noqa: E402

ready = prepared(default_dir())  # "Prepare the meeting" (Home) left these: they open at once, no model runs
data = None
if ready:
    titles = ["—"] + [t for t, _ in ready]
    pick = st.selectbox("Prepared for the meeting", titles, key="open_prepared",
                        help="Results precomputed with Home's “Prepare the meeting”; pick one to show it at once")
    bundle = default_dir() / "meeting.html"
    if bundle.is_file():
        st.download_button("All prepared results in one report (HTML)", bundle.read_bytes(),
                           file_name="kvviz-meeting.html", mime="text/html", key="dl_meeting", on_click="ignore")
    if pick != "—":
        data = dict(ready)[pick].read_bytes()
up = st.file_uploader("A kvviz result (.json)", type=["json"], key="open_upload")
if up is not None:
    data = up.getvalue()
if data is None:
    st.info("Upload a result file exported from one of the pages (or with `python -m kvviz … --json-out FILE`)"
            + (", or pick a prepared one." if ready else "."))
    st.stop()
try:
    opened = open_result(data)
except Exception as e:  # noqa: BLE001
    show_error(e)
    st.stop()
res = opened.result
view = views.get(opened.view)  # the registry: the view's verdict line, charts and tables, as its page draws them
try:  # everything drawn is built first: a damaged field is one line, never half a result above an exception
    settings = getattr(res, "settings", None)
    settings = settings if isinstance(settings, dict) else settings.to_dict() if settings is not None else res.to_dict()
    verdict, text = view.verdict_text(res)
    if not isinstance(verdict, str) or not isinstance(text, str):
        raise TypeError("its verdict is not text")
    style = None if view.verdict_is_html else verdict_style(verdict) or "info"
    figures = list(view.main_figures(res))
    tables = list(view.main_tables(res))
except Exception as e:  # noqa: BLE001 - a file is input: any failure to draw it is one line
    show_error(KvvizError(f"this {opened.view} result is incomplete or damaged: it cannot be drawn "
                          f"({type(e).__name__}: {first_line(e, 120, fallback='')})"))
    st.stop()
st.caption(f"A **{opened.view}** result of `{settings.get('model')}` in {settings.get('dtype', '—')} on "
           f"{settings.get('device', '—')}.")
if opened.environment_differences:
    st.warning("Computed elsewhere — its numbers may not be reproduced bit for bit here: "
               + "; ".join(opened.environment_differences[:6]), icon="ℹ️")
if style is not None:  # (dtypes, padding, reuse: the verdict is their table, below)
    show_verdict(verdict, text, style=style)
for i, fig in enumerate(figures):
    st.plotly_chart(fig, width="stretch", key=f"open_fig_{i}")
for table in tables:
    st.dataframe(table, width="stretch", hide_index=plain_index(table))
with st.expander("Settings"):
    st.json(settings)
exports(res, f"{opened.view}-reopened", saved=data)
