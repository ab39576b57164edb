"""Page: the split comparison in several dtypes at once, for one prompt or over a prompt set."""
import streamlit as st

import kvviz
from kvviz import views
from kvviz.views.dtypes import figures as dtypes_figures
from kvviz.views.dtypes.run import DtypesConfig
from kvviz.teach.firstscreen import dtypes_line
from pages.common import controls, page, prompt_set, show_verdict, verdict_and_chart
from pages.runner import run_or_stop
from pages.ab import ab_run, show_ab
from pages.defaults import DEFAULTS
from pages.exporting import exports

choice, lm = page("Dtypes side by side",
                 "How fast does the cached-vs-full gap grow across layers in float16, bfloat16 and float32, raw and in "
                 "units of each dtype's machine epsilon? float64 is the reference every verdict is checked against.")

with controls():
    source, prompts = prompt_set("dtypes", ["one prompt", "built-in set", "upload a file"],
                                 DEFAULTS["dtypes"]["prompt"], None, 20)
    c1, c2, c3 = st.columns(3)
    dtypes = c1.multiselect("Dtypes (float64 always runs)", ["float32", "float16", "bfloat16"],
                            default=list(DEFAULTS["dtypes"]["dtypes"]), key="dtypes_dtypes")
    split = c2.selectbox("Split", ["last", "half"], key="dtypes_split",
                         format_func={"last": "all but the last token cached", "half": "half cached"}.get)
    mode = c3.radio("Feed the rest", ["chunk", "step"], horizontal=True, key="dtypes_mode")

VIEW = views.get("dtypes")
cfg = DtypesConfig(tuple(prompts), tuple(dtypes), split, mode)
res = run_or_stop(VIEW, lm, cfg, ignores=("dtype",), label=f"Running {len(prompts)} prompt(s) × {len(dtypes) + 1} "
               "dtypes…")  # the sidebar's model, whatever its dtype: the sweep runs its twins in each dtype

left, right = verdict_and_chart((1, 2))
with left:
    verdict, explanation, fix = dtypes_line(res)  # an identical dtype says why, with the one click that shows a gap
    show_verdict(verdict, explanation)
    if fix:
        st.button("Cache half, rest token by token", key="dtypes_show_gap",
                  help="Cache half the prompt and feed the rest one token at a time: many 1-row products, where "
                       "16-bit roundings part",
                  on_click=st.session_state.update, icon=":material/visibility:", type="primary",
                  kwargs={"dtypes_split": "half", "dtypes_mode": "step"})
    counts = res.verdict_counts()
    st.markdown("**Verdicts per dtype** (float64 is the reference)")
    st.dataframe(counts, width="stretch")
    metric = st.radio("Show", ["max_abs", "eps_units"], horizontal=True, key="dtypes_metric",
                      format_func={"max_abs": "raw max |Δ|", "eps_units": "in units of each dtype's ε"}.get)
    how = st.radio("Over the prompts", ["mean", "max"], horizontal=True, key="dtypes_how")
with right:
    st.plotly_chart(dtypes_figures.dtype_curves(res, metric, how), width="stretch", key="dtypes_chart")
st.subheader(f"Layers × dtypes ({how} over {len(res.prompts)} prompt{'s' if len(res.prompts) != 1 else ''})")
st.dataframe(res.stat(metric, how).style.format("{:.3g}"), width="stretch")
with st.expander("A/B: this sweep against one other setting, on one scale"):
    b = ab_run(VIEW, choice, lm, cfg, {"feed mode": ("mode", [m for m in ("chunk", "step") if m != mode])},
               "Runs the sweep once more with B's setting", exclude=("dtype",), ignores=("dtype",))
    if b is not None:
        show_ab(dtypes_figures.ab_dtype_curves(res, b.result, b.label_a, b.label_b, metric, how), "dtypes",
                "Both charts on one y range; the third is |B − A| per dtype and layer.")
checked = [(d, x) for d, xs in res.proved.items() for x in xs if x is not None]
if checked:
    ok = sum(1 for _, x in checked if x)
    st.success(f":material/lock: Precision — proved for {ok} of {len(checked)} precision verdicts: in invariant "
               "mode (every row computed the same way whatever the shape) the cached run equals the full forward bit "
               "for bit.")
st.caption(f"Device: {res.settings.device}; float64 reference on {res.settings.float64_device}. On a CPU some "
           "16-bit kernels compute in float32 and round once at the end, unlike GPU kernels, so 16-bit gaps here can "
           f"be smaller (or exactly zero) where a GPU shows them. Computed in {res.elapsed_s:.1f} s.")
try:  # the sweep's own float64 model (loaded already): its source and tokenizer build the repro script
    lm64 = kvviz.load_model(choice.model_spec, "float64", res.settings.float64_device, choice.attn,
                            trust_remote_code=choice.trust_remote_code)
except Exception:  # noqa: BLE001 - the exports then go without the fingerprint and the script
    lm64 = None
exports(res, "dtypes", lm64)
