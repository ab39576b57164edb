"""Page: the same prompt alone, left-padded and in a batch, with cache settings right and wrong."""
import streamlit as st

from kvviz import views
from kvviz.views.padding import figures as padding_figures
from kvviz.views.padding.run import PaddingConfig
from kvviz.teach.firstscreen import padding_line
from pages.common import controls, page, show_verdict
from pages.runner import run_or_stop
from pages.ab import ab_run, show_ab
from pages.defaults import DEFAULTS
from pages.exporting import exports

choice, lm = page("Padding and batching",
                  "Why does left padding or batching change the output? Every cell is the prompt's hidden states "
                  "compared with the prompt alone, without cache and without padding; the colour is the verdict from "
                  "rerunning that very cell in float64.")
with controls():
    prompt = st.text_area("Prompt", DEFAULTS["padding"]["prompt"], key="padding_prompt", height=80)
    c1, c2 = st.columns(2)
    left_pad = c1.number_input("Left padding (pad tokens)", 0, 64, DEFAULTS["padding"]["left_pad"], key="padding_pad")
    split = c2.number_input("Split point (0 = half the prompt)", 0, 4096, 0, key="padding_split")
    prove = st.toggle("Prove the precision cells (rerun the grid in invariant mode; slower)",
                      DEFAULTS["padding"]["prove"], key="padding_prove",
                      help="Off by default so the grid comes quickly; the float64 rerun decides every verdict anyway.")

VIEW = views.get("padding")
cfg = PaddingConfig(prompt, int(split) or None, int(left_pad))
proof = None if prove else False  # the context's prove: the automatic proof, or none (its memory plan with it)
res = run_or_stop(VIEW, lm, cfg, prove=proof, label="Running the grid…")

show_verdict(*padding_line(res))  # the grid's worst cell, in words, before the grid
value = st.radio("Number in the cells", ["hidden_relative", "logits_relative"], horizontal=True, key="padding_value",
                 format_func={"hidden_relative": "hidden states", "logits_relative": "logits"}.get)
st.plotly_chart(padding_figures.padding_grid(res, value), width="stretch", key="padding_grid")
st.markdown("""
* **no cache** — padding or batching alone: other matrix shapes, so rounding differs — *precision*.
* **cache** — correct position ids and mask: still only rounding.
* **positions omitted** — with pads the model numbers the new tokens from the cache length, counting the pads —
  *logic*.
* **mask new-only** — transformers lines a short mask up with the first positions and pads it with zeros, so the new
  tokens cannot see the latest keys — *logic*, even without padding.
""")
st.dataframe(res.grid("verdict"), width="stretch")
for c in res.cells:  # a cell the model's own forward cannot run: its one-line reason
    if c.get("reason"):
        st.caption(f"**{c['placement']} / {c['scenario']}** — {c['reason']}")
with st.expander("A/B: this grid against one other setting, on one colour scale"):
    b = ab_run(VIEW, choice, lm, cfg, {}, "Runs the grid once more with B's setting", prove=proof)
    if b is not None:
        show_ab(padding_figures.ab_padding_grids(res, b.result, b.label_a, b.label_b, value), "padding",
                "The cells' relative gaps (log₁₀) on one colour scale; exact zeros are written 0 and left grey; the "
                "third grid is |B − A|.", side_by_side=False)
proved = [c for c in res.cells if c["proved"] is not None]
if proved:
    n_ok = sum(c["proved"] for c in proved)
    st.success(f":material/lock: Precision — proved for {n_ok} of {len(proved)} precision cells: in invariant mode "
               "(every row computed the same way whatever the shape) their gap is exactly 0.")
if choice.invariant:
    st.info(":material/lock: Invariant mode is on: cells whose logic is right are bit for bit the prompt alone; the "
            "rest is logic.")
st.caption(f"Split at token {res.settings.split} of {len(res.tokens)}; {res.settings.dtype} on "
           f"{res.settings.device}; batch companions of {res.settings.companions} tokens.")
exports(res, "padding", lm)
