"""One run signature for every view: `run(lm, config, ctx: RunContext) -> Result`.

A view's entry (kvviz.views.View) names its `config` class (a typed dataclass with `validate()`) and its `run`
function; the CLI, the benches and Prepare the meeting call `view.runner()(lm, config, ctx)`, and a view that
composes another (the cache-safety card: split, padding, reuse, quant) does the same through the registry.

`RunContext` carries what is not the scenario itself:
  settings  how the model runs (kvviz.execution.ExecSettings: device placement, attention, cache kind, invariant
            mode, ...); a view with axes of its own (matrix) or no model forward of its own settings reads only
            what applies;
  prove     one meaning everywhere (kvviz.verdict.Prove): None (the default) proves a precision verdict in invariant
            mode when the run finds one and the view has a proof; True always where it has one; False never;
  progress  callable(fraction, text) or None: fractions that only grow, the last one 1.0 once the run is done;
  token     a kvviz.cancel.Token: the run checks it at its checkpoints and raises kvviz.cancel.Cancelled once it is
            cancelled (a token cancelled before the run stops it before its first forward).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

from . import cancel
from .execution import DEFAULT_SETTINGS, ExecSettings
from .verdict import Prove

Progress = Callable[[float, str], None]


@dataclass(frozen=True)
class RunContext:
    settings: ExecSettings = DEFAULT_SETTINGS
    prove: Prove = None
    progress: Progress | None = None
    token: cancel.Token | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[Progress]:
        """Around a view's run: inside the token's scope (checked once before anything runs), handing the run a
        progress callback whose fractions never go back, and reporting 1.0 when the run returns."""
        last = [0.0]

        def report(fraction: float, text: str = "") -> None:
            cancel.check()
            last[0] = max(last[0], min(1.0, float(fraction)))
            if self.progress is not None:
                self.progress(last[0], text)

        with (cancel.scope(self.token) if self.token is not None else contextlib.nullcontext()):
            cancel.check("before the run")
            yield report
            if last[0] < 1.0:
                report(1.0, "Done")


DEFAULT_CONTEXT = RunContext()
