"""Cancellation: a run stops at its next checkpoint and frees the model's lock.

A front end makes a `Token` for a run and enters `scope(token)` around it (the app: Stop, a closed tab or a rerun
while the run works; the CLI: Ctrl-C needs nothing, KeyboardInterrupt already ends it). Inside the scope the library
calls `check()` where a run can stop cleanly: every model call and every decoder layer (`layer_checks`, entered by
`Executor.session`), while it waits for a model's lock (`acquire`), between an engine worker's replies and a sweep's
workers. Once the token is cancelled every checkpoint raises `Cancelled`, a BaseException like KeyboardInterrupt (an
`except Exception` that degrades gracefully does not swallow it), and the `with` blocks on the way out release the
lock. Outside a scope `check()` does nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from typing import Callable, Iterator

from torch.overrides import TorchFunctionMode

from .capture import Capture

# A run's progress callback, (fraction, text): the one definition (kvviz.core.protocol re-exports it; kvviz/models
# imports it from here, below the protocol). It sits beside cancellation because every report is a checkpoint.
Progress = Callable[[float, str], None]


class Cancelled(BaseException):
    """The run was stopped (its token was cancelled); raised at the run's next checkpoint."""


class Token:
    """One run's stop signal. probe: an extra test polled at each checkpoint (the app: has the page asked for a rerun
    or a stop?). `where` is the latest checkpoint's place ("layer 12 of 30"), for the progress line."""

    def __init__(self, probe: Callable[[], bool] | None = None):
        self._event = threading.Event()
        self.probe = probe
        self.where = ""
        self.why = ""
        self.cancelled_at: float | None = None  # time.time() when it was cancelled (or its probe first said so)
        self.checks = 0

    def cancel(self, why: str = "stopped") -> None:
        if not self._event.is_set():
            self.why, self.cancelled_at = why, time.time()
            self._event.set()

    @property
    def is_set(self) -> bool:
        """Cancelled already (the page's probe not asked: cheap enough to test on every torch op)."""
        return self._event.is_set()

    @property
    def cancelled(self) -> bool:
        if not self._event.is_set() and self.probe is not None:
            try:
                if self.probe():
                    self.cancel("stopped by the page")
            except Exception:  # noqa: BLE001 - a probe that fails cancels nothing
                pass
        return self._event.is_set()

    def check(self, where: str | None = None) -> None:
        self.checks += 1
        if where is not None:
            self.where = where
        if self.cancelled:
            raise Cancelled(self.why or "stopped")


_CURRENT: contextvars.ContextVar[Token | None] = contextvars.ContextVar("kvviz_cancel", default=None)


def current() -> Token | None:
    return _CURRENT.get()


@contextlib.contextmanager
def scope(token: Token) -> Iterator[Token]:
    """`check()` in this thread (and this context) checks `token` until the block ends."""
    reset = _CURRENT.set(token)
    try:
        yield token
    finally:
        _CURRENT.reset(reset)


def check(where: str | None = None) -> None:
    """Raise Cancelled when the current run's token is cancelled; nothing outside a scope."""
    token = _CURRENT.get()
    if token is not None:
        token.check(where)


@contextlib.contextmanager
def acquire(lock) -> Iterator[None]:
    """`with lock:` that stops waiting (Cancelled) when the run is stopped meanwhile."""
    if _CURRENT.get() is None:
        with lock:
            yield
        return
    while not lock.acquire(timeout=0.25):
        check()
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def layer_checks(layers) -> Iterator[None]:
    """A checkpoint before every decoder layer of `layers` (and every module inside one), while a token is current:
    a long forward (a long prompt, the invariant proof, the float64 rerun) stops within a layer's part. The hooks
    are removed on exit; outside a scope nothing is attached."""
    token = _CURRENT.get()
    if token is None or layers is None:
        yield
        return
    n = len(layers)
    with Capture() as cap:
        cap.on_input([(f"layer {i + 1} of {n}", layer) for i, layer in enumerate(layers)],
                     lambda where, *_: token.check(where))
        cap.on_input([sub for layer in layers for sub in layer.modules() if sub is not layer], lambda *_: token.check())
        yield


@contextlib.contextmanager
def op_checks() -> Iterator[None]:
    """A checkpoint at every torch call while a token is current, for runs whose single layers can take minutes
    (invariant mode over a long prompt: its fixed-order kernels are loops of small torch calls). Entered outside
    the run's own modes, so the calls those modes make are checked too; outside a scope nothing is entered."""
    token = _CURRENT.get()
    if token is None:
        yield
        return

    class OpChecks(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            if token.is_set or (self.calls % 64 == 0 and token.cancelled):
                raise Cancelled(token.why or "stopped")
            return func(*args, **(kwargs or {}))

    with OpChecks():
        yield
