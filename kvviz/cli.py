"""Command line: `python -m kvviz <view> ...` — every view of the library, one subcommand each (`--help` lists them).

The subcommands come from the view registry (kvviz/views/__init__.py): each view's folder has a cli.py with its
options (`add_arguments`), its help line (`HELP`) and its command (shared pieces in kvviz/io/clirun.py); the subcommand's
name is derived from the folder (`loading_trap` -> `loading-trap`) and an older name of it is an argparse alias
(`View(command_aliases=...)`: `serve-study` runs `serving`). `_run` is the one run block for all of them: it refuses
the common flags a subcommand cannot honour, writes --json-out / --html / --repro, and prints JSON (--json) or the
summary. `open` (a saved result) and `sweep-architectures` are the two subcommands that are not views."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .io.clirun import FlagRefused, Outcome, PlanShown, ctrl_c_stops, finish_timings, view_arguments
from .core.errors import OUT_OF_MEMORY_HINT, KvvizError, first_line, free_memory, is_out_of_memory
from .core.fingerprint import fingerprint
from .core.memory import attach
from .core.protocol import REFUSABLE_FLAGS
from .io.archsweep import add_parser as _archsweep_parser, cli
from .io.export import export_json, html_report, open_result, result_dict
from .io.jsonout import dumps
from .io.repro import repro_script
from .models.compat import TRANSFORMERS_VERSION, range_warning, untested_note
from . import __version__, views


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, non-zero exit
        self.exit(2, f"kvviz: error: {message}\n")


def version_line() -> str:
    """`kvviz --version`: the versions that decide what a run computes; an untested transformers said here."""
    line = f"kvviz {__version__} (torch {torch.__version__}, transformers {TRANSFORMERS_VERSION})"
    return line + ("\n" + range_warning() if range_warning() is not None else "")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m kvviz", description="Where does a KV cache change a model's numbers, and why?")
    parser.add_argument("--version", action="store_true",
                        help="kvviz's, torch's and transformers' versions (and whether kvviz was tested on this "
                             "transformers)")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    seen = set()
    for view in views.all_views():  # one subcommand per view folder (the cache folder: two views); a view without
        if view.command and view.package not in seen:  # a cli.py gets one from its config (clirun.view_arguments)
            seen.add(view.package)
            name = view.command.split(" ")[0]  # derived from the folder by the registry
            aliases = [a for v in views.all_views() if v.package == view.package for a in v.command_aliases]
            mod = view.cli_module()
            p = sub.add_parser(name, aliases=aliases, help=mod.HELP if mod else view.title)
            (mod.add_arguments if mod else view_arguments(view))(p)
            p.set_defaults(command=name)  # an alias as typed runs (and is named in messages) as the subcommand
    op = sub.add_parser("open", help="show a saved result (JSON export) without running any model")
    op.add_argument("file")
    op.add_argument("--html", default=None, help="also write its self-contained HTML report to this file")
    op.add_argument("--quiet", action="store_true", help="no 'written:' line on stderr")
    op.set_defaults(handler=cmd_open)

    _archsweep_parser(sub)
    sub.choices["sweep-architectures"].set_defaults(handler=cmd_sweep_architectures)
    return parser


def _exports(args, res, lm=None) -> None:
    """--json-out, --html and --repro (every view but bisect): written after the run; a message on stderr each."""
    if getattr(args, "memory_plan", None) is not None:
        attach(res, args.memory_plan)  # every JSON result carries the plan, with the measured peak
    fp = None
    if lm is not None:
        fp = fingerprint(lm)
    for flag, make in (("json_out", lambda: export_json(res, fp)), ("html", lambda: html_report(res))):
        target = getattr(args, flag, None)
        if target:
            _write(Path(target), make(), args)
    if getattr(args, "repro", None):
        _write(Path(args.repro), repro_script(res, lm, Path(args.repro).name), args)


def _write(path, text: str, args) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise KvvizError(f"could not write {path}: {e.strerror or e}") from None
    if not args.quiet:
        print(f"written: {path}", file=sys.stderr)


# Common flags a subcommand does not honour are named in its parser's defaults (`not_honoured`: flag -> why, in the
# view's cli.py); given one of these, the subcommand refuses to run (exit 2) before anything loads.
_FLAG = {"invariant": "--invariant", "no_proof": "--no-proof", "json_out": "--json-out", "html": "--html",
         "repro": "--repro"}


def refused_flags(command: str, not_honoured: dict | None) -> dict[str, str]:
    """The common flags (argparse dests) a subcommand refuses, and why: those its view's run refuses (View.refuses:
    --invariant, --no-proof) and those its parser names (`not_honoured`, e.g. --json-out; its reason first)."""
    try:
        view = views.for_command(command)
    except KvvizError:  # open, sweep-architectures: no view
        view = None
    refused = {REFUSABLE_FLAGS[k]: why for k, why in view.refusals().items()} if view else {}
    return {**refused, **(not_honoured or {})}


def _refuse_flags(args) -> None:
    name = _command_name(args)
    for flag, why in refused_flags(name, getattr(args, "not_honoured", None)).items():
        if getattr(args, flag, None):
            raise FlagRefused(f"{_FLAG[flag]} does nothing for `{name}` ({why}); leave it out")


def _command_name(args) -> str:
    sub = getattr(args, "cache_command", None)
    return args.command + (f" {sub}" if sub else "")


def _run(args) -> int:
    _refuse_flags(args)
    out: Outcome = args.handler(args)
    finish_timings(args, out.result)  # the estimate it started with, the seconds it took (JSON: both)
    if out.exportable:
        _exports(args, out.result, out.lm)
    if out.printed:
        return 0
    plan = getattr(out.result, "memory_plan", None)
    over = plan.over_plan() if plan is not None else None  # a wrong plan is said, not only measured
    if getattr(args, "json", False):
        print(dumps(out.payload() if out.payload else result_dict(out.result)))
        if over:
            print(f"kvviz: {over}", file=sys.stderr)
        return 0
    text = out.summary() if out.summary else f"verdict: {out.result.verdict.upper()}\n{out.result.explanation}"
    if getattr(args, "invariant", False):
        text = "(run in invariant mode)\n" + text
    print(text + (f"\n{over}" if over else ""))
    return 0


def cmd_open(args) -> Outcome:
    p = Path(args.file)
    if not p.is_file():
        raise KvvizError(f"no such file: {p}")
    opened = open_result(p.read_bytes())
    res = opened.result
    view = views.get(opened.view)

    def summary() -> str:
        verdict, text = view.verdict_text(res)
        own = getattr(view.cli_module(), "summary", None) if view.cli else None  # the view's own summary, if any
        head = own(res) if own else \
            f"a {view.title} result — verdict: {verdict}" + ("" if view.verdict_is_html else f"\n{text}")
        if not own:  # its tables, as the page and the HTML report show them
            head += "".join("\n\n" + t.to_string(index=False) for t in view.main_tables(res))
        return head + "\n\nenvironment: " + ("the same as here" if not opened.environment_differences else
                                             "differs from here — " + "; ".join(opened.environment_differences))

    if args.html:
        _write(Path(args.html), html_report(res), args)
    return Outcome(res, summary=summary, exportable=False, payload=lambda: json.loads(p.read_text(encoding="utf-8")))


def cmd_sweep_architectures(args) -> Outcome:
    cli(args)  # a long sweep prints each row as it finishes, then its totals (or the JSON)
    return Outcome(None, exportable=False, printed=True)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(version_line())
        return 0
    if not args.command:
        parser.print_help()
        return 2
    try:
        with ctrl_c_stops():
            return _run(args)
    except PlanShown:
        return 0
    except FlagRefused as e:  # a flag the subcommand cannot honour: exit 2, like any other argument error
        print(f"kvviz: error: {e}", file=sys.stderr)
        return 2
    except KvvizError as e:
        print(f"kvviz: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the run ends where it is (its locks released on the way out), one line
        print("kvviz: stopped (Ctrl-C)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head`: not an error
        sys.stderr.close()
        return 0
    except Exception as e:  # noqa: BLE001 - one line, as the app says it; the traceback on request
        if is_out_of_memory(e):  # torch.OutOfMemoryError is a RuntimeError
            free_memory(e)
            print(f"kvviz: error: {OUT_OF_MEMORY_HINT}", file=sys.stderr)
            return 1
        if os.environ.get("KVVIZ_DEBUG"):
            raise
        first = first_line(e)  # an untested transformers is the likelier cause: said here, once (untested_note)
        print(f"kvviz: unexpected error ({type(e).__name__}): {first} - a bug in kvviz or in the model's own code"
              f"{untested_note()}; KVVIZ_DEBUG=1 shows the traceback", file=sys.stderr)
        return 3
