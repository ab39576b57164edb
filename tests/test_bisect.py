"""The bisector names the first module whose output differs; the loading trap tells two ways of loading apart."""
import copy
import dataclasses
import sys
import threading

import pytest

from kvviz.models.compat import output_cache
import torch

import kvviz
from kvviz.views.bisect.run import module_kind, run_bisect
from kvviz.core.execution import ExecSettings
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


@pytest.mark.parametrize("mode", ["chunk", "step"])
def test_bisector_keeps_only_the_compared_rows(mode):
    """The full forward's recorder keeps, per module, the compared positions of its first call only (never a whole
    output: a real model's head over a long prompt is gigabytes in float64); the cached run's recorder keeps no
    tensor, only gaps - and the gaps are the ones of the whole outputs (every module of a bit-identical run 0,
    a perturbed module's gap > 0)."""
    from kvviz.core.execution import Executor
    from kvviz.core.inputs import build_inputs
    from kvviz.views.bisect.run import _Recorder, _cached_rest

    lm = private(kvviz.load_model("tiny:gemma3", "float32", DEVICE))
    cfg = SplitConfig(PROMPT, split=11, mode=mode)
    inp = build_inputs(lm, cfg.prompt)
    a0, n = 11, inp.total - 11
    ex = Executor(lm, INV, max_len=inp.total)
    with ex.session():
        pre = ex.forward(inp.ids[:, :a0], inp.mask[:, :a0], inp.positions[:, :a0], hidden=False)
        with _Recorder(lm.model, inp.total, a0, n) as full:
            ex.forward(inp.ids, inp.mask, inp.positions, hidden=False)
        with _Recorder(lm.model, inp.total, a0, n, ref=full) as cached:
            _cached_rest(ex, cfg, inp, a0, output_cache(pre))
    kept = [v for v in list(full.outputs.values()) + list(full.inputs.values()) if v is not None]
    assert len(kept) > 40
    assert all(t.shape[dim] == n for dim, t in kept)
    assert "lm_head" in full.outputs and full.outputs["lm_head"][1].shape[-2:] == (n, lm.model.config.vocab_size)
    assert cached.outputs == {} and cached.inputs == {}
    gaps = {name: cached.gap(name) for name in full.order}
    compared = {k: g for k, g in gaps.items() if g is not None}
    assert "lm_head" in compared and "model.layers.0.mlp.down_proj" in compared
    assert all(g[0] == 0.0 for g in compared.values())  # invariant mode: bit-identical everywhere


def test_max_abs_gap_in_chunks_is_the_whole_upcasts():
    """metrics.max_abs_gap in float64 chunks gives the maxima of upcasting both tensors whole (chunks that do not
    divide the tensor, the largest gap in the last chunk)."""
    from kvviz.core import metrics

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(7, 13, 11, generator=g).to(torch.bfloat16)
    got = (ref.float() + 1e-2 * torch.randn(7, 13, 11, generator=g)).to(torch.bfloat16)
    got[6, 12, 10] = ref[6, 12, 10].float() + 3  # the largest gap, in the last element
    want = (float((got.double() - ref.double()).abs().max()), float(ref.double().abs().max()))
    import unittest.mock as mock

    with mock.patch.object(metrics, "LOGITS_CHUNK_BYTES", 8 * 100):  # 100 elements a chunk: 11 chunks, the last short
        assert metrics.max_abs_gap(ref, got) == want
    assert metrics.max_abs_gap(ref, got) == want


@pytest.mark.parametrize("mode", ["chunk", "step"])
def test_the_bisectors_comparisons_upcast_one_chunk_at_a_time(mode, monkeypatch):
    """The cached run's module gaps and the op trace's first gap are computed in float64 chunks: no float64 copy of
    a whole module output (the head's over a 262k vocabulary and 120 positions is 0.25 GB, four of them at once
    were the bisector's peak on Gemma 3 270M). Counted with the chunk set to 256 elements on a tiny model whose head
    output is larger; the verdict and gaps are those of the unchunked run."""
    from torch.overrides import TorchFunctionMode

    from kvviz.core import metrics

    lm = private(kvviz.load_model("tiny:llama", "float32", DEVICE))
    total = len(lm.tokenizer(PROMPT)["input_ids"])
    mod = lm.model.get_submodule("model.layers.2.mlp.down_proj")
    mod.register_forward_hook(lambda m, a, out: out + 1e-3 if a[0].shape[1] < total else out)
    cfg = SplitConfig(PROMPT, split=10, mode=mode)
    whole = run_bisect(lm, cfg, INV)
    largest = [0]

    class Upcasts(TorchFunctionMode):  # float64 upcasts made by the bisector's comparisons (not the model's own)
        def __torch_function__(self, func, types, args=(), kwargs=None):
            f = sys._getframe(1)
            while f is not None and ("/torch/" in f.f_code.co_filename.replace("\\", "/")
                                     or f.f_code.co_name == "__torch_function__"):  # other modes (invariant mode)
                f = f.f_back
            caller = f.f_code.co_filename.replace("\\", "/") if f is not None else ""
            if (func is torch.Tensor.double or (func is torch.Tensor.to and torch.float64 in (
                    *args[1:], *(kwargs or {}).values()))) and caller.endswith(("views/bisect/run.py", "metrics.py")):
                largest[0] = max(largest[0], args[0].numel())
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(metrics, "LOGITS_CHUNK_BYTES", 8 * 256)
    with Upcasts():
        chunked = run_bisect(lm, cfg, INV)
    head = (total - 10) * lm.model.config.vocab_size
    assert head > 4 * 256 and 0 < largest[0] <= 256
    assert chunked.first.name == whole.first.name == "model.layers.2.mlp.down_proj"
    assert [(g.name, g.max_abs) for g in chunked.modules] == [(g.name, g.max_abs) for g in whole.modules]
