"""The Lesson's figures (one per step, pure: StepResult -> plotly figure) and its offline HTML handout."""
from __future__ import annotations

import html
import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .lesson import STEPS, StepResult
from ..core import theme
from ..core.plotting import fit_text, zero_floor
from ..core.theme import log_axis
from .exercises import EXERCISES
from ..io.export import figure_html  # kvviz's template, whatever the process default (the app's is Streamlit's)

COLOURS = theme.DTYPE_COLOURS  # the Dtypes view's too
LIGHT, HIGHLIGHT, BAND = "#9ecae1", theme.COLORWAY[2], theme.VERDICT_COLOURS["identical"]  # other layers, the one asked about, ×0.5-×2
def floor_of(*series) -> float:
    """Where a figure draws exact zeros on its log axis (labelled "0"): a decade below its smallest value above 0,
    so the zero line sits just under the data, not 20 decades down."""
    small = [v for vals in series for v in vals if v is not None and v > 0]
    return 10.0 ** (math.floor(math.log10(min(small))) - 1) if small else 1e-20


def _floor(values, floor: float) -> list[float]:
    return [floor if (v is None or v == 0) else v for v in values]


def _layout(fig: go.Figure, title: str, height: int = 420) -> go.Figure:
    fig.update_layout(title=title, height=height, margin=dict(l=10, r=10, t=60, b=10))
    return fit_text(fig)  # title wrapped, legend in rows above the plot: it fits presenter mode's column


def _whole_ticks(fig: go.Figure, n: int, **where) -> None:
    """Layers and steps are whole numbers: ticks on them (at most ~16), never at 0.5."""
    fig.update_xaxes(tick0=0, dtick=max(1, math.ceil(n / 16)), **where)


def log_hline(fig: go.Figure, y: float, text: str, colour: str = theme.FLOOR, dash: str = "dot", above: bool = True,
              x: float = 1.0) -> None:
    """A horizontal line on a log y axis with its label next to it: plotly places an annotation on a log axis at
    log10(y) (add_hline's own label lands at 10^y - at the top of the figure for a y of 1e-20)."""
    fig.add_hline(y=y, line_dash=dash, line_color=colour)
    fig.add_annotation(x=x, xref="x domain", y=math.log10(y), yref="y", text=text, showarrow=False,
                       xanchor="right" if x >= 0.5 else "left", yanchor="bottom" if above else "top",
                       font=dict(color=colour))


def fig_float(r: StepResult) -> go.Figure:
    d = r.data
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45],
                        subplot_titles=(f"{d['value']:.6g} in {d['dtype']}: its neighbours",
                                        f"one ulp at {d['value']:.3g}, each dtype"))
    pts = [("next below", d["below"]), ("stored", d["stored"]), ("next above", d["above"])]
    fig.add_trace(go.Scatter(x=[p[1] for p in pts], y=[0, 0, 0], mode="markers+text", text=[p[0] for p in pts],
                             textposition="top center", marker=dict(size=14, color=COLOURS[d["dtype"]]),
                             name=f"{d['dtype']} numbers", hovertemplate="%{x:.17g}<extra></extra>"), 1, 1)
    fig.add_vline(x=d["value"], line_dash="dash", line_color=theme.FLOOR, row=1, col=1)
    fig.add_annotation(x=d["value"], y=-0.6, text=f"your number {d['value']:.9g}", showarrow=False, row=1, col=1)
    fig.update_yaxes(visible=False, range=[-1, 1], row=1, col=1)
    names = list(d["dtypes"])
    fig.add_trace(go.Bar(x=names, y=[d["dtypes"][n]["ulp"] for n in names], name="ulp at this size",
                         marker_color=[COLOURS[n] for n in names],
                         text=[f"{d['dtypes'][n]['ulp']:.3g}" for n in names], textposition="outside",
                         customdata=[d["dtypes"][n]["mantissa_bits"] for n in names],
                         hovertemplate="%{x}: ulp %{y:.4g}, %{customdata} bits of mantissa<extra></extra>"), 1, 2)
    log_axis(fig, row=1, col=2)
    fig.update_yaxes(title="ulp (log)", row=1, col=2)
    return _layout(fig, f"Step 1 · {r.title}: ε of {d['dtype']} = {d['eps']:.4g}")


def fig_sums(r: StepResult) -> go.Figure:
    d = r.data
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"{d['n']} numbers in {d['dtype']}: error of each order",
                                                        f"adding {d['drift_value']:g}, {d['drift_n']} times"))
    orders = list(d["error_ulps"])
    fig.add_trace(go.Bar(x=[o.replace(" (", "<br>(") for o in orders], y=[d["error_ulps"][o] for o in orders], name="error vs exact (ulps)",
                         marker_color=COLOURS[d["dtype"]], text=[f"{d['error_ulps'][o]:.3g}" for o in orders],
                         textposition="outside"), 1, 1)
    fig.update_yaxes(title="|sum − exact| in ulps", row=1, col=1)
    n = d["drift_n"]
    xs = list(range(1, n + 1))
    step = max(1, n // 400)
    fig.add_trace(go.Scatter(x=xs[::step], y=[d["drift_value"] * i for i in xs[::step]], name="exact",
                             line=dict(color=theme.FLOOR, dash="dash")), 1, 2)
    for dt, run in d["drift"].items():
        fig.add_trace(go.Scatter(x=xs[::step], y=run[::step], name=dt, line=dict(color=COLOURS[dt])), 1, 2)
    fig.update_xaxes(title="additions", row=1, col=2)
    fig.update_yaxes(title="running sum", row=1, col=2)
    fig = _layout(fig, f"Step 2 · {r.title}: left to right vs right to left differ by {d['diff_ulps']:.0f} ulp")
    # a narrow column turns the orders' names: room for them (automargin measured them 2 px short in presenter mode)
    return fig.update_layout(margin_b=90)


def fig_row(r: StepResult) -> go.Figure:
    d = r.data
    fig = go.Figure()
    for bucket in ("0", "1", "2", "3+"):
        fig.add_trace(go.Bar(x=list(d["dtypes"]), y=[p["ulps"][bucket] for p in d["dtypes"].values()],
                             name=f"{bucket} ulp" + ("" if bucket == "1" else "s") + (" (same bits)" if bucket == "0"
                                                                                       else "")))
    fig.update_layout(barmode="stack", yaxis_title=f"outputs (of {d['outputs']})", xaxis_title="dtype")
    return _layout(fig, f"Step 3 · {d['module']}: the last row alone vs inside {d['rows']} rows - how far apart")


def fig_one_layer(r: StepResult) -> go.Figure:
    d = r.data
    labels = d["labels"][1:]
    growth = d["growth"]
    colours = [HIGHLIGHT if i + 1 == d["layer"] else LIGHT for i in range(len(growth))]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.35, 0.65],
                        subplot_titles=(f"layer {d['layer']}: the gap in and out",
                                        "growth factor of every layer (gap out ÷ gap in)"))
    fig.add_trace(go.Bar(x=["entering", "leaving"], y=[d["gap_in"], d["gap_out"]],
                         marker_color=[LIGHT, HIGHLIGHT], name="relative gap",
                         text=[f"{d['gap_in']:.3g}", f"{d['gap_out']:.3g}"], textposition="outside"), 1, 1)
    fig.update_yaxes(title="relative gap", rangemode="tozero", row=1, col=1)  # linear: ×0.99 looks like ×0.99
    # growth factors as points on a log axis centred on ×1, with the answer's bands: a bar from the axis floor
    # made ×0.99 look like a fall
    known = [g for g in growth if g]
    reach = max([2.0] + [max(g, 1 / g) for g in known]) * 1.5
    fig.add_annotation(x=0, xref="x2 domain", y=math.log10(2), yref="y2", text="about the same (×0.5 to ×2)",
                       showarrow=False, xanchor="left", yanchor="top", font=dict(color=BAND))
    fig.add_trace(go.Scatter(x=list(range(1, len(growth) + 1)), y=[g if g else None for g in growth],
                             mode="markers", marker=dict(color=colours, size=11), name="growth factor",
                             customdata=labels, hovertemplate="%{customdata}: ×%{y:.3g}<extra></extra>"), 1, 2)
    fig.add_hline(y=1, line_dash="dot", line_color=theme.FLOOR, row=1, col=2)
    fig.add_hrect(y0=0.5, y1=2, fillcolor=BAND, opacity=0.08, line_width=0, row=1, col=2)  # after the points:
    # plotly skips a shape on a subplot that has no trace yet
    ticks = [t for t in (0.01, 0.1, 0.5, 1, 2, 10, 100) if 1 / reach <= t <= reach]  # named: no "2 5" minor labels
    fig.update_yaxes(type="log", title="× (log, centred on ×1)", range=[-math.log10(reach), math.log10(reach)],
                     tickmode="array", tickvals=ticks, ticktext=[f"×{t:g}" for t in ticks], row=1, col=2)
    fig.update_xaxes(title="layer", row=1, col=2)
    _whole_ticks(fig, len(growth), row=1, col=2)
    f = d["factor"]
    return _layout(fig, f"Step 4 · layer {d['layer']} in {d['dtype']}: "
                        + (f"×{f:.3g}" if f is not None else "the gap is born here" if d["gap_out"] else "no gap"))


def fig_layers(r: StepResult) -> go.Figure:
    d = r.data
    x = list(range(len(d["labels"])))
    floor = floor_of(d["float64"], *[p["relative"] + p["format_error"] for p in d["dtypes"].values()])
    fig = go.Figure()
    for dt, p in d["dtypes"].items():
        c = COLOURS[dt]
        fig.add_trace(go.Scatter(x=x, y=_floor(p["relative"], floor), name=f"{dt}: cached vs full", mode="lines+markers",
                                 line=dict(color=c), customdata=d["labels"],
                                 hovertemplate="%{customdata}: %{y:.3g}<extra>" + dt + "</extra>"))
        fig.add_trace(go.Scatter(x=x, y=_floor(p["format_error"], floor), name=f"{dt}: full forward vs float64",
                                 mode="lines", line=dict(color=c, dash="dot"), customdata=d["labels"],
                                 hovertemplate="%{customdata}: %{y:.3g}<extra>" + dt + " vs float64</extra>"))
    # each ε labelled at its own line, at the left; a label below its line where the next ε up is within a decade
    # and a half (float16's 2^-10 under bfloat16's 2^-7), so no two labels print on top of each other
    eps = sorted((p["eps"], dt) for dt, p in d["dtypes"].items())
    for i, (e, dt) in enumerate(eps):
        crowded = i + 1 < len(eps) and eps[i + 1][0] / e < 10 ** 1.5
        log_hline(fig, e, f"ε {dt}", COLOURS[dt], dash="dash", above=not crowded, x=0.0)
    fig.add_trace(go.Scatter(x=x, y=_floor(d["float64"], floor), name="float64: cached vs full", mode="lines",
                             line=dict(color=COLOURS["float64"]), customdata=d["labels"],
                             hovertemplate="%{customdata}: %{y:.3g}<extra>float64</extra>"))
    zero_floor(fig, floor, "0 (bitwise equal)")
    log_axis(fig)
    fig.update_yaxes(title="relative gap (log)")
    fig.update_xaxes(title="hidden state (0 = embeddings)")
    _whole_ticks(fig, len(x))
    return _layout(fig, f"Step 5 · {r.title}", height=480)


def _lens_panel(fig: go.Figure, v: dict, step: int) -> None:
    """Step 6's right panel: the logit lens of the parting step - each path's top-1 margin over its runner-up per
    hidden state, its top-1 written on the marker, the decision depth marked."""
    for side, dash, colour in (("full", "solid", LIGHT), ("cached", "dash", theme.MARK)):
        p = v[side]
        fig.add_trace(go.Scatter(x=v["labels"], y=p["margin"], name=f"lens top-1 margin, {side} path",
                                 mode="lines+markers+text", line=dict(dash=dash, color=colour), text=p["top1"],
                                 textposition="top center" if side == "full" else "bottom center",
                                 customdata=p["top2"], hovertemplate="%{x}: %{text} by %{y:.3g} over %{customdata}"
                                 f"<extra>{side}</extra>"), row=1, col=2)
    if v["depth"] is not None:
        fig.add_vline(x=v["depth"], line_dash="dot", line_color=theme.MARK, row=1, col=2,
                      annotation_text=f"decided at {v['labels'][v['depth']]}", annotation_position="top left")
    fig.update_yaxes(title="top-1 margin (logits)", type="linear", rangemode="tozero", row=1, col=2)
    fig.update_xaxes(title=f"hidden state (lens at step {step})", row=1, col=2)


def fig_greedy(r: StepResult) -> go.Figure:
    d = r.data
    x = list(range(len(d["margins"])))
    floor = floor_of(d["margins"], d["gaps"])
    lens = d.get("flip_lens")
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.12) if lens else go.Figure()
    fig.add_trace(go.Bar(x=x, y=_floor(d["margins"], floor), name="top-2 margin (no-cache path)", marker_color=LIGHT,
                         customdata=[repr(t) for t in d["tokens"]], hovertemplate="step %{x}: %{customdata}, margin %{y:.3g}"
                                                               "<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=_floor(d["gaps"], floor), name="largest |Δ logit| between the paths",
                             mode="lines+markers", line=dict(color=theme.MARK)))
    if d["parting"] is not None:
        fig.add_vline(x=d["parting"], line_dash="dash", line_color=theme.MARK,
                      annotation_text=f"they part at step {d['parting']}", annotation_position="top right",
                      annotation_yanchor="top")  # inside the plot: above it is the legend's row
    zero_floor(fig, floor, "0 (an exact tie, or no gap)")
    log_axis(fig)
    fig.update_yaxes(title="logit units (log)")
    fig.update_xaxes(title="step")
    _whole_ticks(fig, len(x))
    if lens:
        _lens_panel(fig, lens, d["parting"])
    head = (f"they part at step {d['parting']}" if d["parting"] is not None else
            f"no parting in {len(x)} steps")
    where = f"{d['model']} (constructed)" if d.get("constructed") else d.get("model", "")
    return _layout(fig, f"Step 6 · greedy, {where} in {d['dtype']}: {head}")


def fig_referee(r: StepResult) -> go.Figure:
    d = r.data
    x = list(range(len(d["labels"])))
    floor = floor_of(d["normal"], d["float64"], d["invariant"])
    fig = go.Figure()
    for key, name, colour in (("normal", f"{d['dtype']}, normal run", COLOURS.get(d["dtype"], theme.COLORWAY[0])),
                              ("float64", "float64, same scenario", COLOURS["float64"]),
                              ("invariant", f"{d['dtype']}, invariant mode", theme.COLORWAY[3])):
        fig.add_trace(go.Scatter(x=x, y=_floor(d[key], floor), name=name, mode="lines+markers", line=dict(color=colour),
                                 customdata=d["labels"], hovertemplate="%{customdata}: %{y:.3g}<extra></extra>"))
    zero_floor(fig, floor, "0 (bitwise equal)")
    log_axis(fig)
    fig.update_yaxes(title="relative gap, cached vs full (log)")
    fig.update_xaxes(title="hidden state (0 = embeddings)")
    _whole_ticks(fig, len(x))
    m = d["max"]
    return _layout(fig, f"Step 7 · {d['dtype']} {m['normal']:.2g} → float64 {m['float64']:.2g} → invariant "
                        + ("0" if m["invariant"] == 0 else f"{m['invariant']:.2g}"))


def fig_bug(r: StepResult) -> go.Figure:
    d = r.data
    fig = go.Figure()
    floor = floor_of([row["hidden"] for row in d["rows"]])
    for dt in dict.fromkeys(row["dtype"] for row in d["rows"]):
        rows = [row for row in d["rows"] if row["dtype"] == dt]
        fig.add_trace(go.Bar(x=[row["scenario"] for row in rows], y=_floor([row["hidden"] for row in rows], floor),
                             name=dt, marker_color=COLOURS.get(dt), text=[f"{row['hidden']:.2g}" for row in rows],
                             textposition="outside"))
    zero_floor(fig, floor, "0 (bitwise equal)")
    fig.update_layout(barmode="group")
    log_axis(fig)
    fig.update_yaxes(title="largest relative gap (log)")
    return _layout(fig, f"Step 8 · {d['left_pad']} pad tokens: the bug's gap stays in float64")


FIGURES = {1: fig_float, 2: fig_sums, 3: fig_row, 4: fig_one_layer, 5: fig_layers, 6: fig_greedy, 7: fig_referee,
           8: fig_bug}


def figure(r: StepResult) -> go.Figure:
    return FIGURES[r.step](r)


def exercises_html(runs: dict | None = None) -> str:
    """The lesson's "Find the bug" exercises (kvviz.teach.exercises) for the handout: each one's story and question,
    the answer behind a reveal. `runs` (exercise key -> ExerciseRun, where they were run): the measured gaps and
    kvviz's verdict in the verdict's colour (the app's box: logic red, precision blue)."""
    out = []
    for ex in EXERCISES:
        run = (runs or {}).get(ex.key)
        measured = ""
        if run is not None:
            f64 = run.float64_gap
            measured = (f'<div class="verdict {theme.box_class(run.verdict)}"><b>Verdict: {html.escape(run.verdict)}.'
                        f"</b> In {html.escape(ex.dtype)} the largest relative gap is {run.gap:.3g}; rerun in float64 "
                        f"it is {'0' if not f64 else f'{f64:.3g}'}.</div>")
        out.append(f"""<section class="exercise" id="exercise-{ex.key}"><h3>{html.escape(ex.title)}</h3>
<div class="q"><b>Bug or rounding?</b> {html.escape(ex.story)} <i>Choose: precision (rounding) or logic (a bug).</i></div>
<details><summary>Reveal the answer</summary>{measured}<p>{html.escape(ex.hidden)}</p></details></section>""")
    return ('<h2 id="exercises">Exercises: find the bug</h2><p>Each exercise is a cached-vs-full comparison whose '
            "settings are hidden. Decide, then open the answer (in the app, the Lesson's last step runs them).</p>"
            + "".join(out))


def handout_html(results: list[StepResult], model: str = "", exercise_runs: dict | None = None) -> str:
    """The whole lesson as one self-contained HTML file (plotly inlined once: it opens offline): each step's
    question, its choices, the answer with the measured numbers, the figure and the explanation; then the exercises
    (exercises_html; `exercise_runs`: their measured gaps and verdicts, where they were run). Drawn in kvviz's theme:
    the app's colours, fonts and verdict boxes."""
    parts = []
    for i, r in enumerate(sorted(results, key=lambda r: r.step)):
        choices = "".join(f"<li>{html.escape(c)}</li>" for c in r.choices)
        right = (f"<p><b>Answer:</b> {html.escape(r.choices[r.answer])}</p>" if r.answer is not None else "")
        fig = figure_html(figure(r), include_plotlyjs=(i == 0), div_id=f"lesson-step-{r.step}")
        parts.append(f"""<section class="step" id="step-{r.step}"><h2>Step {r.step}: {html.escape(r.title)}</h2>
<div class="q"><b>Predict.</b> {html.escape(r.question)}<ol type="a">{choices}</ol></div>
<details><summary>Reveal the answer</summary>{right}<p>{html.escape(r.reveal)}</p>{fig}
<p class="why"><b>Why.</b> {html.escape(r.explanation)}</p></details></section>""")
    missing = [s for s in STEPS if s not in {r.step for r in results}]
    note = (f"<p><i>Steps not computed in this handout: {', '.join(map(str, missing))}.</i></p>" if missing else "")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>kvviz lesson: rounding or a bug?</title>
<style>{STYLE}</style></head><body>
<h1>Rounding or a bug? A lesson in precision-error accumulation</h1>
<p>Computed live by kvviz{(' on ' + html.escape(model)) if model else ''}. For each step: predict, then open the
answer. The numbers are this machine's; another CPU or GPU sums in other orders and gets other last bits.</p>
{note}{''.join(parts)}
{exercises_html(exercise_runs)}
</body></html>"""


# The page, the question boxes (the app's information box: blue) and the verdict boxes: kvviz's theme
STYLE = (theme.PAGE_CSS + theme.box_css(".verdict")
         + f".q{{padding:.6em 1em;border-radius:8px;background:{theme.VERDICT_BOXES['precision'][0]};"
           f"color:{theme.VERDICT_BOXES['precision'][1]}}}"
         + "section.step{margin-bottom:2.5em}.why{opacity:.85}@media print{details{display:block}}"
           "@media (prefers-color-scheme: dark){.q{background:#14304d;color:#dbeafb}}")
