"""The padding view's figures and tables: pure functions of its result (no model runs here)."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from ...core.plotting import ZERO_COLOUR, shared_range, VERDICT_COLORS, fit_text
from .run import SCENARIOS


def padding_grid(res, value: str = "hidden_relative") -> go.Figure:
    """Placements × scenarios: each cell coloured by its verdict, with the gap written in it (placements that do
    not apply - "left-padded" with no padding - are left out)."""
    verdicts = res.grid("verdict")
    vals = res.grid(value)
    f64 = res.grid("float64_relative")
    rows = list(res.placements)
    cols = [s[0] for s in SCENARIOS]
    code = {"identical": 0, "precision": 1, "logic": 2}  # "cannot run": no colour, the word in the cell
    z = [[code.get(verdicts.loc[p, c], np.nan) for c in cols] for p in rows]

    def cell(p, c):
        if verdicts.loc[p, c] not in code:
            return f"<b>{verdicts.loc[p, c]}</b>"
        return f"<b>{verdicts.loc[p, c]}</b><br>{vals.loc[p, c]:.2g}<br>float64: {f64.loc[p, c]:.1g}"

    text = [[cell(p, c) for c in cols] for p in rows]
    scale = [[0, VERDICT_COLORS["identical"]], [0.33, VERDICT_COLORS["identical"]],
             [0.34, VERDICT_COLORS["precision"]], [0.66, VERDICT_COLORS["precision"]],
             [0.67, VERDICT_COLORS["logic"]], [1, VERDICT_COLORS["logic"]]]
    fig = go.Figure(go.Heatmap(z=z, x=cols, y=rows, text=text, texttemplate="%{text}", zmin=0, zmax=2,
                               colorscale=scale, showscale=False, hoverinfo="text", xgap=3, ygap=3))
    return _framed(fig, f"Relative gap vs the prompt alone without cache — {res.settings.dtype} on "
                        f"{res.settings.device}", rows, cols)


def _framed(fig: go.Figure, title: str, rows: list[str], cols: list[str], **layout) -> go.Figure:
    """A grid's frame: placements top down, scenario names on two lines ("cache,<br>positions omitted") so
    neighbouring columns do not overlap."""
    fig.update_layout(title=title, height=140 + 80 * len(rows), margin=dict(l=90, r=10, t=60, b=10), **layout)
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(tickmode="array", tickvals=cols, ticktext=[c.replace(", ", ",<br>") for c in cols])
    return fit_text(fig)


def ab_padding_grids(res_a, res_b, label_a: str, label_b: str, value: str = "hidden_relative"
                     ) -> tuple[go.Figure, go.Figure, go.Figure]:
    """A/B for the padding grid: log10 of each cell's relative gap on ONE colour scale for both, the verdict
    written in the cell, and |B − A|. Exact zeros (bitwise equal) are written "0" and left uncoloured."""
    rows = [p for p in res_a.placements if p in res_b.placements]
    cols = [s[0] for s in SCENARIOS]
    za, zb = (r.grid(value).loc[rows, cols].to_numpy(dtype=float) for r in (res_a, res_b))
    zrange = shared_range(za, zb, True)

    def grid(z, res, title, verdicts=True):
        v = res.grid("verdict") if verdicts else None
        text = [[(f"<b>{v.loc[p, c]}</b><br>" if verdicts else "") + (f"{z[i, j]:.2g}" if z[i, j] else "0")
                 for j, c in enumerate(cols)] for i, p in enumerate(rows)]
        shown = np.where(z > 0, np.log10(np.where(z > 0, z, 1.0)), np.nan)
        fig = go.Figure(go.Heatmap(z=shown, x=cols, y=rows, text=text, texttemplate="%{text}", hoverinfo="text",
                                   textfont=dict(size=13), colorscale="Viridis", xgap=3, ygap=3,
                                   colorbar=dict(title="log₁₀ gap"),
                                   **({} if zrange is None or not verdicts else dict(zmin=zrange[0], zmax=zrange[1]))))
        return _framed(fig, title, rows, cols, plot_bgcolor=ZERO_COLOUR)

    return (grid(za, res_a, f"A — {label_a}"), grid(zb, res_b, f"B — {label_b}"),
            grid(np.abs(zb - za), res_a, "|B − A| of the relative gap", verdicts=False))


def main(result) -> list:
    return [padding_grid(result, "hidden_relative")]


def tables(result) -> list:
    return [result.grid("verdict")]
