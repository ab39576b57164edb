"""The split comparison on tiny models: exact in float64, and the verdicts of the seeds' scenarios."""
import numpy as np
import pytest
import torch

import kvviz
from kvviz.core.errors import KvvizError
from kvviz.views.split.run import SplitConfig, run_split
from kvviz.core.verdict import FLOAT64_CLOSED_REL

from conftest import PROMPT, DEVICE

CAUSAL = [a for a in kvviz.TINY_ARCHS if a != "roberta"]


def lm(arch, dtype="float32"):
    return kvviz.load_model(f"tiny:{arch}", dtype, DEVICE)


@pytest.mark.parametrize("mode", ["chunk", "step"])
@pytest.mark.parametrize("arch", CAUSAL)
def test_float64_cached_equals_uncached(arch, mode):
    res = run_split(lm(arch, "float64"), SplitConfig(PROMPT, split=11, mode=mode))
    assert res.main.has_cache
    n_rest = len(res.tokens) - 11
    assert res.main.hidden["max_abs"].shape == (lm(arch).n_layers + 1, n_rest)
    assert res.main.hidden["max_abs"].max() <= 1e-10
    assert res.main.logits["max_abs"].max() <= 1e-10
    assert res.main.logits["argmax_agree"].all()
    assert all(r["keys_max_abs"] <= 1e-10 and r["values_max_abs"] <= 1e-10 for r in res.main.kv)
    assert res.verdict in ("identical", "precision")


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_split_beyond_window(arch):
    # window 8: the rest starts well after the window, and token-by-token the cache is cropped at every step
    res = run_split(lm(arch, "float64"), SplitConfig(PROMPT * 2, split=20, mode="step", left_pad=2))
    assert res.main.hidden["max_abs"].max() <= 1e-10
    assert res.main.kv and all(r["keys_max_abs"] <= 1e-10 and r["values_max_abs"] <= 1e-10 for r in res.main.kv)
    windowed = [r for r in res.main.kv if r["positions"] < len(res.tokens)]
    assert windowed and all(r["positions"] <= 8 for r in windowed)  # the sliding layers keep only the window


def test_gpt2_left_pad_omitted_positions_is_logic():
    res = run_split(lm("gpt2"), SplitConfig(PROMPT, split=10, left_pad=3, position_ids="omit"))
    assert res.verdict == "logic"
    assert res.float64 is not None and res.float64.max_relative > 1e-3
    assert "position ids were omitted" in res.explanation


def test_gpt2_left_pad_auto_positions_is_precision_or_identical():
    cfg = SplitConfig(PROMPT, split=10, left_pad=3, position_ids="auto")
    res = run_split(lm("gpt2"), cfg)
    assert res.verdict in ("precision", "identical")
    assert (res.verdict == "identical") == res.main.identical  # the rule holds whichever way the kernels round
    assert (res.float64 is None) == res.main.identical  # a gap always brings its float64 evidence
    assert run_split(lm("gpt2", "float64"), cfg).main.max_relative <= FLOAT64_CLOSED_REL


@pytest.mark.parametrize("mode", ["chunk", "step"])
def test_gpt2_new_only_mask_is_logic(mode):
    res = run_split(lm("gpt2"), SplitConfig(PROMPT, split=10, left_pad=3, attention_mask="new-only", mode=mode))
    assert res.verdict == "logic"
    assert "attention mask covered only the new tokens" in res.explanation


def test_roberta_has_no_cache_and_is_logic():
    res = run_split(lm("roberta"), SplitConfig(PROMPT, split=10))
    assert res.verdict == "logic"
    assert not res.main.has_cache
    assert "no cache" in res.explanation and "bidirectional" in res.explanation
    # the evidence: appending the rest really changes what the prefix computes
    assert res.main.bidirectional_change > 1e-3
    assert res.to_dict()["result"]["hidden"] == {}


def test_bfloat16_llama_is_precision_with_float64_evidence():
    cfg = SplitConfig(PROMPT, split=8)
    res = run_split(lm("llama", "bfloat16"), cfg)
    assert res.verdict in ("precision", "identical")
    assert (res.verdict == "identical") == res.main.identical
    # the gap is measured against bfloat16's epsilon
    eps = torch.finfo(torch.bfloat16).eps
    np.testing.assert_allclose(res.main.hidden["eps_units"], res.main.hidden["relative"] / eps)
    # the evidence the verdict rests on: the same scenario in float64 closes to float64 rounding
    f64 = run_split(lm("llama", "float64"), cfg)
    assert f64.main.dtype == "float64" and f64.main.max_relative <= 1e-12


def test_single_compared_token():
    res = run_split(lm("gpt2", "float64"), SplitConfig("ab", split=2))  # <s> a | b
    assert res.tokens == ["<s>", "a", "b"]
    assert res.compared == [2]
    assert res.verdict in ("identical", "precision")
    assert res.main.max_abs <= 1e-10
    assert (res.verdict == "identical") == (res.main.max_abs == 0)


def test_metrics_have_real_values_and_labels():
    res = run_split(lm("qwen2", "float16"), SplitConfig(PROMPT, split=5))
    d = res.to_dict()
    assert d["layer_labels"][0] == "embeddings" and d["layer_labels"][-1].endswith("final norm")
    assert len(d["layer_labels"]) == 5
    assert d["cached_tokens"] == res.tokens[:5]
    h = res.main.hidden
    assert ((h["relative"] == 0) == (h["max_abs"] == 0)).all()  # relative is max |Δ| / max |ref|: zero together
    assert (h["max_abs"] >= h["mean_abs"]).all() and (h["mean_abs"] >= 0).all()
    np.testing.assert_allclose(h["eps_units"], h["relative"] / torch.finfo(torch.float16).eps)
    # the embeddings of the compared tokens are the same lookup in both runs
    assert h["max_abs"][0].max() == 0
    assert (h["cosine"] >= 0).all() and (h["cosine"] < 1e-2).all()
    # the describe() table: rows mean..max, abs Δ ≥ 0
    desc = res.main.describe
    assert set(desc) == {"without past", "with past", "absolute Δ", "relative Δ"}
    assert list(desc["absolute Δ"]) == ["mean", "std", "min", "25%", "50%", "75%", "max"]
    assert desc["absolute Δ"]["min"] >= 0
    assert desc["absolute Δ"]["max"] == pytest.approx(float(res.main.logits["max_abs"][-1]), rel=1e-6)
    # K/V counts, element by element
    for row in res.main.kv:
        assert 0 <= row["keys_differ"] <= row["keys_total"] == row["values_total"]


def test_describe_matches_pandas():
    import pandas as pd

    from kvviz.core.metrics import describe

    x = torch.randn(1000, dtype=torch.float64)
    ours = describe(x).numpy()
    theirs = pd.Series(x.numpy()).describe().drop("count").to_numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)


@pytest.mark.parametrize("split", [0, 33, 34, 100, -1])
def test_split_outside_prompt_is_a_clear_error(split):
    with pytest.raises(KvvizError, match="outside the prompt"):
        run_split(lm("gpt2"), SplitConfig(PROMPT, split=split))


@pytest.mark.parametrize("prompt", ["", "   \n\t "])
def test_empty_prompt_is_a_clear_error(prompt):
    with pytest.raises(KvvizError, match="empty"):
        run_split(lm("gpt2"), SplitConfig(prompt, split=1))


def test_prompt_longer_than_context():
    with pytest.raises(KvvizError, match="longer than the model's context"):
        run_split(lm("gpt2"), SplitConfig("x" * 600, split=3))


def test_bad_modes_and_padding():
    with pytest.raises(KvvizError, match="left padding"):
        run_split(lm("gpt2"), SplitConfig(PROMPT, split=3, left_pad=-2))
    with pytest.raises(KvvizError, match="mode"):
        run_split(lm("gpt2"), SplitConfig(PROMPT, split=3, mode="sideways"))


def test_float64_reference_logits_a_chunk_at_a_time_agree_with_all_at_once(monkeypatch):
    """A large vocabulary's float64 logits over many positions are computed a chunk of rows at a time (memory):
    forced here on a tiny model (2 rows a chunk), the step-by-step comparison's numbers are those of the whole
    forward to float64 rounding, and the verdict is the same."""
    from kvviz.views.split import run as split_mod

    lm = kvviz.load_model("tiny:llama", "float64", DEVICE)
    cfg = SplitConfig(PROMPT, split=3, mode="step")
    whole = split_mod.run_split(lm, cfg, prove=False)
    vocab = lm.model.config.vocab_size
    monkeypatch.setattr(split_mod, "REFERENCE_LOGITS_BYTES", 2 * 8 * vocab)
    calls = []
    real = split_mod._ChunkedLogits._chunk

    def counting(self, j):
        calls.append(j)
        return real(self, j)

    monkeypatch.setattr(split_mod._ChunkedLogits, "_chunk", counting)
    chunked = split_mod.run_split(lm, cfg, prove=False)
    n = len(chunked.compared)
    assert n > 4 and len(calls) >= n  # every compared position went through the chunks
    for k in ("max_abs", "relative", "kl"):
        a, b = whole.main.logits[k], chunked.main.logits[k]
        assert np.allclose(a, b, rtol=0, atol=1e-12), k
    assert list(whole.main.logits["argmax_agree"]) == list(chunked.main.logits["argmax_agree"])
    assert whole.verdict == chunked.verdict
