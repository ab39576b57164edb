"""The greedy view's figures and tables: pure functions of its result (no model runs here)."""
from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ...core import theme
from ...core.theme import MARK, log_axis
from ...core.plotting import short, heatmap, shared_range, fit_text, zero_floor
from .run import GreedyPath

PARTED = theme.VERDICT_FILLS["logic"]  # a token where the texts part


def primary_pair(res, a: GreedyPath = GreedyPath.NO_CACHE, b: GreedyPath = GreedyPath.CACHE):
    """The pair the views lead with: no_cache vs cache when both ran, else the first pair that parts."""
    try:
        return res.pair(a, b)
    except KeyError:
        parting = [p for p in res.pairs if p.first_divergence is not None]
        return (parting or res.pairs)[0]


def first_parting(res) -> int | None:
    steps = [p.first_divergence for p in res.pairs if p.first_divergence is not None]
    return min(steps) if steps else None


def greedy_margins(res) -> go.Figure:
    """Each path's top-1 minus top-2 logit per step; divergences marked; unsettled preview steps hollow."""
    fig = go.Figure()
    floor = min([m / 10 for p in res.paths.values() for m in p.margins if m > 0], default=1e-6)  # ties: crosses here
    for p in res.paths.values():
        settled = p.settled or [True] * len(p.margins)
        symbols = ["x" if m == 0 else ("circle" if s else "circle-open") for m, s in zip(p.margins, settled)]
        fig.add_trace(go.Scatter(
            x=list(range(len(p.margins))), y=[m if m > 0 else floor for m in p.margins], mode="lines+markers",
            name=p.label, marker=dict(symbol=symbols, size=7),
            # tokens quoted here: plotly's hover templates have no !r (it drew "chose - over -")
            customdata=[[repr(t), repr(s), f"{m:.4g}" if m > 0 else "0 (a tie)"]
                        for t, s, m in zip(p.tokens, p.top2, p.margins)],
            hovertemplate="step %{x}: chose %{customdata[0]} over %{customdata[1]}<br>margin %{customdata[2]}"
                          "<extra>" + p.name + "</extra>"))
    for pr in res.pairs:
        if pr.first_divergence is not None:
            fig.add_vline(x=pr.first_divergence, line_dash="dot", line_color=MARK)
    t = first_parting(res)
    if t is not None:
        fig.add_annotation(x=t, y=1, yref="paper", yanchor="top", text=f"first parting: step {t}", showarrow=False,
                           font=dict(color=MARK), xanchor="left")  # inside the plot: the legend is above it
    fig.update_layout(title=f"Top-2 margin per step — {res.settings.dtype} on {res.settings.device}",
                      xaxis_title="step", yaxis_title="top-1 − top-2 logit", height=380,
                      margin=dict(l=10, r=10, t=60, b=10), legend=dict(orientation="h", y=-0.3))
    log_axis(fig)
    if any(m == 0 for p in res.paths.values() for m in p.margins):
        zero_floor(fig, floor, "× margin 0 (a tie), drawn at this floor")
    return fit_text(fig)


def greedy_heatmap(res, pair=None, log: bool = True) -> go.Figure:
    """Layers × steps: relative gap of the last token's hidden state between two paths."""
    pair = pair or primary_pair(res)
    a = res.paths[pair.a]
    n = pair.hidden_relative.shape[1]
    labels = [f"{t}: {short(a.tokens[t])}" for t in range(n)]
    title = (f"Last token's hidden state, {pair.a} vs {pair.b} (relative gap) — {res.settings.dtype} on "
             f"{res.settings.device}")
    fig = heatmap(pair.hidden_relative, labels, res.layer_labels, title, "relative gap", log, x_title="step")
    if pair.first_divergence is not None:
        fig.add_vline(x=pair.first_divergence - 0.5, line_color=MARK, line_width=2)
        fig.add_annotation(x=pair.first_divergence, y=1, yref="paper", yanchor="top", xanchor="left",
                           showarrow=False, text="paths part", font=dict(color=MARK),
                           bgcolor="rgba(255,255,255,0.85)")  # inside the plot: the legend row is above it
    return fig


def ab_greedy_heatmaps(res_a, res_b, label_a: str, label_b: str, log: bool = True,
                       pair: tuple[GreedyPath, GreedyPath] = (GreedyPath.NO_CACHE, GreedyPath.CACHE)
                       ) -> tuple[go.Figure, go.Figure, go.Figure]:
    """A/B for greedy decoding: the same pair of paths (default no cache vs cache) under two settings, layers ×
    steps on ONE shared colour scale, and |B − A| over the steps both ran."""
    try:
        pa, pb = res_a.pair(*pair), res_b.pair(*pair)
    except KeyError:
        raise ValueError(f"both results need the paths {pair[0]} and {pair[1]}") from None
    za, zb = np.asarray(pa.hidden_relative, dtype=float), np.asarray(pb.hidden_relative, dtype=float)
    if za.shape[0] != zb.shape[0]:
        raise ValueError("A and B have different numbers of layers; compare settings of the same model")
    n = min(za.shape[1], zb.shape[1])
    za, zb = za[:, :n], zb[:, :n]
    zrange = shared_range(za, zb, log)
    ta, tb = res_a.paths[pair[0]].tokens, res_b.paths[pair[0]].tokens
    name = "relative gap"
    fa = heatmap(za, [f"{t}: {short(ta[t])}" for t in range(n)], res_a.layer_labels, f"A — {label_a}", name, log,
                 zrange=zrange, x_title="step")
    fb = heatmap(zb, [f"{t}: {short(tb[t])}" for t in range(n)], res_a.layer_labels, f"B — {label_b}", name, log,
                 zrange=zrange, x_title="step")
    fd = heatmap(np.abs(zb - za), [str(t) for t in range(n)], res_a.layer_labels, "|B − A| of the relative gap",
                 "|B − A|", log, x_title="step")
    for f, p in ((fa, pa), (fb, pb)):
        if p.first_divergence is not None and p.first_divergence < n:
            f.add_vline(x=p.first_divergence - 0.5, line_color=MARK, line_width=2)
    return fa, fb, fd


def greedy_reference_gap(res) -> go.Figure | None:
    """For each path, max |Δ logit| against the float64 reference path per step (while they saw the same tokens)."""
    if GreedyPath.FLOAT64 not in res.paths:
        return None
    fig = go.Figure()
    for p in res.paths.values():
        if p.float64_gap is None:
            continue
        fig.add_trace(go.Scatter(x=list(range(len(p.float64_gap))), y=p.float64_gap, mode="lines+markers",
                                 name=p.label))
    fig.update_layout(title="Distance from the float64 reference: is the cache path further from the truth?",
                      xaxis_title="step", yaxis_title="max |Δ logit| vs float64", height=360,
                      margin=dict(l=10, r=10, t=60, b=10), legend=dict(orientation="h", y=-0.3))
    log_axis(fig)
    return fit_text(fig)


def greedy_step_frame(res) -> pd.DataFrame:
    pair = primary_pair(res)
    n = res.steps
    data: dict = {"step": list(range(n))}
    for p in res.paths.values():
        data[f"{p.name} token"] = p.tokens[:n]
        data[f"{p.name} margin"] = p.margins[:n]
        if p.settled is not None:
            data[f"{p.name} settled"] = p.settled[:n]
    data[f"max |Δ logit| {pair.a}/{pair.b}"] = pair.max_abs_logit[:n]
    data[f"KL {pair.a}/{pair.b}"] = pair.kl[:n]
    data["same history"] = pair.same_history[:n]
    return pd.DataFrame(data)


def _upto(pair) -> int:
    """Steps up to and including the first parting (all steps when the pair never parts; 1 when it parts at 0)."""
    n = len(pair.max_abs_logit)
    return n if pair.first_divergence is None else min(n, pair.first_divergence + 1)


def greedy_pairs_frame(res) -> pd.DataFrame:
    return pd.DataFrame([{
        "paths": f"{p.a} vs {p.b}",
        "first parting step": p.first_divergence,
        "tokens there": "" if p.first_divergence is None else f"{p.a_token!r} / {p.b_token!r}",
        "verdict": p.verdict or "same tokens",
        "float64 replay gap": p.float64_gap,
        "max |Δ logit| up to parting": max(p.max_abs_logit[: _upto(p)]),
    } for p in res.pairs])


def texts_html(res) -> str:
    """The paths' continuations side by side. Every token where a path parts from another is shaded red (hover:
    from which path); the first parting of all is also underlined."""
    first = first_parting(res)
    marks: dict[str, dict[int, list[str]]] = {name: {} for name in res.paths}
    for pr in res.pairs:
        if pr.first_divergence is not None:
            marks[pr.a].setdefault(pr.first_divergence, []).append(pr.b)
            marks[pr.b].setdefault(pr.first_divergence, []).append(pr.a)
    cols = []
    for p in res.paths.values():
        parts = []
        for i, tok in enumerate(p.tokens):
            text = html.escape(tok).replace("\n", "⏎<br>")
            if i in marks[p.name]:
                line = f"border-bottom:2px solid {MARK};" if i == first else ""
                title = html.escape(f"step {i}: parts from {', '.join(marks[p.name][i])}")
                parts.append(f'<span title="{title}" style="background:{PARTED};color:#111;{line}">{text}</span>')
            else:
                parts.append(text)
        cols.append(f'<div style="flex:1 1 0;min-width:180px"><b>{html.escape(p.label)}</b>'
                    f'<div style="font-family:monospace;white-space:pre-wrap;background:#f7f7f7;color:#111;'
                    f'padding:6px;border-radius:4px">{"".join(parts)}</div></div>')
    return f'<div style="display:flex;gap:10px;flex-wrap:wrap">{"".join(cols)}</div>'


def main(result) -> list:
    ref = greedy_reference_gap(result)
    return [greedy_margins(result), greedy_heatmap(result)] + ([ref] if ref is not None else [])
