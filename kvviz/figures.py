"""Pure functions from results to Plotly figures and pandas tables: no model runs here, so views are cheap."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .metrics import HIDDEN_METRICS
from .naming import hover_text
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


ZERO_COLOUR = "#b0bec5"  # exact zeros on log-scale maps: bitwise equal


def heatmap(z: np.ndarray, x_labels: list[str], y_labels: list[str], title: str, value_name: str,
            log: bool = True, x_title: str = "token", zrange: tuple[float, float] | None = None) -> go.Figure:
    """A layers × positions heatmap; hover shows token, layer and the exact value. On a log scale exact zeros
    (bitwise equal) get their own colour and legend entry; an all-zero map says so and keeps its full axes."""
    z = np.asarray(z, dtype=float)
    zero = z == 0
    shown = _log_matrix(z) if log else z
    hover = np.empty(z.shape, dtype=object)
    for i, y in enumerate(y_labels):
        for j, x in enumerate(x_labels):
            hover[i, j] = [x, hover_text(y), f"{z[i, j]:.4g}" if z[i, j] != 0 else "0 (bitwise equal)"]
    colorbar = dict(title=("log₁₀ " if log else "") + value_name)
    if log and np.isfinite(shown).any():
        lo, hi = math.floor(np.nanmin(shown)), math.ceil(np.nanmax(shown))
        ticks = list(range(lo, hi + 1)) if hi > lo else [lo]
        if zrange is not None:
            lo, hi = zrange
            ticks = list(range(math.floor(lo), math.ceil(hi) + 1)) if hi > lo else [math.floor(lo)]
        colorbar.update(tickvals=ticks, ticktext=[f"1e{t}" for t in ticks], title=value_name)
    template = ("token %{customdata[0]}<br>%{customdata[1]}<br>" + value_name + ": %{customdata[2]}<extra></extra>"
                ).replace("token ", "" if x_title != "token" else "token ")
    xs, ys = list(range(len(x_labels))), list(range(len(y_labels)))
    fig = go.Figure()
    if not (log and zero.all()):
        fig.add_trace(go.Heatmap(z=shown, x=xs, y=ys, customdata=hover, colorscale="Viridis", colorbar=colorbar,
                                 hoverongaps=False, hovertemplate=template, showscale=not zero.all(),
                                 **({} if zrange is None else dict(zmin=zrange[0], zmax=zrange[1]))))
    if log and zero.any():
        fig.add_trace(go.Heatmap(z=np.where(zero, 1.0, np.nan), x=xs, y=ys, customdata=hover, showscale=False,
                                 colorscale=[[0, ZERO_COLOUR], [1, ZERO_COLOUR]], hoverongaps=False,
                                 hovertemplate=template))
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="0: bitwise equal", showlegend=True,
                                 marker=dict(symbol="square", size=12, color=ZERO_COLOUR)))
    if zero.all():
        title += " — bitwise identical: 0 everywhere"
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title="hidden state",
                      height=max(360, 16 * len(y_labels) + 160), margin=dict(l=10, r=10, t=60, b=10),
                      plot_bgcolor="#f3f3f3", legend=dict(orientation="h", y=-0.25))
    step = max(1, math.ceil(len(x_labels) / 24))  # long prompts: thin the labels (at most 24)
    fig.update_xaxes(tickmode="array", tickvals=xs[::step], ticktext=x_labels[::step], tickangle=-45,
                     range=[-0.5, len(x_labels) - 0.5])
    fig.update_yaxes(tickmode="array", tickvals=ys, ticktext=y_labels, autorange="reversed",
                     range=[len(y_labels) - 0.5, -0.5])
    return fig


def split_heatmap(res: SplitResult, metric: str = "relative", log: bool = True) -> go.Figure:
    if not res.main.has_cache:
        raise ValueError("this result has no cached run to draw (the model returned no cache)")
    if metric not in HIDDEN_METRICS:
        raise ValueError(f"unknown metric {metric}; choose one of {', '.join(HIDDEN_METRICS)}")
    labels = [f"{i}: {short(res.tokens[i])}" for i in res.compared]
    title = (f"{METRIC_TITLES[metric]}: cached vs full forward — {res.settings.dtype} on "
             f"{res.settings.device}, split {res.settings.split} ({res.settings.mode})")
    return heatmap(res.main.hidden[metric], labels, res.layer_labels, title, METRIC_TITLES[metric], log)


def _shared_range(za: np.ndarray, zb: np.ndarray, log: bool) -> tuple[float, float] | None:
    """One colour range for two maps (log10 of the positive values on a log scale; None when all are zero)."""
    both = np.concatenate([za.ravel(), zb.ravel()])
    if log:
        pos = both[both > 0]
        return (float(np.log10(pos.min())), float(np.log10(pos.max()))) if pos.size else None
    return float(both.min()), float(both.max())


def ab_heatmaps(res_a: SplitResult, res_b: SplitResult, label_a: str, label_b: str, metric: str = "relative",
                log: bool = True) -> tuple[go.Figure, go.Figure, go.Figure]:
    """A/B: two split results of the same prompt and split on ONE shared colour scale, and their difference
    |B − A| per layer and position (drawn like any gap map: exact zeros in their own colour)."""
    for r in (res_a, res_b):
        if not r.main.has_cache:
            raise ValueError("this result has no cached run to draw (the model returned no cache)")
    if metric not in HIDDEN_METRICS:
        raise ValueError(f"unknown metric {metric}; choose one of {', '.join(HIDDEN_METRICS)}")
    za, zb = (np.asarray(r.main.hidden[metric], dtype=float) for r in (res_a, res_b))
    if za.shape != zb.shape or list(res_a.compared) != list(res_b.compared):
        raise ValueError("A and B compare different positions or layers; use the same prompt and split point")
    zrange = _shared_range(za, zb, log)
    labels = [f"{i}: {short(res_a.tokens[i])}" for i in res_a.compared]
    name = METRIC_TITLES[metric]
    fa = heatmap(za, labels, res_a.layer_labels, f"A — {label_a}", name, log, zrange=zrange)
    fb = heatmap(zb, labels, res_a.layer_labels, f"B — {label_b}", name, log, zrange=zrange)
    fd = heatmap(np.abs(zb - za), labels, res_a.layer_labels, f"|B − A| of {name}", "|B − A|", log)
    return fa, fb, fd


def _zero_floor(fig: go.Figure, floor: float, text: str) -> None:
    """The dotted "0" floor of a log axis with its label at the floor (plotly's add_hline annotation reads a log
    axis' y as an exponent and would put the label near 1)."""
    fig.add_hline(y=floor, line_dash="dot", line_color="#888")
    fig.add_annotation(x=1, xref="paper", y=float(np.log10(floor)), yref="y", text=text, showarrow=False,
                       xanchor="right", yanchor="bottom", font=dict(color="#888"))


def _floor_zeros(values, floor: float) -> list[float]:
    return [v if v > 0 else floor for v in values]


def layer_lines(res: SplitResult, metric: str = "relative", log: bool = True) -> go.Figure:
    """Per layer: the worst and the mean over compared positions, with the float64 rerun dashed. In ε units every
    line is in the run dtype's ε (the float64 rerun too, so it can never look worse than it is); on a log axis
    exact zeros sit on a labelled "0" floor instead of dropping off the chart."""
    fig = go.Figure()
    x = res.layer_labels
    runs = [(res.main, "")]
    if res.float64 is not None and res.float64 is not res.main:
        runs.append((res.float64, " (float64 rerun)"))
    import torch as _torch

    eps_run = _torch.finfo(getattr(_torch, res.settings.dtype)).eps
    series = []
    for comp, suffix in runs:
        if not comp.has_cache:
            continue
        m = comp.hidden["relative"] / eps_run if metric == "eps_units" else comp.hidden[metric]
        series.append((m, suffix))
    positive = [v for m, _ in series for v in np.ravel(m) if v > 0]
    floor = min(positive) / 10 if positive else 1e-20
    for m, suffix in series:
        dash = "dash" if suffix else None
        for how, values in (("max", m.max(axis=1)), ("mean", m.mean(axis=1))):
            fig.add_trace(go.Scatter(x=x, y=_floor_zeros(values, floor) if log else values, mode="lines+markers",
                                     name=f"{how} over tokens{suffix}", line=dict(dash=dash),
                                     customdata=values, hovertemplate="%{x}: %{customdata:.4g}<extra></extra>"))
    unit = f" (in {res.settings.dtype}'s ε)" if metric == "eps_units" else ""
    fig.update_layout(title=f"{METRIC_TITLES[metric]}{unit} per layer — {res.settings.dtype} on {res.settings.device}",
                      xaxis_title="hidden state", yaxis_title=METRIC_TITLES[metric] + unit, height=380,
                      margin=dict(l=10, r=10, t=60, b=10), legend=dict(orientation="h", y=-0.35))
    if log:
        fig.update_yaxes(type="log", exponentformat="power")
        if any((np.asarray(m) == 0).any() for m, _ in series):
            _zero_floor(fig, floor, "0 (bitwise equal)")
    _thin_x(fig, list(x))
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


# ----------------------------------------------------------------------------------------------------------------
# Greedy paths

def primary_pair(res, a: str = "no_cache", b: str = "cache"):
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
    positive = [m for p in res.paths.values() for m in p.margins if m > 0]
    floor = min(positive) / 10 if positive else 1e-6  # exact ties (margin 0) are drawn here, as crosses
    for p in res.paths.values():
        settled = p.settled or [True] * len(p.margins)
        symbols = ["x" if m == 0 else ("circle" if s else "circle-open") for m, s in zip(p.margins, settled)]
        fig.add_trace(go.Scatter(
            x=list(range(len(p.margins))), y=[m if m > 0 else floor for m in p.margins], mode="lines+markers",
            name=p.label, marker=dict(symbol=symbols, size=7),
            customdata=[[t, s, f"{m:.4g}" if m > 0 else "0 (a tie)"] for t, s, m in zip(p.tokens, p.top2, p.margins)],
            hovertemplate="step %{x}: chose %{customdata[0]!r} over %{customdata[1]!r}<br>margin %{customdata[2]}"
                          "<extra>" + p.name + "</extra>"))
    for pr in res.pairs:
        if pr.first_divergence is not None:
            fig.add_vline(x=pr.first_divergence, line_dash="dot", line_color="#c0392b")
    t = first_parting(res)
    if t is not None:
        fig.add_annotation(x=t, y=1, yref="paper", text=f"first parting: step {t}", showarrow=False,
                           font=dict(color="#c0392b"), xanchor="left")
    fig.update_layout(title=f"Top-2 margin per step — {res.settings.dtype} on {res.settings.device}",
                      xaxis_title="step", yaxis_title="top-1 − top-2 logit", height=380,
                      margin=dict(l=10, r=10, t=60, b=10), legend=dict(orientation="h", y=-0.3))
    fig.update_yaxes(type="log", exponentformat="power")
    return fig


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
        fig.add_vline(x=pair.first_divergence - 0.5, line_color="#c0392b", line_width=2)
        fig.add_annotation(x=pair.first_divergence, y=1.02, yref="paper", showarrow=False, text="paths part",
                           font=dict(color="#c0392b"))
    return fig


def ab_greedy_heatmaps(res_a, res_b, label_a: str, label_b: str, log: bool = True,
                       pair: tuple[str, str] = ("no_cache", "cache")) -> tuple[go.Figure, go.Figure, go.Figure]:
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
    zrange = _shared_range(za, zb, log)
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
            f.add_vline(x=p.first_divergence - 0.5, line_color="#c0392b", line_width=2)
    return fa, fb, fd


def greedy_reference_gap(res) -> go.Figure | None:
    """For each path, max |Δ logit| against the float64 reference path per step (while they saw the same tokens)."""
    if "float64" not in res.paths:
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
    fig.update_yaxes(type="log", exponentformat="power")
    return fig


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
    import html

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
                line = "border-bottom:2px solid #c0392b;" if i == first else ""
                title = html.escape(f"step {i}: parts from {', '.join(marks[p.name][i])}")
                parts.append(f'<span title="{title}" style="background:#f8c9c4;color:#111;{line}">{text}</span>')
            else:
                parts.append(text)
        cols.append(f'<div style="flex:1 1 0;min-width:180px"><b>{html.escape(p.label)}</b>'
                    f'<div style="font-family:monospace;white-space:pre-wrap;background:#f7f7f7;color:#111;'
                    f'padding:6px;border-radius:4px">{"".join(parts)}</div></div>')
    return f'<div style="display:flex;gap:10px;flex-wrap:wrap">{"".join(cols)}</div>'


# ----------------------------------------------------------------------------------------------------------------
# Precision lab

DTYPE_COLORS = {"float64": "#555555", "float32": "#1f77b4", "float16": "#ff7f0e", "bfloat16": "#2ca02c"}
VERDICT_COLORS = {"identical": "#cfe8cf", "precision": "#cfe3fa", "logic": "#f8c9c4"}


def _thin_x(fig: go.Figure, labels: list[str], most: int = 16) -> None:
    """At most `most` category labels on the x axis (every k-th, and the last), so long axes stay legible."""
    if len(labels) > most:
        step = -(-len(labels) // most)
        keep = list(labels[::step]) + ([labels[-1]] if (len(labels) - 1) % step else [])
        fig.update_xaxes(tickmode="array", tickvals=keep, ticktext=keep)


def dtype_curves(res, metric: str = "max_abs", how: str = "mean") -> go.Figure:
    """Per-layer curves, one per dtype, on one log-scale chart (mean or max over the prompt set). In ε units every
    dtype is in its own ε, except the float64 reference: it is drawn in the finest compared dtype's ε (so it cannot
    look worse than the dtypes it checks) and says so. Exact zeros sit on a labelled "0" floor."""
    import torch as _torch

    table = res.stat(metric, how)
    series = []
    others = [d for d in res.dtypes if d != "float64"]
    for d in res.dtypes:
        y = table[d].to_numpy(dtype=float)
        name = d
        if metric == "eps_units" and d == "float64" and others:
            finest = min(others, key=lambda o: _torch.finfo(getattr(_torch, o)).eps)
            y = res.stat("relative", how)[d].to_numpy(dtype=float) / _torch.finfo(getattr(_torch, finest)).eps
            name = f"float64 (in {finest}'s ε)"
        series.append((d, name, y))
    positive = [v for _, _, y in series for v in y if v > 0]
    floor = min(positive) / 10 if positive else 1e-20
    fig = go.Figure()
    for i, (d, name, y) in enumerate(series):
        same = next((n for _, n, o in series[i + 1:] if np.array_equal(o, y)), None)
        if same is not None:  # drawn first, so the later line covers it: say so in the legend
            name += f" (= {same}, under it)"
        fig.add_trace(go.Scatter(x=list(table.index), y=_floor_zeros(y, floor), mode="lines+markers", name=name,
                                 line=dict(color=DTYPE_COLORS.get(d), dash="dash" if d == "float64" else None),
                                 customdata=[f"{v:.3g}" if v > 0 else "0 (bitwise equal)" for v in y],
                                 hovertemplate="%{x}<br>" + name + ": %{customdata}<extra></extra>"))
    n = len(res.prompts)
    what = METRIC_TITLES.get(metric, metric)
    fig.update_layout(title=f"{what} per layer, {how} over {n} prompt{'s' if n != 1 else ''} — device "
                            f"{res.settings.device} (float64 on {res.settings.float64_device})",
                      xaxis_title="hidden state", yaxis_title=what, height=420, margin=dict(l=10, r=10, t=60, b=10),
                      legend=dict(orientation="h", y=-0.35))
    fig.update_yaxes(type="log", exponentformat="power")
    if any(v == 0 for _, _, y in series for v in y):
        _zero_floor(fig, floor, "0 (bitwise equal)")
    _thin_x(fig, list(table.index))
    return fig


def ab_dtype_curves(res_a, res_b, label_a: str, label_b: str, metric: str = "max_abs", how: str = "mean"
                    ) -> tuple[go.Figure, go.Figure, go.Figure]:
    """A/B for the dtype sweep: both charts on ONE y range, and |B − A| per dtype and layer."""
    fa, fb = dtype_curves(res_a, metric, how), dtype_curves(res_b, metric, how)
    ys = [v for f in (fa, fb) for t in f.data for v in (t.y or ()) if v is not None and v > 0]
    if ys:
        rng = [math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))]
        for f in (fa, fb):
            f.update_yaxes(range=rng)
    fa.update_layout(title=f"A — {label_a}")
    fb.update_layout(title=f"B — {label_b}")
    ta, tb = res_a.stat(metric, how), res_b.stat(metric, how)
    fd = go.Figure()
    for d in [d for d in res_a.dtypes if d in res_b.dtypes]:
        diff = np.abs(tb[d].to_numpy(dtype=float) - ta[d].to_numpy(dtype=float))
        positive = diff[diff > 0]
        floor = positive.min() / 10 if positive.size else 1e-20
        fd.add_trace(go.Scatter(x=list(ta.index), y=_floor_zeros(diff, floor), mode="lines+markers", name=d,
                                line=dict(color=DTYPE_COLORS.get(d)),
                                customdata=[f"{v:.3g}" if v > 0 else "0 (bitwise equal)" for v in diff],
                                hovertemplate="%{x}<br>" + d + ": %{customdata}<extra></extra>"))
    fd.update_layout(title=f"|B − A| of {METRIC_TITLES.get(metric, metric)} per layer", height=380,
                     margin=dict(l=10, r=10, t=60, b=10), legend=dict(orientation="h", y=-0.35))
    fd.update_yaxes(type="log", exponentformat="power")
    _thin_x(fd, list(ta.index))
    return fa, fb, fd


def padding_grid(res, value: str = "hidden_relative") -> go.Figure:
    """Placements × scenarios: each cell coloured by its verdict, with the gap written in it (placements that do
    not apply - "left-padded" with no padding - are left out)."""
    from .padding import SCENARIOS

    verdicts = res.grid("verdict")
    vals = res.grid(value)
    f64 = res.grid("float64_relative")
    rows = list(res.placements)
    cols = [s[0] for s in SCENARIOS]
    code = {"identical": 0, "precision": 1, "logic": 2}
    z = [[code[verdicts.loc[p, c]] for c in cols] for p in rows]
    text = [[f"<b>{verdicts.loc[p, c]}</b><br>{vals.loc[p, c]:.2g}<br>float64: {f64.loc[p, c]:.1g}" for c in cols]
            for p in rows]
    scale = [[0, VERDICT_COLORS["identical"]], [0.33, VERDICT_COLORS["identical"]],
             [0.34, VERDICT_COLORS["precision"]], [0.66, VERDICT_COLORS["precision"]],
             [0.67, VERDICT_COLORS["logic"]], [1, VERDICT_COLORS["logic"]]]
    fig = go.Figure(go.Heatmap(z=z, x=cols, y=rows, text=text, texttemplate="%{text}", zmin=0, zmax=2,
                               colorscale=scale, showscale=False, hoverinfo="text", xgap=3, ygap=3))
    fig.update_layout(title=f"Relative gap vs the prompt alone without cache — {res.settings.dtype} on "
                            f"{res.settings.device}", height=140 + 80 * len(rows), margin=dict(l=90, r=10, t=60, b=10))
    fig.update_yaxes(autorange="reversed")
    _two_line_columns(fig, cols)
    return fig


def _two_line_columns(fig: go.Figure, cols: list[str]) -> None:
    """Scenario names on two lines ("cache,<br>positions omitted") so neighbouring columns do not overlap."""
    fig.update_xaxes(tickmode="array", tickvals=cols, ticktext=[c.replace(", ", ",<br>") for c in cols])


def ab_padding_grids(res_a, res_b, label_a: str, label_b: str, value: str = "hidden_relative"
                     ) -> tuple[go.Figure, go.Figure, go.Figure]:
    """A/B for the padding grid: log10 of each cell's relative gap on ONE colour scale for both, the verdict
    written in the cell, and |B − A|. Exact zeros (bitwise equal) are written "0" and left uncoloured."""
    from .padding import SCENARIOS

    rows = [p for p in res_a.placements if p in res_b.placements]
    cols = [s[0] for s in SCENARIOS]
    za = np.array([[res_a.grid(value).loc[p, c] for c in cols] for p in rows], dtype=float)
    zb = np.array([[res_b.grid(value).loc[p, c] for c in cols] for p in rows], dtype=float)
    zrange = _shared_range(za, zb, True)

    def grid(z, res, title, verdicts=True):
        v = res.grid("verdict") if verdicts else None
        text = [[(f"<b>{v.loc[p, c]}</b><br>" if verdicts else "") + (f"{z[i, j]:.2g}" if z[i, j] else "0")
                 for j, c in enumerate(cols)] for i, p in enumerate(rows)]
        shown = np.where(z > 0, np.log10(np.where(z > 0, z, 1.0)), np.nan)
        fig = go.Figure(go.Heatmap(z=shown, x=cols, y=rows, text=text, texttemplate="%{text}", hoverinfo="text",
                                   textfont=dict(size=13), colorscale="Viridis", xgap=3, ygap=3,
                                   colorbar=dict(title="log₁₀ gap"),
                                   **({} if zrange is None or not verdicts else dict(zmin=zrange[0], zmax=zrange[1]))))
        fig.update_layout(title=title, height=140 + 80 * len(rows), margin=dict(l=90, r=10, t=60, b=10),
                          plot_bgcolor=ZERO_COLOUR)
        fig.update_yaxes(autorange="reversed")
        _two_line_columns(fig, cols)
        return fig

    return (grid(za, res_a, f"A — {label_a}"), grid(zb, res_b, f"B — {label_b}"),
            grid(np.abs(zb - za), res_a, "|B − A| of the relative gap", verdicts=False))


def ab_reuse_frame(res_a, res_b) -> pd.DataFrame:
    """A/B for prompt-cache reuse: per continuation and way, A's and B's verdict, gap to fresh and text."""
    from .text import fmt_number

    b = {(r["index"], r["strategy"]): r for r in res_b.runs}
    rows = []
    for r in res_a.runs:
        o = b.get((r["index"], r["strategy"]))
        if o is None:
            continue
        rows.append({"continuation": r["index"] + 1, "way": r["strategy"], "A verdict": r["verdict"],
                     "B verdict": o["verdict"], "A gap to fresh": fmt_number(r["logits_relative"]),
                     "B gap to fresh": fmt_number(o["logits_relative"]), "A text": r["text"], "B text": o["text"]})
    return pd.DataFrame(rows)


def reuse_frame(res) -> pd.DataFrame:
    df = res.table()
    df["first_divergence"] = df["first_divergence"].astype("Int64")  # empty where the tokens never part
    return df.rename(columns={"first_divergence": "parts from fresh at step", "logits_relative": "logit gap",
                              "float64_relative": "float64 gap"})


# ----------------------------------------------------------------------------------------------------------------
# Backends matrix

MATRIX_COLOURS = {"identical": "#2e7d32", "precision": "#1565c0", "logic": "#c62828", "nondeterministic": "#ef6c00",
                  "lossy": "#6a1b9a", "error": "#9e9e9e"}


def matrix_grid(res) -> go.Figure:
    """Settings (rows) × attention implementations (columns), coloured by verdict; grey cells could not run."""
    attns = list(dict.fromkeys(c.attention for c in res.cells))
    settings = list(dict.fromkeys(_matrix_row(c) for c in res.cells))
    names = list(MATRIX_COLOURS)
    z = np.full((len(settings), len(attns)), np.nan)
    hover = np.empty(z.shape, dtype=object)
    for c in res.cells:
        i, j = settings.index(_matrix_row(c)), attns.index(c.attention)
        kind = "error" if c.error else c.verdict
        z[i, j] = names.index(kind)
        hover[i, j] = (f"<b>{kind}</b><br>{c.error}" if c.error else
                       f"<b>{kind}</b><br>first divergence: {'—' if c.first_divergence is None else c.first_divergence}"
                       f"<br>max |Δ logit|: {c.max_abs_logit:.3g}<br>distinct outputs: {c.distinct_outputs}"
                       f"<br>{c.seconds_per_token * 1000:.1f} ms/token<br>compiled: "
                       f"{'frames ' + str(c.compiled['frames']) if c.compiled and c.compiled['requested'] else 'no'}")
    n = len(names)
    scale = [[k / n, MATRIX_COLOURS[v]] for k, v in enumerate(names) for k in (k, k + 1)]
    scale = [[min(1.0, p), col] for p, col in scale]
    fig = go.Figure(go.Heatmap(z=z, x=attns, y=settings, zmin=-0.5, zmax=n - 0.5, colorscale=scale,
                               customdata=hover, hovertemplate="%{customdata}<extra></extra>", xgap=3, ygap=3,
                               colorbar=dict(tickvals=list(range(n)), ticktext=names, title="verdict")))
    for i, s in enumerate(settings):
        for j, a in enumerate(attns):
            if not np.isnan(z[i, j]):
                fig.add_annotation(x=a, y=s, text=names[int(z[i, j])], showarrow=False,
                                   font=dict(color="white", size=12))
    fig.update_layout(title=f"Backends × settings — {res.settings['model']} in {res.settings['dtype']} on "
                            f"{res.settings['device']}, {res.settings['max_new_tokens']} tokens × "
                            f"{res.settings['repeats']} repeats",
                      height=max(260, 60 * len(settings) + 140), margin=dict(l=10, r=10, t=60, b=10))
    fig.update_yaxes(autorange="reversed")
    return fig


def _matrix_row(c) -> str:
    return " · ".join([c.cache, f"compile {c.compile}"] + ([",".join(c.flags)] if c.flags else []))


def matrix_cell_steps(cell) -> go.Figure:
    """One cell: max |Δ logit| and KL against the reference per step (while both saw the same tokens)."""
    fig = go.Figure()
    steps = list(range(len(cell.step_max_abs_logit)))
    floor = min([v for v in cell.step_max_abs_logit + cell.step_kl if v > 0] or [1e-12]) / 10
    fig.add_trace(go.Scatter(x=steps, y=[v if v > 0 else floor for v in cell.step_max_abs_logit],
                             mode="lines+markers", name="max |Δ logit| (0 drawn at the floor)"))
    fig.add_trace(go.Scatter(x=steps, y=[v if v > 0 else floor for v in cell.step_kl], mode="lines+markers",
                             name="KL(reference ‖ cell)", line=dict(dash="dot")))
    if cell.first_divergence is not None:
        fig.add_vline(x=cell.first_divergence, line_color="#c0392b", annotation_text="parts here")
    fig.update_layout(title=f"{cell.label} vs the eager no-cache reference", xaxis_title="step",
                      height=340, margin=dict(l=10, r=10, t=60, b=10), legend=dict(orientation="h", y=-0.3))
    fig.update_yaxes(type="log", exponentformat="power")
    return fig


def cache_growth(rows: list[dict], log: bool = True) -> go.Figure:
    """KV-cache bytes against context length, one line per model × dtype (rows from kvviz.cachesize.growth)."""
    fig = go.Figure()
    keys = list(dict.fromkeys((r["model"], r["dtype"]) for r in rows))
    for model, dtype in keys:
        pts = [r for r in rows if r["model"] == model and r["dtype"] == dtype]
        fig.add_trace(go.Scatter(x=[r["tokens"] for r in pts], y=[r["bytes"] / 2 ** 20 for r in pts],
                                 mode="lines", name=f"{model} · {dtype}"))
    fig.update_layout(title="KV cache size against context length (batch 1)", xaxis_title="tokens in the cache",
                      yaxis_title="MiB", height=400, margin=dict(l=10, r=10, t=60, b=10))
    if log:
        fig.update_yaxes(type="log", exponentformat="power")
    return fig


# ------------------------------------------------------------------------------------------------------------------
# Quantized caches and weights


def quant_steps(res) -> go.Figure:
    """Per decoding step: KL(unquantized ‖ quantized) (log axis, exact zeros at a labelled floor) and where the
    free-running greedy texts part."""
    positive = [k for k in res.kl if k > 0]
    floor = min(positive) / 10 if positive else 1e-12
    fig = go.Figure()
    fig.add_trace(go.Scatter(
        x=list(range(len(res.kl))), y=_floor_zeros(res.kl, floor), mode="lines+markers", name="KL per step",
        marker=dict(symbol=["circle" if a else "x" for a in res.argmax_agree], size=8),
        customdata=[[f"{k:.3g}" if k > 0 else "0 (identical)", f"{m:.3g}", "same" if a else "another"]
                    for k, m, a in zip(res.kl, res.logits_max_abs, res.argmax_agree)],
        hovertemplate="step %{x}: KL %{customdata[0]}<br>max |Δ logit| %{customdata[1]}<br>next token: "
                      "%{customdata[2]}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", marker=dict(symbol="x", size=8, color="#444"),
                             name="× another token"))
    if positive and len(positive) < len(res.kl):
        _zero_floor(fig, floor, "0 (identical)")
    if res.agreement < res.steps:
        fig.add_vline(x=res.agreement, line_dash="dash", line_color="#c0392b")
        fig.add_annotation(x=res.agreement, y=1, yref="paper", showarrow=False, xanchor="left",
                           text=f"greedy texts part at step {res.agreement}", font=dict(color="#c0392b"))
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line=dict(dash="dash", color="#c0392b"),
                                 name="free-running greedy texts part"))
    fig.update_layout(title=f"KL(unquantized ‖ {res.label}) per step — {res.settings.dtype} on "
                            f"{res.settings.device}", xaxis_title="decoding step (teacher forced on the unquantized "
                                                                  "tokens)",
                      yaxis_title="KL (nats)", height=380, margin=dict(l=10, r=10, t=60, b=10),
                      legend=dict(orientation="h", y=-0.3))
    fig.update_yaxes(type="log", exponentformat="power")
    return fig


def quant_layers(res) -> go.Figure:
    """The largest relative gap of each layer's hidden state over the steps (exact zeros at a labelled floor)."""
    positive = [r for r in res.layer_relative if r > 0]
    floor = min(positive) / 10 if positive else 1e-12
    fig = go.Figure(go.Bar(
        x=res.layers, y=_floor_zeros(res.layer_relative, floor), name="max relative gap",
        marker_color=["#b0bec5" if r == 0 else "#8e44ad" for r in res.layer_relative],
        customdata=[[f"{r:.3g}" if r > 0 else "0 (identical)", f"{a:.3g}"]
                    for r, a in zip(res.layer_relative, res.layer_max_abs)],
        hovertemplate="%{x}<br>relative %{customdata[0]}<br>max |Δ| %{customdata[1]}<extra></extra>"))
    fig.update_layout(title=f"Largest hidden-state gap per layer over the steps — {res.label}",
                      yaxis_title="max |Δ| / max |unquantized|", height=360, margin=dict(l=10, r=10, t=60, b=10))
    fig.update_yaxes(type="log", exponentformat="power")
    _thin_x(fig, list(res.layers))
    return fig


def quant_frame(res) -> pd.DataFrame:
    from .text import fmt_number

    n = res.steps
    return pd.DataFrame({
        "step": list(range(n)),
        "unquantized token": res.reference_tokens[:n],
        "quantized token (free running)": res.quantized_tokens[:n],
        "KL": [fmt_number(k) for k in res.kl],
        "max |Δ logit|": [fmt_number(m) for m in res.logits_max_abs],
        "same next token": ["yes" if a else "no" for a in res.argmax_agree],
    })


def loading_trap_steps(res) -> go.Figure:
    """Max |Δ logit| per step between the two ways of making a 16-bit model (exact zeros at a labelled floor)."""
    positive = [v for v in res.max_abs_logit if v > 0]
    floor = min(positive) / 10 if positive else 1e-12
    fig = go.Figure(go.Scatter(x=list(range(len(res.max_abs_logit))), y=_floor_zeros(res.max_abs_logit, floor),
                               mode="lines+markers", name="max |Δ logit|"))
    if positive and len(positive) < len(res.max_abs_logit):
        _zero_floor(fig, floor, "0 (identical)")
    if res.first_divergence is not None:
        fig.add_vline(x=res.first_divergence, line_dash="dash", line_color="#c0392b")
        fig.add_annotation(x=res.first_divergence, y=1, yref="paper", showarrow=False, xanchor="left",
                           text=f"texts part at step {res.first_divergence}", font=dict(color="#c0392b"))
    fig.update_layout(title="from_pretrained(dtype) vs float32 + .to(dtype): max |Δ logit| per step",
                      xaxis_title="step", yaxis_title="max |Δ logit|", height=360, margin=dict(l=10, r=10, t=60, b=10))
    fig.update_yaxes(type="log", exponentformat="power")
    return fig


def bisect_modules(res) -> go.Figure:
    """Every compared module in execution order: max |Δ| of its output (zeros on a labelled floor), the first
    module that differs marked."""
    vals = [m.max_abs for m in res.modules]
    positive = [v for v in vals if v > 0]
    floor = min(positive) / 10 if positive else 1e-20
    first = res.first.name if res.first else None
    fig = go.Figure(go.Bar(x=list(range(len(vals))), y=_floor_zeros(vals, floor),
                           marker_color=["#c0392b" if m.name == first else ("#b0bec5" if m.max_abs == 0 else "#1f77b4")
                                         for m in res.modules],
                           customdata=[[m.name, m.kind, f"{m.max_abs:.3g}" if m.max_abs else "0 (bitwise equal)"]
                                       for m in res.modules],
                           hovertemplate="%{customdata[0]} (%{customdata[1]})<br>max |Δ| %{customdata[2]}"
                                         "<extra></extra>"))
    fig.update_layout(title="Output of every module, cached vs full forward" + (f" — first difference: {first}"
                                                                               if first else " — all equal"),
                      xaxis_title="module (in execution order)", yaxis_title="max |Δ|", height=360,
                      margin=dict(l=10, r=10, t=60, b=10))
    fig.update_yaxes(type="log", exponentformat="power")
    if any(v == 0 for v in vals):
        _zero_floor(fig, floor, "0 (bitwise equal)")
    return fig
