"""The quant view's figures and tables: pure functions of its result (no model runs here)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ...core import theme
from ...core.theme import MARK, log_axis
from ...core.plotting import zero_floor, floor_zeros, thin_x, fit_text
from ...core.text import fmt_number


def quant_steps(res) -> go.Figure:
    """Per decoding step: KL(unquantized ‖ quantized) (log axis, exact zeros at a labelled floor) and where the
    free-running greedy texts part."""
    positive = [k for k in res.kl if k > 0]
    floor = min(positive) / 10 if positive else 1e-12
    fig = go.Figure()
    fig.add_trace(go.Scatter(
        x=list(range(len(res.kl))), y=floor_zeros(res.kl, floor), mode="lines+markers", name="KL per step",
        marker=dict(symbol=["circle" if a else "x" for a in res.argmax_agree], size=8),
        customdata=[[f"{k:.3g}" if k > 0 else "0 (identical)", f"{m:.3g}", "same" if a else "another"]
                    for k, m, a in zip(res.kl, res.logits_max_abs, res.argmax_agree)],
        hovertemplate="step %{x}: KL %{customdata[0]}<br>max |Δ logit| %{customdata[1]}<br>next token: "
                      "%{customdata[2]}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", marker=dict(symbol="x", size=8, color="#444"),
                             name="× another token"))
    if positive and len(positive) < len(res.kl):
        zero_floor(fig, floor, "0 (identical)")
    if res.agreement < res.steps:
        fig.add_vline(x=res.agreement, line_dash="dash", line_color=MARK)
        fig.add_annotation(x=res.agreement, y=1, yref="paper", showarrow=False, xanchor="left",
                           text=f"greedy texts part at step {res.agreement}", font=dict(color=MARK))
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line=dict(dash="dash", color=MARK),
                                 name="free-running greedy texts part"))
    fig.update_layout(title=f"KL(unquantized ‖ {res.label}) per step — {res.settings.dtype} on {res.settings.device}",
                      xaxis_title="decoding step (teacher forced on the unquantized tokens)",
                      yaxis_title="KL (nats)", height=380, margin=dict(l=10, r=10, t=60, b=10),
                      legend=dict(orientation="h", y=-0.3))
    log_axis(fig)
    return fit_text(fig)


def quant_layers(res) -> go.Figure:
    """The largest relative gap of each layer's hidden state over the steps (exact zeros at a labelled floor)."""
    positive = [r for r in res.layer_relative if r > 0]
    floor = min(positive) / 10 if positive else 1e-12
    fig = go.Figure(go.Bar(
        x=res.layers, y=floor_zeros(res.layer_relative, floor), name="max relative gap",
        marker_color=[theme.ZERO if r == 0 else theme.COLORWAY[3] for r in res.layer_relative],
        customdata=[[f"{r:.3g}" if r > 0 else "0 (identical)", f"{a:.3g}"]
                    for r, a in zip(res.layer_relative, res.layer_max_abs)],
        hovertemplate="%{x}<br>relative %{customdata[0]}<br>max |Δ| %{customdata[1]}<extra></extra>"))
    fig.update_layout(title=f"Largest hidden-state gap per layer over the steps — {res.label}",
                      yaxis_title="max |Δ| / max |unquantized|", height=360, margin=dict(l=10, r=10, t=60, b=10))
    log_axis(fig)
    thin_x(fig, list(res.layers))
    return fit_text(fig)


def quant_frame(res) -> pd.DataFrame:
    n = res.steps
    return pd.DataFrame({
        "step": list(range(n)),
        "unquantized token": res.reference_tokens[:n],
        "quantized token (free running)": res.quantized_tokens[:n],
        "KL": [fmt_number(k) for k in res.kl],
        "max |Δ logit|": [fmt_number(m) for m in res.logits_max_abs],
        "same next token": ["yes" if a else "no" for a in res.argmax_agree],
    })


def main(result) -> list:
    return [quant_steps(result), quant_layers(result)]


def tables(result) -> list:
    return [quant_frame(result)]
