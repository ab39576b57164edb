"""Page: from_pretrained(dtype=16-bit) vs float32 + .to(16-bit): two different models."""
import streamlit as st

from pages.defaults import DEFAULTS
from kvviz.views.loading_trap import figures as loading_trap_figures
from kvviz.views.loading_trap.run import LoadingTrapConfig
from pages.common import controls, page, show_verdict, side_by_side, verdict_and_chart
from pages.runner import run_or_stop
from pages.exporting import exports

choice, lm = page("Loading trap",
                  "Loading a model in float32 and calling .to(bfloat16) also casts buffers such as the rotary "
                  "frequencies, which from_pretrained(dtype=bfloat16) keeps in float32: two different models, whose "
                  "greedy texts can part although no cache is involved.")
with controls():
    prompt = st.text_area("Prompt", DEFAULTS["loading_trap"]["prompt"], key="loading_trap_prompt", height=70)
    c1, c2 = st.columns(2)
    n = c1.number_input("New tokens", 1, 256, DEFAULTS["loading_trap"]["n"], key="loading_trap_n")
    dtype = c2.radio("16-bit dtype", ["bfloat16", "float16"], horizontal=True, key="loading_trap_dtype")

# its two loadings are its own: the sidebar's dtype is not one of its inputs
res = run_or_stop("loading_trap", lm, LoadingTrapConfig(prompt, int(n), dtype), ignores=("dtype",),
                  label="Decoding with both models…")
left, right = verdict_and_chart()
with left:
    show_verdict({"different models": "logic", "same model": "identical"}.get(res.verdict, res.verdict),
                 res.explanation)
with right:
    st.plotly_chart(loading_trap_figures.loading_trap_steps(res), width="stretch", key="loading_trap_chart")
side_by_side((f"**from_pretrained(dtype={dtype})**", res.loaded_text),
             (f"**float32, then .to({dtype})**", res.cast_text))
if res.buffers:
    st.dataframe([{"buffer": x.name, "from_pretrained": x.loaded_dtype, ".to()": x.cast_dtype, "max |Δ|": x.max_abs}
                  for x in res.buffers], hide_index=True, width="stretch")
exports(res, "loading_trap", lm)
