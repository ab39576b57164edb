"""What every subcommand shares (kvviz/cli.py runs them; each view's cli.py defines its own): the common model
options, loading behind the memory plan, the run settings, progress on stderr, and the Outcome a subcommand returns.

A view's cli.py has `HELP` (its line in --help), `add_arguments(parser)` (its options on the parser kvviz/cli.py makes
under the subcommand the registry derives; `set_defaults(handler=command, ...)`) and `command(args) -> Outcome`. It checks its arguments, runs, and returns; it never prints or exports: kvviz/cli.py
does that for all of them (flags a subcommand cannot honour refused, --json-out/--html/--repro, JSON or summary)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from .. import views
from ..core import estimate, memory
from ..core.dtypes import DTYPE_NAMES
from ..core.errors import KvvizError
from ..engines import registry
from ..models.loading import ATTN_CHOICES
from ..core.execution import ExecSettings
from ..core.memory import check_fits
from ..core.prompts import load_prompts
from ..core.protocol import RunContext, add_config_arguments, config_from
from ..models import loading
from ..models.loading import parse_spec
from ..models.placement import parse_placement


@dataclass
class Outcome:
    result: object
    lm: object = None  # the model the result was computed with (for the export's fingerprint and the repro script)
    summary: "Callable[[], str] | None" = None  # the human summary (default: the result's verdict line)
    payload: "Callable[[], dict] | None" = None  # what --json prints (default: result.to_dict())
    exportable: bool = True  # --json-out / --html / --repro apply
    printed: bool = False  # the subcommand printed its output as it went (a long sweep's rows)


class FlagRefused(KvvizError):
    """A flag the subcommand cannot honour (with the others it was given): exit 2, like any other argument error."""


class PlanShown(Exception):
    """--plan: the memory plan was printed; nothing is loaded or run."""


# Set by Ctrl-C (ctrl_c_stops) before its KeyboardInterrupt: a KeyboardInterrupt that lands in a finalizer (a
# `__del__`, a garbage-collection callback, where Python prints "Exception ignored" and goes on) is raised again at
# the run's next progress report.
_INTERRUPTED = threading.Event()


@contextlib.contextmanager
def ctrl_c_stops() -> Iterator[None]:
    """Around a CLI run in the main thread: Ctrl-C raises KeyboardInterrupt and marks the run interrupted."""
    def interrupt(signum, frame):
        _INTERRUPTED.set()
        signal.default_int_handler(signum, frame)

    try:
        old = signal.signal(signal.SIGINT, interrupt)
    except ValueError:  # not the main thread: Ctrl-C as Python handles it
        old = None
    _INTERRUPTED.clear()
    try:
        yield
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)


def progress_to_stderr(quiet: bool):
    last = {"msg": None}

    def report(frac: float, msg: str) -> None:
        if _INTERRUPTED.is_set():
            raise KeyboardInterrupt
        if not quiet and msg != last["msg"]:
            last["msg"] = msg
            print(f"[{frac * 100:3.0f}%] {msg}", file=sys.stderr, flush=True)

    return report


def model_args(p: argparse.ArgumentParser, attn_list: bool = False) -> None:
    """The options every model-running subcommand has."""
    p.add_argument("--model", default="default", help="default | tiny:<arch> | hub id | folder | file.gguf")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    if attn_list:  # the matrix: a comma-separated list of attention implementations, one grid column each
        p.add_argument("--attn", "--attns", dest="attns", default="eager,sdpa",
                             help="comma-separated: eager,sdpa,flex_attention,flash_attention_2")
        p.set_defaults(attn="auto")
    else:
        p.add_argument("--attn", default="auto", choices=ATTN_CHOICES, help="attention implementation")
    p.add_argument("--devices", default="one", choices=("one", "auto", "spread"),
                   help="one: the whole model on --device; auto: accelerate's device_map (GPUs, then CPU RAM, then "
                              "disk offload); spread: layers split evenly over several GPUs")
    p.add_argument("--max-memory", default=None,
                   help="with --devices auto|spread: budget per device, e.g. 0=20GiB,1=20GiB,cpu=64GiB")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model's own Python code (off by default; only for models you trust)")
    p.add_argument("--invariant", action="store_true",
                   help="run in invariant mode: every op computes a row the same way however many rows it sees, so a "
                              "cached run equals the full forward bit for bit wherever the logic is right")
    p.add_argument("--no-proof", action="store_true",
                   help="skip the invariant-mode rerun that proves precision verdicts (faster; verdicts stay)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.add_argument("--json-out", default=None, help="also save the result as JSON (with the environment) to this file")
    p.add_argument("--html", default=None, help="also write a self-contained HTML report to this file")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--plan", action="store_true", help="print the memory plan of this run and exit (nothing loaded)")


def repro_arg(p: argparse.ArgumentParser, what: str = "") -> None:
    p.add_argument("--repro", default=None,
                   help=f"also write a standalone repro script{what} (torch + transformers only)")


def spec(args):
    """The model spec, parsed once from --model and carried whole from here on."""
    if not hasattr(args, "spec"):
        args.spec = parse_spec(args.model)
    return args.spec


def settings(args):
    """How the model runs (kvviz.core.execution.ExecSettings), from the common options."""
    return ExecSettings(invariant=bool(getattr(args, "invariant", False))).validate()


def plan_gate(args) -> None:
    """The memory plan, after the arguments are checked and before anything is loaded: --plan prints it and stops;
    a run that cannot fit is refused in one line (KvvizError); the plan rides on the result (`memory_plan`). Where
    the input itself is wrong there is no plan: the run then reports that in its own line."""
    if getattr(args, "memory_plan", None) is not None:
        return

    plan = plan_or_none(args)
    if args.plan:
        if plan is None:
            raise KvvizError("no memory plan for this input; run it without --plan to see what is wrong")
        print("\n".join(plan.lines()))
        print(plan_estimate_line(args, plan))
        raise PlanShown
    args.memory_plan = check_fits(plan) if plan is not None else None


def load(args):
    plan_gate(args)
    lm = loading.load_model(spec(args), args.dtype, args.device, args.attn, trust_remote_code=args.trust_remote_code,
                    progress=progress_to_stderr(args.quiet), **placement(args))
    args.estimate, args.loaded_model = run_estimate(args, lm), lm
    return lm


# The run's time estimate (kvviz.core.estimate): --plan prints it beside the memory plan (from this machine's stored
# pace, else a first guess); a run makes it once the model is loaded (calibrating the pace on first use), its
# context carries it, its result and JSON the estimate it started with (`estimate_s`) beside `elapsed_s`.


def _view_name(args) -> str:
    sub = getattr(args, "cache_command", None)
    return getattr(args, "plan_view", None) or views.for_command(args.command + (f" {sub}" if sub else "")).name


def plan_estimate_line(args, plan) -> str:
    """--plan's time line: the estimate before loading."""
    w = workload_of_args(args)
    try:
        est = estimate.for_plan(spec(args), args.dtype, args.device, w, max(1, plan.tokens - int(w.new_tokens or 0)),
                                _view_name(args), invariant=bool(getattr(args, "invariant", False)),
                                params=plan.weights // max(1, _dtype_bytes(args.dtype)), load_bytes=plan.weights)
    except (KvvizError, OSError, ValueError):
        return "time: no estimate for this input"
    return f"time: {est.line()}"


def _dtype_bytes(dtype: str) -> int:
    return {"float64": 8, "float32": 4}.get(str(dtype), 2)


def run_estimate(args, lm):
    """The run's estimate on the loaded model (calibrating this machine's pace for it on first use, said on
    stderr); None where the input has no workload to estimate (the run then says what is wrong)."""
    try:
        w = workload_of_args(args)
        if estimate.load_pace(estimate.key_of_model(lm)) is None and not args.quiet:
            print("kvviz: measuring this machine's pace for this model (once: a few short forwards)…", file=sys.stderr)
        return estimate.for_model(lm, w, estimate.tokens_of(lm, w), _view_name(args),
                                  invariant=bool(getattr(args, "invariant", False)))
    except (memory.NoPlan, KvvizError, OSError, ValueError):
        return None


def finish_timings(args, result) -> None:
    """After the run: its result carries the estimate it started with and the seconds it took, and the pace is
    refined by the phases it measured (kvviz.core.estimate.record)."""
    clock = getattr(args, "phase_clock", None)
    if clock is None or not isinstance(result, estimate.Timed):
        return
    est = getattr(args, "estimate", None)
    measured = clock.measured()
    result.timed(estimate.Timings(est.total_s if est is not None else None, sum(measured.values()), measured))
    lm = getattr(args, "loaded_model", None)
    if est is not None and lm is not None:
        estimate.record(estimate.key_of_model(lm), _view_name(args), est, measured)


def placement(args) -> dict:
    """load_model's placement arguments from --devices/--max-memory (checked in one line; {} for one device). A
    subcommand that cannot run on a dispatched model says why in its parser defaults (`not_dispatched`)."""
    place = parse_placement(getattr(args, "devices", "one"), getattr(args, "max_memory", None))
    if not place.dispatched:
        return {}
    why = getattr(args, "not_dispatched", None)
    if why is None and getattr(args, "weights", "none") not in (None, "none"):
        why = "quantizes a copy of the weights"
    if why:
        raise KvvizError(f"--devices {place.mode} cannot be used with {args.command}: it {why}; use --devices one")
    return {"placement": place}


def nonnegative_pad(args) -> None:
    if getattr(args, "left_pad", 0) < 0:
        raise KvvizError(f"--left-pad must be 0 or more, not {args.left_pad}")


def prove(args):
    """run_* functions' `prove`: False with --no-proof, else None (prove where a precision verdict needs it)."""
    return False if getattr(args, "no_proof", False) else None


def context(args):
    """A view's run context (kvviz.core.protocol.RunContext) from the common options: settings, --no-proof, progress."""
    args.phase_clock = estimate.PhaseClock()  # the run starts now: its phases timed as it names them
    return RunContext(settings(args), prove(args), progress_to_stderr(args.quiet),
                      estimate=getattr(args, "estimate", None), on_phase=args.phase_clock)


def split_list(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))


def view_arguments(view) -> Callable:
    """The subcommand of a view without a cli.py of its own: the common model options, one option per field of its
    config (kvviz.core.protocol.config_fields), --repro where it has a repro script; its run through the protocol."""
    def add_arguments(p: argparse.ArgumentParser) -> None:
        model_args(p)
        add_config_arguments(p, view.config_type())
        if view.repro:
            repro_arg(p)
        p.set_defaults(handler=command)

    def command(args) -> Outcome:
        cfg = config_from(view.config_type(), vars(args))
        lm = load(args)
        res = views.run(view, lm, cfg, context(args))

        def summary() -> str:
            verdict, text = view.verdict_text(res)
            return f"verdict: {str(verdict).upper()}" + ("" if view.verdict_is_html else f"\n{text}")

        return Outcome(res, lm, summary)

    return add_arguments


# The memory plan of a CLI command (its --plan and its refusal before loading), from its parsed arguments


def workload_of_args(args) -> memory.Workload:
    """The workload of a CLI command: its config's own (`args.workload`, set by a command that builds its typed
    config before loading: `config.workload()`, as its page plans it; with --attn where it names none, as the page
    gives it the sidebar's), else read off its parsed arguments. A prompt set (--prompts, --limit: dtypes, serving)
    counts each of its prompts; a shared prefix with prompts (serving) is put before each of them."""
    attention = str(getattr(args, "attns", None) or getattr(args, "attn", None) or "auto")
    prove = not getattr(args, "no_proof", False)  # --no-proof: the plan has no proof phase
    if isinstance(getattr(args, "workload", None), memory.Workload):
        w = args.workload
        return dataclasses.replace(w, attention=attention if w.attention == "auto" else w.attention,
                                   prove=w.prove and prove)
    prompt, prefix = getattr(args, "prompt", None), getattr(args, "prefix", None)
    texts = tuple(t for t in (prompt, prefix) if isinstance(t, str))
    if hasattr(args, "prompts"):
        prompts = [prompt] if isinstance(prompt, str) else _prompt_set(args)
        texts = tuple((prefix or "") + p for p in prompts)
    dtypes = getattr(args, "dtypes", None)
    split = getattr(args, "split", None)
    paths = getattr(args, "paths", None)
    engine = registry.facts(getattr(args, "engine", None) or registry.default())
    conditions = getattr(args, "conditions", None)
    return memory.Workload(texts=texts, continuations=tuple(getattr(args, "continuation", None) or ()),
                          new_tokens=int(getattr(args, "max_new_tokens", 0) or 0),
                          left_pad=int(getattr(args, "left_pad", 0) or 0), tokens=getattr(args, "tokens", None),
                          batch=getattr(args, "batch", None) or getattr(args, "batch_size", None),
                          conditions=split_list(conditions) if isinstance(conditions, str) else (),
                          # transformers' paged engine runs in this process; vLLM, llama.cpp, a server in theirs
                          page_size=getattr(args, "page_size", None) if engine.pages_here
                          and not getattr(args, "server", None) else 0,
                          dtypes=tuple(d.strip() for d in dtypes.split(",") if d.strip()) if isinstance(dtypes, str)
                          else (),
                          split=split if isinstance(split, int) else None,
                          weights=str(getattr(args, "weights", "none") or "none"),
                          attention=attention, prove=prove,
                          paths=tuple(p.strip() for p in paths.split(",") if p.strip()) if isinstance(paths, str) else ())


def config_workload(cfg) -> memory.Workload:
    """A view config's workload: its own `workload()`, else read off its fields as the subcommand generated from it
    reads its options (kvviz.core.protocol.add_config_arguments: a list field is one comma-separated option) - the
    generic page and that subcommand plan alike."""
    if callable(getattr(cfg, "workload", None)):
        return cfg.workload()
    options = {k: ",".join(map(str, v)) if isinstance(v, (tuple, list)) else v
               for k, v in dataclasses.asdict(cfg).items()}
    return workload_of_args(argparse.Namespace(**options))


def _prompt_set(args) -> list[str]:
    """The prompts of --prompts/--limit as the run loads them (none to plan where they cannot be read: the run says
    why in its own line)."""
    try:
        return load_prompts(getattr(args, "prompts", None) or "builtin", getattr(args, "limit", None))
    except (KvvizError, OSError, ValueError):
        raise memory.NoPlan() from None


def plan_for_args(args) -> memory.MemoryPlan:
    """The plan of a CLI command from its parsed arguments. Input errors are left to the run itself (its own one
    line): a prompt over the limit, a model file that cannot be read."""
    sub = getattr(args, "cache_command", None)
    # a subcommand whose options pick another view of its folder names it (`serving --sweep`: serving_sweep)
    view = getattr(args, "plan_view", None) or views.for_command(args.command + (f" {sub}" if sub else "")).name
    spec = getattr(args, "spec", None) or args.model
    return memory.plan_workload(spec, args.dtype, args.device, view, workload_of_args(args),
                                invariant=bool(getattr(args, "invariant", False)))


def plan_or_none(args) -> memory.MemoryPlan | None:
    """plan_for_args, or None where the input itself is wrong (the run reports that in its own line)."""
    try:
        return plan_for_args(args)
    except memory.NoPlan:
        return None
