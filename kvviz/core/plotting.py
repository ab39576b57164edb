"""Shared plotting pieces of every view's figures (kvviz/views/<view>/figures.py): the gap heatmap, short token
labels, colour ranges and log-axis floors. Pure: no model runs here."""
from __future__ import annotations

import math
import re

import numpy as np
import plotly.graph_objects as go

from . import theme
from .naming import hover_text

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


def log_matrix(z: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log10(z.astype(float))
    out[~np.isfinite(out)] = np.nan  # exact zeros are drawn as blank (identical)
    return out


ZERO_COLOUR = theme.ZERO  # exact zeros on log-scale maps: bitwise equal


def heatmap(z: np.ndarray, x_labels: list[str], y_labels: list[str], title: str, value_name: str,
            log: bool = True, x_title: str = "token", zrange: tuple[float, float] | None = None,
            height: int | None = None) -> go.Figure:
    """A layers × positions heatmap; hover shows token, layer and the exact value. On a log scale exact zeros
    (bitwise equal) get their own colour and legend entry; an all-zero map says so and keeps its full axes.
    height: the whole figure's height in px (presenter mode: the last layer and the token axis in the first screen);
    its rows then share what is left, every k-th layer named (and the last) where 18 px a label do not fit."""
    z = np.asarray(z, dtype=float)
    zero = z == 0
    shown = log_matrix(z) if log else z
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
                      plot_bgcolor=theme.MISSING, legend=dict(orientation="h", y=-0.25))
    step = max(1, math.ceil(len(x_labels) / 24))  # long prompts: thin the labels (at most 24)
    fig.update_xaxes(tickmode="array", tickvals=xs[::step], ticktext=x_labels[::step], tickangle=-45,
                     range=[-0.5, len(x_labels) - 0.5])
    named = list(range(len(y_labels)))
    if height is not None:  # the rows share what the title, legend and token axis leave: name what fits
        rows_px = max(1, height - 200)  # ~title and legend above, angled token labels below
        step = max(1, math.ceil(18 * len(y_labels) / rows_px))
        named = named[::step] + ([named[-1]] if (len(named) - 1) % step else [])
    fig.update_yaxes(tickmode="array", tickvals=named, ticktext=[y_labels[i] for i in named], autorange="reversed",
                     range=[len(y_labels) - 0.5, -0.5])
    fit_text(fig)
    if height is not None and fig.layout.height > height:  # a short map keeps its own height
        fig.update_layout(height=height)
    return fig


def shared_range(za: np.ndarray, zb: np.ndarray, log: bool) -> tuple[float, float] | None:
    """One colour range for two maps (log10 of the positive values on a log scale; None when all are zero)."""
    both = np.concatenate([za.ravel(), zb.ravel()])
    if log:
        pos = both[both > 0]
        return (float(np.log10(pos.min())), float(np.log10(pos.max()))) if pos.size else None
    return float(both.min()), float(both.max())


def zero_floor(fig: go.Figure, floor: float, text: str) -> None:
    """The dotted "0" floor of a log axis with its label at the floor (plotly's add_hline annotation reads a log
    axis' y as an exponent and would put the label near 1)."""
    fig.add_hline(y=floor, line_dash="dot", line_color=theme.FLOOR)
    fig.add_annotation(x=1, xref="paper", y=float(np.log10(floor)), yref="y", text=text, showarrow=False,
                       xanchor="right", yanchor="bottom", xshift=-8, font=dict(color=theme.FLOOR))
    # xshift: plotly places the right-anchored label by its width measured before the page's font loaded


def floor_zeros(values, floor: float) -> list[float]:
    return [v if v > 0 else floor for v in values]


VERDICT_COLORS = theme.VERDICT_FILLS  # light fills of verdict grids


def thin_x(fig: go.Figure, labels: list[str], most: int = 16) -> None:
    """At most `most` category labels on the x axis (every k-th, and the last), so long axes stay legible."""
    if len(labels) > most:
        step = -(-len(labels) // most)
        keep = list(labels[::step]) + ([labels[-1]] if (len(labels) - 1) % step else [])
        fig.update_xaxes(tickmode="array", tickvals=keep, ticktext=keep)


def plain_index(table) -> bool:
    """A table whose index is only row numbers (not worth showing) - a grid indexed by labels keeps its index."""
    return table.index.name is None and table.index.dtype != object


def wrap_title(text: str, most: int = 44) -> str:
    """A long title on lines of at most `most` characters (plotly never wraps one: a narrow column cuts it): broken
    after its ' — ' and '; ' parts first (a part stays whole where it fits), a longer part between words."""
    if len(text) <= most or "<br>" in text:
        return text
    lines: list[str] = []
    for part in re.split(r"(?<= —) |(?<=;) ", text):  # ' — ' and '; ' end a part
        if lines and len(lines[-1]) + 1 + len(part) <= most:
            lines[-1] += " " + part
            continue
        line = ""
        for w in part.split(" "):
            if line and len(line) + 1 + len(w) > most:
                lines.append(line)
                line = w
            else:
                line = f"{line} {w}" if line else w
        lines.append(line)
    return "<br>".join(lines)


def fit_text(fig: go.Figure, most: int = 44, width: int = 380) -> go.Figure:
    """Titles and legends that fit a narrow chart (presenter mode's chart column at 1280×720 is ~400 px): the title
    wrapped and left-aligned; the legend (below the plot it covered the x-axis title, on the right a long name was cut)
    in rows of its own between the title and the plot (a long name's trailing aside cut), the rows it needs at `width` px
    reserved in the top margin and added to the height (the plot keeps its size); Markdown backticks dropped."""
    title = (fig.layout.title.text or "").replace("`", "")
    for t in fig.data:  # labels written for Markdown (`cache`) print their backticks in a legend
        if t.name and "`" in t.name:
            t.name = t.name.replace("`", "")
        if t.name and len(t.name) > 36 and t.name.endswith(")") and " (" in t.name:  # a long aside: cut in a column
            t.name = t.name[: t.name.rindex(" (")]
    wrapped = wrap_title(title, most)
    lines = wrapped.count("<br>") + 1 if wrapped else 0
    items = [t for t in fig.data if t.showlegend is not False and t.name and t.type not in ("heatmap", "contour")]
    shown = fig.layout.showlegend is not False and (len(items) > 1 or any(t.showlegend for t in items))
    # every entry as wide as the longest name at a generous 7 px a character: plotly's own measure, taken before the
    # page's font has loaded, cut legends short ("0: bitwise equ")
    entry = 40 + 7 * max((len(t.name) for t in items), default=0)
    per_row = max(1, (width - 60) // entry) if shown else 1
    rows = -(-len(items) // per_row) if shown else 0
    # subplot titles sit just above the plot, where the legend goes: the legend goes a row higher
    sub = 24 if shown and any(a.yref == "paper" and (a.y or 0) >= 0.99 and a.yanchor == "bottom"
                              for a in fig.layout.annotations) else 0
    legend_h = 22 * rows + (8 if rows else 0) + sub
    height = (fig.layout.height or 450) + legend_h
    top = 24 + 22 * lines + legend_h
    if shown:
        plot_h = max(1, height - max(top, fig.layout.margin.t or 0) - (fig.layout.margin.b or 10))
        fig.update_layout(legend=dict(orientation="h", xref="paper", x=0, xanchor="left", yref="paper",
                                      y=1.01 + sub / plot_h, yanchor="bottom", entrywidth=entry,
                                      entrywidthmode="pixels"))
    m = fig.layout.margin
    # a category axis centres its first and last labels on the plot's edges: half of each hangs into the margin, which
    # automargin measured before the page's font loaded (short: "layer 4 + final norm", a matrix's "dynamic · compile
    # off" cut) - reserved here
    cats = [[str(x) for x in t.x] for t in fig.data if t.x is not None and len(t.x) and isinstance(t.x[-1], str)]
    left = 10 + 4 * max((len(re.sub("<[^>]+>", "", c[0])) for c in cats), default=0)
    right = 10 + 4 * max((len(re.sub("<[^>]+>", "", c[-1])) for c in cats), default=0)
    # category y labels and a colour bar's named ticks lie wholly in their margins (the matrix's were cut by 16 and 3 px)
    ylabels = [str(y) for t in fig.data if t.y is not None and len(t.y) and isinstance(t.y[-1], str) for y in t.y]
    left = max(left, 24 + int(7 * max((len(re.sub("<[^>]+>", "", y)) for y in ylabels), default=0)))
    named = [str(v) for t in fig.data if t.type == "heatmap" and t.colorbar.ticktext for v in t.colorbar.ticktext]
    if named:
        right = max(right, 60 + int(6.5 * max(len(v) for v in named)))
    fig.update_layout(height=height,
                      title=dict(text=wrapped, x=0, xanchor="left", xref="container", pad=dict(l=10),
                                 yref="container", y=1 - (8 + 11 * lines) / height, yanchor="middle"),
                      margin=dict(l=max(m.l if m.l is not None else 10, left), r=max(m.r if m.r is not None else 10, right),
                                  b=m.b if m.b is not None else 10, t=max(top, m.t or 0)))
    fig.update_xaxes(automargin=True)  # tick labels and axis titles push the margins, never overlap
    fig.update_yaxes(automargin=True)
    return fig
