"""Page: the terms the other pages use."""
import streamlit as st

from pages.common import ensure_navigation

ensure_navigation()
st.title("Glossary")
st.markdown("""
**KV cache (`cache` — `past_key_values` before transformers 5.24)** — the keys and values every attention layer computed for the tokens so far, kept so
the next token only computes its own row instead of the whole sequence again.

**Full forward** — one forward pass over the whole sequence without a cache: kvviz's reference.

**Split point k** — tokens before k are run first and cached; the rest is fed through that cache.

**Hidden state** — the vector a layer hands to the next, one per token. "embeddings" is the input to layer 1; the
last one is after the final norm.

**Machine epsilon (ε)** — the distance from 1.0 to the next number the dtype can represent: 2⁻²³ ≈ 1.2e-7 (float32),
2⁻¹⁰ ≈ 9.8e-4 (float16), 2⁻⁷ ≈ 7.8e-3 (bfloat16), 2⁻⁵² ≈ 2.2e-16 (float64). A relative gap of a few ε is a few
roundings.

**Relative gap** — max |Δ| over the vector divided by max |reference|.

**KL divergence** — how different two next-token distributions are (0: the same; in nats).

**Top-2 margin** — the winning logit minus the runner-up. When the margin is smaller than the rounding gap between
two runs, the choice can flip: a near tie.

**describe()** — pandas' summary of a set of numbers (mean, std, min, quartiles, max), here of the last position's
logits without and with the cache, and of their difference.

**precision / logic / identical** — kvviz's verdict. *identical*: bit for bit the same. *precision*: the gap closes
when the same scenario runs in float64 (rounding). *logic*: it stays (the cached path computes something else).
*lossy*: a quantized cache, different by design. *nondeterministic*: repeats of the same run differ.

**Invariant mode** — every op computes a row the same way however many rows or keys it sees (per-row matrix
products, fixed-order softmax and attention). A cached run then equals the full forward bit for bit whenever the
logic is right, which proves a precision verdict.

**Position ids** — each token's position, which rotary or learned position embeddings use. With left padding they
must be counted from the first real token, not from the start of the padded row.

**Attention mask** — which keys a token may look at. With a cache it must cover the cached tokens and the new ones.

**Quantized KV cache** — keys and values stored in fewer bits (int4, int2, fp8) in groups that share a scale; the
newest tokens (the **residual**, e.g. 8) stay in full precision until it fills. Saves memory; changes the numbers.

**Weight-only quantization (int8 / int4)** — the linear layers' weights stored in 8 or 4 bits and expanded when
used; activations stay in the model's dtype.

**Teacher forcing** — feeding both runs the same tokens (here the unquantized run's) so every step compares the same
context; **greedy agreement** is the other view: each run on its own tokens, counted until the texts part.
""")
