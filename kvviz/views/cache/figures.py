"""The cache view's figures and tables: pure functions of its result (no model runs here)."""
from __future__ import annotations

import plotly.graph_objects as go

from ...core.theme import log_axis
from ...core.plotting import fit_text


def cache_growth(rows: list[dict], log: bool = True) -> go.Figure:
    """KV-cache bytes against context length, one line per model × dtype (rows from kvviz.views.cache.size.growth)."""
    fig = go.Figure()
    keys = list(dict.fromkeys((r["model"], r["dtype"]) for r in rows))
    for model, dtype in keys:
        pts = [r for r in rows if r["model"] == model and r["dtype"] == dtype]
        fig.add_trace(go.Scatter(x=[r["tokens"] for r in pts], y=[r["bytes"] / 2 ** 20 for r in pts],
                                 mode="lines", name=f"{model} · {dtype}"))
    fig.update_layout(title="KV cache size against context length (batch 1)", xaxis_title="tokens in the cache",
                      yaxis_title="MiB", height=400, margin=dict(l=10, r=10, t=60, b=10))
    if log:
        log_axis(fig)
    return fit_text(fig)

