"""First screens: a page's default run shows a difference or says in its verdict line why there is none
here, with the one click that shows one; one-click scenarios open without Streamlit's widget-state warning."""
import logging

import pytest

pytest.importorskip("streamlit")  # the app tests need Streamlit (a GPU image may lack it)
from streamlit.testing.v1 import AppTest  # noqa: E402

from conftest import ROOT
from test_app import alerts, start

pytestmark = pytest.mark.app


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("preset", ["tie", "padding", "proof", "lens_padding"])
def test_a_scenario_opens_without_the_widget_state_warning(monkeypatch, preset):
    from streamlit.elements.lib import policies

    monkeypatch.setattr(policies, "_shown_default_value_warning", False)  # shown once a process: reset
    rec = _Records()
    logging.getLogger("streamlit.elements.lib.policies").addHandler(rec)
    try:
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=180)
        at.run()
        at.button(key=f"preset_{preset}").click().run()
        at.run()
        assert not at.exception
        assert "Verdict" in alerts(at) or "same" in alerts(at)
    finally:
        logging.getLogger("streamlit.elements.lib.policies").removeHandler(rec)
    assert not [m for m in rec.lines if "default value" in m], rec.lines


def test_why_an_identical_split_is_identical_and_the_fix_that_shows_a_gap():
    import dataclasses

    import kvviz
    from kvviz.teach.firstscreen import split_identical_why

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    res = kvviz.run_split(lm, kvviz.SplitConfig(prompt="Hello world, caching is fun! 123", split=6), prove=False)
    gap = dataclasses.replace(res, verdict="precision")  # a gap (whatever this CPU's own run gave): nothing to explain
    assert split_identical_why(gap) == ("", None)
    same = dataclasses.replace(res, verdict="identical")  # a run with no gap, whatever this CPU gave
    why, fix = split_identical_why(same)
    assert fix == "step" and f"one chunk of {len(res.compared)} rows" in why
    step = dataclasses.replace(same, settings=dataclasses.replace(res.settings, mode="step"))
    assert split_identical_why(step)[1] == "bfloat16"
    assert split_identical_why(same, invariant=True) == ("", None)  # invariant mode: identical is the point


def test_the_split_page_shows_why_and_its_one_click(monkeypatch):
    import dataclasses

    import kvviz

    import kvviz.views.split.run as split_run  # the split view's run (the page runs it through run_view)

    real = split_run.run_split
    monkeypatch.setattr(split_run, "run_split", lambda *a, **k: dataclasses.replace(real(*a, **k),
                                                                                     verdict="identical"))
    at = start("pages/split.py", model="tiny:llama")
    assert "Verdict: identical" in alerts(at) and "Why nothing here" in alerts(at)
    at.button(key="split_show_gap").click().run()
    assert not at.exception and at.radio(key="split_mode").value == "step"


def test_greedy_default_says_why_no_parting_and_one_click_shows_a_tie():
    at = start("pages/greedy.py", model="tiny:llama", greedy_n=3)
    text = alerts(at)
    assert "paths chose the same" in text  # tiny llama, 3 tokens, float32: no tie
    assert "Why nothing here" in text and "closest call was step" in text
    at.button(key="greedy_show_tie").click().run()
    assert not at.exception
    # the constructed cache flip (no cache and cache part on any machine), named on the page: see tests/test_greedy.py
    assert at.session_state["model_preset"] == "tiny:flip" and at.session_state["dtype"] == "bfloat16"
    assert at.text_area(key="greedy_prompt").value == "Once upon a time" and "Verdict: precision" in alerts(at)


def _identical_in(res, dtype):
    import dataclasses

    return dataclasses.replace(res, verdicts={**res.verdicts, dtype: ["identical"] * len(res.prompts)})


def test_why_a_dtype_shows_nothing_and_the_fix_that_shows_its_gap():
    import dataclasses

    import kvviz
    from kvviz.teach.firstscreen import dtypes_line
    from kvviz.views.dtypes.run import run_dtypes

    res = run_dtypes(kvviz.parse_spec("tiny:llama"), ["Hello world, caching is fun! 123"], ["float32", "bfloat16"],
                     "cpu", "auto", split="last", mode="chunk", prove=False)
    gaps = dataclasses.replace(res, verdicts={**res.verdicts, "float32": ["precision"], "bfloat16": ["precision"]})
    verdict, text, fix = dtypes_line(gaps)
    assert (verdict, fix) == ("precision", None) and "float32: precision on 1 of 1; bfloat16: precision on 1 of 1" in text
    assert "Why nothing" not in text
    verdict, text, fix = dtypes_line(_identical_in(gaps, "bfloat16"))  # as the default model's sweep is on a CPU
    assert verdict == "precision" and fix == "half-step"
    assert "Why nothing in bfloat16 here: with only the last token fed through the cache" in text
    assert "summed in float32 and rounded once" in text
    done = dataclasses.replace(_identical_in(gaps, "bfloat16"),
                               settings=dataclasses.replace(res.settings, split="half", mode="step"))
    assert dtypes_line(done)[2] is None  # already half, token by token: nothing more to click
    both = _identical_in(_identical_in(gaps, "bfloat16"), "float32")
    assert dtypes_line(both)[0] == "identical" and "Why nothing in float32 and bfloat16" in dtypes_line(both)[1]


def test_the_dtypes_page_says_why_and_its_one_click(monkeypatch):
    import kvviz.views.dtypes.run as dtypes_run

    real = dtypes_run.run_dtypes
    monkeypatch.setattr(dtypes_run, "run_dtypes", lambda *a, **k: _identical_in(real(*a, **k), "bfloat16"))
    at = start("pages/dtypes.py", model="tiny:llama", dtypes_dtypes=["bfloat16"])
    assert "Verdict: identical" in alerts(at) and "Why nothing in bfloat16 here" in alerts(at)
    at.button(key="dtypes_show_gap").click().run()
    assert not at.exception
    assert at.selectbox(key="dtypes_split").value == "half" and at.radio(key="dtypes_mode").value == "step"


# Every page that runs a model on opening, with its default controls: the first verdict line shows a difference, or
# says why there is none here (and the page then offers the click that shows one). The KV cache page checks a saved
# cache bit for bit (equality is its point): it has no default difference.
FIRST_SCREENS = ["split", "greedy", "dtypes", "padding", "reuse", "loading_trap", "quant", "check", "serving", "matrix",
                 "lens"]


@pytest.mark.heavy
@pytest.mark.parametrize("page", FIRST_SCREENS)
def test_every_pages_default_shows_a_difference_or_says_why_not(page):
    at = start(f"pages/{page}.py", model="tiny:llama")
    boxes = [e.value for e in list(at.success) + list(at.info) + list(at.error) + list(at.warning)]
    verdicts = [b for b in boxes if b.startswith(("**Verdict:", "**SAFE**", "**UNSAFE**"))]  # the card: SAFE/UNSAFE
    assert verdicts, (page, boxes)
    first = verdicts[0]
    if first.startswith("**SAFE**"):  # the card's point: it says why (cached paths compute what the full one does)
        assert "every cached path computes what the full forward computes" in first
    elif first.startswith("**Verdict: identical.**"):
        assert "Why nothing" in first, (page, first)
        assert [b for b in at.button if b.key and b.key.endswith(("show_gap", "show_tie"))], page


def test_the_first_screen_list_names_every_page_with_a_run():
    from kvviz import views

    from conftest import ROOT

    pages = {v.page.stem for v in views.all_views() if v.page and v.page.prefix}
    # cache: a workbench; a page whose button starts an engine's process runs nothing on its first screen
    engines = {v.page.stem for v in views.all_views() if v.page and v.page.starts_engine}
    assert engines == {"engine_layers"}
    assert pages - set(FIRST_SCREENS) == {"cache"} | engines, pages
    assert all((ROOT / "pages" / f"{p}.py").exists() for p in FIRST_SCREENS)


def test_why_no_serving_condition_parted_and_the_fix():
    import dataclasses

    import kvviz
    from kvviz.teach.firstscreen import serving_why
    from kvviz.views.serving.run import ServeConfig, run_serving

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    res = run_serving(lm, ServeConfig(prompts=["Hello there", "The capital of France is"], runs=1, max_new_tokens=3,
                                      batch_size=2))
    same = dataclasses.replace(res, prompts=[dataclasses.replace(p, first_divergence=None) for p in res.prompts])
    why, fix = serving_why(same)
    m, i, t = min((m, p.index, t) for p in res.prompts for t, m in enumerate(p.reference_margins))
    assert fix == "bfloat16" and f"the closest call was prompt {i}, step {t}, margin {m:.3g}" in why
    parted = dataclasses.replace(same, prompts=[dataclasses.replace(same.prompts[0], first_divergence=1)]
                                 + same.prompts[1:])
    assert serving_why(parted) == ("", None)
    bf16 = dataclasses.replace(same, settings=dataclasses.replace(same.settings, dtype="bfloat16"))
    assert serving_why(bf16)[1] is None


def test_a_bisector_finding_before_the_heatmaps_first_row_is_explained_as_rounding_away():
    import numpy as np

    from kvviz.teach.firstscreen import rounding_away_note

    gaps = np.zeros((5, 3))  # embeddings + 4 layers, 3 compared positions
    gaps[3:, 1] = 1e-6  # the heatmap's first differing row: layer 3 (decoder layer module 2)
    note = rounding_away_note(gaps, "model.layers.0.self_attn.q_proj")
    assert "inside model.layers.0.self_attn.q_proj (its layer writes row layer 1)" in note
    assert "the heatmap's first differing row is layer 3" in note and "x + Δ rounds back to x" in note
    assert rounding_away_note(gaps, "model.layers.2.mlp") == ""  # they agree: nothing to explain
    assert rounding_away_note(gaps, None) == ""
    assert "no hidden state in the heatmap differs" in rounding_away_note(np.zeros((5, 3)), "model.layers.1.mlp")


def test_the_backends_page_runs_its_default_axes_on_opening():
    at = start("pages/matrix.py", model="tiny:llama")
    assert not at.exception and "_results_matrix" in at.session_state
    assert "Run the matrix" not in alerts(at) and "Verdict:" in alerts(at) and at.get("plotly_chart")


def test_why_a_matrix_shows_nothing_and_the_fix():
    import dataclasses

    import kvviz
    from kvviz.teach.firstscreen import matrix_why
    from kvviz.views.matrix.run import MatrixConfig, run_matrix

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    res = run_matrix(lm, MatrixConfig("Hello world", max_new_tokens=2, attentions=("eager",), caches=("dynamic",),
                                      repeats=1))
    same = dataclasses.replace(res, cells=[dataclasses.replace(c, verdict="identical") for c in res.cells])
    why, fix = matrix_why(same)
    assert fix == "bfloat16" and why.startswith("Why nothing here: every setting gave the eager no-cache reference's")
    assert matrix_why(same, invariant=True) == ("", None)
    differs = dataclasses.replace(res, cells=[dataclasses.replace(c, verdict="precision") for c in res.cells])
    assert matrix_why(differs) == ("", None)


def test_greedy_why_line_never_says_a_margin_within_the_gap_stayed_above_it():
    """Issue 39: 'margin 0 against a gap of 0.312' beside 'stayed above' contradicted itself; the words follow the
    numbers: within the gap and no flip says why the choice held; above the gap says above."""
    from types import SimpleNamespace as NS

    from kvviz.teach.firstscreen import greedy_closest_call

    def res(margins, gaps):
        return NS(pairs=[NS(a="no_cache", b="cache", max_abs_logit=gaps)], paths={"no_cache": NS(margins=margins)})

    within = greedy_closest_call(res([0.9, 0.0, 2.0], [0.3, 0.312, 0.3]))
    assert "step 1" in within and "margin 0 was within the gap of 0.312" in within and "held" in within
    above = greedy_closest_call(res([0.9, 0.5, 2.0], [0.3, 0.312, 0.3]))
    assert "step 1" in above and "margin 0.5, above the gap of 0.312" in above
