"""kvviz's one look: palette, verdict colours, background and fonts, registered once as the plotly template "kvviz".

Every figure kvviz writes - the app's charts, the HTML report, the lesson handout, the meeting bundle - is drawn with
it: the app sets it as plotly's default template (`use()`, pages/common.py), the files assign it to every figure they
write (kvviz.io.export.standalone_figure). A new view's figures get it without code of their own.

The verdict colours are the app's verdict boxes (Streamlit's success / info / error / warning alerts, light theme):
logic red, precision blue, identical green, anything else amber - in the app, the reports and the handout alike; the
strong colours (VERDICT_COLOURS) fill the cells of verdict grids and legends in the same hues.

Log axes: every axis and colour bar labels its numbers as powers of ten ("10⁻¹²"), never with SI prefixes (plotly's
default "B" format draws "10f", "1p", "100μ"); `log_axis` labels decades only (no "2 5" or "9 8 7 … 2" between them).
"""
from __future__ import annotations

import math

import plotly.graph_objects as go
import plotly.io as pio

NAME = "kvviz"

# The page's colours (Streamlit's light theme): background, text, grid lines, font.
BACKGROUND = "#ffffff"
TEXT = "#31333f"
GRID = "#e6e9ef"
FONT = '"Source Sans Pro", "Source Sans 3", system-ui, sans-serif'
MISSING = "#f3f3f3"  # heatmap cells with no value
ZERO = "#b0bec5"  # exact zeros on log-scale maps: bitwise equal
FLOOR = "#888888"  # the dotted line (and its label) where a log axis draws values of 0
EXPONENT_FORMAT = "power"  # 1e-12 is drawn "10⁻¹²"; never "B"/"SI" ("1p")

# Strong verdict colours: grid cells, legends, bars. Red is logic and only logic; precision blue everywhere.
VERDICT_COLOURS = {"identical": "#2e7d32", "precision": "#1565c0", "logic": "#c62828", "nondeterministic": "#ef6c00",
                   "lossy": "#6a1b9a", "error": "#9e9e9e", "not finished": "#5d4037", "not run": "#bdbdbd"}
LOGIC = VERDICT_COLOURS["logic"]
PRECISION = VERDICT_COLOURS["precision"]
MARK = LOGIC  # a marker where paths or texts part

# The verdict boxes, as the app draws them (Streamlit 1.67's alerts on a white page): (background, text colour).
# The box classes: identical (st.success), precision (st.info), logic (st.error), other (st.warning).
VERDICT_BOXES = {"identical": ("#e8f9ee", "#177233"), "precision": ("#e8f2fc", "#004280"),
                 "logic": ("#ffecec", "#7d353b"), "other": ("#fffce7", "#926c05")}
# Light cell fills of verdict grids (the padding grid: the text in the cell stays readable)
VERDICT_FILLS = {"identical": "#cfe8cf", "precision": "#cfe3fa", "logic": "#f8c9c4"}

# Lines and bars without a colour of their own take these in turn: no red (logic's colour) among them.
COLORWAY = ["#1565c0", "#00897b", "#ef6c00", "#6a1b9a", "#5d4037", "#546e7a", "#ad1457", "#9e9d24", "#0097a7",
            "#8d6e63"]
# One colour a dtype, in every figure (the Dtypes view, the lesson's steps)
DTYPE_COLOURS = {"float64": "#555555", "float32": "#1565c0", "float16": "#ef6c00", "bfloat16": "#00897b"}

# Verdict words of views that are not precision/logic verdicts, by the box class they read as (Open a result, reports)
VERDICT_CLASS = {"same model": "identical", "bitwise equal": "identical", "safe": "identical",
                 "different models": "logic", "differs": "logic", "unsafe": "logic", "lossy": "precision"}


def box_class(verdict) -> str:
    """The verdict box a verdict word reads as: identical, precision, logic, or other (information / warning). A
    tally of several verdicts (kvviz.core.verdict.Tally: "logic: 1, precision: 3") reads as its worst, which it
    carries typed; no text is searched for a verdict word."""
    v = getattr(verdict, "verdict", None) or VERDICT_CLASS.get(str(verdict), str(verdict))
    return str(v) if v in ("identical", "precision", "logic") else "other"


def box_css(selector: str = ".verdict") -> str:
    """CSS for HTML verdict boxes: `<div class="verdict logic">` takes logic's colours, and so on; dark mode keeps
    the hue."""
    rules = [f"{selector}{{padding:.8em 1em;border-radius:8px}}"]
    dark = {"identical": ("#173d24", "#dff5e6"), "precision": ("#14304d", "#dbeafb"),
            "logic": ("#4a1c1f", "#ffdede"), "other": ("#463b12", "#fff3c4")}
    for name, (bg, fg) in VERDICT_BOXES.items():
        rules.append(f"{selector}.{name}{{background:{bg};color:{fg}}}")
    rules.append("@media (prefers-color-scheme: dark){" + "".join(
        f"{selector}.{name}{{background:{bg};color:{fg}}}" for name, (bg, fg) in dark.items()) + "}")
    return "".join(rules)


PAGE_CSS = (f"body{{font-family:{FONT};max-width:1100px;margin:2em auto;padding:0 1em;color:{TEXT};"
            f"background:{BACKGROUND};line-height:1.45}}"
            "@media (prefers-color-scheme: dark){body{background:#0e1117;color:#fafafa}}")


def _axis() -> dict:
    return dict(exponentformat=EXPONENT_FORMAT, showexponent="all", gridcolor=GRID, zerolinecolor=GRID,
                linecolor=GRID, tickcolor=GRID, minor=dict(showgrid=False, ticks=""), title=dict(standoff=10))


def _colorbar() -> dict:
    return dict(exponentformat=EXPONENT_FORMAT, showexponent="all", outlinewidth=0)


def template() -> go.layout.Template:
    """The template, built from the constants above."""
    axis = _axis()
    cb = dict(colorbar=_colorbar())
    return go.layout.Template(
        layout=dict(colorway=COLORWAY, paper_bgcolor=BACKGROUND, plot_bgcolor=BACKGROUND,
                    font=dict(family=FONT, color=TEXT, size=13), title=dict(font=dict(size=16)),
                    hoverlabel=dict(font=dict(family=FONT)), xaxis=axis, yaxis=axis,
                    coloraxis=dict(colorbar=_colorbar()), legend=dict(bgcolor="rgba(0,0,0,0)"),
                    colorscale=dict(sequential="Viridis")),
        data=dict(heatmap=[go.Heatmap(**cb)], contour=[go.Contour(**cb)],
                  scatter=[go.Scatter(marker=cb)], bar=[go.Bar(marker=cb)]))


def register() -> go.layout.Template:
    """Register the template as plotly's "kvviz" (once; idempotent) and return it."""
    if NAME not in pio.templates:
        pio.templates[NAME] = template()
    return pio.templates[NAME]


def use() -> None:
    """Make "kvviz" plotly's default template for this process (the app: `import streamlit` made it "streamlit",
    whose placeholder colours only Streamlit's frontend fills in)."""
    register()
    pio.templates.default = NAME


def _values(fig: go.Figure, axis: str) -> list[float]:
    out = []
    for t in fig.data:
        vals = getattr(t, axis, None)
        if vals is None or t.type in ("heatmap", "contour"):
            continue
        for v in vals:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
                out.append(float(v))
    return out


def log_axis(fig: go.Figure, axis: str = "y", **where) -> go.Figure:
    """A log axis labelled by decades only, as powers of ten: a tick every decade (dtick 1), none between them;
    where the data spans less than a decade, the range is widened to the decades around it, so that at least two
    labels show. `where`: row/col of a subplot (the data of every trace is then taken)."""
    update = fig.update_yaxes if axis == "y" else fig.update_xaxes
    update(type="log", exponentformat=EXPONENT_FORMAT, showexponent="all", dtick=1, tick0=0,
           minor=dict(showgrid=False, ticks=""), **where)
    vals = _values(fig, axis)
    if vals:
        lo, hi = math.log10(min(vals)), math.log10(max(vals))
        if math.floor(lo) == math.floor(hi) and hi - lo < 1:  # within one decade: show the decades around it
            update(range=[math.floor(lo), math.floor(lo) + 1 if hi > math.floor(lo) else math.floor(lo) + 1],
                   **where)
    return fig
