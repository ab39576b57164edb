"""Page: is my model cache-safe? The battery of float64 checks, one line of evidence each."""
import streamlit as st

from kvviz.views.check.run import CheckConfig
from kvviz.views.quant.run import KV_CHOICES, WEIGHT_CHOICES
from pages.common import controls, page
from pages.runner import run_or_stop
from pages.exporting import exports

choice, lm = page("Is my model cache-safe?",
                  "Each check runs on the float64 copy of the model, where rounding cannot hide or fake a gap: "
                  "cached vs full, left padding, batching, prompt-cache reuse, past the sliding window, causal or "
                  "not, its own code, quantized weights.")
with controls():
    c1, c2 = st.columns(2)
    weights = c1.selectbox("Check with quantized weights", WEIGHT_CHOICES, key="check_weights",
                           help="int8 / int4 weight-only (optimum-quanto): the card then measures the loss against "
                                "the unquantized model.")
    kv = c2.selectbox("Check with a quantized KV cache", KV_CHOICES, key="check_kv")

card = run_or_stop("check", lm, CheckConfig(weights=weights, kv=kv), label="Running the checks…")
{"safe": st.success, "lossy": st.warning, "unsafe": st.error}[card.overall](
    f"**{card.overall.upper()}** — {card.summary}")
# plain text in an HTML table: it wraps long evidence (a canvas table cut it off) and needs no emoji glyphs
import pandas as pd  # noqa: E402

st.table(pd.DataFrame([{"check": c.name, "status": c.status.upper(), "evidence": c.evidence}
                       for c in card.checks]).set_index("check"))
exports(card, "check", lm)
