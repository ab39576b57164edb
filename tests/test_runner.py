"""pages/runner.py: a page's run - which run holds the model, the held line, the progress line between reports."""
import pytest

import kvviz

from conftest import DEVICE


@pytest.mark.app
def test_a_run_says_which_run_of_another_tab_holds_the_model():
    import time

    from pages import runner
    from test_app import start

    other = {"model": ("tiny:llama", "float32", "auto"), "session": "another-tab", "what": "Greedy paths (greedy)",
             "started": time.time() - 125}
    runner._RUNNING[-1] = other
    try:
        at = start("pages/split.py", model="tiny:llama")
    finally:
        runner._RUNNING.pop(-1, None)
    said = " ".join(c.value for c in at.caption)
    import re

    assert re.search(r"Another run holds the model: Greedy paths \(greedy\), started \d\d:\d\d:\d\d UTC "
                     r"\(1\d\d s ago\)", said), said
    assert "this one waited for it" in said and "Verdict:" in " ".join(e.value for e in list(at.success) +
                                                                         list(at.info) + list(at.error))
    assert not [r for r in runner._RUNNING.values() if r["session"] != "another-tab"]  # its own entry is gone
    at = start("pages/split.py", model="tiny:gpt2")  # another model: nothing held, nothing said
    assert "Another run holds the model" not in " ".join(c.value for c in at.caption)
    runner._RUNNING[-1] = {**other, "model": ("tiny:llama", "bfloat16", "auto")}  # the same model in another dtype:
    try:  # another loaded model with its own lock
        at = start("pages/split.py", model="tiny:llama")
    finally:
        runner._RUNNING.pop(-1, None)
    assert "Another run holds the model" not in " ".join(c.value for c in at.caption)


@pytest.mark.app
def test_the_held_line_names_the_run_and_its_start():
    from pages.runner import held_line

    line = held_line({"what": "Lesson: rounding or a bug? (lesson5)", "started": 0.0}, now=61.0)
    assert line.startswith("Another run holds the model: Lesson: rounding or a bug? (lesson5), started 00:00:00 UTC "
                           "(61 s ago)")


@pytest.mark.app
def test_the_progress_line_follows_the_clock_between_reports():
    """A run that reports half done after 9 s and then works a minute on one step: the line counts down from the
    measured pace, then says it takes longer, instead of standing at "about 9 s left"."""
    from pages.runner import _Ticker, progress_text

    now, drawn = [0.0], []
    t = _Ticker(lambda f, text: drawn.append((f, text)), lambda: now[0])
    now[0] = 9.0
    t.report(0.5, "Step 3 of 6")
    assert drawn[-1] == (0.5, "Step 3 of 6 — about 9 s left")
    now[0] = 13.0
    t.tick()
    assert drawn[-1] == (0.5, "Step 3 of 6 — about 5 s left")
    now[0] = 69.0
    t.tick()
    assert drawn[-1][1] == "Step 3 of 6 — taking longer than the pace so far said: 60 s on this part, 69 s in all"
    now[0] = 70.0
    t.report(0.75, "Step 4 of 6")
    assert drawn[-1][1] == "Step 4 of 6 — about 23 s left"  # the new pace: 70 s for 3/4
    assert progress_text(0.0, "Loading", 5.0) == "Loading — 5 s so far"
    assert progress_text(0.4, "Tokens — 3 s left", 20.0) == "Tokens — 3 s left"  # a run's own estimate stands


def test_no_freeze_outside_a_server_s_script_run():
    """pages.runner.freeze_what_lives does nothing without a script run (no session) - and under AppTest, whose
    Runtime is a stand-in (tests/test_cancel_browser.py checks a real server)."""
    import gc

    from pages import runner

    before = gc.get_freeze_count()
    assert runner.freeze_what_lives() == "off" and gc.get_freeze_count() == before
