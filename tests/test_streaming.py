"""Hidden states reduced layer by layer as a forward produces them (kvviz.core.streaming): the same numbers as the
all-at-once reduction, and never more than one path's layers held."""
import weakref

import numpy as np
import pytest

from kvviz.models.compat import output_cache
import torch

import kvviz
from kvviz.core import execution
from kvviz.views.split import run as split
from kvviz.core.dtypes import machine_eps
from kvviz.core.execution import Executor
from kvviz.core.inputs import build_inputs
from kvviz.core.metrics import hidden_divergence
from kvviz.core.reference import reference_model
from kvviz.views.split.run import SplitConfig, run_split
from kvviz.core.streaming import decoder_layers

from conftest import DEVICE, PROMPT

# full attention, sliding windows (mistral: every layer; gemma2/gemma3: mixed), other layer classes, a tie
ARCHS = ["llama", "mistral", "gemma2", "gemma3", "gpt2", "gpt_neox", "tie"]


def lm(arch, dtype="float32"):
    return kvviz.load_model(f"tiny:{arch}", dtype, DEVICE)


def all_at_once(m, cfg: SplitConfig) -> dict[str, np.ndarray]:
    """The hidden-state gaps as split computed them before: both paths return every layer's hidden states
    (output_hidden_states=True), stacked [n_hidden, n_rest, H], then one hidden_divergence over the stack."""
    inp = build_inputs(m, cfg.prompt, cfg.left_pad)
    a0 = inp.pad + cfg.split
    ex = Executor(m, max_len=inp.total)
    with ex.session():
        pre = ex.forward(inp.ids[:, :a0], inp.mask[:, :a0], inp.positions[:, :a0], hidden=False)
        full = ex.forward(inp.ids, inp.mask, inp.positions)
        ref = torch.stack([h[0, a0:] for h in full.hidden_states])
        del full
        if cfg.mode == "chunk":
            got = ex.forward(inp.ids[:, a0:], inp.mask, inp.positions[:, a0:], output_cache(pre))
            got_h = torch.stack([h[0] for h in got.hidden_states])
        else:
            cache, hs = output_cache(pre), []
            for j in range(a0, inp.total):
                out = ex.forward(inp.ids[:, j:j + 1], inp.mask[:, :j + 1], inp.positions[:, j:j + 1], cache)
                cache = output_cache(out)
                hs.append(torch.stack([h[0, -1] for h in out.hidden_states]))
            got_h = torch.stack(hs, dim=1)
        hd = hidden_divergence(ref, got_h, machine_eps(m.dtype))
    return {k: v.cpu().numpy() for k, v in hd.items()}


@pytest.mark.parametrize("mode", ["chunk", "step"])
@pytest.mark.parametrize("arch", ARCHS)
def test_reduced_per_layer_equals_all_at_once(arch, mode, row_count_rounding):
    """bfloat16 (gaps of every size: built by a row-count-dependent linear layer, so on any CPU or GPU) and a prompt
    past the window of the sliding-window models: every metric of every layer and position bit for bit equal to the
    stacked reduction."""
    m = lm(arch, "bfloat16")
    cfg = SplitConfig(PROMPT * 2, split=20, mode=mode)
    comp = split._run(m, cfg, build_inputs(m, cfg.prompt, cfg.left_pad), lambda f, msg: None)
    old = all_at_once(m, cfg)
    assert set(comp.hidden) == set(old)
    for name, want in old.items():
        assert comp.hidden[name].dtype == want.dtype
        np.testing.assert_array_equal(comp.hidden[name], want, err_msg=name)
    assert comp.hidden["max_abs"].shape == (m.n_layers + 1, len(build_inputs(m, cfg.prompt).ids[0]) - 20)
    if arch != "gpt2":  # real gaps (gpt2's Conv1D layers are not F.linear): numbers compared, not only zeros
        assert comp.hidden["max_abs"].max() > 0


def test_streamed_float64_reference_reduced_per_layer_equals_all_at_once():
    """The hooks run inside the streamed float64 reference's forward (its torch function mode): same numbers."""
    ref = reference_model(lm("llama", "bfloat16"), "streamed")
    assert ref.stream64 is not None
    for mode in ("chunk", "step"):
        cfg = SplitConfig(PROMPT, split=9, mode=mode, left_pad=2)
        comp = split._run(ref, cfg, build_inputs(ref, cfg.prompt, cfg.left_pad), lambda f, msg: None)
        for name, want in all_at_once(ref, cfg).items():
            np.testing.assert_array_equal(comp.hidden[name], want, err_msg=f"{mode} {name}")


def test_hooks_and_after_the_forward_give_the_same_result():
    """The whole split result (float64 evidence and invariant proof included) with the hooks on and with every
    hidden state reduced after its forward returns."""
    m = lm("gemma3", "bfloat16")
    cfg = SplitConfig(PROMPT * 2, split=17, mode="step")
    on = run_split(m, cfg, prove=True).to_dict()
    with execution.hidden_all_at_once():
        off = run_split(m, cfg, prove=True).to_dict()
    for key in ("result", "float64_evidence", "invariant_check"):
        assert on[key]["hidden"] == off[key]["hidden"], key
        assert on[key]["logits"] == off[key]["logits"], key
    assert on["verdict"] == off["verdict"]


def _live_layer_outputs(m, run) -> tuple[int, int]:
    """Run `run()` while counting the decoder layers' outputs still alive when each layer returns: (the most alive
    at once, decoder layers). (The first layer's input, the embeddings, is left out: the model's own forward keeps
    it to the end.) Test hooks, removed after."""
    seen: list[weakref.ref] = []
    peak = [0]

    def count(module, args, output):
        seen.append(weakref.ref(output[0] if isinstance(output, tuple) else output))
        peak[0] = max(peak[0], sum(1 for r in seen if r() is not None))

    layers = decoder_layers(m.model)
    handles = [layer.register_forward_hook(count) for layer in layers]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return peak[0], len(layers)


@pytest.mark.parametrize("mode", ["chunk", "step"])
def test_never_more_than_two_layers_of_a_forward_alive(mode):
    """A whole split run (the full forward held, the cached path compared): when any layer returns, at most two
    layer outputs exist (the one just made and its input) - the held path keeps copies of the compared rows only.
    Reduced after the forward instead, every layer of the forward is alive at its end (the count works)."""
    m = lm("llama")
    execution.Executor(m).forward(torch.tensor([[1, 2, 3]]), hidden=True)  # transformers' recorder installed
    hooks = [len(layer._forward_hooks) for layer in decoder_layers(m.model)]
    cfg = SplitConfig(PROMPT, split=11, mode=mode)
    inp = build_inputs(m, cfg.prompt)

    def run():
        split._run(m, cfg, inp, lambda f, msg: None)

    peak, n_layers = _live_layer_outputs(m, run)
    assert n_layers == 4
    assert peak <= 2
    with execution.hidden_all_at_once():
        old_peak, _ = _live_layer_outputs(m, run)
    assert old_peak == n_layers
    assert [len(layer._forward_hooks) for layer in decoder_layers(m.model)] == hooks  # ours all removed


def test_held_path_is_the_compared_rows_only():
    """The held reference: n_hidden copies of the compared positions, nothing of the prefix's positions."""
    from kvviz.core.streaming import HeldRows

    m = lm("llama", "float32")
    inp = build_inputs(m, PROMPT)
    held = HeldRows(lambda h: h[0, 11:])
    ex = Executor(m, max_len=inp.total)
    with ex.session():
        out = ex.forward(inp.ids, inp.mask, inp.positions, hidden=held)
    assert out.hidden_states is None
    assert len(held) == m.n_layers + 1
    H = m.model.config.hidden_size
    assert held.nbytes == (m.n_layers + 1) * (inp.total - 11) * H * 4


def test_a_sink_error_removes_the_hooks():
    m = lm("llama")
    layers = decoder_layers(m.model)
    before = [dict(layer._forward_hooks) for layer in layers]

    def boom(i, h):
        if i == 2:
            raise RuntimeError("sink failed")

    ex = Executor(m)
    with ex.session(), pytest.raises(RuntimeError, match="sink failed"):
        ex.forward(torch.tensor([[5, 6, 7, 8]]), hidden=boom)
    assert [dict(layer._forward_hooks) for layer in layers] == before


# ------------------------------------------------------------------------------------------------------------------
# Padding and batching: each scenario's hidden states compared with the held reference layer by layer


def _padding_all_at_once(m, ids, comp_ids, k, left_pad) -> dict:
    """Padding's hidden-state numbers as computed before: every layer of the reference and of each scenario
    stacked, one hidden_divergence, torch.equal on the stacks."""
    from kvviz.views.padding import run as padding
    from kvviz.models.compat import takes_logits_to_keep

    eps = machine_eps(m.dtype)
    ex = Executor(m, max_len=max(len(c) for c in comp_ids + [ids]) + left_pad)
    out = {}
    with ex.session():
        ref = ex.forward(torch.tensor([ids]), use_cache=False)
        ref_h = torch.stack([h[0, k:] for h in ref.hidden_states])
        for placement in [p for p in padding.PLACEMENTS if p != "left-padded" or left_pad > 0]:
            rows = [ids] + (comp_ids if placement == "in a batch" else [])
            extra = left_pad if placement == "left-padded" else 0
            for label, use_cache, pm, mm in padding.SCENARIOS:
                b_ids, mask, pos, pad = padding._batch(m, rows, 0, extra)
                c = pad + k
                if not use_cache:
                    o = ex.forward(b_ids, mask, pos, use_cache=False)
                    h = torch.stack([x[0, c:] for x in o.hidden_states])
                else:
                    keep = 1 if takes_logits_to_keep(m.model) else None
                    pre = ex.forward(b_ids[:, :c], mask[:, :c], pos[:, :c], hidden=False, logits_to_keep=keep)
                    o = ex.forward(b_ids[:, c:], mask if mm == "full" else mask[:, c:],
                                   pos[:, c:] if pm == "auto" else None, output_cache(pre))
                    h = torch.stack([x[0] for x in o.hidden_states])
                hd = hidden_divergence(ref_h, h, eps)
                out[(placement, label)] = (float(hd["relative"].max()), float(hd["max_abs"].max()),
                                           torch.equal(h, ref_h))
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3", "tie"])
def test_padding_cells_reduced_per_layer_equal_all_at_once(arch):
    from kvviz.views.padding import run as padding
    from kvviz.core.execution import DEFAULT_SETTINGS

    m = lm(arch, "bfloat16")
    ids = padding.encode(m, PROMPT)
    comp_ids = padding.companion_ids(m, ids, None, 3)
    k = len(ids) // 2
    new = padding._padding_cells(m, DEFAULT_SETTINGS, ids, comp_ids, k, 3)
    old = _padding_all_at_once(m, ids, comp_ids, k, 3)
    assert new.keys() == old.keys() and len(new) == 15
    for key, (rel, max_abs, equal) in old.items():
        cell = new[key]
        assert (cell["hidden_relative"], cell["hidden_max_abs"]) == (rel, max_abs), key
        assert cell["bitwise_equal"] == (equal and cell["logits_max_abs"] == 0), key
    if arch == "llama":  # real gaps somewhere, and some cells exactly equal
        assert any(c["hidden_max_abs"] > 0 for c in new.values())
        assert any(c["bitwise_equal"] for c in new.values())


# ------------------------------------------------------------------------------------------------------------------
# Decoding (greedy's paths, quant's runs): only the last position of each layer is kept per forward


@pytest.mark.parametrize("policy", ["no_cache", "cache", "user_loop"])
def test_decode_keeps_the_same_last_rows(policy):
    """Executor.decode (each forward keeps its layers' last position as they come) gives exactly the tokens,
    logits and hidden rows of the same loop over forwards returning every hidden state."""
    from kvviz.core import loops

    m = lm("gemma3", "bfloat16")
    inp = build_inputs(m, PROMPT * 2, extra_tokens=6)
    ex = Executor(m, max_len=inp.total + 6)
    with ex.session():
        new = ex.decode(inp.ids, inp.mask, 6, policy=policy, positions=inp.positions)
        toks, logits, hidden, _ = loops.decode(ex._caller(), inp.ids, inp.mask, 6, policy, inp.positions)
    assert new.tokens == toks
    assert all(torch.equal(a, b) for a, b in zip(new.logits, logits))
    assert len(new.hidden) == len(hidden) == 6
    assert all(torch.equal(a, b) for a, b in zip(new.hidden, hidden))
    assert new.hidden[0].shape == (m.n_layers + 1, m.model.config.hidden_size)


@pytest.mark.parametrize("fresh", [False, True])
def test_no_cache_decode_never_holds_every_layer(fresh):
    """fresh: a model fresh from its files. transformers installs its hidden-state recorder's hooks in a model's
    first forward that records them; the stream's hooks are attached before that forward, so without installing
    the recorder's first (compat.install_output_recorder) they ran before it and the first forward kept a third layer
    output alive (which test ran first in a pytest-xdist worker decided whether the warm case saw a fresh model)."""
    from kvviz.models.loading import clear_cache

    if fresh:
        clear_cache()
    m = lm("llama")
    installed = any(getattr(mod, "_output_capturing_hooks_installed", False) for mod in m.model.modules())
    assert not (fresh and installed)
    inp = build_inputs(m, PROMPT, extra_tokens=4)

    def run():
        ex = Executor(m, max_len=inp.total + 4)
        with ex.session():
            ex.decode(inp.ids, inp.mask, 4, policy="no_cache", positions=inp.positions)

    peak, n_layers = _live_layer_outputs(m, run)
    assert peak <= 2 < n_layers


def test_greedy_fast_preview_rows_equal_all_at_once():
    """The fast no-cache preview's teacher-forced forward keeps only the steps' rows of each layer: they are the
    rows of the same forward returning every hidden state."""
    from kvviz.views.greedy.run import StepRecorder, _cache, _fast_no_cache
    from kvviz.core.inputs import positions_from_mask

    m = lm("llama", "bfloat16")
    inp = build_inputs(m, PROMPT, extra_tokens=6)
    ex = Executor(m, max_len=inp.total + 6)
    with ex.session():
        rec = StepRecorder("cache", 6, lambda: None)
        _cache(ex, inp, 6, rec)
        guide = rec.done()
        fast = _fast_no_cache(ex, inp, 6, StepRecorder("no_cache", 6, lambda: None), guide)
        ids = torch.cat([inp.ids, torch.tensor([guide.token_ids[:5]], device=inp.ids.device)], 1)
        mask = torch.ones_like(ids)
        out = ex.forward(ids, mask, positions_from_mask(mask), use_cache=False)
    start = inp.ids.shape[1] - 1
    want = torch.stack([h[0, start:start + 6] for h in out.hidden_states], 1)
    div = next((t for t, (a, b) in enumerate(zip(fast.token_ids, guide.token_ids)) if a != b), 5)
    assert fast.hidden.shape[1:] == want.shape[1:]
    assert torch.equal(fast.hidden[:div + 1], want[:div + 1])


def test_generate_keeps_the_same_last_rows():
    """Executor.generate keeps each step's last position of each layer as they come: the rows are those of
    model.generate returning every hidden state; the prefill never holds every layer at once."""
    from transformers import GenerationConfig

    m = lm("gemma3", "bfloat16")
    inp = build_inputs(m, PROMPT * 2, extra_tokens=5)
    ex = Executor(m)
    with ex.session():
        new = ex.generate(inp.ids, inp.mask, 5, 0)
        gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=5, min_new_tokens=0, eos_token_id=[],
                              pad_token_id=0, output_logits=True, output_hidden_states=True,
                              return_dict_in_generate=True, use_cache=True)
        old = m.model.generate(input_ids=inp.ids, attention_mask=inp.mask, generation_config=gc,
                               disable_compile=True)
    assert torch.equal(new.sequences, old.sequences)
    assert len(new.hidden_states) == len(old.hidden_states) == 5
    for a, b in zip(new.hidden_states, old.hidden_states):
        assert len(a) == len(b) == m.n_layers + 1
        assert all(x.shape[1] == 1 and torch.equal(x[0, -1], y[0, -1]) for x, y in zip(a, b))

    def run():
        with ex.session():
            ex.generate(inp.ids, inp.mask, 3, 0)

    peak, n_layers = _live_layer_outputs(m, run)
    assert peak <= 2 < n_layers


def test_kv_cache_round_trip_gap_equals_all_at_once(tmp_path):
    """The KV cache view's continuation: a reloaded cache whose values were nudged gives the same hidden-state gap
    (and bit-for-bit flag) as both forwards' stacked hidden states."""
    from kvviz.core.execution import cache_layers
    from kvviz.views.cache.run import continue_and_compare, load_cache, prefill, save_cache

    m = lm("mistral", "bfloat16")
    save_cache(m, PROMPT * 2, tmp_path / "c.safetensors")
    loaded = load_cache(m, tmp_path / "c.safetensors")
    for keys, values in cache_layers(loaded.cache):
        values.mul_(1.0 + 2.0 ** -6)  # a reloaded cache that is not quite the fresh one
    cont = m.tokenizer(" and then some", add_special_tokens=False)["input_ids"]
    n = len(loaded.token_ids)
    ids = torch.tensor([cont])
    mask = torch.ones((1, n + len(cont)), dtype=torch.long)
    pos = torch.arange(n, n + len(cont))[None]
    import copy

    ex = Executor(m)
    with ex.session():
        a = ex.forward(ids, mask, pos, copy.deepcopy(loaded.cache))
        b = ex.forward(ids, mask, pos, prefill(m, loaded.token_ids))
    ha, hb = torch.stack(a.hidden_states), torch.stack(b.hidden_states)
    want = float((ha.double() - hb.double()).abs().max())
    res = continue_and_compare(m, loaded, " and then some")
    assert want > 0 and res.max_abs_hidden == want and not res.bitwise_equal


def _live_tensors() -> int:
    import gc
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_token_by_token_comparison_keeps_nothing_per_step():
    """Compared token by token, a step's per-layer gaps go into matrices allocated once: no tensor made during a
    forward outlives it. (They used to be kept as small tensors per step and layer; made in the middle of each
    forward, among the float64 reference's large temporaries, they fragmented glibc's heap: the cache-safety card
    of a 270M model grew ~70 MB a step, 5.2 GB instead of 2.8 - docs/benchmarks.md.)"""
    from kvviz.core.streaming import HeldRows, LayerGaps

    m = lm("llama", "float32")
    inp = build_inputs(m, PROMPT)
    a0 = 11
    ex = Executor(m, max_len=inp.total)
    with ex.session():
        pre = ex.forward(inp.ids[:, :a0], inp.mask[:, :a0], inp.positions[:, :a0], hidden=False)
        held = HeldRows(lambda h: h[0, a0:])
        ex.forward(inp.ids, inp.mask, inp.positions, hidden=held)
        gaps = LayerGaps(held, machine_eps(m.dtype))
        sink = gaps.stepping(lambda h: h[0, -1:])
        cache, counts = output_cache(pre), {}
        for j in range(a0, inp.total):
            out = ex.forward(inp.ids[:, j:j + 1], inp.mask[:, :j + 1], inp.positions[:, j:j + 1], cache,
                             hidden=sink)
            cache = output_cache(out)
            del out
            if j in (a0 + 1, inp.total - 1):  # counted where compared (a count walks every object of the process)
                counts[j - a0 + 1] = _live_tensors()
    assert inp.total - a0 >= 6
    # the same tensors alive after step 2 as after the last one
    assert counts[inp.total - a0] == counts[2], f"tensors alive after step: {counts}"
    hd = gaps.matrices()
    assert hd["max_abs"].shape == (m.n_layers + 1, inp.total - a0)
    assert torch.isfinite(hd["relative"]).all()
    ref = all_at_once(m, SplitConfig(PROMPT, split=a0, mode="step"))
    assert np.array_equal(hd["max_abs"].numpy(), ref["max_abs"])


def test_a_partly_compared_layer_is_an_error():
    from kvviz.core.errors import KvvizError
    from kvviz.core.streaming import HeldRows, LayerGaps

    held = HeldRows(lambda h: h[0])
    for i in range(3):
        held(i, torch.ones(1, 4, 8))
    gaps = LayerGaps(held, 1e-7)
    sink = gaps.sink(lambda h: h[0, :2], slice(0, 2))
    for i in range(3):
        sink(i, torch.ones(1, 2, 8))
    with pytest.raises(KvvizError, match="compared at"):
        gaps.matrices()
    sink2 = gaps.sink(lambda h: h[0, :2], slice(2, 4))
    for i in range(3):
        sink2(i, torch.full((1, 2, 8), 2.0))
    hd = gaps.matrices()
    assert hd["max_abs"].tolist() == [[0.0, 0.0, 1.0, 1.0]] * 3
