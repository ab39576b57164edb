"""Hidden states reduced layer by layer, as a forward produces them.

Asking both forwards of a comparison (a cached run against a full forward) for every layer's hidden states
(`output_hidden_states=True`) and computing the gaps afterwards holds every layer of both paths at once. Here the
path compared against a held one hands each hidden state to a *sink* the moment it exists, and the sink reduces it
against the held path's same layer to the per-position metrics (kvviz.core.metrics.hidden_divergence), so only the
metrics are kept: at most one path's hidden states exist (the held one, only the compared positions), plus the
layer the model is computing.

How: transformers 5 records hidden states with forward hooks on the decoder layers into a list of the running
forward (reached through kvviz.models.compat); kvviz adds its own hook to each decoder layer (the longest ModuleList)
for one call. After a layer returns, every recorded hidden state but the newest (transformers replaces the last one
with the final norm's output) goes to the sink and is dropped from that list. What is left when the forward returns
goes to the sink from `out.hidden_states`, which is then cleared. The sink sees exactly the tensors
`output_hidden_states=True` returns, in order, each once - the numbers cannot differ, only when they are reduced.

Nothing of the shared model is changed beyond the hooks of one call (the caller holds the model's lock: every
forward runs inside `Executor.session()`); they are removed on exit, also on error. On a dispatched model
(accelerate) a layer's output is still on the device that holds the layer when the hook sees it, and the sink
reduces it there; only the small per-position metrics move to the CPU.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from .capture import Capture
from .errors import KvvizError

from ..models.compat import OUTPUT_COLLECTOR as _COLLECTOR  # None where this transformers has none: reduced after the forward
from ..models.compat import install_output_recorder
from .metrics import hidden_divergence

Sink = Callable[[int, torch.Tensor], None]  # (index in hidden_states, the tensor [B, T, H])


def decoder_layers(model) -> torch.nn.ModuleList | None:
    """The ModuleList of decoder layers (the longest ModuleList of the model, the first of equals)."""
    return max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=None)


class _Stream:
    def __init__(self, sink: Sink):
        self.sink = sink
        self.delivered: set[int] = set()  # indices delivered from the current forward's record
        self._seen = 0  # the record's length at the last hook (within a forward it grows a layer at a time)

    def deliver(self, i: int, t: torch.Tensor | None) -> None:
        if t is None or i in self.delivered:
            return
        self.delivered.add(i)
        self.sink(i, t)

    def hook(self, _name, module, args, output) -> None:
        coll = _COLLECTOR.get() if _COLLECTOR is not None else None
        hs = coll.get("hidden_states") if isinstance(coll, dict) else None
        if not isinstance(hs, list):
            return
        if len(hs) <= self._seen:  # not longer than at the last layer: another forward's record (generate)
            self.delivered = set()
        self._seen = len(hs)
        for i in range(len(hs) - 1):  # all but the newest (the last one is replaced by the final norm's output)
            t, hs[i] = hs[i], None
            self.deliver(i, t)  # (None: delivered already)


@contextlib.contextmanager
def hidden_hooks(model, sink: Sink, hooks: bool = True) -> Iterator[_Stream]:
    """For the duration: after each decoder layer returns, every hidden state recorded so far but the newest goes
    to `sink(index, tensor)` and is dropped from the running forward's record. The hooks are removed on exit,
    also on error. hooks=False: nothing is attached (the caller delivers from the output)."""
    stream = _Stream(sink)
    layers = decoder_layers(model) if hooks and _COLLECTOR is not None else None
    if layers:
        install_output_recorder(model)  # the recorder's hooks first: each layer records, then the stream drains
    with Capture().on_output(layers or (), stream.hook):
        yield stream


def reduced_call(model, call: Callable[[], object], sink: Sink, hooks: bool = True):
    """Run `call()` (one model call with output_hidden_states=True) with each hidden state handed to `sink(index,
    tensor)` as it is produced (hooks=False: after the forward, in order). Returns the output, its hidden_states
    cleared."""
    with hidden_hooks(model, sink, hooks) as stream:
        out = call()
    states = getattr(out, "hidden_states", None) or ()
    for i, t in enumerate(states):
        if t is not None and i in stream.delivered:  # the hooks saw another forward's recording: never mix them
            raise KvvizError("internal error: a hidden state was recorded twice; rerun with compile off")
        stream.deliver(i, t)
    del states
    if getattr(out, "hidden_states", None) is not None:
        out["hidden_states"] = None
    return out


def reduced_generate(model, generate: Callable[[], object], hooks: bool = True):
    """Run `generate()` (model.generate with output_hidden_states=True) keeping only the last position of each
    hidden state of each step, as they are produced: the output's hidden_states are then, per step, a tuple of
    [B, 1, H] rows (the rows a decoding view reads), never every layer of the prompt's prefill at once."""
    rows = _LastRowsPerForward()
    with hidden_hooks(model, rows, hooks):
        out = generate()
    states = getattr(out, "hidden_states", None)
    if states is None:
        return out
    if rows.steps and len(rows.steps) != len(states):
        raise KvvizError("internal error: hidden states recorded for another number of steps; rerun with compile "
                         "off")
    merged = []
    for t, step in enumerate(states):
        got = rows.steps[t] if rows.steps else {}
        layers = []
        for i, x in enumerate(step):
            if x is not None:
                if i in got:
                    raise KvvizError("internal error: a hidden state was recorded twice; rerun with compile off")
                layers.append(x[:, -1:].clone())
            else:
                layers.append(got[i])
        merged.append(tuple(layers))
    del states
    out["hidden_states"] = tuple(merged)
    return out


class _LastRowsPerForward:
    """The last position of each hidden state, per forward (a forward begins when hidden state 0 comes again)."""

    def __init__(self):
        self.steps: list[dict[int, torch.Tensor]] = []
        self.last: int | None = None

    def __call__(self, i: int, h: torch.Tensor) -> None:
        if self.last is None or i <= self.last:
            self.steps.append({})
        self.last = i
        self.steps[-1][i] = h[:, -1:].clone()


# ------------------------------------------------------------------------------------------------------------------
# Sinks


class HeldRows:
    """The held path: a copy of some rows of every hidden state (`select(tensor)`, e.g. the compared positions of
    row 0), so the rest of each layer's tensor is freed as the forward goes on."""

    def __init__(self, select: Callable[[torch.Tensor], torch.Tensor]):
        self.select = select
        self.layers: list[torch.Tensor | None] = []

    def __call__(self, i: int, h: torch.Tensor) -> None:
        self.layers.extend([None] * (i + 1 - len(self.layers)))
        self.layers[i] = self.select(h).clone()

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers if t is not None)


class LayerGaps:
    """Per-layer, per-position gaps of compared forwards against a HeldRows, reduced as each layer arrives:
    `sink(select, at)` is the sink of one compared forward whose rows `select(tensor)` are the held rows `at`
    (a slice of the held positions). `matrices()`: metric -> [n_hidden, n_positions] (float64, CPU), the same
    numbers hidden_divergence gives on the stacked layers (each position's metrics depend on its row only).

    free: drop a held layer once a compared forward covered all its positions (one forward for all of them).
    equal: also track whether every compared row is bit for bit the held one (`self.equal`)."""

    def __init__(self, held: HeldRows, eps: float, label: str = "the cached run", free: bool = False,
                 equal: bool = False):
        self._div = hidden_divergence
        self.held, self.eps, self.label, self.free = held, eps, label, free
        self.track_equal, self.equal = equal, True
        # metric -> [n_hidden, n_positions] float64 on the CPU, allocated once at the first compared layer and
        # filled in place: small long-lived tensors made in the middle of each forward of a step-by-step run would
        # split the freed blocks of its large temporaries and grow glibc's heap every step (docs/benchmarks.md).
        self._out: dict[str, torch.Tensor] | None = None
        self._filled: list[int] = []

    @property
    def n_hidden(self) -> int:
        return len(self.held)

    def sink(self, select: Callable[[torch.Tensor], torch.Tensor], at: slice = slice(None)) -> Sink:
        def take(i: int, h: torch.Tensor) -> None:
            if i >= self.n_hidden or self.held.layers[i] is None:
                raise KvvizError(f"{self.label} returned more hidden states than the {self.n_hidden} of the "
                                 "reference")
            ref = self.held.layers[i][at]
            got = select(h)
            if got.shape != ref.shape:
                raise KvvizError(f"{self.label} returned hidden states of shape {tuple(got.shape)} at hidden state "
                                 f"{i}, expected {tuple(ref.shape)}")
            if got.device != ref.device:
                got = got.to(ref.device)
            d = self._div(ref, got, self.eps)
            if self.track_equal and self.equal:
                self.equal = torch.equal(got, ref)
            if self._out is None:
                self._allocate(d)
            start = at.start or 0
            for k, v in d.items():
                dst = self._out[k][i, start:start + v.shape[-1]]
                if v.shape[-1] != dst.shape[-1] or v.dim() != 1:
                    raise KvvizError(f"{self.label}: hidden state {i} compared {tuple(v.shape)} positions, "
                                     f"expected {dst.shape[-1]} at {start}")
                dst.copy_(v)
            self._filled[i] += v.shape[-1]
            del d
            if self.free and at == slice(None):
                self.held.layers[i] = None
        return take

    def stepping(self, select: Callable[[torch.Tensor], torch.Tensor], start: int = 0) -> Sink:
        """The sink of a run of one-position forwards (token by token): forward k's rows are held position
        start + k (a forward begins when hidden state 0 arrives again)."""
        j, last = start - 1, None

        def take(i: int, h: torch.Tensor) -> None:
            nonlocal j, last
            if last is None or i <= last:
                j += 1
            last = i
            self.sink(select, slice(j, j + 1))(i, h)
        return take

    def _allocate(self, d: dict[str, torch.Tensor]) -> None:
        """One [n_hidden, n_positions] float64 CPU matrix per metric (n_positions: the held rows' positions)."""
        widths = {t.shape[-2] for t in self.held.layers if t is not None}
        if len(widths) != 1 or any(t is not None and t.dim() != 2 for t in self.held.layers):
            raise KvvizError(f"{self.label}: the held hidden states are not one [positions, hidden] row each")
        n = widths.pop()
        self._out = {k: torch.empty(self.n_hidden, n, dtype=torch.float64) for k in d}
        self._filled = [0] * self.n_hidden

    def matrices(self) -> dict[str, torch.Tensor]:
        got = sum(1 for f in self._filled if f)
        if self._out is None or got != self.n_hidden:
            raise KvvizError(f"{self.label} returned {got} hidden states, expected {self.n_hidden}")
        n = next(iter(self._out.values())).shape[-1]
        if any(f != n for f in self._filled):
            raise KvvizError(f"{self.label}: hidden states compared at {sorted(set(self._filled))} positions, "
                             f"expected {n} for every one")
        return dict(self._out)
