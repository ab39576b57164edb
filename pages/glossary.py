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

**ulp (unit in the last place)** — the gap between a number and the next one the dtype can store: what one step
of the last mantissa bit is worth *at that size*. Floats are evenly spaced between two powers of two and the spacing
doubles at each power, so the ulp grows with the number: in bfloat16 the ulp of 1.0 is 2⁻⁷ ≈ 0.0078 and the ulp of
100 is 0.5. "Two results 3 ulp apart" means they differ by three steps of the last bit. A count in ulps of a tiny
result (a sum whose terms cancelled) can be large while the error is small next to the terms that were added.

**Machine epsilon (ε)** — the ulp of 1.0: the distance from 1.0 to the next number up. ε = 2⁻(stored mantissa bits):
2⁻⁵² ≈ 2.2e-16 (float64), 2⁻²³ ≈ 1.2e-7 (float32), 2⁻¹⁰ ≈ 9.8e-4 (float16), 2⁻⁷ ≈ 7.8e-3 (bfloat16). It is a
*relative* size: near any number x the spacing is about ε·|x|. A relative gap of a few ε is a few roundings.

**Unit round-off (u)** — the largest relative error of one rounding to the nearest representable number: half the
spacing, u = ε/2 (2⁻²⁴ ≈ 6e-8 in float32, 2⁻⁸ ≈ 0.0039 in bfloat16). Every +, × or stored result can be off by up to
u of its size; a sum of n terms can gather up to about n·u, usually far less.

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
