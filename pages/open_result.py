"""Page: open a result exported by kvviz (JSON) and look at it again - no model is loaded or run."""
import streamlit as st

from kvviz import figures
from kvviz.export import main_figures, open_result, verdict_text
from pages.common import page, show_verdict
from pages.runner import show_error
from pages.exporting import exports

page("Open a result",
     "A result downloaded from any page (Result JSON) opens here as it was: verdict, charts and tables, without "
     "loading or running any model. If it was computed with other versions or on another device, it says so.",
     needs_model=False)
from kvviz.meeting import default_dir, prepared  # noqa: E402

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
settings = getattr(res, "settings", None)
settings = settings if isinstance(settings, dict) else settings.to_dict() if settings is not None else res.to_dict()
st.caption(f"A **{opened.view}** result of `{settings.get('model')}` in {settings.get('dtype', '—')} on "
           f"{settings.get('device', '—')}.")
if opened.environment_differences:
    st.warning("Computed elsewhere — its numbers may not be reproduced bit for bit here: "
               + "; ".join(opened.environment_differences[:6]), icon="ℹ️")
verdict, text = verdict_text(res)
if opened.view in ("split", "greedy", "quant", "loading_trap", "bisect"):
    show_verdict({"different models": "logic", "same model": "identical"}.get(verdict, verdict), text)
elif opened.view == "check":
    {"safe": st.success, "lossy": st.warning, "unsafe": st.error}.get(res.overall, st.info)(
        f"**{res.overall.upper()}** — {res.summary}")
for i, fig in enumerate(main_figures(res)):
    st.plotly_chart(fig, width="stretch", key=f"open_fig_{i}")
if opened.view == "dtypes":
    st.dataframe(res.verdict_counts(), width="stretch")
elif opened.view == "padding":
    st.dataframe(res.grid("verdict"), width="stretch")
elif opened.view == "reuse":
    st.dataframe(figures.reuse_frame(res), hide_index=True, width="stretch")
elif opened.view == "quant":
    st.dataframe(figures.quant_frame(res), hide_index=True, width="stretch")
elif opened.view == "check":
    st.dataframe([{"status": c.status, "check": c.name, "evidence": c.evidence} for c in res.checks],
                 hide_index=True, width="stretch")
elif opened.view == "loading_trap":
    a, b = st.columns(2)
    a.text(res.loaded_text)
    b.text(res.cast_text)
elif opened.view == "serving":
    from kvviz.serving import prompt_frame

    st.info(f"**{verdict}** — {text}")
    st.dataframe(prompt_frame(res), hide_index=True, width="stretch")
elif opened.view == "split" and res.main.has_cache:
    st.dataframe(figures.logits_frame(res), hide_index=True, width="stretch")
if opened.view in ("kv_reload", "kv_size"):
    {"bitwise equal": st.success, "differs": st.error}.get(verdict, st.info)(text)
with st.expander("Settings"):
    st.json(settings)
exports(res, f"{opened.view}-reopened")
