"""One run signature for every view: `run(lm, config, ctx: RunContext) -> Result`.

A view's entry (kvviz.views.View) names its `config` class (a typed dataclass with `validate()`) and its `run`
function; everything outside a view's folder runs it through `kvviz.views.run(view, lm, config, ctx)` (the pages'
runner, the CLI, the Lesson, the exercises, Prepare the meeting, the architecture sweep, bench/), and a view that
composes another (the cache-safety card: split, padding, reuse, quant; dtypes: split) does the same.

`RunContext` carries what is not the scenario itself:
  settings  how the model runs (kvviz.core.execution.ExecSettings: device placement, attention, cache kind, invariant
            mode, ...), validated when the context is made (one line for a bad one); a view with axes of its own
            (matrix) or no model forward of its own settings reads only what applies;
  prove     one meaning everywhere (kvviz.core.verdict.Prove): None (the default) proves a precision verdict in invariant
            mode when the run finds one and the view has a proof; True always where it has one; False never;
  progress  callable(fraction, text) or None: fractions that only grow, the last one 1.0 once the run is done;
  token     a kvviz.core.cancel.Token: the run checks it at its checkpoints and raises kvviz.core.cancel.Cancelled once it is
            cancelled (a token cancelled before the run stops it before its first forward);
  reference the float64 model its verdict compares with, already loaded (the Lesson's, a bench's); None (the
            default): the model's own, `lm.reference()`. A view with no float64 reference ignores it;
  float64_run  the same view's run of the same config in float64, already made: a view that runs another once per
            dtype (dtypes runs split) passes it on, so float64 runs once; None: the run makes its own;
  auto_proof  False: no automatic invariant proof after the run (the app's "Run without the proof" for a long run;
            `prove=True` still proves);
  estimate  the run's time estimate (kvviz.core.estimate.Estimate) made before it started: the progress bar's share of
            each phase comes from it, and the result's timings carry its total (`estimate_s`);
  on_phase  callable(name) or None: told the name of each phase of the run as it starts ("run", "float64", "proof":
            kvviz.core.estimate.PHASES), a value - never parsed back from a progress message.
No run writes module state: what one run measures reaches the next only through the estimate store
(kvviz.core.estimate.record), never a global another user's run reads mid-run.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator
import argparse
import dataclasses
import typing

from . import cancel
from .estimate import Estimate
from .execution import DEFAULT_SETTINGS, ExecSettings
from .cancel import Progress  # noqa: F401 - the one definition; views import it from here
from .verdict import Prove
from ..models.loading import LoadedModel
from .errors import KvvizError


def no_progress(fraction: float, text: str = "") -> None:
    """The progress callback of a run nobody watches."""


@dataclass(frozen=True)
class RunContext:
    settings: ExecSettings = DEFAULT_SETTINGS
    prove: Prove = None
    progress: Progress | None = None
    token: cancel.Token | None = None
    reference: LoadedModel | None = None  # a float64 model
    float64_run: object | None = None  # the same view's result in float64 (split's SplitResult for dtypes)
    auto_proof: bool = True
    estimate: Estimate | None = None
    on_phase: Callable[[str], None] | None = None

    def phase(self, name: str) -> None:
        """Say that the run's phase `name` starts (to whoever watches: on_phase)."""
        if self.on_phase is not None:
            self.on_phase(name)

    def __post_init__(self) -> None:
        """The settings are validated here, once, where a run's context is made (before any model loads): a bad
        cache kind or flag is one line (KvvizError), and the views' runs take them as given."""
        object.__setattr__(self, "settings", (self.settings or DEFAULT_SETTINGS).validate())

    @contextlib.contextmanager
    def running(self, refuses: "dict[str, str] | None" = None) -> Iterator[Progress]:
        """Around a view's run: inside the token's scope (checked once before anything runs), handing the run a
        progress callback whose fractions never go back, and reporting 1.0 when the run returns. `refuses`: what
        the run cannot honour, and why (the view's REFUSES: "invariant" - invariant mode, "prove" - a proof
        rerun): asked for in this context, the run is refused in one line before it starts, never ignored."""
        for what, why in (refuses or {}).items():
            if (what == "invariant" and self.settings.invariant) or (what == "prove" and self.prove is True):
                raise KvvizError(f"{REFUSABLE[what]} does nothing for this run ({why})")
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
# What a view's run may refuse (its REFUSES, named in its registry entry), as a run and the CLI say it
REFUSABLE = {"invariant": "invariant mode", "prove": "a proof rerun"}
REFUSABLE_FLAGS = {"invariant": "invariant", "prove": "no_proof"}  # the CLI flag (argparse dest) of each


# A view's Config as controls: its dataclass fields, typed. The CLI (a view without a cli.py of its own gets one
# option per field) and the app (a view without a page script gets a generic page: pages/view.py) both read them.
@dataclass(frozen=True)
class ConfigField:
    name: str
    kind: str  # "str", "int", "float", "bool", "choice" (a Literal), "list" (a tuple of str)
    default: object
    choices: tuple = ()  # a "choice"'s values; a "list"'s allowed values (empty: any)


def config_fields(cls) -> list[ConfigField]:
    """The fields of a view's config dataclass (every field needs a default: a page starts from them)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{f.name} has no default")
        t = hints[f.name]
        args = typing.get_args(t)
        if typing.get_origin(t) is typing.Literal:
            out.append(ConfigField(f.name, "choice", default, args))
        elif typing.get_origin(t) is tuple:
            inner = typing.get_args(args[0]) if args and typing.get_origin(args[0]) is typing.Literal else ()
            out.append(ConfigField(f.name, "list", tuple(default), inner))
        elif t in (bool, int, float, str):
            out.append(ConfigField(f.name, t.__name__, default))
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: a {t} is not a control (str, int, float, bool, Literal, "
                            "tuple[str, ...])")
    return out


def config_from(cls, values: dict):
    """The config from `values` (a page's controls, the CLI's arguments: unknown keys ignored, missing ones take the
    field's default), validated (KvvizError in one line for a bad value)."""
    kw = {}
    for f in config_fields(cls):
        if f.name not in values or values[f.name] is None:
            continue
        v = values[f.name]
        if f.kind == "list":
            v = tuple(t.strip() for t in v.split(",") if t.strip()) if isinstance(v, str) else tuple(v)
            bad = [t for t in v if f.choices and t not in f.choices]
        else:
            bad = [v] if f.kind == "choice" and v not in f.choices else []
        if bad:
            raise KvvizError(f"{f.name.replace('_', ' ')}: {bad[0]!r} is not one of {', '.join(map(str, f.choices))}")
        kw[f.name] = v
    cfg = cls(**kw)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def add_config_arguments(parser, cls) -> None:
    """One option per config field: `--max-new-tokens 8`, `--mode step`, `--dtypes a,b`, a bool as a switch."""
    for f in config_fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if f.kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.kind == "choice":
            parser.add_argument(flag, default=f.default, choices=f.choices)
        elif f.kind == "list":
            parser.add_argument(flag, default=",".join(f.default), help="comma-separated"
                                + (f": {', '.join(f.choices)}" if f.choices else ""))
        else:
            parser.add_argument(flag, default=f.default, type={"int": int, "float": float, "str": str}[f.kind])
