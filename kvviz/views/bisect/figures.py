"""The bisect view's figures and tables: pure functions of its result (no model runs here)."""
from __future__ import annotations

import plotly.graph_objects as go

from ...core import theme
from ...core.theme import log_axis
from ...core.plotting import zero_floor, floor_zeros, fit_text


def bisect_modules(res) -> go.Figure:
    """Every compared module in execution order: max |Δ| of its output (zeros on a labelled floor), the first
    module that differs marked."""
    vals = [m.max_abs for m in res.modules]
    positive = [v for v in vals if v > 0]
    floor = min(positive) / 10 if positive else 1e-20
    first = res.first.name if res.first else None
    fig = go.Figure(go.Bar(x=list(range(len(vals))), y=floor_zeros(vals, floor),
                           marker_color=[theme.MARK if m.name == first else (theme.ZERO if m.max_abs == 0 else theme.COLORWAY[0])
                                         for m in res.modules],
                           customdata=[[m.name, m.kind, f"{m.max_abs:.3g}" if m.max_abs else "0 (bitwise equal)"]
                                       for m in res.modules],
                           hovertemplate="%{customdata[0]} (%{customdata[1]})<br>max |Δ| %{customdata[2]}"
                                         "<extra></extra>"))
    fig.update_layout(title="Output of every module, cached vs full forward" + (f" — first difference: {first}"
                                                                               if first else " — all equal"),
                      xaxis_title="module (in execution order)", yaxis_title="max |Δ|", height=360,
                      margin=dict(l=10, r=10, t=60, b=10))
    log_axis(fig)
    if any(v == 0 for v in vals):
        zero_floor(fig, floor, "0 (bitwise equal)")
    return fit_text(fig)


def main(result) -> list:
    return [bisect_modules(result)]
