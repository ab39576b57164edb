"""Every page's one-click fix (the button an identical first screen offers: "Feed the rest token by token", "Switch
to bfloat16", "Cache half, feed the rest token by token"...) works on every machine.

Whether a page offers its fix depends on this CPU's kernels (an AVX2-only AMD EPYC gives identical bits where this
machine's AVX-512 kernels do not), so each test forces the branch: it replaces the function that decides (or makes
the run's result one where nothing parted) inside AppTest, which runs the page script in-process. Then it presses the
button, checks the settings the button promises were applied, reruns, hides and shows the button again and leaves the
page and comes back - the steps where the app wrote the button's key back into session state (the page stash, a
link) and Streamlit raised "st.session_state['dtypes_show_gap'] is read-only"."""
from __future__ import annotations

import ast
import dataclasses
import json

import pytest
from streamlit.testing.v1 import AppTest

from conftest import ROOT

pytestmark = pytest.mark.app

# How long one AppTest run may take before it counts as hung: as tests/test_app.py's APP_TIMEOUT, over 3x the slowest
# page run measured on 2 shared cores (61 s; the runs here took at most 27 s a test under that load).
TIMEOUT = 600


class Shown:
    """Whether the forced branch is on: the patched decider reads it on every run."""

    def __init__(self):
        self.on = True


def _forced(real, shown: Shown, forced):
    def decide(*a, **k):
        return forced(*a, **k) if shown.on else real(*a, **k)

    return decide


def _nothing_parted(real, shown: Shown, field_of_result: str):
    """The run, with every pair (greedy) or prompt (serving) made one that did not part: the page's identical first
    screen, as a machine whose kernels agree bit for bit shows it."""
    def run(*a, **k):
        res = real(*a, **k)
        if not shown.on:
            return res
        items = [dataclasses.replace(x, first_divergence=None) for x in getattr(res, field_of_result)]
        return dataclasses.replace(res, **{field_of_result: items})

    return run


def _split(monkeypatch, shown, fix):
    import kvviz.teach.firstscreen as fs

    monkeypatch.setattr(fs, "split_identical_why", _forced(fs.split_identical_why, shown,
                                                           lambda *a, **k: ("Why nothing here: forced.", fix)))


def _dtypes(monkeypatch, shown):
    import kvviz.teach.firstscreen as fs

    real = fs.dtypes_line
    monkeypatch.setattr(fs, "dtypes_line", _forced(real, shown, lambda res: (*real(res)[:2], "half-step")))


def _greedy(monkeypatch, shown):
    import kvviz.views.greedy.run as g

    monkeypatch.setattr(g, "run_greedy", _nothing_parted(g.run_greedy, shown, "pairs"))


def _serving(monkeypatch, shown):
    import kvviz.teach.firstscreen as fs
    import kvviz.views.serving.run as sv

    monkeypatch.setattr(sv, "run_serving", _nothing_parted(sv.run_serving, shown, "prompts"))
    monkeypatch.setattr(fs, "serving_why", _forced(fs.serving_why, shown,
                                                   lambda res: ("Why nothing here: forced.", "bfloat16")))


def _matrix(monkeypatch, shown):
    import kvviz.teach.firstscreen as fs

    monkeypatch.setattr(fs, "matrix_why", _forced(fs.matrix_why, shown,
                                                  lambda *a, **k: ("Why nothing here: forced.", "bfloat16")))


def _run_matrix(at):
    at.button(key="matrix_run").click().run()


# page, its state, how to force the fix, the button, the settings it promises, whether the forced branch can be
# switched off (a result made "nothing parted" cannot be made to part), what brings the button back after the click
CASES = {
    "split-step": ("split", {}, lambda m, s: _split(m, s, "step"), "split_show_gap", {"split_mode": "step"}, True,
                   None),
    "split-bfloat16": ("split", {}, lambda m, s: _split(m, s, "bfloat16"), "split_show_gap", {"dtype": "bfloat16"},
                       True, None),
    "dtypes": ("dtypes", {"dtypes_dtypes": ["bfloat16"]}, _dtypes, "dtypes_show_gap",
               {"dtypes_split": "half", "dtypes_mode": "step"}, True, None),
    "greedy": ("greedy", {"greedy_n": 3}, _greedy, "greedy_show_tie",  # a scenario: it ends when you leave the page
               {"model_preset": "tiny:flip", "dtype": "bfloat16", "greedy_prompt": "Once upon a time", "greedy_n": 6},
               False, None),
    "serving": ("serving", {"serving_runs": 1, "serving_tokens": 2, "serving_limit": 2}, _serving,
                "serving_show_gap", {"dtype": "bfloat16"}, True, None),
    "matrix": ("matrix", {"matrix_n": 3, "matrix_rep": 1}, _matrix, "matrix_show_gap", {"dtype": "bfloat16"}, True,
               _run_matrix),
}


def _expected(settings: dict) -> dict:
    from kvviz.teach.lesson import GREEDY_PROMPT

    return {k: GREEDY_PROMPT if v == "GREEDY_PROMPT" else v for k, v in settings.items()}


def _button_keys(at) -> set:
    return {b.key for b in at.button}


def _raised(at) -> str:
    """What the run raised: the last lines of its traceback ("" when nothing)."""
    return " | ".join(f"{e.message} at {e.stack_trace[-1] if e.stack_trace else '?'}" for e in at.exception)


def _check(at, page: str, expect: dict, step: str) -> None:
    assert not at.exception, (page, step, _raised(at))
    got = {k: at.session_state[k] for k in expect}
    assert got == expect, (page, step, got)
    # the widgets show the settings too (the sidebar's dtype, the page's own controls)
    for k, v in expect.items():
        widget = next((w for w in at.main.get("radio") + at.main.get("selectbox") + at.sidebar.get("selectbox")
                       + at.main.get("number_input") + at.main.get("text_area") if w.key == k), None)
        if widget is not None:
            assert widget.value == v, (page, step, k, widget.value)


@pytest.mark.parametrize("case", list(CASES))
def test_every_one_click_fix_applies_its_settings_and_the_page_keeps_working(case, monkeypatch):
    page, state, force, button, promised, hideable, bring_back = CASES[case]
    expect = _expected(promised)
    shown = Shown()
    force(monkeypatch, shown)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT)
    # the page's settings come in a link, the app's own route (AppTest's session state set before the first run
    # would stay under a control's key and come back when the control is not drawn)
    at.query_params.update({"model_preset": '"tiny:llama"', **{k: json.dumps(v) for k, v in state.items()}})
    at.run()
    at.switch_page(f"pages/{page}.py").run()
    if bring_back:
        bring_back(at)
    assert not at.exception, _raised(at)
    assert button in _button_keys(at), (case, _button_keys(at))
    before = {k: at.session_state[k] for k in expect if k in at.session_state}
    assert before != expect, (case, before)  # the button has something to do

    at.button(key=button).click().run()
    _check(at, page, expect, "after the click")
    at.run()  # the step that crashed: the next run
    _check(at, page, expect, "the run after the click")
    if bring_back:
        bring_back(at)
        _check(at, page, expect, "the run that brings the button back")
    assert button in _button_keys(at), case
    if hideable:  # a run without the button, then with it again: its key must not come back as a set value
        shown.on = False
        at.run()
        assert not at.exception, _raised(at)
        shown.on = True
        at.run()
        _check(at, page, expect, "the button hidden and shown again")
        assert button in _button_keys(at), case
    at.switch_page("pages/glossary.py").run()  # away and back: the page's settings come back, the button's key not
    assert not at.exception, _raised(at)
    if "model_preset" in expect:  # a scenario's settings hold on its page only: away, the defaults are back
        assert "_scenario" not in at.session_state and at.session_state["dtype"] == "float32"
        return
    at.switch_page(f"pages/{page}.py").run()
    if bring_back:
        bring_back(at)
    _check(at, page, expect, "after leaving the page and coming back")
    assert button in _button_keys(at), case
    assert not any(button in k for k in at.query_params), dict(at.query_params)  # a link never carries a button


def test_a_link_that_names_a_button_opens_the_page():
    """A link saved before the fix carried the button's key (dtypes_show_gap=false): it opens the page, the
    button draws, nothing is written to its key."""
    import kvviz.teach.firstscreen as fs

    real = fs.dtypes_line
    fs.dtypes_line = lambda res: (*real(res)[:2], "half-step")
    try:
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT)
        at.query_params.update({"model_preset": '"tiny:llama"', "dtypes_dtypes": '["bfloat16"]',
                                "dtypes_show_gap": "false", "split_show_gap": "true"})
        at.run()
        at.switch_page("pages/dtypes.py").run()
        assert not at.exception, _raised(at)
        assert "dtypes_show_gap" in _button_keys(at)
        at.button(key="dtypes_show_gap").click().run()
        _check(at, "dtypes", {"dtypes_split": "half", "dtypes_mode": "step"}, "after the click")
    finally:
        fs.dtypes_line = real


def _one_click_buttons() -> dict[str, str]:
    """key -> page of every button in pages/ whose click sets settings through st.session_state.update or starts a
    scenario (pages.state.start_scenario) - a page's one-click fix."""
    found = {}
    for path in sorted((ROOT / "pages").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "button":
                kw = {k.arg: k.value for k in node.keywords}
                if "on_click" in kw and ast.unparse(kw["on_click"]) in ("st.session_state.update", "start_scenario"):
                    found[ast.literal_eval(kw["key"])] = path.stem
    return found


def test_every_one_click_fix_is_exercised():
    """A new one-click fix in pages/ gets a case above."""
    covered = {(CASES[c][0], CASES[c][3]) for c in CASES}
    found = {(page, key) for key, page in _one_click_buttons().items()}
    assert found and found == covered, (found, covered)


def test_every_read_only_widget_key_is_known_and_never_a_setting():
    """The app finds the read-only widgets (buttons, downloads, uploaders...) by reading the code: each one's key
    must be readable there (a literal or an f-string), none of them is a setting that the stash, a link or a
    restore writes back, and no control's key is taken for one."""
    from pages.state import READ_ONLY_WIDGETS, _persistable, _widget_calls, is_read_only

    read_only, controls = [], []
    for name, key, file, line in _widget_calls():
        if key is None:
            continue
        if name in READ_ONLY_WIDGETS:
            assert isinstance(key, (ast.Constant, ast.JoinedStr)), (file, line, ast.unparse(key))
            read_only.append((file, line, key))
        elif name in ("selectbox", "radio", "multiselect", "number_input", "slider", "text_area", "text_input",
                      "toggle", "checkbox", "select_slider", "segmented_control", "pills", "color_picker",
                      "date_input", "time_input") and isinstance(key, ast.Constant):
            controls.append(key.value)
    literal = [k.value for _, _, k in read_only if isinstance(k, ast.Constant)]
    assert {"dtypes_show_gap", "split_show_gap", "greedy_show_tie", "serving_show_gap", "matrix_show_gap",
            "matrix_run", "split_bisect", "cache_download", "open_upload"} <= set(literal)
    for key in literal + ["dtypes_upload", "dl_json_split", "_stop_button_3", "preset_tie"]:
        assert is_read_only(key) and not _persistable(key), key
    assert controls and not [k for k in controls if is_read_only(k)]
    for key in ("dtypes_split", "dtypes_mode", "split_mode", "greedy_n", "dtype", "split_ab_on", "split_k"):
        assert not is_read_only(key) and _persistable(key), key
