"""First screens (issue 29): a page's default run shows a difference or says in its verdict line why there is none
here, with the one click that shows one; one-click scenarios open without Streamlit's widget-state warning."""
import logging

import pytest
from streamlit.testing.v1 import AppTest

from conftest import ROOT
from test_app import alerts, start

pytestmark = pytest.mark.app


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("preset", ["tie", "padding", "proof"])
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
    from kvviz.firstscreen import split_identical_why

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    res = kvviz.run_split(lm, kvviz.SplitConfig(prompt="Hello world, caching is fun! 123", split=6), prove=False)
    gap = dataclasses.replace(res, verdict="precision")  # a gap (whatever this CPU's own run gave): nothing to explain
    assert split_identical_why(gap) == ("", None)
    same = dataclasses.replace(res, verdict="identical")  # as the default model's chunk run is on this CPU
    why, fix = split_identical_why(same)
    assert fix == "step" and f"one chunk of {len(res.compared)} rows" in why
    step = dataclasses.replace(same, settings=dataclasses.replace(res.settings, mode="step"))
    assert split_identical_why(step)[1] == "bfloat16"
    assert split_identical_why(same, invariant=True) == ("", None)  # invariant mode: identical is the point


def test_the_split_page_shows_why_and_its_one_click(monkeypatch):
    import dataclasses

    import kvviz

    real = kvviz.run_split
    monkeypatch.setattr(kvviz, "run_split", lambda *a, **k: dataclasses.replace(real(*a, **k), verdict="identical"))
    at = start("pages/split_point.py", model="tiny:llama")
    assert "Verdict: identical" in alerts(at) and "Why nothing here" in alerts(at)
    at.button(key="split_show_gap").click().run()
    assert not at.exception and at.radio(key="split_mode").value == "step"


def test_greedy_default_says_why_no_parting_and_one_click_shows_a_tie():
    at = start("pages/greedy_paths.py", model="tiny:llama", greedy_n=3)
    text = alerts(at)
    assert "paths chose the same" in text  # tiny llama, 3 tokens, float32: no tie
    assert "Why nothing here" in text and "closest call was step" in text
    at.button(key="greedy_show_tie").click().run()
    assert not at.exception
    from kvviz.lesson import GREEDY_PROMPT

    assert at.text_area(key="greedy_prompt").value == GREEDY_PROMPT and at.session_state["dtype"] == "bfloat16"
    assert at.number_input(key="greedy_n").value == 8


def _identical_in(res, dtype):
    import dataclasses

    return dataclasses.replace(res, verdicts={**res.verdicts, dtype: ["identical"] * len(res.prompts)})


def test_why_a_dtype_shows_nothing_and_the_fix_that_shows_its_gap():
    import dataclasses

    import kvviz
    from kvviz.firstscreen import dtypes_line
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
    at = start("pages/dtypes_lab.py", model="tiny:llama", dt_dtypes=["bfloat16"])
    assert "Verdict: identical" in alerts(at) and "Why nothing in bfloat16 here" in alerts(at)
    at.button(key="dt_show_gap").click().run()
    assert not at.exception
    assert at.selectbox(key="dt_split").value == "half" and at.radio(key="dt_mode").value == "step"
