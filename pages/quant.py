"""Page: a quantized KV cache and/or quantized weights against the unquantized run of the same model."""
import streamlit as st

from pages.defaults import DEFAULTS
from kvviz.views.quant import figures as quant_figures
from kvviz.views.quant.run import DEFAULT_RESIDUAL, KV_CHOICES, WEIGHT_CHOICES, package_available, QuantConfig
from pages.common import controls, page, show_verdict, side_by_side, verdict_and_chart
from pages.runner import run_or_stop
from pages.exporting import exports

choice, lm = page("Quantized cache & weights",
                  "Quantized KV caches and weights are sold as \"almost the same quality\"; how close they come "
                  "depends on the model. This compares the quantized run with the unquantized one, step by step: "
                  "KL of the next-token distribution, how long the greedy texts agree, and which layer moves most.")


def _kv_label(kv: str) -> str:
    backend = kv.split(":")[0]
    names = {"none": "none (unquantized cache)", "fp8": "fp8 (transformers, no package)"}
    label = names.get(kv, f"{kv} ({'optimum-quanto' if backend == 'quanto' else 'hqq'})")
    return label if package_available(backend) else f"{label} — not installed"


with controls():
    prompt = st.text_area("Prompt", DEFAULTS["quant"]["prompt"], key="quant_prompt", height=70)
    c1, c2, c3, c4 = st.columns(4)
    kv = c1.selectbox("Quantized KV cache", KV_CHOICES, index=KV_CHOICES.index(DEFAULTS["quant"]["kv"]), key="quant_kv",
                      format_func=_kv_label,
                      help="transformers' QuantizedCache: keys and values stored in n bits per value in groups, "
                           "the last tokens (the residual) kept unquantized.")
    residual = c2.number_input("Residual length (tokens)", 1, 4096, DEFAULT_RESIDUAL, key="quant_residual",
                               help="The newest tokens stay unquantized until the residual fills; then everything "
                                    "is quantized together.", disabled=kv in ("none", "fp8"))
    weights = c3.selectbox("Quantized weights", WEIGHT_CHOICES, key="quant_weights",
                           format_func=lambda w: "none" if w == "none" else (
                               f"{w[4:]} (bitsandbytes, CUDA only)" if w.startswith("bnb-") else
                               f"{w} weight-only (optimum-quanto)"
                               + ("" if package_available("quanto") else " — not installed")))
    n = c4.number_input("New tokens", 2, 256, DEFAULTS["quant"]["n"], key="quant_n")

cfg = QuantConfig(prompt, kv=kv, residual_length=int(residual), weights=weights, max_new_tokens=int(n))

res = run_or_stop("quant", lm, cfg, label=f"Comparing {cfg.label or 'nothing'} with the unquantized run…")

left, right = verdict_and_chart()
with left:
    show_verdict("lossy" if res.verdict == "lossy" else "identical", res.explanation)
    m1, m2 = st.columns(2)
    m1.metric("Greedy agreement", f"{res.agreement} / {res.steps} tokens", help="Tokens before the texts part")
    m2.metric("Max KL", f"{res.kl_max:.3g} nats", help="The largest per-step KL(unquantized ‖ quantized), natural log")
with right:
    st.plotly_chart(quant_figures.quant_steps(res), width="stretch", key="quant_steps_chart")
st.plotly_chart(quant_figures.quant_layers(res), width="stretch", key="quant_layers_chart")
side_by_side(("**Unquantized** (dynamic cache)", res.reference_text),
             (f"**Quantized** ({res.label})", res.quantized_text))
with st.expander("Step by step"):
    st.dataframe(quant_figures.quant_frame(res), hide_index=True, width="stretch")
for note in res.notes:
    st.caption(f"ℹ️ {note}")
if choice.invariant:
    st.caption("Invariant mode does not apply here: quantization changes the numbers by design.")
st.caption(f"{res.settings.dtype} on {res.settings.device}; {res.seconds:.1f} s. KL is teacher forced along the "
           f"unquantized tokens, so every step compares the same context; the agreement is free running.")
exports(res, "quant", lm)
