"""Pure functions from results to Plotly figures and pandas tables: no model runs here, so views are cheap."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .metrics import HIDDEN_METRICS
from .split import SplitResult

METRIC_TITLES = {
    "max_abs": "max |Δ|",
    "mean_abs": "mean |Δ|",
    "relative": "relative gap",
    "cosine": "cosine distance",
    "eps_units": "gap / machine ε",
}


def short(text: str, n: int = 12) -> str:
    t = text.replace("\n", "⏎").replace("\t", "⇥")
    t = t if t.strip() else repr(t)[1:-1] or "∅"
    return t if len(t) <= n else t[: n - 1] + "…"


def _log_matrix(z: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log10(z.astype(float))
    out[~np.isfinite(out)] = np.nan  # exact zeros are drawn as blank (identical)
    return out


def heatmap(z: np.ndarray, x_labels: list[str], y_labels: list[str], title: str, value_name: str,
            log: bool = True, x_title: str = "token") -> go.Figure:
    """A layers × positions heatmap; hover shows token, layer and the exact value."""
    z = np.asarray(z, dtype=float)
    shown = _log_matrix(z) if log else z
    hover = np.empty(z.shape, dtype=object)
    for i, y in enumerate(y_labels):
        for j, x in enumerate(x_labels):
            hover[i, j] = [x, y, f"{z[i, j]:.4g}" if z[i, j] != 0 else "0 (bitwise equal)"]
    colorbar = dict(title=("log₁₀ " if log else "") + value_name)
    if log and np.isfinite(shown).any():
        lo, hi = math.floor(np.nanmin(shown)), math.ceil(np.nanmax(shown))
        ticks = list(range(lo, hi + 1)) if hi > lo else [lo]
        colorbar.update(tickvals=ticks, ticktext=[f"1e{t}" for t in ticks], title=value_name)
    fig = go.Figure(go.Heatmap(
        z=shown, x=list(range(len(x_labels))), y=list(range(len(y_labels))), customdata=hover,
        colorscale="Viridis", colorbar=colorbar, hoverongaps=False,
        hovertemplate="token %{customdata[0]}<br>%{customdata[1]}<br>" + value_name + ": %{customdata[2]}"
                      "<extra></extra>"))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title="hidden state", height=max(360, 16 * len(y_labels)
                                                                                              + 160),
                      margin=dict(l=10, r=10, t=60, b=10), plot_bgcolor="#f3f3f3")
    fig.update_xaxes(tickmode="array", tickvals=list(range(len(x_labels))), ticktext=x_labels, tickangle=-45)
    fig.update_yaxes(tickmode="array", tickvals=list(range(len(y_labels))), ticktext=y_labels, autorange="reversed")
    return fig


def split_heatmap(res: SplitResult, metric: str = "relative", log: bool = True) -> go.Figure:
    if not res.main.has_cache:
        raise ValueError("this result has no cached run to draw (the model returned no cache)")
    if metric not in HIDDEN_METRICS:
        raise ValueError(f"unknown metric {metric}; choose one of {', '.join(HIDDEN_METRICS)}")
    labels = [f"{i}: {short(res.tokens[i])}" for i in res.compared]
    title = (f"{METRIC_TITLES[metric]}: cached vs full forward — {res.settings['dtype']} on "
             f"{res.settings['device']}, split {res.settings['split']} ({res.settings['mode']})")
    return heatmap(res.main.hidden[metric], labels, res.layer_labels, title, METRIC_TITLES[metric], log)


def layer_lines(res: SplitResult, metric: str = "relative", log: bool = True) -> go.Figure:
    """Per layer: the worst and the mean over compared positions, with the float64 rerun as a dashed line."""
    fig = go.Figure()
    x = res.layer_labels
    runs = [(res.main, "")]
    if res.float64 is not None and res.float64 is not res.main:
        runs.append((res.float64, " (float64 rerun)"))
    for comp, suffix in runs:
        if not comp.has_cache:
            continue
        m = comp.hidden[metric]
        dash = "dash" if suffix else None
        fig.add_trace(go.Scatter(x=x, y=m.max(axis=1), mode="lines+markers", name=f"max over tokens{suffix}",
                                 line=dict(dash=dash)))
        fig.add_trace(go.Scatter(x=x, y=m.mean(axis=1), mode="lines+markers", name=f"mean over tokens{suffix}",
                                 line=dict(dash=dash)))
    fig.update_layout(title=f"{METRIC_TITLES[metric]} per layer — {res.settings['dtype']} on {res.settings['device']}",
                      xaxis_title="hidden state", yaxis_title=METRIC_TITLES[metric], height=380,
                      margin=dict(l=10, r=10, t=60, b=10), legend=dict(orientation="h", y=-0.35))
    if log:
        fig.update_yaxes(type="log", exponentformat="power")
    return fig


def logits_frame(res: SplitResult) -> pd.DataFrame:
    lg = res.main.logits
    return pd.DataFrame({
        "position": res.compared,
        "token": [res.tokens[i] for i in res.compared],
        "next (full)": res.main.reference_top1,
        "next (cached)": res.main.cached_top1,
        "argmax agrees": lg["argmax_agree"].astype(bool),
        "top-5 overlap": lg["top5_overlap"].astype(int),
        "max |Δ logit|": lg["max_abs"],
        "KL(full‖cached)": lg["kl"],
    })


def describe_frame(res: SplitResult) -> pd.DataFrame:
    """Seed 003's table for the last compared position: rows mean … max, columns without/with/|Δ|/relative Δ."""
    return pd.DataFrame(res.main.describe)


def kv_frame(res: SplitResult) -> pd.DataFrame:
    rows = [{
        "layer": r["layer"] + 1,
        "keys differing": f"{r['keys_differ']} of {r['keys_total']}",
        "keys max |Δ|": r["keys_max_abs"],
        "values differing": f"{r['values_differ']} of {r['values_total']}",
        "values max |Δ|": r["values_max_abs"],
    } for r in res.main.kv]
    return pd.DataFrame(rows)
