"""Greedy paths on tiny models: exact paths equal naive loops bit for bit; fast previews; verdicts."""
import os
import subprocess
import sys

import pytest
import torch

import kvviz
from kvviz.models.compat import cache_argument, output_cache
from kvviz.core.errors import KvvizError
from kvviz.views.greedy.run import PATHS, GreedyConfig, run_greedy
from conftest import DEVICE, ROOT
from test_lesson_student import AVX2
from kvviz.core.execution import Executor

PROMPT = "Once upon a time, there"
N = 12


def naive_no_cache(model, ids, n):
    """The plain loop without cache, as people write it."""
    logits = []
    with torch.no_grad():
        for _ in range(n):
            out = model(ids)
            logits.append(out.logits[0, -1])
            ids = torch.hstack((ids, torch.argmax(out.logits[0, -1]).unsqueeze(0).unsqueeze(0)))
    return ids, torch.stack(logits)


def naive_cache(model, ids, n):
    """The plain loop with cache."""
    logits, cached = [], None
    tokens = ids
    with torch.no_grad():
        for _ in range(n):
            if cached is None:
                out = model(tokens, use_cache=True)
            else:
                out = model(tokens[:, -1:], **{cache_argument(model): cached}, use_cache=True)
            cached = output_cache(out)
            logits.append(out.logits[0, -1])
            tokens = torch.hstack((tokens, torch.argmax(out.logits[0, -1]).unsqueeze(0).unsqueeze(0)))
    return tokens, torch.stack(logits)


def ids_of(lm, prompt):
    return torch.tensor([lm.tokenizer(prompt)["input_ids"]], device=lm.device)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])
def test_exact_paths_equal_naive_loops_bit_for_bit(arch, dtype):
    lm = kvviz.load_model(f"tiny:{arch}", dtype, DEVICE)
    res = run_greedy(lm, GreedyConfig(PROMPT, N, paths=("no_cache", "cache", "generate")))
    ids = ids_of(lm, PROMPT)
    nc_ids, nc_logits = naive_no_cache(lm.model, ids, N)
    c_ids, c_logits = naive_cache(lm.model, ids, N)
    assert res.paths["no_cache"].token_ids == nc_ids[0, ids.shape[1]:].tolist()
    assert res.paths["cache"].token_ids == c_ids[0, ids.shape[1]:].tolist()
    # logit for logit: kvviz's captured logits are the naive loops' logits, bitwise
    from kvviz.core.execution import Executor
    from kvviz.views.greedy.run import StepRecorder, _cache, no_cache_loop  # the same functions run_greedy uses
    from kvviz.core.inputs import build_inputs

    inp = build_inputs(lm, PROMPT, 0, N)
    ex = Executor(lm)
    rec = StepRecorder("no_cache", N, lambda: None)
    with ex.session():
        no_cache_loop(ex, inp, N, rec)
    assert torch.equal(torch.stack(rec.logits), nc_logits)
    rec = StepRecorder("cache", N, lambda: None)
    with ex.session():
        _cache(ex, inp, N, rec)
    assert torch.equal(torch.stack(rec.logits), c_logits)
    assert res.paths["no_cache"].forwards == N and res.paths["cache"].forwards == N
    assert res.paths["generate"].forwards == N


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "gemma2"])
def test_float64_all_paths_agree(arch):
    lm = kvviz.load_model(f"tiny:{arch}", "float64", DEVICE)
    res = run_greedy(lm, GreedyConfig(PROMPT, N, paths=PATHS))
    toks = {p.name: p.token_ids for p in res.paths.values()}
    assert len({tuple(t) for t in toks.values()}) == 1, toks
    for pair in res.pairs:
        assert pair.first_divergence is None
        assert pair.hidden_relative.max() <= 1e-10
        if "generate" in (pair.a, pair.b):
            # generate() itself casts the logits it hands out to float32
            assert max(pair.max_abs_logit) <= 1e-5
        else:
            assert max(pair.max_abs_logit) <= 1e-10
    assert any("float32" in n for n in res.notes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_fast_equals_exact_where_settled(arch, dtype):
    lm = kvviz.load_model(f"tiny:{arch}", dtype, DEVICE)
    exact = run_greedy(lm, GreedyConfig(PROMPT, 20, paths=("no_cache", "cache", "float64")))
    fast = run_greedy(lm, GreedyConfig(PROMPT, 20, paths=("no_cache", "cache", "float64"), fast=True))
    for name in ("no_cache", "float64"):
        f, e = fast.paths[name], exact.paths[name]
        assert f.preview and f.settled is not None and len(f.settled) == 20
        assert "fast preview" in f.label
        for t, ok in enumerate(f.settled):
            if ok:
                assert f.token_ids[t] == e.token_ids[t], (name, t)
        # fewer forwards than the exact loop: one teacher-forced forward plus the steps after parting
        div = next((t for t, (a, b) in enumerate(zip(f.token_ids, fast.paths["cache"].token_ids)) if a != b), None)
        expected = 1 if div is None else 1 + (20 - div - 1)
        assert f.forwards == expected
    assert fast.paths["cache"].token_ids == exact.paths["cache"].token_ids


def test_user_loop_with_left_padding_parts_with_logic():
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    res = run_greedy(lm, GreedyConfig(PROMPT, N, left_pad=3, paths=("no_cache", "cache", "user_loop")))
    pair = res.pair("no_cache", "user_loop")
    assert pair.first_divergence is not None
    assert pair.verdict == "logic" and pair.float64_gap > 1e-3
    assert "left padding" in pair.explanation
    assert res.pair("no_cache", "cache").first_divergence is None or res.pair("no_cache", "cache").verdict != "logic"


def test_user_loop_without_padding_matches_cache():
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    res = run_greedy(lm, GreedyConfig(PROMPT, N, paths=("cache", "user_loop")))
    assert res.paths["cache"].token_ids == res.paths["user_loop"].token_ids


def test_omitted_positions_in_cache_path_with_padding_is_logic():
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    res = run_greedy(lm, GreedyConfig(PROMPT, N, left_pad=4, position_ids="omit", paths=("no_cache", "cache")))
    pair = res.pair("no_cache", "cache")
    assert pair.first_divergence is not None and pair.verdict == "logic"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("prompt", ["Bonjour", "Once upon a time, there", "x"])
def test_constructed_16bit_tie_flip_is_precision(dtype, prompt):
    # tiny:tie is built so that "a" and "b" differ by 2^-12 of a weight: 16-bit rounds both weights to the same
    # number, so the logits tie exactly and argmax takes "a"; float64 chooses "b". Certain on every CPU and GPU.
    lm = kvviz.load_model("tiny:tie", dtype, DEVICE)
    res = run_greedy(lm, GreedyConfig(prompt, 4, paths=("no_cache", "cache", "float64")))
    assert res.paths["no_cache"].text == "aaaa" and res.paths["cache"].text == "aaaa"
    assert res.paths["float64"].text == "bbbb"
    assert res.paths["no_cache"].margins[0] == 0.0  # an exact tie in 16-bit
    assert res.paths["float64"].margins[0] > 1e-3   # a clear (small) preference in float64
    pair = res.pair("no_cache", "float64")
    assert pair.first_divergence == 0 and (pair.a_token, pair.b_token) == ("a", "b")
    assert pair.verdict == "precision" and pair.float64_gap == 0.0
    assert "near tie" in pair.explanation
    assert res.pair("no_cache", "cache").first_divergence is None


FLIP_CHILD = "KVVIZ_FLIP_CHILD"


@pytest.mark.parametrize("threads", [1, 2])
def test_constructed_cache_flip_parts_no_cache_from_cache(threads):
    """tiny:flip in bfloat16: every number exact but one double rounding in transformers' cached Mamba step, so no
    cache writes "aaaaaa" and the cache "abbbbb" (parting at step 1) on every CPU path and thread count; float64
    closes the gap (precision), the near-tie words come from the margins (2^-7) against the largest logit (8)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lm = kvviz.load_model("tiny:flip", "bfloat16", DEVICE)
        res = run_greedy(lm, GreedyConfig("Once upon a time", 6, paths=("no_cache", "cache", "float64")))
    finally:
        torch.set_num_threads(before)
    assert res.paths["no_cache"].text == "aaaaaa" and res.paths["cache"].text == "abbbbb"
    assert res.paths["float64"].text == "aaaaaa"
    pair = res.pair("no_cache", "cache")
    assert pair.first_divergence == 1 and (pair.a_token, pair.b_token) == ("a", "b")
    assert res.paths["no_cache"].margins[1] == res.paths["cache"].margins[1] == 2.0 ** -7
    assert pair.max_abs_logit[:2] == [0.0, 2.0 ** -6]  # the same prefill, then "b"'s logit -2^-7 against +2^-7
    assert pair.verdict == "precision" and pair.float64_gap == 0.0
    assert pair.near_tie is True and pair.logit_scale == 8.0 and "a near tie (under 1% of the largest logit, 8)" \
        in pair.explanation
    # invariant mode keeps the cached step's bfloat16 rounding: unproved, and never called logic
    assert pair.proved is False and "not reduction order alone" in pair.proof and "logic" not in pair.proof


@pytest.mark.skipif(bool(os.environ.get(FLIP_CHILD)), reason="the child process runs the test itself")
@pytest.mark.skipif(os.environ.get("ATEN_CPU_CAPABILITY") == "avx2",
                    reason="AVX2 is forced in this process: the test above runs on it (make test-any-cpu)")
def test_constructed_cache_flip_parts_on_the_forced_avx2_path():
    env = {**os.environ, **AVX2, FLIP_CHILD: "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:randomly", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "test_greedy.py"), "-k", "flip_parts_no_cache_from_cache"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "2 passed" in p.stdout


def test_constructed_tie_does_not_flip_in_float32():
    lm = kvviz.load_model("tiny:tie", "float32", DEVICE)
    res = run_greedy(lm, GreedyConfig("Hello", 3, paths=("no_cache", "cache", "float64")))
    assert {p.text for p in res.paths.values()} == {"bbb"}
    assert all(p.first_divergence is None for p in res.pairs)
    assert min(res.paths["no_cache"].margins) > 1e-3


def test_stop_at_divergence_truncates():
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    res = run_greedy(lm, GreedyConfig(PROMPT, 20, left_pad=3, paths=("cache", "user_loop"), stop_at_divergence=True))
    d = res.pair("cache", "user_loop").first_divergence
    assert d is not None
    assert all(len(p.token_ids) == d + 1 for p in res.paths.values())


def test_result_json_has_everything():
    from kvviz.io.jsonout import dumps
    import json

    lm = kvviz.load_model("tiny:llama", "bfloat16", DEVICE)
    res = run_greedy(lm, GreedyConfig(PROMPT, 6, paths=("no_cache", "cache", "float64")))
    d = json.loads(dumps(res.to_dict()))
    assert set(d["paths"]) == {"no_cache", "cache", "float64"}
    for p in d["paths"].values():
        assert len(p["token_ids"]) == 6 and len(p["margins"]) == 6 and p["forwards"] >= 1 and p["seconds"] > 0
    assert d["paths"]["cache"]["float64_gap"][0] is not None
    pair = d["pairs"][0]
    assert len(pair["hidden_relative"]) == len(d["layer_labels"]) == 5
    assert len(pair["hidden_relative"][0]) == 6


@pytest.mark.parametrize("kw, msg", [
    (dict(max_new_tokens=0), "between 1 and"),
    (dict(max_new_tokens=100000), "between 1 and"),
    (dict(paths=("cache",)), "at least two"),
    (dict(paths=("cache", "beam")), "unknown path"),
    (dict(left_pad=-1), "left padding"),
    (dict(prompt=""), "empty"),
])
def test_bad_greedy_input(kw, msg):
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    cfg = dict(prompt=PROMPT, max_new_tokens=4, paths=("no_cache", "cache")) | kw
    with pytest.raises(KvvizError, match=msg):
        run_greedy(lm, GreedyConfig(**cfg))


def test_context_overflow_counts_new_tokens():
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    with pytest.raises(KvvizError, match="context"):
        run_greedy(lm, GreedyConfig("x" * 500, 100, paths=("no_cache", "cache")))


@pytest.mark.app
def test_the_near_tie_button_flips_on_any_machine_and_is_scoped_to_its_page():
    """"Show a near tie" opens the constructed cache flip (tiny:flip in bfloat16, where no cache and the cache part at
    step 1 on every machine, whatever the kernels), with one sentence on how it was built. The switch is named on the
    page and ends when you leave it: the sidebar's dtype is not changed for every page."""
    pytest.importorskip("streamlit")
    from kvviz.models.tiny import FLIP_BUILT
    from pages.state import SIDEBAR_DEFAULTS
    from test_app import alerts, start

    at = start("pages/greedy.py", model="tiny:llama", greedy_n=3)
    assert "paths chose the same" in alerts(at) and at.session_state["dtype"] == "float32"
    at.button(key="greedy_show_tie").click().run()
    assert not at.exception, at.exception
    assert at.session_state["model_preset"] == "tiny:flip" and at.session_state["dtype"] == "bfloat16"
    text = alerts(at)
    assert "Scenario: The cache changes a word" in text and "Another page" in text  # said on the page
    assert "Verdict: precision" in text  # no cache and cache part: "a" against "b" at step 1, a near tie
    assert ("At step 1 no cache (full forward each step) chose 'a' (id 67) and cache (the cache passed back each "
            "step) chose 'b' (id 68)") in text and "a near tie" in text
    assert FLIP_BUILT in [c.value for c in at.caption]  # how it was built, in one sentence
    assert at.text_area(key="greedy_prompt").value == "Once upon a time"
    at.switch_page("pages/glossary.py").run()  # leaving the page ends the scenario: the defaults come back
    assert not at.exception
    assert at.session_state["dtype"] == SIDEBAR_DEFAULTS["dtype"] and "_scenario" not in at.session_state


def test_the_greedy_proof_replays_the_parting_step_only(monkeypatch):
    """The invariant proof of a greedy verdict costs a few forwards at the parting step, not a second decode of
    every path (the Guide's 40-token recipe spent 26 of its 29 minutes there)."""
    calls = {"normal": 0, "invariant": 0}
    real = Executor.forward

    def counting(self, *a, **k):
        calls["invariant" if self.settings.invariant else "normal"] += 1
        return real(self, *a, **k)

    from kvviz.core.simkernel import split_k_kernel

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
