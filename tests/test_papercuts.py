"""Papercuts a new user met (slow proofs, silent waits, unexplained flat results, stray characters), each with its
test."""
import pytest

import kvviz
from kvviz.execution import Executor
from kvviz.views.greedy.run import GreedyConfig, run_greedy

from conftest import DEVICE


def test_the_greedy_proof_replays_the_parting_step_only(monkeypatch):
    """The invariant proof of a greedy verdict costs a few forwards at the parting step, not a second decode of
    every path (the Guide's 40-token recipe spent 26 of its 29 minutes there)."""
    calls = {"normal": 0, "invariant": 0}
    real = Executor.forward

    def counting(self, *a, **k):
        calls["invariant" if self.settings.invariant else "normal"] += 1
        return real(self, *a, **k)

    from kvviz.simkernel import split_k_kernel

    monkeypatch.setattr(Executor, "forward", counting)
    lm = kvviz.load_model("tiny:split", "float32", DEVICE)
    with split_k_kernel():  # a 1-row product sums in another order than a block of rows: the paths part
        res = run_greedy(lm, GreedyConfig("Once upon a time", 12, paths=("no_cache", "cache", "generate")),
                         prove=True)
    pair = res.pair("no_cache", "cache")
    assert pair.first_divergence is not None and pair.verdict == "precision" and pair.proved is True
    assert f"at step {pair.first_divergence}, where they part" in pair.proof
    assert res.pair("cache", "generate").proved is True
    # each computation replayed once per step proved (full: 1 forward; cached: prefill + one chunk), against a
    # forward per step and path in the normal run
    assert calls["invariant"] <= 6 and calls["invariant"] < calls["normal"] / 4, calls


def test_units_on_the_normal_runs_gap():
    from kvviz.verdict import precision_sentence

    text = precision_sentence(1e-16, True, 0.0, normal_gap=4.0)
    assert "against a largest absolute gap of 4 (in the hidden state's own units) in the normal run" in text


def test_the_guide_counts_its_reports():
    from conftest import ROOT

    guide = (ROOT / "docs" / "guide.md").read_text()
    rows = [line for line in guide.split("## The numbers")[0].splitlines() if line.startswith("| ")
            and not line.startswith("| report")]
    words = {5: "five", 6: "six", 7: "seven"}
    assert f"made from {words[len(rows)]} public reports" in guide, len(rows)


def test_the_tie_hover_names_both_tokens():
    from kvviz.views.greedy import figures

    lm = kvviz.load_model("tiny:tie", "bfloat16", DEVICE)
    res = run_greedy(lm, GreedyConfig("Once upon a time", 3, paths=("no_cache", "cache")), prove=False)
    fig = figures.greedy_margins(res)
    for trace in fig.data:
        assert "!r" not in trace.hovertemplate  # plotly has no !r: it drew "chose - over -"
        assert all(c[0].startswith(("'", '"')) and c[1].startswith(("'", '"')) for c in trace.customdata)


@pytest.mark.app
def test_prove_it_is_rounding_shows_the_normal_runs_gap_beside():
    from streamlit.testing.v1 import AppTest

    from conftest import ROOT

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=180)
    at.run()
    at.button(key="preset_proof").click().run()
    at.run()
    assert not at.exception
    labels = {m.label: m.value for m in at.metric}
    assert "max |Δ|, normal run (absolute)" in labels and labels["max |Δ|, invariant mode (absolute)"] == "0"
    assert float(labels["max |Δ|, normal run (absolute)"]) > 0


def test_texts_of_random_bytes_show_their_bytes_not_mojibake():
    from kvviz.text import REPLACEMENT, display_text

    lm = kvviz.load_model("tiny:mistral", "float32", DEVICE)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = lm.tokenizer  # byte-level: one token a byte; a random model emits bytes that are not UTF-8
    byte = bytes_to_unicode()
    ids = [tok.convert_tokens_to_ids(byte[0xE4]), tok.convert_tokens_to_ids(byte[0xFF])] + \
        tok("Hi there", add_special_tokens=False)["input_ids"]
    assert REPLACEMENT in tok.decode(ids)  # what the sliding-window scenario's texts showed
    shown = display_text(tok, ids)
    assert REPLACEMENT not in shown and "⟨e4⟩" in shown and "⟨ff⟩" in shown and shown.endswith("Hi there")
    clean = tok("Hello world", add_special_tokens=False)["input_ids"]
    assert display_text(tok, clean) == tok.decode(clean)


@pytest.mark.app
def test_the_sliding_window_scenario_runs_on_its_own_and_its_texts_show_no_mojibake():
    from streamlit.testing.v1 import AppTest

    from conftest import ROOT
    from kvviz.text import REPLACEMENT

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=240)
    at.run()
    at.button(key="preset_window").click().run()
    assert not at.exception, at.exception
    shown = [e.value for e in list(at.info) + list(at.success) + list(at.error) + list(at.warning)]
    assert not any("Run the matrix" in v for v in shown), shown  # it ran: no "press Run the matrix"
    assert any(v.startswith("**Verdict:") for v in shown) and at.get("plotly_chart"), shown
    texts = [t.value for t in at.text] + [c.value for c in at.caption] + shown
    assert not [t for t in texts if REPLACEMENT in t]


@pytest.mark.app
def test_a_split_typed_past_the_prompt_shows_the_split_the_run_uses():
    from test_app import start

    at = start("pages/split.py", model="tiny:llama")
    box = at.number_input(key="split_k_typed")
    hi = int(at.slider(key="split_k_slider").max)
    assert box.max is None  # a browser keeps an out-of-range number in a box with a max (flagged, never sent)
    box.set_value(999).run()
    assert not at.exception
    assert at.number_input(key="split_k_typed").value == hi and at.slider(key="split_k_slider").value == hi
    assert f"{hi} cached" in " ".join(c.value for c in at.caption)
    assert f"k = 999 is outside 1–{hi}: using {hi}." in " ".join(c.value for c in at.caption)
    at.number_input(key="split_k_typed").set_value(0).run()
    assert at.slider(key="split_k_slider").value == 1 and "k = 0 is outside" in " ".join(c.value for c in at.caption)


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


def test_split_next_token_columns_show_lone_bytes_not_mojibake():
    """Split point's logits table (next token, full and cached): a token that is one byte of a UTF-8 character shows
    as its byte (⟨e4⟩), not U+FFFD - on a byte-level tiny model most next tokens are such bytes."""
    import kvviz
    from kvviz.text import REPLACEMENT
    from kvviz.views.split.figures import logits_frame
    from kvviz.views.split.run import SplitConfig, run_split

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    res = run_split(lm, SplitConfig("The capital of France is Paris, and the capital of Italy is", split=20),
                    prove=False)
    frame = logits_frame(res)
    shown = list(frame["next (full)"]) + list(frame["next (cached)"])
    assert shown and not [t for t in shown if REPLACEMENT in t], shown
    raw = [lm.tokenizer.decode([int(i)]) for i in range(lm.config.vocab_size)]
    assert any(REPLACEMENT in t for t in raw)  # the tokenizer has such tokens (the test can fail)
