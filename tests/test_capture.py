"""Issue 52 item 4: one capture module (kvviz/core/capture.py). What it hands a callback is what the model computed (the
same bits as output_hidden_states), and every hook it registered is gone when its block ends - normally, on an error
raised inside the block or inside a hook, on a cancellation, and when registering fails halfway."""
import ast

import pytest
import torch

import kvviz
from kvviz.core import cancel
from kvviz.core.capture import Capture, capture, named
from kvviz.core.execution import Executor
from kvviz.core.streaming import decoder_layers

from conftest import ROOT, PROMPT


@pytest.fixture(scope="module")
def lm():
    return kvviz.load_model("tiny:llama", "float32", "cpu")


def _hooks(model) -> dict:
    """Every module's forward hooks, pre-hooks (with their kwargs flags) and always-called hooks, by module path."""
    return {name: (list(m._forward_hooks), list(m._forward_pre_hooks), list(m._forward_hooks_with_kwargs),
                   list(m._forward_pre_hooks_with_kwargs), list(m._forward_hooks_always_called))
            for name, m in model.named_modules()}


def _ids(lm):
    return lm.tokenizer(PROMPT, return_tensors="pt")["input_ids"]


def test_names_are_module_paths_and_outputs_are_the_hidden_states(lm):
    """Module paths (kvviz.core.naming's "model.layers.{k-1}" is row k), "" the model itself: each callback gets its
    name first; a decoder layer's output is hidden state k bit for bit, the final norm's the last one."""
    model = lm.model
    ids = _ids(lm)
    with torch.no_grad():
        want = model(ids, output_hidden_states=True).hidden_states
    before = _hooks(model)  # (transformers' own recorder hooks are installed by the first call that records)
    n = len(decoder_layers(model))
    paths = [f"model.layers.{i}" for i in range(n)] + ["model.norm"]
    seen, outs, calls = [], {}, []
    with capture(model, paths, on_input=lambda name, mod, args: seen.append(name),
                 on_output=lambda name, mod, args, out: outs.__setitem__(name, out[0] if isinstance(out, tuple)
                                                                         else out)) as cap:
        assert len(cap) == 2 * len(paths)
        with Capture(model).on_input("", lambda name, mod, args, kwargs: calls.append((name, sorted(kwargs))),
                                     with_kwargs=True):
            with torch.no_grad():
                model(ids)
    assert seen == paths  # in the order the forward ran them, once each
    assert calls == [("", [])]
    assert len(want) == n + 1
    for i in range(n - 1):
        assert torch.equal(outs[f"model.layers.{i}"], want[i + 1])
    assert torch.equal(outs["model.norm"], want[n])  # the last hidden state is taken after the final norm
    assert _hooks(model) == before


def test_keys_modules_and_containers(lm):
    """(key, module) pairs hand their key (an index, a label); a ModuleList stands for its modules; None is every
    module, the model itself first as ""."""
    model = lm.model
    layers = decoder_layers(model)
    assert [k for k, _ in named(model, enumerate(layers))] == list(range(len(layers)))
    assert [m for _, m in named(model, layers)] == list(layers)
    assert named(model, layers[0]) == [(None, layers[0])]
    every = named(model)
    assert every[0] == ("", model) and len(every) == len(list(model.modules()))
    got = []
    with capture(model, enumerate(layers), on_output=lambda i, mod, args, out: got.append(i)):
        with torch.no_grad():
            model(_ids(lm))
    assert got == list(range(len(layers)))


def test_every_hook_is_removed_after_an_error_in_the_block_or_in_a_hook(lm):
    model = lm.model
    before = _hooks(model)
    with pytest.raises(RuntimeError, match="in the block"):
        with capture(model, None, on_input=lambda *a: None, on_output=lambda *a: None, with_kwargs=True):
            assert _hooks(model) != before
            raise RuntimeError("in the block")
    assert _hooks(model) == before

    def boom(name, mod, args, out):
        raise ValueError(f"hook of {name}")

    ended = []
    with pytest.raises(ValueError, match="hook of model.layers.1"):
        with capture(model, ["model.layers.1"], on_output=boom), \
                capture(model, "", on_output=lambda name, *a: ended.append(name), always_call=True):
            with torch.no_grad():
                model(_ids(lm))
    assert ended == [""]  # always_call: the model's own hook ran although its forward raised
    assert _hooks(model) == before


def test_a_failed_registration_leaves_no_hook(lm):
    model = lm.model
    before = _hooks(model)
    with pytest.raises(AttributeError):
        capture(model, ["model.layers.0", "model.no_such_module"], on_output=lambda *a: None)
    assert _hooks(model) == before
    cap = Capture(model).on_input(["model.layers.0"], lambda *a: None)
    with pytest.raises(AttributeError):
        cap.on_output(["model.norm", "model.nope"], lambda *a: None)
    assert len(cap) == 0 and _hooks(model) == before


def test_every_hook_is_removed_after_a_cancellation(lm):
    """A run stopped mid-forward (the stop token set while layer 1 runs; the cancellation checkpoints, themselves
    captures, stop it before layer 2): the checkpoints' hooks and the caller's are all gone afterwards."""
    model = lm.model
    before = _hooks(model)
    token = cancel.Token()
    ran = []

    def stop_after_first(i, mod, args, out):
        ran.append(i)
        if i == 0:
            token.cancel()

    with cancel.scope(token), pytest.raises(cancel.Cancelled):
        with Executor(lm).session() as ex:
            with capture(model, enumerate(decoder_layers(model)), on_output=stop_after_first):
                assert _hooks(model) != before
                ex.forward(_ids(lm))
    assert ran == [0] and token.where == f"layer 2 of {len(decoder_layers(model))}"  # stopped before layer 2
    assert _hooks(model) == before


def test_remove_ends_a_held_capture_early(lm):
    """A capture kept across calls (the vLLM worker's, on while a tag is set): remove() ends it, twice is nothing."""
    model = lm.model
    before = _hooks(model)
    got = []
    cap = capture(model, "model.norm", on_output=lambda name, *a: got.append(name))
    with torch.no_grad():
        model(_ids(lm))
        cap.remove()
        cap.remove()
        model(_ids(lm))
    assert got == ["model.norm"] and len(cap) == 0 and _hooks(model) == before


def test_the_module_stands_alone():
    """The vLLM worker loads this very file by its path in vLLM's environment (no kvviz there): it imports only the
    standard library, and the worker's module is this file."""
    path = ROOT / "kvviz" / "core" / "capture.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"__future__", "functools"}
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))


def test_the_vllm_worker_uses_the_same_file(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "kvviz" / "engines"))
    import vllm_worker

    assert vllm_worker.capture.__file__ is not None
    from pathlib import Path

    assert Path(vllm_worker.capture.__file__).resolve() == (ROOT / "kvviz" / "core" / "capture.py").resolve()
    assert vllm_worker.capture.Capture.__qualname__ == Capture.__qualname__
