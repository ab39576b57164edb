"""The dtypes view's figures and tables: pure functions of its result (no model runs here)."""
from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
import torch as _torch

from ...core.theme import DTYPE_COLOURS, log_axis
from ...core.plotting import METRIC_TITLES, zero_floor, floor_zeros, thin_x, fit_text


DTYPE_COLORS = DTYPE_COLOURS  # the theme's: the same in the lesson


def _line(x: list, y, dtype: str, name: str, floor: float, dash: str | None = None) -> go.Scatter:
    """One dtype's curve, its exact zeros drawn at `floor` and hovered as "0 (bitwise equal)"."""
    return go.Scatter(x=x, y=floor_zeros(y, floor), mode="lines+markers", name=name,
                      line=dict(color=DTYPE_COLORS.get(dtype), dash=dash),
                      customdata=[f"{v:.3g}" if v > 0 else "0 (bitwise equal)" for v in y],
                      hovertemplate="%{x}<br>" + name + ": %{customdata}<extra></extra>")


def dtype_curves(res, metric: str = "max_abs", how: str = "mean") -> go.Figure:
    """Per-layer curves, one per dtype, on one log-scale chart (mean or max over the prompt set). In ε units every
    dtype is in its own ε, except the float64 reference: it is drawn in the finest compared dtype's ε (so it cannot
    look worse than the dtypes it checks) and says so. Exact zeros sit on a labelled "0" floor."""
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
    floor = min([v / 10 for _, _, y in series for v in y if v > 0], default=1e-20)  # exact zeros are drawn here
    fig = go.Figure()
    for i, (d, name, y) in enumerate(series):
        same = next((n for _, n, o in series[i + 1:] if np.array_equal(o, y)), None)
        if same is not None:  # drawn first, so the later line covers it: say so in the legend
            name += f" (= {same}, under it)"
        fig.add_trace(_line(list(table.index), y, d, name, floor, "dash" if d == "float64" else None))
    n = len(res.prompts)
    what = METRIC_TITLES.get(metric, metric)
    fig.update_layout(title=f"{what} per layer, {how} over {n} prompt{'s' if n != 1 else ''} — device "
                            f"{res.settings.device} (float64 on {res.settings.float64_device})",
                      xaxis_title="hidden state", yaxis_title=what, height=420, margin=dict(l=10, r=10, t=60, b=10),
                      legend=dict(orientation="h", y=-0.35))
    log_axis(fig)
    if any(v == 0 for _, _, y in series for v in y):
        zero_floor(fig, floor, "0 (bitwise equal)")
    thin_x(fig, list(table.index))
    return fit_text(fig)


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
        fd.add_trace(_line(list(ta.index), diff, d, d, min(diff[diff > 0] / 10, default=1e-20)))
    fd.update_layout(title=f"|B − A| of {METRIC_TITLES.get(metric, metric)} per layer", height=380,
                     margin=dict(l=10, r=10, t=60, b=10), legend=dict(orientation="h", y=-0.35))
    log_axis(fd)
    thin_x(fd, list(ta.index))
    return fit_text(fa), fit_text(fb), fit_text(fd)


def main(result) -> list:
    return [dtype_curves(result, "max_abs", "mean"), dtype_curves(result, "eps_units", "max")]


def tables(result) -> list:
    return [result.verdict_counts()]
