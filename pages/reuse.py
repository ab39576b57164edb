"""Page: one prompt cache reused for several continuations."""
import streamlit as st

from kvviz import views
from kvviz.views.reuse import figures as reuse_figures, report as reuse_report
from kvviz.views.reuse.run import REUSE_STRATEGIES, ReuseConfig
from pages.common import controls, page, show_verdict
from pages.runner import run_or_stop
from pages.ab import ab_run
from pages.defaults import DEFAULTS
from pages.exporting import exports

choice, lm = page("Prompt-cache reuse",
                  "Cache a shared prefix once and reuse it for several continuations: **deepcopy** (a copy of the "
                  "prefix cache per continuation), **reused** (the same cache object again after an earlier "
                  "continuation grew it - the common bug), against **fresh** (no prefix cache: the reference). "
                  "Greedy texts side by side, where they part from fresh, and why.")
with controls():
    prefix = st.text_area("Shared prefix", DEFAULTS["reuse"]["prefix"], key="reuse_prefix", height=70)
    conts = st.text_area("Continuations (one a line; write \\n for a line break)",
                         "\n".join(c.replace("\n", "\\n") for c in DEFAULTS["reuse"]["continuations"]),
                         key="reuse_conts", height=110)
    n = st.number_input("New tokens per continuation", 1, 256, DEFAULTS["reuse"]["n"], key="reuse_n")
    prove = st.toggle("Prove precision gaps (rerun in invariant mode; slower)", DEFAULTS["reuse"]["prove"],
                      key="reuse_prove", help="Off by default so the texts come quickly; float64 decides the verdicts.")
merged = [c.replace("\\n", "\n") for c in conts.splitlines() if c.strip()]
VIEW = views.get("reuse")
cfg = ReuseConfig(prefix, tuple(merged), int(n))
proof = None if prove else False  # the context's prove: the automatic proof, or none (its memory plan with it)
res = run_or_stop(VIEW, lm, cfg, prove=proof, label="Decoding…")

show_verdict(*reuse_report.worst_way(res))
for i, cont in enumerate(res.settings.continuations):
    st.markdown(f"**Continuation {i + 1}**")
    st.text(cont)
    cols = st.columns(3)
    for col, (strategy, desc) in zip(cols, REUSE_STRATEGIES.items()):
        run = next(r for r in res.runs if r["index"] == i and r["strategy"] == strategy)
        if strategy == "fresh":
            col.markdown("**fresh** — the reference")
        else:
            parts = ("same tokens as fresh" if run["first_divergence"] is None else
                     f"parts from fresh at step {run['first_divergence']}")
            box = {"identical": col.success, "precision": col.info, "logic": col.error}.get(run["verdict"], col.info)
            proof = {True: " :material/lock: proved: bit for bit the fresh run in invariant mode",
                     False: " (in invariant mode it still differs: logic)"}.get(run.get("proved"), "")
            box(f"**{strategy}** — {run['verdict']}, {parts}{proof}")
        col.text(run["text"])
        col.caption(desc)
with st.expander("A/B: these continuations under one other setting"):
    b = ab_run(VIEW, choice, lm, cfg, {}, "Decodes once more with B's setting", prove=proof)
    if b is not None:
        st.dataframe(reuse_figures.ab_reuse_frame(res, b.result), hide_index=True, width="stretch")
        st.caption("Each way of reusing the prefix under A and B: verdict, the largest relative logit gap to a "
                   "fresh prefill, and the text.")
st.subheader("All runs")
st.dataframe(reuse_figures.reuse_frame(res), hide_index=True, width="stretch")
st.caption("Verdicts: the largest relative logit gap to the fresh run while both saw the same tokens, and the same "
           "in float64: a gap that closes in float64 is precision, one that stays is logic. "
           f"{res.settings.dtype} on {res.settings.device}.")
exports(res, "reuse", lm)
