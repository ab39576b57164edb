"""The loading_trap view's figures and tables: pure functions of its result (no model runs here)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ...core.theme import MARK, log_axis
from ...core.plotting import zero_floor, floor_zeros, fit_text


def loading_trap_steps(res) -> go.Figure:
    """Max |Δ logit| per step between the two ways of making a 16-bit model (exact zeros at a labelled floor)."""
    positive = [v for v in res.max_abs_logit if v > 0]
    floor = min(positive) / 10 if positive else 1e-12
    fig = go.Figure(go.Scatter(x=list(range(len(res.max_abs_logit))), y=floor_zeros(res.max_abs_logit, floor),
                               mode="lines+markers", name="max |Δ logit|"))
    if positive and len(positive) < len(res.max_abs_logit):
        zero_floor(fig, floor, "0 (identical)")
    if res.first_divergence is not None:
        fig.add_vline(x=res.first_divergence, line_dash="dash", line_color=MARK)
        fig.add_annotation(x=res.first_divergence, y=1, yref="paper", showarrow=False, xanchor="left",
                           text=f"texts part at step {res.first_divergence}", font=dict(color=MARK))
    fig.update_layout(title="from_pretrained(dtype) vs float32 + .to(dtype): max |Δ logit| per step",
                      xaxis_title="step", yaxis_title="max |Δ logit|", height=360, margin=dict(l=10, r=10, t=60, b=10))
    log_axis(fig)
    return fit_text(fig)


def main(result) -> list:
    return [loading_trap_steps(result)]


def tables(result) -> list:
    s = result.settings
    return [pd.DataFrame({f"from_pretrained(dtype={s['dtype']})": [result.loaded_text],
                          f"float32 + .to({s['dtype']})": [result.cast_text]})]
