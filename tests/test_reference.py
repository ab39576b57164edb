"""The streamed float64 reference (kvviz.core.reference) gives the full float64 twin's numbers bit for bit, through every
consumer, without holding a float64 copy of the model and without changing the shared model."""
import threading

import numpy as np
import pytest

from kvviz.models.compat import output_cache
import torch
from conftest import DEVICE, PROMPT

from kvviz.core.execution import ExecSettings, Executor
from kvviz.models.loading import load_model
from kvviz.core.reference import is_streamed
from kvviz.models.tiny import TINY_ARCHS

DTYPES = ("float32", "bfloat16")  # float32: the tiny checkpoints' own dtype; bfloat16: read from the checkpoint


def _refs(lm):
    twin, streamed = lm.reference("twin"), lm.reference("streamed")
    assert not is_streamed(twin) and twin.model is not lm.model
    assert is_streamed(streamed) and streamed.model is lm.model and streamed.dtype == torch.float64
    return twin, streamed


def _same(a, b, path="") -> None:
    """Recursive bit-for-bit equality of results (timings and notes aside)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            if k not in ("elapsed_s", "proof_s", "seconds", "notes", "warnings"):
                _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b.to(a.device)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), path
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _snapshot(model):
    return ([(n, id(p), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)],
            [(n, id(b), b.dtype, b.clone()) for n, b in model.named_buffers()],
            len(model._forward_pre_hooks), len(model._forward_hooks))


def _unchanged(model, snap) -> None:
    now = _snapshot(model)
    assert now[0] == snap[0] and now[2:] == snap[2:]
    for (n, i, d, v), (n2, i2, d2, v2) in zip(snap[1], now[1]):
        assert (n, i, d) == (n2, i2, d2) and torch.equal(v, v2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", TINY_ARCHS + ("tie",))
def test_streamed_forward_and_generate_equal_the_twin(arch, dtype):
    lm = load_model(f"tiny:{arch}", dtype, DEVICE)
    snap = _snapshot(lm.model)
    twin, streamed = _refs(lm)
    ids = lm.tokenizer(PROMPT, return_tensors="pt").input_ids.to(lm.device)
    outs = []
    for ref in (twin, streamed):
        ex = Executor(ref)
        with ex.session():
            full = ex.forward(ids, use_cache=False)
            pre = ex.forward(ids[:, :5])
            rest = ex.forward(ids[:, 5:], cache=output_cache(pre))
            gen = None if arch == "roberta" else ex.generate(ids, torch.ones_like(ids), 3, pad_token_id=0)
        outs.append((full, pre, rest, gen))
    (f1, p1, r1, g1), (f2, p2, r2, g2) = outs
    assert f2.logits.dtype == torch.float64 and f2.hidden_states[-1].dtype == torch.float64
    _same(f1.logits, f2.logits)
    _same(list(f1.hidden_states), list(f2.hidden_states))
    if arch != "roberta":
        _same(r1.logits, r2.logits)
        _same(list(r1.hidden_states), list(r2.hidden_states))
        from kvviz.core.execution import cache_layers

        _same(cache_layers(output_cache(r1)), cache_layers(output_cache(r2)))
        _same(g1.sequences, g2.sequences)
        _same(list(g1.logits), list(g2.logits))  # generate casts logits to float32 outside forward, for both
        assert g2.logits[0].dtype == torch.float32
    _unchanged(lm.model, snap)
    assert next(lm.model.parameters()).dtype == lm.dtype


def test_bfloat16_reference_reads_the_checkpoint_not_the_rounded_weights():
    lm = load_model("tiny:llama", "bfloat16", DEVICE)
    streamed = lm.reference("streamed")
    assert streamed.stream64.from_checkpoint  # the float32 checkpoint's own tensors
    upcast = load_model("tiny:llama", "float32", DEVICE).reference("twin")
    ids = lm.tokenizer(PROMPT, return_tensors="pt").input_ids.to(lm.device)
    with Executor(streamed).session() as ex:
        a = ex.forward(ids, use_cache=False).logits
    with Executor(upcast).session() as ex:
        b = ex.forward(ids, use_cache=False).logits
    assert torch.equal(a, b)
    # the rounded bfloat16 weights upcast would give other numbers
    rounded = {n: p.detach().double() for n, p in lm.model.named_parameters()}
    assert any(not torch.equal(rounded[n], p.detach().double()) for n, p in upcast.model.named_parameters()
               if n in rounded)


@pytest.mark.parametrize("mode", ("chunk", "step"))
@pytest.mark.parametrize("arch", ("llama", "gpt2", "gemma2", "gpt_neox"))
def test_split_float64_runs_equal(arch, mode):
    from kvviz.core.inputs import build_inputs
    from kvviz.views.split.run import SplitConfig, _run

    lm = load_model(f"tiny:{arch}", "float32", DEVICE)
    twin, streamed = _refs(lm)
    cfg = SplitConfig(PROMPT, split=6, mode=mode, left_pad=2)
    for settings in (ExecSettings(), ExecSettings(invariant=True)):  # the invariant proof rerun too
        a = _run(twin, cfg, build_inputs(twin, cfg.prompt, cfg.left_pad), lambda f, m: None, settings)
        b = _run(streamed, cfg, build_inputs(streamed, cfg.prompt, cfg.left_pad), lambda f, m: None, settings)
        _same(a.to_dict(), b.to_dict())


def test_run_split_verdict_equal_with_either_reference():
    from kvviz.views.split.run import SplitConfig, run_split

    lm = load_model("tiny:llama", "float16", DEVICE)
    twin, streamed = _refs(lm)
    cfg = SplitConfig(PROMPT, split=5, mode="step")
    a = run_split(lm, cfg, reference=twin).to_dict()
    b = run_split(lm, cfg, reference=streamed).to_dict()
    assert a["float64_evidence"] is not None
    _same(a, b)


@pytest.mark.parametrize("arch", ("llama", "gemma2"))
def test_greedy_float64_path_equal(arch):
    from kvviz.views.greedy.run import GreedyConfig, run_greedy

    lm = load_model(f"tiny:{arch}", "bfloat16", DEVICE)
    twin, streamed = _refs(lm)
    cfg = dict(prompt=PROMPT, max_new_tokens=5, left_pad=1, paths=("no_cache", "cache", "float64"))
    a = run_greedy(lm, GreedyConfig(**cfg), reference=twin).to_dict()
    b = run_greedy(lm, GreedyConfig(**cfg), reference=streamed).to_dict()
    _same(a, b)


def _with_strategy(monkeypatch, strategy, fn):
    monkeypatch.setenv("KVVIZ_REFERENCE", strategy)
    return fn()


def test_padding_and_reuse_equal(monkeypatch):
    from kvviz.views.padding.run import run_padding
    from kvviz.views.reuse.run import run_reuse

    lm = load_model("tiny:llama", "float32", DEVICE)
    runs = {
        "padding": lambda: run_padding(lm, "Hello world, caching", left_pad=2, prove=False).to_dict(),
        "reuse": lambda: run_reuse(lm, "Hello world,", ["caching"], max_new_tokens=3, prove=False).to_dict(),
    }
    for name, fn in runs.items():
        _same(_with_strategy(monkeypatch, "twin", fn), _with_strategy(monkeypatch, "streamed", fn), name)


@pytest.mark.slow
def test_check_card_and_dtype_sweep_equal(monkeypatch):
    from kvviz.views.check.run import run_check
    from kvviz.views.dtypes.run import run_dtypes

    lm = load_model("tiny:llama", "float32", DEVICE)
    runs = {
        "check": lambda: run_check(lm).to_dict(),
        "dtypes": lambda: run_dtypes(lm, [PROMPT], dtypes=("float32", "bfloat16")).to_dict(),
    }
    for name, fn in runs.items():
        _same(_with_strategy(monkeypatch, "twin", fn), _with_strategy(monkeypatch, "streamed", fn), name)


def test_auto_strategy_and_bad_strategy(monkeypatch):
    from kvviz.core.errors import KvvizError

    lm = load_model("tiny:llama", "float32", DEVICE)
    monkeypatch.delenv("KVVIZ_REFERENCE", raising=False)
    assert not is_streamed(lm.reference())  # tiny: the twin is small and faster
    monkeypatch.setenv("KVVIZ_REFERENCE", "streamed")
    assert is_streamed(lm.reference())
    assert lm.reference() is lm.reference()  # one streamed reference per loaded model
    assert lm.twin("float64").reference() is lm.twin("float64")
    with pytest.raises(KvvizError, match="strategy"):
        lm.reference("copy")


def test_restored_on_error_and_invisible_to_other_threads():
    lm = load_model("tiny:llama", "bfloat16", DEVICE)
    snap = _snapshot(lm.model)
    streamed = lm.reference("streamed")
    seen = {}

    def other():
        seen["dtype"] = lm.model.dtype
        seen["param"] = next(lm.model.parameters()).dtype

    with pytest.raises(RuntimeError, match="boom"):
        with Executor(streamed).session() as ex:
            assert lm.model.dtype == torch.float64  # inside the run, the model reads as float64 (as the twin)
            t = threading.Thread(target=other)
            t.start()
            t.join()
            ex.forward(torch.tensor([[1, 5, 9]]), use_cache=False)
            raise RuntimeError("boom")
    assert seen == {"dtype": torch.bfloat16, "param": torch.bfloat16}
    assert lm.model.dtype == torch.bfloat16
    assert not torch.overrides._get_current_function_mode_stack()
    _unchanged(lm.model, snap)
    with Executor(lm).session() as ex:  # the model itself still runs in its own dtype
        assert ex.forward(torch.tensor([[1, 5, 9]]), use_cache=False).logits.dtype == torch.bfloat16


@pytest.mark.slow
def test_default_model_streamed_equals_twin():
    from kvviz.views.greedy.run import GreedyConfig, run_greedy
    from kvviz.core.inputs import build_inputs
    from kvviz.views.split.run import SplitConfig, _run

    lm = load_model("default", "float32", DEVICE)
    twin, streamed = _refs(lm)
    prompt = "The capital of France is Paris, and the capital of Italy is"
    for mode in ("chunk", "step"):
        cfg = SplitConfig(prompt, split=6, mode=mode)
        a = _run(twin, cfg, build_inputs(twin, prompt, 0), lambda f, m: None)
        b = _run(streamed, cfg, build_inputs(streamed, prompt, 0), lambda f, m: None)
        _same(a.to_dict(), b.to_dict())
    cfg = dict(prompt=prompt, max_new_tokens=4, paths=("cache", "float64"))
    _same(run_greedy(lm, GreedyConfig(**cfg), reference=twin).to_dict(),
          run_greedy(lm, GreedyConfig(**cfg), reference=streamed).to_dict())


def test_a_small_model_s_weights_are_upcast_once_a_large_one_s_every_forward(monkeypatch):
    """The streamed reference keeps upcast weights from run to run where the float64 copy is small
    (kvviz.core.memory.stream_keep_bytes), so one-token steps cost what the twin's do; with no room, every forward upcasts
    again. Either way the numbers are the same, bit for bit."""
    from kvviz.core import reference

    lm = load_model("tiny:llama", "float32", DEVICE)
    ref = lm.reference("streamed")
    n_params = len({id(p) for p in lm.model.parameters()})
    upcasts = []
    real = reference.StreamedFloat64._value

    def counting(self, t, src):
        if not isinstance(src, torch.Tensor) and t.dtype.is_floating_point and id(t) not in self.kept:
            upcasts.append(id(t))
        return real(self, t, src)

    monkeypatch.setattr(reference.StreamedFloat64, "_value", counting)
    ids = torch.tensor([lm.tokenizer(PROMPT)["input_ids"]], device=lm.device)

    def two_forwards():
        upcasts.clear()
        ex = Executor(ref)
        with ex.session():
            out = [ex.forward(ids[:, :-1]), ex.forward(ids[:, -1:], cache=None)]
        return [o.logits for o in out]

    assert ref.stream64.keep_bytes >= 8 * sum(p.numel() for p in lm.model.parameters())
    monkeypatch.setattr(ref.stream64, "kept", {})  # as on its first run (earlier tests ran this reference)
    kept = two_forwards()
    assert 0 < len(set(upcasts)) == len(upcasts) <= n_params  # each weight once, however many forwards
    again = two_forwards()  # a later run reuses them: no upcast at all
    assert upcasts == [] and all(torch.equal(a, b) for a, b in zip(kept, again))
    monkeypatch.setattr(ref.stream64, "keep_bytes", 0)
    monkeypatch.setattr(ref.stream64, "kept", {})
    streamed = two_forwards()
    assert len(upcasts) > len(set(upcasts))  # no room: upcast again on the second forward
    assert all(torch.equal(a, b) for a, b in zip(kept, streamed))


def test_a_large_bfloat16_model_reads_only_the_rows_it_needs_from_the_checkpoint(monkeypatch):
    """Where nothing is kept (a model whose float64 copy is large) and the loaded weights are rounded, the embedding
    lookup reads only the looked-up rows from the checkpoint and a large head is applied in slices read from it; the
    numbers are still the float32 checkpoint's, bit for bit, and no whole table is read."""
    from kvviz.core import float64, reference

    # tiny:gemma3's head in slices of 16 rows - in every float64 run, the twin's included (kvviz.core.float64.head_slice_rows)
    monkeypatch.setattr(float64, "REFERENCE_CHUNK_BYTES", 8 * 64 * 16)
    lm = load_model("tiny:gemma3", "bfloat16", DEVICE)
    ref = lm.reference("streamed")
    monkeypatch.setattr(ref.stream64, "keep_bytes", 0)
    monkeypatch.setattr(ref.stream64, "kept", {})
    embed = lm.model.get_input_embeddings().weight
    reads = []
    real = reference.CheckpointReader._read

    def counting(self, offset, shape, dtype):
        reads.append(shape)
        return real(self, offset, shape, dtype)

    monkeypatch.setattr(reference.CheckpointReader, "_read", counting)
    ids = lm.tokenizer(PROMPT, return_tensors="pt").input_ids.to(lm.device)
    with Executor(ref).session() as ex:
        a = ex.forward(ids, use_cache=False)
    with Executor(load_model("tiny:gemma3", "float32", DEVICE).reference("twin")).session() as ex:
        b = ex.forward(ids, use_cache=False)
    assert torch.equal(a.logits, b.logits.to(a.logits.device))
    _same(list(a.hidden_states), list(b.hidden_states))
    assert reads and max(s[0] for s in reads if len(s) == 2 and s[1] == embed.shape[1]) <= 16  # never the table
