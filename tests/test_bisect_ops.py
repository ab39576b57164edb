"""The bisector down to ops (issue 17): the first torch op whose output differs between the full forward and the
cached run, with its module path (layer naming rule), shapes and dtypes - in normal and in invariant mode."""
import torch

import kvviz
from kvviz import invariant
from kvviz.views.bisect.run import layer_name, run_bisect
from kvviz.execution import ExecSettings
from kvviz.views.split.run import SplitConfig

from conftest import DEVICE, PROMPT

CFG = SplitConfig(PROMPT * 2, split=20)


def test_layer_naming_rule():
    assert layer_name("model.layers.0.self_attn") == "layer 1 (model.layers.0.self_attn)"
    assert layer_name("transformer.h.3.attn") == "layer 4 (transformer.h.3.attn)"
    assert layer_name("model.embed_tokens").startswith("embeddings")


def test_normal_mode_names_the_attention_op():
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    res = run_bisect(lm, CFG)
    op = res.first_op
    assert op is not None and op.max_abs > 0
    assert op.module.startswith("model.layers.") and op.layer.startswith("layer ")
    assert op.layer == layer_name(op.module)
    assert op.out_dtype == "float32" and op.shapes and all(len(s) >= 2 for s in op.shapes[:1])
    n = len(lm.tokenizer(CFG.prompt)["input_ids"])
    assert n - CFG.split in op.out_shape  # the compared positions
    assert op.text in res.explanation


def test_invariant_mode_nothing_differs_and_a_broken_op_is_named(monkeypatch):
    lm = kvviz.load_model("tiny:gemma3", "bfloat16", DEVICE)
    res = run_bisect(lm, CFG, ExecSettings(invariant=True))
    assert res.first is None and res.first_op is None
    # break one op of invariant mode: the trace names that op, inside the attention, with bfloat16 inputs
    monkeypatch.setattr(invariant, "invariant_sdpa", torch.nn.functional.scaled_dot_product_attention)
    res = run_bisect(lm, CFG, ExecSettings(invariant=True))
    assert res.first_op is not None
    assert res.first_op.op == "scaled_dot_product_attention" and "self_attn" in res.first_op.module
    assert "bfloat16" in res.first_op.dtypes
