"""The bisector names the first module whose output differs; the loading trap tells two ways of loading apart."""
import copy
import dataclasses
import threading

import pytest
import torch

import kvviz
from kvviz.views.bisect.run import module_kind, run_bisect
from kvviz.execution import ExecSettings
from kvviz.views.loading_trap.run import run_loading_trap
from kvviz.views.split.run import SplitConfig, run_split

from conftest import DEVICE, PROMPT

INV = ExecSettings(invariant=True)


def private(lm):
    """A private copy of a loaded model, so a test may hook it without touching the shared one."""
    return dataclasses.replace(lm, model=copy.deepcopy(lm.model), lock=threading.RLock())


@pytest.mark.parametrize("arch, module, kind, layer", [
    ("llama", "model.layers.2.mlp.down_proj", "MLP part", 2),
    ("llama", "model.layers.1.self_attn.k_proj", "q/k/v projection", 1),
    ("gpt2", "transformer.h.3.mlp", "MLP", 3),
])
@pytest.mark.parametrize("mode", ["chunk", "step"])
def test_bisector_names_the_perturbed_module(arch, module, kind, layer, mode):
    lm = private(kvviz.load_model(f"tiny:{arch}", "float32", DEVICE))
    total = len(lm.tokenizer(PROMPT)["input_ids"])
    mod = lm.model.get_submodule(module)

    def perturb(m, args, out):  # only in the cached run: its inputs are shorter than the whole prompt
        return out + 1e-3 if args[0].shape[1] < total else out

    mod.register_forward_hook(perturb)
    res = run_bisect(lm, SplitConfig(PROMPT, split=10, mode=mode), INV)
    assert res.first is not None
    assert (res.first.name, res.first.kind, res.first.layer) == (module, kind, layer)
    assert res.first.max_abs == pytest.approx(1e-3, rel=1e-2)
    before = [g for g in res.modules[: res.modules.index(res.first)]]
    assert before and all(g.max_abs == 0 for g in before)
    assert module in res.explanation


@pytest.mark.parametrize("arch, kind", [("llama", "rotary"), ("gpt_neox", "rotary"), ("gpt2", "embedding")])
def test_omitted_positions_start_at_the_positions(arch, kind):
    lm = kvviz.load_model(f"tiny:{arch}", "bfloat16", DEVICE)
    res = run_bisect(lm, SplitConfig(PROMPT, split=8, left_pad=3, position_ids="omit"), INV)
    assert res.first.kind == kind and res.first.layer is None


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_invariant_mode_leaves_nothing_to_bisect(arch):
    lm = kvviz.load_model(f"tiny:{arch}", "bfloat16", DEVICE)
    res = run_bisect(lm, SplitConfig(PROMPT, split=8, mode="step"), INV)
    assert res.first is None and len(res.modules) > 10 and all(g.max_abs == 0 for g in res.modules)


def test_normal_mode_agrees_with_the_split_comparison():
    lm = kvviz.load_model("tiny:qwen2", "bfloat16", DEVICE)
    cfg = SplitConfig(PROMPT, split=8, mode="step")
    res = run_bisect(lm, cfg)
    assert (res.first is None) == run_split(lm, cfg, prove=False).main.identical


def test_module_kinds():
    assert module_kind("model.layers.0.self_attn.q_proj") == "q/k/v projection"
    assert module_kind("transformer.h.1.attn.c_proj") == "attention output"
    assert module_kind("transformer.h.1.mlp.c_proj") == "MLP part"
    assert module_kind("model.norm") == "norm" and module_kind("lm_head") == "lm_head"


def test_bisect_of_a_bidirectional_model_is_a_clear_error():
    with pytest.raises(kvviz.KvvizError, match="no cache"):
        run_bisect(kvviz.load_model("tiny:roberta", "float32", DEVICE), SplitConfig(PROMPT, split=5))


def test_loading_trap_tells_the_two_models_apart():
    lm = kvviz.load_model("tiny:llama", "bfloat16", DEVICE)
    res = run_loading_trap(lm, "This is a ", 6)
    assert res.verdict == "different models"
    inv = {b.name: b for b in res.buffers}["model.rotary_emb.inv_freq"]
    assert (inv.loaded_dtype, inv.cast_dtype) == ("float32", "bfloat16") and inv.max_abs > 0
    assert max(res.max_abs_logit) > 0  # the rotary angles differ, so the logits do
    assert "inv_freq" in res.explanation
    shared32 = kvviz.load_model("tiny:llama", "float32", DEVICE)
    assert shared32.model.model.rotary_emb.inv_freq.dtype == torch.float32  # the shared model was not cast
    assert next(shared32.model.parameters()).dtype == torch.float32


def test_loading_trap_without_rotary_is_the_same_model():
    res = run_loading_trap(kvviz.load_model("tiny:gpt2", "bfloat16", DEVICE), "Hi", 4)
    assert res.verdict == "same model" and res.buffers == [] and res.first_divergence is None
    assert max(res.max_abs_logit) == 0.0


def test_cli_bisect_and_trap(capsys):
    import json

    from kvviz.cli import main

    assert main(["bisect", "--model", "tiny:llama", "--prompt", PROMPT, "--split", "8", "--left-pad", "3",
                 "--position-ids", "omit", "--invariant", "--json", "--quiet", "--device", DEVICE]) == 0
    assert json.loads(capsys.readouterr().out)["first"]["kind"] == "rotary"
    assert main(["loading-trap", "--model", "tiny:llama", "--max-new-tokens", "3", "--json", "--quiet",
                 "--device", DEVICE]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "different models"
