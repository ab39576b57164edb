"""Issue 27: kvviz's GGUF conversion is a standard checkpoint other engines read the same way; the engine seam
(kvviz/engines/); the real engines (vLLM, llama.cpp) where `make engines` built their environments."""
import json

import pytest
import torch
from safetensors import safe_open

import kvviz
from kvviz.execution import Executor
from kvviz.gguf_stream import INDEX_NAME


@pytest.mark.slow
def test_converted_default_model_is_a_standard_checkpoint():
    """The converted folder holds the tied embedding under model.embed_tokens.weight (not lm_head.weight alone) and
    names its architecture, and a plain AutoModelForCausalLM.from_pretrained gives kvviz's loader's logits bit for
    bit (vLLM read the old folder's missing embedding as zeros: uniform logits)."""
    from transformers import AutoModelForCausalLM

    from kvviz.loading import converted_gguf_folder, default_gguf_path

    lm = kvviz.load_model("default", "float32", "cpu")
    folder = converted_gguf_folder(default_gguf_path())
    assert str(folder) == lm.source
    index = json.loads((folder / INDEX_NAME).read_text())
    names = set(index["weight_map"])
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    shard = folder / index["weight_map"]["model.embed_tokens.weight"]
    with safe_open(str(shard), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
    assert emb.shape == (49152, 576) and emb.abs().max() > 0.1
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True

    plain = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert torch.equal(plain.lm_head.weight, emb)
    ids = torch.tensor([lm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")])
    with torch.no_grad():
        a = plain(input_ids=ids).logits
    ex = Executor(lm)
    with ex.session():
        b = ex.forward(ids, use_cache=False, hidden=False).logits
    assert torch.equal(a, b)
    assert a[0, -1].std() > 1.0  # real logits, not uniform
