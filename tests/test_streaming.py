"""Hidden states reduced layer by layer as a forward produces them (kvviz.streaming): the same numbers as the
all-at-once reduction, and never more than one path's layers held."""
import weakref

import numpy as np
import pytest
import torch

import kvviz
from kvviz import execution, split
from kvviz.dtypes import machine_eps
from kvviz.execution import Executor
from kvviz.inputs import build_inputs
from kvviz.metrics import hidden_divergence
from kvviz.reference import reference_model
from kvviz.split import SplitConfig, run_split
from kvviz.streaming import decoder_layers

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
            got = ex.forward(inp.ids[:, a0:], inp.mask, inp.positions[:, a0:], pre.past_key_values)
            got_h = torch.stack([h[0] for h in got.hidden_states])
        else:
            cache, hs = pre.past_key_values, []
            for j in range(a0, inp.total):
                out = ex.forward(inp.ids[:, j:j + 1], inp.mask[:, :j + 1], inp.positions[:, j:j + 1], cache)
                cache = out.past_key_values
                hs.append(torch.stack([h[0, -1] for h in out.hidden_states]))
            got_h = torch.stack(hs, dim=1)
        hd = hidden_divergence(ref, got_h, machine_eps(m.dtype))
    return {k: v.cpu().numpy() for k, v in hd.items()}


@pytest.mark.parametrize("mode", ["chunk", "step"])
@pytest.mark.parametrize("arch", ARCHS)
def test_reduced_per_layer_equals_all_at_once(arch, mode):
    """bfloat16 (gaps of every size) and a prompt past the window of the sliding-window models: every metric of
    every layer and position bit for bit equal to the stacked reduction."""
    m = lm(arch, "bfloat16")
    cfg = SplitConfig(PROMPT * 2, split=20, mode=mode)
    comp = split._run(m, cfg, build_inputs(m, cfg.prompt, cfg.left_pad), lambda f, msg: None)
    old = all_at_once(m, cfg)
    assert set(comp.hidden) == set(old)
    for name, want in old.items():
        assert comp.hidden[name].dtype == want.dtype
        np.testing.assert_array_equal(comp.hidden[name], want, err_msg=name)
    assert comp.hidden["max_abs"].shape == (m.n_layers + 1, len(build_inputs(m, cfg.prompt).ids[0]) - 20)
    if arch in ("llama", "mistral"):  # real gaps here: the test compares numbers, not only zeros
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
    execution.STREAM_HIDDEN[0] = False
    try:
        off = run_split(m, cfg, prove=True).to_dict()
    finally:
        execution.STREAM_HIDDEN[0] = True
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
    execution.STREAM_HIDDEN[0] = False
    try:
        old_peak, _ = _live_layer_outputs(m, run)
    finally:
        execution.STREAM_HIDDEN[0] = True
    assert old_peak == n_layers
    assert [len(layer._forward_hooks) for layer in decoder_layers(m.model)] == hooks  # ours all removed


def test_held_path_is_the_compared_rows_only():
    """The held reference: n_hidden copies of the compared positions, nothing of the prefix's positions."""
    from kvviz.streaming import HeldRows

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
