"""The one way kvviz captures what a model's modules see and return: hooks on named modules, every one removed on exit.

    with capture(model, ["model.layers.0", "model.norm"], on_output=keep) as cap:
        model(ids)          # keep(name, module, args, output) after each of those modules returns

Every caller that looks inside a forward goes through here: the bisector (every module, and the op trace's module
stack), the streamed hidden states (each decoder layer), the float64 allocator release (before each layer), the
streamed float64 reference (the model's own call), the cancellation checkpoints (before each layer and each module
inside one), and the vLLM worker's layer capture (in vLLM's own process: it loads this very file by its path,
kvviz/engines/vllm_worker.py). So it imports nothing of kvviz and nothing heavy (not even torch: it only calls the
modules' own `register_forward_hook` / `register_forward_pre_hook`).

Names are the model's own module paths (`model.named_modules()`, kvviz.core.naming's "model.layers.{k-1}" for row k),
"" for the model itself; or (key, module) pairs, whose key the callback gets in place of a path (a label, an index).
A callback gets the name first, then what torch hands a hook: on_input(name, module, args) or, with kwargs,
(name, module, args, kwargs); on_output(name, module, args, output) or (name, module, args, kwargs, output). A
callback that returns a value replaces the input or output, as a torch hook's does.

Costs: one `functools.partial` (C) per hooked call on top of the hook itself; names are resolved once, on entry.
The hooks are removed when the block ends, also on an error or a cancellation raised inside it (or inside a hook),
and when registering fails halfway; `remove()` ends them early (a capture held across calls, as the vLLM worker's).
"""
from __future__ import annotations

import functools

__all__ = ["Capture", "capture", "named"]


def named(model, names=None) -> list:
    """(name, module) pairs: None -> every module of `model` ("" for the model itself), in `named_modules()` order;
    a str -> that module path ("" the model itself); a module -> itself, a container of modules (a ModuleList, a
    Sequential) -> its modules; else an iterable of paths, modules or (key, module) pairs (a bare
    module gets the key None)."""
    if names is None:
        return list(model.named_modules())
    if isinstance(names, str) or not hasattr(names, "__iter__"):  # one path, or one module (not a ModuleList)
        names = (names,)
    out = []
    for item in names:
        if isinstance(item, str):
            out.append((item, model if item == "" else model.get_submodule(item)))
        elif isinstance(item, tuple):
            out.append(item)
        else:
            out.append((None, item))
    return out


class Capture:
    """Hooks registered through on_input / on_output, all removed by remove() or on leaving `with` (also on error).
    `model` resolves string names; None where only modules or (key, module) pairs are given."""

    __slots__ = ("model", "handles")

    def __init__(self, model=None):
        self.model = model
        self.handles: list = []

    def on_input(self, names, fn, *, with_kwargs: bool = False) -> "Capture":
        """fn(name, module, args[, kwargs]) before each of `names` runs (a forward pre-hook)."""
        try:
            for key, mod in named(self.model, names):
                hook = functools.partial(fn, key)
                self.handles.append(mod.register_forward_pre_hook(hook, with_kwargs=with_kwargs))
        except BaseException:
            self.remove()
            raise
        return self

    def on_output(self, names, fn, *, with_kwargs: bool = False, always_call: bool = False) -> "Capture":
        """fn(name, module, args[, kwargs], output) after each of `names` returns (a forward hook); always_call: also
        when the module raises (torch's always_call)."""
        kw = {"always_call": True} if always_call else {}
        try:
            for key, mod in named(self.model, names):
                hook = functools.partial(fn, key)
                self.handles.append(mod.register_forward_hook(hook, with_kwargs=with_kwargs, **kw))
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Remove every hook of this capture (again: nothing)."""
        handles, self.handles = self.handles, []
        for h in handles:
            h.remove()

    def __len__(self) -> int:
        return len(self.handles)

    def __enter__(self) -> "Capture":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def capture(model, names=None, *, on_input=None, on_output=None, with_kwargs: bool = False,
            always_call: bool = False) -> Capture:
    """A Capture of `names` (see `named`) with on_input before and/or on_output after each; use it as a context
    manager (the hooks go when the block ends, also on error) or keep it and call remove()."""
    cap = Capture(model)
    names = named(model, names)  # resolved once (a generator of pairs is read once)
    if on_input is not None:
        cap.on_input(names, on_input, with_kwargs=with_kwargs)
    if on_output is not None:
        cap.on_output(names, on_output, with_kwargs=with_kwargs, always_call=always_call)
    return cap
