"""The matrix view's figures and tables: pure functions of its result (no model runs here)."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from ...core.theme import VERDICT_COLOURS, MARK, log_axis
from ...core.plotting import fit_text, zero_floor


MATRIX_COLOURS = {v: VERDICT_COLOURS[v] for v in ("identical", "precision", "logic", "nondeterministic", "lossy",
                                                   "error")}  # the theme's, in the grid's order


def matrix_grid(res) -> go.Figure:
    """Settings (rows) × attention implementations (columns), coloured by verdict; grey cells could not run."""
    attns = list(dict.fromkeys(c.attention for c in res.cells))
    settings = list(dict.fromkeys(c.setting for c in res.cells))
    names = list(MATRIX_COLOURS)
    z = np.full((len(settings), len(attns)), np.nan)
    hover = np.empty(z.shape, dtype=object)
    for c in res.cells:
        i, j = settings.index(c.setting), attns.index(c.attention)
        kind = "error" if c.error else c.verdict
        z[i, j] = names.index(kind)
        hover[i, j] = (f"<b>{kind}</b><br>{c.error}" if c.error else
                       f"<b>{kind}</b><br>first divergence: {'—' if c.first_divergence is None else c.first_divergence}"
                       f"<br>max |Δ logit|: {c.max_abs_logit:.3g}<br>distinct outputs: {c.distinct_outputs}"
                       f"<br>{c.seconds_per_token * 1000:.1f} ms/token<br>compiled: "
                       f"{'frames ' + str(c.compiled['frames']) if c.compiled and c.compiled['requested'] else 'no'}")
    n = len(names)
    scale = [[k / n, MATRIX_COLOURS[v]] for k, v in enumerate(names) for k in (k, k + 1)]  # k / n <= n / n = 1
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
    return fit_text(fig)


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
        fig.add_vline(x=cell.first_divergence, line_color=MARK, annotation_text="parts here")
    fig.update_layout(title=f"{cell.label} vs the eager no-cache reference", xaxis_title="step",
                      height=340, margin=dict(l=10, r=10, t=60, b=10), legend=dict(orientation="h", y=-0.3))
    log_axis(fig)
    if any(v == 0 for v in cell.step_max_abs_logit + cell.step_kl):
        zero_floor(fig, floor, "0 (identical), drawn at this floor")
    return fit_text(fig)


def main(result) -> list:
    return [matrix_grid(result)]
