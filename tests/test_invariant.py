"""Invariant mode: cached and full forwards agree bit for bit wherever the logic is right (every tiny architecture,
sliding windows past the window, 16-bit dtypes, chunk and step, greedy paths, alone vs in a padded batch); logic
errors keep their gap; nothing stays switched on after a run."""
import pytest
import torch
import torch.nn.functional as F

import kvviz
from kvviz.core import invariant
from kvviz.core.execution import ExecSettings, Executor
from kvviz.views.greedy.run import GreedyConfig, run_greedy
from kvviz.views.padding.run import run_padding
from kvviz.views.split.run import SplitConfig, run_split

from conftest import DEVICE, PROMPT

INV = ExecSettings(invariant=True)
CAUSAL = [a for a in kvviz.TINY_ARCHS if a != "roberta"]


def assert_bitwise(res):
    m = res.main
    assert m.has_cache and m.identical
    assert m.hidden["max_abs"].max() == 0 and m.logits["max_abs"].max() == 0
    assert all(r["keys_differ"] == 0 and r["values_differ"] == 0 and r["keys_total"] > 0 for r in m.kv)
    assert res.verdict == "identical"


@pytest.mark.parametrize("mode", ["chunk", "step"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", CAUSAL)
def test_cached_equals_full_bit_for_bit(arch, dtype, mode):
    lm = kvviz.load_model(f"tiny:{arch}", dtype, DEVICE)
    prompt = PROMPT * 2 if arch in ("mistral", "gemma2", "gemma3") else PROMPT  # past the sliding window of 8
    res = run_split(lm, SplitConfig(prompt, split=11, mode=mode, left_pad=2), settings=INV)
    assert_bitwise(res)
    assert "gap is exactly 0" in res.proof and res.settings.execution.invariant


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_float16_too(arch):
    lm = kvviz.load_model(f"tiny:{arch}", "float16", DEVICE)
    assert_bitwise(run_split(lm, SplitConfig(PROMPT * 2, split=20, mode="step"), settings=INV))


@pytest.mark.slow
def test_default_model_bfloat16_step():
    lm = kvviz.load_model("default", "bfloat16", DEVICE)
    res = run_split(lm, SplitConfig("The capital of France is Paris, and the capital of Italy is", split=6,
                                    mode="step"), settings=INV)
    assert_bitwise(res)


@pytest.mark.parametrize("kw, cause", [
    (dict(left_pad=3, position_ids="omit"), "position ids were omitted"),
    (dict(attention_mask="new-only"), "attention mask covered only the new tokens"),
    (dict(left_pad=2, attention_mask="new-only", mode="step"), "attention mask covered only the new tokens"),
])
def test_logic_errors_keep_their_gap(kw, cause):
    lm = kvviz.load_model("tiny:llama", "bfloat16", DEVICE)
    res = run_split(lm, SplitConfig(PROMPT, split=8, **kw), settings=INV)
    assert res.verdict == "logic" and cause in res.explanation
    assert res.main.max_abs > 1e-2 and res.float64.max_relative > 1e-3
    assert "survives" in res.proof and res.proved is False


def test_bidirectional_model_stays_logic():
    res = run_split(kvviz.load_model("tiny:roberta", "bfloat16", DEVICE), SplitConfig(PROMPT, split=8), settings=INV)
    assert res.verdict == "logic" and not res.main.has_cache


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_normal_run_comes_with_its_proof(arch):
    lm = kvviz.load_model(f"tiny:{arch}", "bfloat16", DEVICE)
    res = run_split(lm, SplitConfig(PROMPT, split=8, mode="step"), prove=True)
    assert res.invariant is not None and res.invariant.identical and res.proved is True
    assert res.verdict in ("identical", "precision")
    expected = "Precision — proved" if res.verdict == "precision" else "exactly 0 as well"
    assert expected in res.proof
    d = res.to_dict()
    assert d["proved"] is True and d["invariant_check"]["identical"] is True


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_greedy_paths_identical_token_for_token(arch):
    lm = kvviz.load_model(f"tiny:{arch}", "bfloat16", DEVICE)
    res = run_greedy(lm, GreedyConfig("Once upon a time, there", 10, paths=("no_cache", "cache", "generate")),
                     settings=INV)
    for pair in res.pairs:
        assert pair.first_divergence is None and max(pair.max_abs_logit) == 0.0, (pair.a, pair.b)


def test_alone_equals_left_padded_and_batched():
    lm = kvviz.load_model("tiny:qwen2", "bfloat16", DEVICE)
    res = run_padding(lm, "Once upon a time, there", left_pad=3, settings=INV)
    bitwise = res.grid("bitwise_equal")
    for placement in ("alone", "left-padded", "in a batch"):
        assert bitwise.loc[placement, "no cache"] and bitwise.loc[placement, "cache"]
    assert res.grid().loc["left-padded", "cache, positions omitted"] == "logic"


def test_nothing_stays_on_after_a_run_or_an_error():
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    run_split(lm, SplitConfig(PROMPT, split=5), settings=INV)
    assert not invariant.active() and torch._C._len_torch_function_stack() == 0
    with pytest.raises(RuntimeError, match="boom"):
        with Executor(lm, INV).session():
            assert invariant.active() and torch._C._len_torch_function_stack() == 1
            raise RuntimeError("boom")
    assert not invariant.active() and torch._C._len_torch_function_stack() == 0
    # and the ops are the plain ones again: F.linear is one batched call, not one per row
    x, w = torch.randn(5, 8), torch.randn(3, 8)
    assert torch.equal(F.linear(x, w), torch.mm(x, w.t()))


def test_invariant_mode_is_per_thread():
    import threading

    seen = []
    with invariant.invariant_mode():
        t = threading.Thread(target=lambda: seen.append((invariant.active(), torch._C._len_torch_function_stack())))
        t.start()
        t.join()
        assert invariant.active()
    assert seen == [(False, 0)]


def test_fixed_order_ops_do_not_depend_on_shape():
    torch.manual_seed(0)
    a, b = torch.randn(7, 33, dtype=torch.bfloat16), torch.randn(33, 5, dtype=torch.bfloat16)
    full = invariant.fixed_order_matmul(a, b)
    assert all(torch.equal(invariant.fixed_order_matmul(a[i:i + 1], b), full[i:i + 1]) for i in range(7))
    assert torch.equal(invariant.fixed_order_matmul(a, b[:, :2]), full[:, :2])  # fewer columns, same bits
    # masked keys (weight exactly 0) appended to a row change nothing
    p = torch.softmax(torch.randn(1, 4), -1)
    v = torch.randn(4, 6)
    padded = invariant.fixed_order_matmul(torch.cat([p, torch.zeros(1, 3)], 1), torch.cat([v, torch.randn(3, 6)]))
    assert torch.equal(padded, invariant.fixed_order_matmul(p, v))
    x = torch.randn(3, 5)
    masked = torch.cat([x, torch.full((3, 4), torch.finfo(torch.float32).min)], 1)
    assert torch.equal(invariant.fixed_order_softmax(masked)[:, :5], invariant.fixed_order_softmax(x))


def test_padding_precision_cells_come_with_their_proof():
    lm = kvviz.load_model("tiny:llama", "bfloat16", DEVICE)
    res = run_padding(lm, "Once upon a time, there", left_pad=3)
    for c in res.cells:
        assert c["proved"] is (True if c["verdict"] == "precision" else None)


def test_matrix_in_invariant_mode_is_identical_everywhere():
    from kvviz.views.matrix.run import MatrixConfig, run_matrix

    cfg = MatrixConfig("Hello there", 5, attentions=("eager", "sdpa"), caches=("dynamic", "static"), repeats=1,
                       invariant=True)
    res = run_matrix("tiny:llama", cfg, "bfloat16", DEVICE)
    assert [c.verdict for c in res.cells] == ["identical"] * 4 and res.settings["invariant"] is True


def test_greedy_pairs_are_proved_or_shown_to_be_logic():
    lm = kvviz.load_model("tiny:llama", "bfloat16", DEVICE)
    res = run_greedy(lm, GreedyConfig("Once upon a time", 6, left_pad=3,
                                      paths=("no_cache", "cache", "generate", "user_loop", "float64")), prove=True)
    proved = {(p.a, p.b): p.proved for p in res.pairs}
    assert proved[("no_cache", "cache")] is True and proved[("cache", "generate")] is True
    assert proved[("cache", "user_loop")] is False  # no positions after a left-padded prompt: logic
    assert all(v is None for (a, b), v in proved.items() if "float64" in (a, b))  # another dtype, not another order
    pair = res.pair("no_cache", "cache")
    assert "Precision — proved" in pair.proof


def test_reuse_ways_are_proved_or_shown_to_be_logic():
    from kvviz.views.reuse.run import run_reuse

    lm = kvviz.load_model("tiny:llama", "bfloat16", DEVICE)
    res = run_reuse(lm, "Answer briefly.", [" Q: 2+2?", " Q: sky?"], 4, prove=True)
    by = {(r["index"], r["strategy"]): r["proved"] for r in res.runs}
    assert by[(0, "deepcopy")] is True and by[(1, "deepcopy")] is True
    assert by[(1, "reused")] is False and by[(0, "fresh")] is None


def test_single_prompt_dtype_sweep_proves_its_precision_verdicts():
    from kvviz.views.dtypes.run import run_dtypes

    res = run_dtypes(kvviz.load_model("tiny:llama", "bfloat16", DEVICE), [PROMPT], ["float32", "bfloat16"])
    for d in ("float32", "bfloat16"):
        assert res.proved[d] == [True if res.verdicts[d][0] == "precision" else None]
    assert res.proved["float64"] == [None]
