import streamlit as st

from pages.common import ensure_navigation

ensure_navigation()

st.title("kvviz: why does the KV cache change my numbers?")
st.markdown("""
When a model runs with a **KV cache** (`past_key_values`), it computes the new tokens against stored keys and
values instead of recomputing the whole sequence. In exact arithmetic both ways give the same numbers. In practice
they sometimes don't, for two very different reasons:

* **precision** — 16-bit (and even 32-bit) arithmetic rounds; the cached run multiplies matrices of other shapes,
  so sums are taken in another order and round differently. Harmless in itself, but it can flip a near tie.
* **logic** — the cached run is fed the wrong thing: position ids left out with a left-padded prompt, an attention
  mask that covers only the new tokens, or a model that is not causal at all (RoBERTa).

kvviz tells them apart the way a numerical analyst would: **rerun the very same scenario in float64**. If the gap
closes, it was precision; if it stays, it is logic.

**Pages**
* **Split point** — feed a prefix, cache it, feed the rest: where (layer × token) and how much the numbers differ
  from one full forward, against the dtype's machine epsilon, with a verdict.
* **Greedy paths** — decode with and without cache (and with `generate()`, and the loop people write): the texts
  side by side, the step where they part, the top-2 margin there, and the verdict for that step.
* **Dtypes side by side** — float64, float32, float16 and bfloat16 per layer on one chart, raw and in units of each
  dtype's epsilon, for one prompt or averaged over a prompt set (built in, or your own file).
* **Padding and batching** — the same prompt alone, left-padded and in a batch, with cache settings right and
  wrong: which effect is precision and which is logic.
* **Prompt-cache reuse** — one prefix cache reused for several continuations: deep copy, reused object, none.

Pick the model, dtype, device and attention implementation in the sidebar; they apply to every page.
""")
