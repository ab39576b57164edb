"""One look everywhere (issue 53, items 4 and 5): every figure kvviz draws - the app's, the HTML report's, the
lesson handout's, the meeting bundle's - takes kvviz's template (kvviz.core.theme): its background, palette and
verdict colours, and log axes and colour bars labelled as powers of ten (never SI prefixes: "10f", "1p", "100μ"),
decades only. Figures are built from tiny-model results through the real runs."""
import re

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import pytest

import kvviz
from kvviz import views
from kvviz.core import theme
from kvviz.io.export import html_report, standalone_figure
from kvviz.views.bisect.run import run_bisect
from kvviz.views.dtypes import figures as dtypes_figures
from kvviz.views.dtypes.run import run_dtypes
from kvviz.views.greedy import figures as greedy_figures
from kvviz.views.greedy.run import GreedyConfig, run_greedy
from kvviz.views.loading_trap.run import run_loading_trap
from kvviz.views.matrix import figures as matrix_figures
from kvviz.views.padding.run import run_padding
from kvviz.views.reuse.run import run_reuse
from kvviz.views.split import figures as split_figures

from conftest import DEVICE, PROMPT

SI = {None, "B", "SI", "SI extended"}  # None: plotly's default, "B"


@pytest.fixture(scope="module")
def lm():
    return kvviz.load_model("tiny:llama", "bfloat16", DEVICE)


@pytest.fixture(scope="module")
def results(lm):
    logic = kvviz.SplitConfig(PROMPT, 8, left_pad=2, position_ids="omit")
    return {
        "split": kvviz.run_split(lm, logic),
        "greedy": run_greedy(lm, GreedyConfig("Hello", 4, paths=("no_cache", "cache", "float64"))),
        "dtypes": run_dtypes(lm, [PROMPT], ["float32", "bfloat16"]),
        "padding": run_padding(lm, PROMPT, left_pad=2),
        "reuse": run_reuse(lm, "Answer.", [" Q?", " R?"], 3),
        "loading_trap": run_loading_trap(kvviz.load_model("tiny:gpt2", "float32", DEVICE), PROMPT, 4, "float16"),
        "bisect": run_bisect(lm, logic),
    }


def every_figure(results) -> list[tuple[str, go.Figure]]:
    """Each view's main figures and the other charts its page draws."""
    figs = [(name, f) for name, res in results.items() for f in views.of(res).main_figures(res)]
    s, g, d = results["split"], results["greedy"], results["dtypes"]
    for metric in ("relative", "max_abs", "eps_units"):
        for log in (True, False):
            figs += [(f"split {metric} {log}", split_figures.split_heatmap(s, metric, log)),
                     (f"split lines {metric} {log}", split_figures.layer_lines(s, metric, log))]
    figs += [("greedy margins", greedy_figures.greedy_margins(g)), ("greedy map", greedy_figures.greedy_heatmap(g))]
    figs += [("dtypes " + how, dtypes_figures.dtype_curves(d, "relative", how)) for how in ("absolute", "eps")]
    return figs


def effective(fig: go.Figure, axis_name: str, prop: str):
    """An axis property as plotly draws it: the figure's own, else its template's."""
    own = fig.layout[axis_name][prop]
    if own is not None:
        return own
    return fig.layout.template.layout[re.sub(r"\d+$", "", axis_name)][prop]


def colorbar_formats(fig: go.Figure) -> list:
    out = []
    for t in fig.data:
        if t.type in ("heatmap", "contour"):
            tmpl = fig.layout.template.data[t.type]
            out.append(t.colorbar.exponentformat or (tmpl[0].colorbar.exponentformat if tmpl else None))
    return out


def axes(fig: go.Figure) -> list[str]:
    return [k for k in fig.layout.to_plotly_json() if re.fullmatch(r"[xy]axis\d*", k)] or ["xaxis", "yaxis"]


def test_the_template_is_kvvizs_look():
    t = theme.register()
    assert pio.templates["kvviz"] is t
    assert t.layout.paper_bgcolor == t.layout.plot_bgcolor == theme.BACKGROUND == "#ffffff"
    assert list(t.layout.colorway) == theme.COLORWAY and theme.LOGIC not in theme.COLORWAY  # red is logic's alone
    assert t.layout.xaxis.exponentformat == t.layout.yaxis.exponentformat == "power"
    assert t.data.heatmap[0].colorbar.exponentformat == "power"
    assert t.layout.coloraxis.colorbar.exponentformat == "power"
    # one red for logic, one blue for precision, in every figure that colours verdicts
    from kvviz.views.serving.sweep import VERDICT_COLOURS as SWEEP

    assert SWEEP["precision"] == matrix_figures.MATRIX_COLOURS["precision"] == theme.PRECISION == "#1565c0"
    assert SWEEP["logic"] == matrix_figures.MATRIX_COLOURS["logic"] == theme.LOGIC == "#c62828"


def test_every_views_figures_take_the_theme_and_never_si_prefixes(results):
    figs = every_figure(results)
    assert len(figs) > 25
    logs = 0
    for name, built in figs:
        fig = standalone_figure(built)  # as the report, the handout and the meeting bundle write it
        assert fig.layout.template.layout.paper_bgcolor == theme.BACKGROUND, name
        for ax in axes(fig):
            assert effective(fig, ax, "exponentformat") not in SI, (name, ax)
            if fig.layout[ax].type == "log":
                logs += 1
                # decades only: a tick each decade, no "2 5" or "9 8 7 … 2" between them (or named ticks)
                assert fig.layout[ax].dtick == 1 or fig.layout[ax].tickvals is not None, (name, ax)
                assert fig.layout[ax].exponentformat == "power", (name, ax)
        assert all(f not in SI for f in colorbar_formats(fig)), name
    assert logs >= 10


def test_in_the_apps_process_a_new_figure_takes_the_theme():
    """pages/common.py calls theme.use(): a figure built with no template of its own (a new view's) takes kvviz's."""
    import streamlit  # noqa: F401  (makes "streamlit" the default, as in the app)

    before = pio.templates.default
    try:
        theme.use()
        fig = go.Figure(go.Scatter(y=[1e-12, 1e-9]))
        assert fig.layout.template.layout.colorway[0] == theme.COLORWAY[0]
        assert fig.layout.template.layout.yaxis.exponentformat == "power"
    finally:
        pio.templates.default = before


def test_log_axis_labels_decades_and_widens_a_range_inside_one_decade():
    fig = theme.log_axis(go.Figure(go.Scatter(y=[2e-7, 5e-7])))
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.dtick == 1
    assert list(fig.layout.yaxis.range) == [-7, -6]  # both decades labelled, 2e-7 and 5e-7 between them
    wide = theme.log_axis(go.Figure(go.Scatter(y=[1e-12, 3e-3])))
    assert wide.layout.yaxis.range is None  # autorange: nine decades to label


def test_a_zero_drawn_at_a_floor_says_so():
    """Values of 0 on a log axis are drawn at a floor with its note, never as an unexplained '10⁻¹³'."""
    cell = type("Cell", (), dict(step_max_abs_logit=[0.0, 0.0, 2e-3], step_kl=[0.0, 0.0, 1e-6], first_divergence=2,
                                 label="eager · dynamic"))()
    fig = matrix_figures.matrix_cell_steps(cell)
    notes = [a.text for a in fig.layout.annotations]
    assert any("0 (identical), drawn at this floor" in (n or "") for n in notes), notes
    assert fig.layout.yaxis.dtick == 1 and fig.layout.yaxis.exponentformat == "power"


def test_the_html_reports_logic_verdict_box_is_red(results):
    page = html_report(results["split"])
    assert results["split"].verdict == "logic"
    assert '<div class="verdict logic"><b>Verdict: logic.</b>' in page
    bg, fg = theme.VERDICT_BOXES["logic"]
    assert f".verdict.logic{{background:{bg};color:{fg}}}" in page
    assert bg == "#ffecec"  # Streamlit's st.error on a white page, as the app draws a logic verdict
    assert "#eef3fb" not in page  # the old blue box every verdict had
    # precision and identical keep the app's blue and green
    assert theme.box_class("precision") == "precision" and theme.box_class("identical") == "identical"
    from kvviz.core.verdict import Tally

    assert theme.box_class(Tally({"logic": 1, "precision": 3})) == "logic" and theme.box_class("see the grid") == "other"
    assert theme.box_class("logic: 1, precision: 3") == "other"  # a plain line is never searched for a verdict word
    assert theme.box_class("unsafe") == "logic" and theme.box_class("safe") == "identical"


def test_the_meeting_bundle_keeps_the_verdict_colours(results):
    from kvviz.teach.meeting import bundle

    page = bundle([("logic", html_report(results["split"])), ("padding", html_report(results["padding"]))])
    assert '<div class="verdict logic">' in page and f"background:{theme.VERDICT_BOXES['logic'][0]}" in page


def test_the_handout_carries_the_exercises():
    from kvviz.teach import lesson
    from kvviz.teach.exercises import EXERCISES
    from kvviz.teach.lesson_figures import handout_html

    page = handout_html([lesson.step_float()])
    assert "Exercises: find the bug" in page
    for ex in EXERCISES:
        assert f'id="exercise-{ex.key}"' in page and ex.title in page
        assert ex.hidden.replace("'", "&#x27;") in page  # the answer, behind its reveal
    assert f"background:{theme.BACKGROUND}" in page and theme.COLORWAY[0] in page
    assert "#eef3fb" not in page


def test_the_handout_shows_an_exercises_measured_verdict_in_its_colour(lm):
    from kvviz.teach.exercises import ExerciseRun, BY_KEY
    from kvviz.teach.lesson_figures import exercises_html

    res = kvviz.run_split(lm, kvviz.SplitConfig(PROMPT, 8, left_pad=2, position_ids="omit"))
    page = exercises_html({"batch": ExerciseRun(BY_KEY["batch"], res)})
    assert '<div class="verdict logic"><b>Verdict: logic.</b>' in page
    assert f"largest relative gap is {res.main.max_relative:.3g}" in page


def test_padding_names_cells_by_row_and_column(results):
    from kvviz.teach.firstscreen import grid_cells, padding_line

    cells = [{"placement": "alone", "scenario": "cache, mask new-only", "verdict": "logic"},
             {"placement": "alone", "scenario": "cache, omitted + new-only", "verdict": "logic"},
             {"placement": "left-padded", "scenario": "cache, positions omitted", "verdict": "logic"}]
    assert grid_cells(cells) == ('row "alone": columns "cache, mask new-only" and "cache, omitted + new-only"; '
                                 'row "left-padded": column "cache, positions omitted"')
    res = results["padding"]
    verdict, text = padding_line(res)
    logic = [c for c in res.cells if c["verdict"] == "logic"]
    assert verdict == "logic" and logic
    for c in logic:
        assert f'"{c["scenario"]}"' in text
    assert "(alone)" not in text and 'row "' in text


def test_presenter_heatmap_fits_a_height_and_names_its_last_layer():
    labels = ["embeddings"] + [f"layer {i}" for i in range(1, 32)] + ["layer 32 + final norm"]
    z = np.abs(np.random.default_rng(0).normal(size=(len(labels), 12))) * 1e-3
    from kvviz.core.plotting import heatmap

    fig = heatmap(z, [f"{i}: t" for i in range(12)], labels, "t", "relative gap", height=500)
    assert fig.layout.height == 500
    named = list(fig.layout.yaxis.ticktext)
    assert named[0] == "embeddings" and named[-1] == "layer 32 + final norm" and len(named) < len(labels)
    tall = heatmap(z, [f"{i}: t" for i in range(12)], labels, "t", "relative gap")
    assert tall.layout.height > 500 and list(tall.layout.yaxis.ticktext) == labels  # normal mode: every layer
