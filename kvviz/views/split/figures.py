"""The split view's figures and tables: pure functions of its result (no model runs here)."""
from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch as _torch

from ...core.metrics import HIDDEN_METRICS
from .run import SplitResult
from ...core.theme import log_axis
from ...core.plotting import METRIC_TITLES, short, heatmap, shared_range, zero_floor, floor_zeros, thin_x, fit_text


def _position_labels(metric: str, *results: SplitResult) -> list[str]:
    """The first result's compared positions as x labels, once every result has a cached run and `metric` is known."""
    for r in results:
        if not r.main.has_cache:
            raise ValueError("this result has no cached run to draw (the model returned no cache)")
    if metric not in HIDDEN_METRICS:
        raise ValueError(f"unknown metric {metric}; choose one of {', '.join(HIDDEN_METRICS)}")
    return [f"{i}: {short(results[0].tokens[i])}" for i in results[0].compared]


def split_heatmap(res: SplitResult, metric: str = "relative", log: bool = True, height: int | None = None) -> go.Figure:
    """Layers × compared positions; height: the figure's height in px (presenter mode fits it to the first screen)."""
    labels = _position_labels(metric, res)
    title = (f"{METRIC_TITLES[metric]}: cached vs full forward — {res.settings.dtype} on "
             f"{res.settings.device}, split {res.settings.split} ({res.settings.mode})")
    return heatmap(res.main.hidden[metric], labels, res.layer_labels, title, METRIC_TITLES[metric], log, height=height)


def ab_heatmaps(res_a: SplitResult, res_b: SplitResult, label_a: str, label_b: str, metric: str = "relative",
                log: bool = True) -> tuple[go.Figure, go.Figure, go.Figure]:
    """A/B: two split results of the same prompt and split on ONE shared colour scale, and their difference
    |B − A| per layer and position (drawn like any gap map: exact zeros in their own colour)."""
    labels = _position_labels(metric, res_a, res_b)
    za, zb = (np.asarray(r.main.hidden[metric], dtype=float) for r in (res_a, res_b))
    if za.shape != zb.shape or list(res_a.compared) != list(res_b.compared):
        raise ValueError("A and B compare different positions or layers; use the same prompt and split point")
    zrange = shared_range(za, zb, log)
    name = METRIC_TITLES[metric]
    fa = heatmap(za, labels, res_a.layer_labels, f"A — {label_a}", name, log, zrange=zrange)
    fb = heatmap(zb, labels, res_a.layer_labels, f"B — {label_b}", name, log, zrange=zrange)
    fd = heatmap(np.abs(zb - za), labels, res_a.layer_labels, f"|B − A| of {name}", "|B − A|", log)
    return fa, fb, fd


def layer_lines(res: SplitResult, metric: str = "relative", log: bool = True) -> go.Figure:
    """Per layer: the worst and the mean over compared positions, with the float64 rerun dashed. In ε units every
    line is in the run dtype's ε (the float64 rerun too, so it can never look worse than it is); on a log axis
    exact zeros sit on a labelled "0" floor instead of dropping off the chart."""
    fig = go.Figure()
    x = res.layer_labels
    runs = [(res.main, "")]
    if res.float64 is not None and res.float64 is not res.main:
        runs.append((res.float64, " (float64 rerun)"))

    eps_run = _torch.finfo(getattr(_torch, res.settings.dtype)).eps
    series = [(c.hidden["relative"] / eps_run if metric == "eps_units" else c.hidden[metric], suffix)
              for c, suffix in runs if c.has_cache]
    floor = min([v / 10 for m, _ in series for v in np.ravel(m) if v > 0], default=1e-20)
    for m, suffix in series:
        for how, values in (("max", m.max(axis=1)), ("mean", m.mean(axis=1))):
            fig.add_trace(go.Scatter(x=x, y=floor_zeros(values, floor) if log else values, mode="lines+markers",
                                     name=f"{how} over tokens{suffix}", line=dict(dash="dash" if suffix else None),
                                     customdata=values, hovertemplate="%{x}: %{customdata:.4g}<extra></extra>"))
    unit = f" (in {res.settings.dtype}'s ε)" if metric == "eps_units" else ""
    fig.update_layout(title=f"{METRIC_TITLES[metric]}{unit} per layer — {res.settings.dtype} on {res.settings.device}",
                      xaxis_title="hidden state", yaxis_title=METRIC_TITLES[metric] + unit, height=380,
                      margin=dict(l=10, r=10, t=60, b=10), legend=dict(orientation="h", y=-0.35))
    if log:
        log_axis(fig)
        if any((np.asarray(m) == 0).any() for m, _ in series):
            zero_floor(fig, floor, "0 (bitwise equal)")
    thin_x(fig, list(x))
    return fit_text(fig)


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
    """The describe() table for the last compared position: rows mean … max, columns without/with/|Δ|/relative Δ."""
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


def main(result) -> list:
    return [split_heatmap(result), layer_lines(result)] if result.main.has_cache else []


def tables(result) -> list:
    return [logits_frame(result)] if result.main.has_cache else []


def token_strip(tokens: list[str], split: int | None = None, highlight: int | None = None, window: int = 64) -> str:
    """Tokens as HTML chips: the cached ones (before `split`) shaded blue, one token highlighted in red. Every chip
    sets its own text and background colours, so it reads the same in light and dark themes. Beyond `window` tokens
    only those around the split are drawn, with a count of the hidden ones."""
    chips = []
    centre = split if split is not None else 0
    lo = max(0, min(centre - window // 2, len(tokens) - window)) if len(tokens) > window else 0
    hi = min(len(tokens), lo + window) if len(tokens) > window else len(tokens)
    hidden = ('<span style="color:#111;background:#fff3c4;border:1px dashed #b08800;border-radius:4px;'
              'padding:1px 4px;margin:1px;display:inline-block;font-family:monospace">… {n} tokens …</span>')
    if lo > 0:
        chips.append(hidden.format(n=lo))
    for i, t in enumerate(tokens[lo:hi], start=lo):
        text = html.escape(t.replace("\n", "⏎")) or "∅"
        if highlight is not None and i == highlight:
            style = "background:#f8c9c4;border:1px solid #c0392b"
        elif split is not None and i < split:
            style = "background:#cfe3fa;border:1px solid #4a90d9"
        else:
            style = "background:#f0f0f0;border:1px solid #bbb"
        chips.append(f'<span title="token {i}" style="{style};color:#111;border-radius:4px;padding:1px 3px;'
                     f'margin:1px;display:inline-block;font-family:monospace;white-space:pre">{text}</span>')
    if hi < len(tokens):
        chips.append(hidden.format(n=len(tokens) - hi))
    return "".join(chips)


def tiles(res, eps: float, normal=None) -> list[tuple[str, str, str | None]]:
    """The page's number tiles beside the verdict, (label, value, tooltip), each label naming its unit (absolute,
    relative to |x|, in ε of the model's dtype - `eps` -, positions). normal: in invariant mode, the same scenario's
    normal run (its gap beside the proof's); else a run that also ran in invariant mode shows both gaps."""
    out = []
    if normal is not None:
        out += [("max |Δ|, normal run (absolute)", f"{normal.main.max_abs:.3g}",
                 "The same scenario with invariant mode off: the gap the proof removes"),
                ("max |Δ|, invariant mode (absolute)", f"{res.main.max_abs:.3g}",
                 "This run: every row computed the same way whatever the shape")]
    elif res.invariant is not None and not res.settings.execution.invariant:
        out += [("max |Δ|, normal run (absolute)", f"{res.main.max_abs:.3g}",
                 "The largest absolute gap of a hidden state, in the model's own units"),
                ("max |Δ|, invariant mode (absolute)", f"{res.invariant.max_abs:.3g}",
                 "The same scenario with every row computed the same way whatever the shape")]
    f64 = res.float64
    return out + [("largest relative gap (÷ |x|)", f"{res.main.max_relative:.3g}",
                   "max |Δ| / max |x| of a hidden state: 1e-7 is a seven-digit agreement"),
                  (f"in units of ε ({res.settings.dtype})", f"{res.main.max_relative / eps:.3g} ε",
                   f"The relative gap in units of {res.settings.dtype}'s machine epsilon"),
                  ("float64 rerun (÷ |x|)", "—" if f64 is None else f"{f64.max_relative:.3g}",
                   "The same scenario in float64: the evidence for the verdict"),
                  ("next token agrees (positions)",
                   f"{int(res.main.logits['argmax_agree'].sum())}/{len(res.compared)}", None)]
