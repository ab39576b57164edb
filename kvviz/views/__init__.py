"""The views: one folder each under kvviz/views/, one line each in VIEW_FOLDERS below.

A view is a scenario kvviz can run and show (split, greedy, …). Its folder holds everything about it:

    kvviz/views/<name>/
        __init__.py   its View entry (below), naming its own modules' pieces, and its library API (config, result)
        run.py        config, run, result (the computation, through kvviz.core.execution); its `run(lm, config, ctx)`
                      is the one signature every view has (kvviz.core.protocol), named in its entry (config=, run=)
        figures.py    pure result -> figures/tables; `main(result)`: the charts of its HTML report and Open a
                      result, `tables(result)`: their tables
        report.py     `reopen(dict)`: the result rebuilt from a JSON export; `verdict(result)`: its verdict line
        repro.py      (optional) its standalone repro script: `check`, `script`, `key_figure`
        cli.py        (optional) its subcommand: `HELP` (its --help line), `add_arguments(parser)` (whose
                      `set_defaults` names the common flags it refuses, and why, as `not_honoured`),
                      `command(args) -> Outcome`; without one, the subcommand has the common model options and
                      one option per config field (kvviz.io.clirun.view_arguments)
        scenario.py   (optional) `setup(preset, device) -> (lm, config, settings)`: a one-click scenario of its
                      page, run ahead through the view's run by Prepare the meeting (kvviz.teach.meeting); without one,
                      a preset's controls are the config's fields
A view with a Page entry and no page script pages/<folder>.py gets the generic page (pages/view.py: its config's
fields as controls, its run through the protocol, its verdict, figures, tables and downloads); its own one-click
scenarios go in its entry (`scenarios`: kvviz.views.Preset, also kvviz.teach.presets.Preset), listed on Home and run by Prepare the meeting.
tests/test_toy_view.py adds a view that way, in a temporary package, with no other edit. (A link to its page opened
as a fresh server's first request needs pages/<folder>.py running the generic page: docs/example_view/pages/.)

Each entry also holds the view's facts that the core reads instead of comparing names: its memory profile (what
the memory plan counts for it, kvviz.core.memory; a view without one is refused here), its page (navigation, the
settings prefix of its controls, its controls' defaults) and the run names its page gives pages/runner.run_cached.

One name: a view's folder names it, and everything public is derived from that name (`register` sets them and
refuses an entry that declares another):
    JSON `view`        the view's name, which is its folder's (a folder of several views names each one itself)
    CLI subcommand     the folder with '_' -> '-' (`loading_trap` -> `python -m kvviz loading-trap`); in a folder
                       of several views, that word and the view's own second word (`cache load`, `cache size`)
    page URL path      the folder (`/split`, `/loading_trap`); the page script is pages/<folder>.py (a fresh
                       Streamlit server looks its first request's URL up among pages/ file names: a page file
                       named otherwise answers "Page not found" there)
    settings prefix    the folder and '_' (`split_prompt`)
A name that was public before the rule is kept as an explicit alias in the entry: `command_aliases` (argparse
aliases: the old subcommand runs the view, --help names the derived one), `Page.url_aliases` (an old URL opens
the page at its own URL, the link's settings kept: app.py) and `Page.link_prefix` (an old settings prefix in a
saved link).

The export (JSON, reopen, HTML), the repro scripts, the CLI's subcommands and `open`, the memory plan, Prepare
the meeting and the app's navigation and state iterate this registry; nothing compares view names. Adding a view is its folder plus one line in VIEW_FOLDERS
(docs/architecture.md shows a small example). An entry names its pieces themselves - functions, classes, modules
(`reopen=report.reopen`, `run=run.run`, `config=run.SplitConfig`, `cli=cli`): its __init__ imports its own modules,
so a tool's go-to-definition follows them; the registry imports the folders on first use (`_ensure`).

One path: code outside a view's folder runs the view only through the protocol, `kvviz.views.run(name_or_view, lm,
config, ctx=None)` (its entry's `run(lm, config, ctx)`); a folder's own `run_<x>` function is private to it. What a
run needs beyond its config (settings, proof, progress, cancellation, a float64 reference already loaded, a float64
run already made) travels in the context (kvviz.core.protocol.RunContext).
"""
from __future__ import annotations

import functools
import importlib
import time
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Callable

from ..core.errors import KvvizError
from ..core.estimate import Timed, Timings
from ..core.protocol import DEFAULT_CONTEXT, RunContext
from ..core.memory import Decoding, MemoryProfile  # noqa: F401 - a view's entry names them (from .. import MemoryProfile)

# The registry: one line a view folder (kvviz.views.<folder>, or a full dotted package name for a view kept
# elsewhere). Order = the order of the CLI's subcommands and of the pages within a section of the app's navigation.
VIEW_FOLDERS = [
    "split",
    "greedy",
    "dtypes",
    "padding",
    "reuse",
    "loading_trap",
    "matrix",
    "cache",  # two views (kv_reload, kv_size) and the `cache` subcommand
    "quant",
    "check",
    "bisect",
    "serving",
    "engine_layers",
    "lens",
]


@dataclass(frozen=True)
class Preset:
    """A one-click scenario for teaching (kvviz.teach.presets): the sidebar's model and dtype, the page, and that
    page's controls. Defined here so that a view's entry can declare its own (View(scenarios=...)) without importing
    teach, which sits above the views."""
    key: str
    title: str
    what: str
    page: str
    model: str
    dtype: str
    controls: dict = field(default_factory=dict)
    invariant: bool = False


@dataclass(frozen=True)
class Page:
    """Where the view's page sits in the app's navigation (the page script is pages/<stem>.py)."""
    stem: str  # the page script's name: the view's folder
    section: str
    icon: str
    title: str | None = None  # the navigation's name for it (default: the view's title)
    prefix: str = ""  # the session-state / URL prefix of its controls: "<view folder>_", set by register()
    link_prefix: str = ""  # another prefix a saved link may carry for these controls (read as `prefix`)
    url_path: str = ""  # its URL path in the app: the view's folder, set by register()
    url_aliases: tuple[str, ...] = ()  # older URL paths of the page that still open it (app.py sends them on)
    defaults: dict = field(default_factory=dict, compare=False)  # its controls' default values (pages/defaults.py)
    starts_engine: bool = False  # its run button starts an engine's own process (vLLM): its first screen runs
    # nothing, and the pages bench and seam checks leave it to its own tests


@dataclass(frozen=True)
class View:
    name: str  # the `view` of its JSON export
    title: str  # as the pages call it
    result_type: str  # the class name of its result
    reopen: Callable[[dict], object]  # JSON dict (header removed) -> the result: report.reopen
    figures: Callable[[object], list] | None = None  # result -> its main figures (pure): figures.main
    verdict: Callable[[object], tuple[str, str]] | None = None  # result -> (verdict, one paragraph): report.verdict
    verdict_is_html: bool = False  # the paragraph is an HTML table (dtypes, padding, reuse)
    tables: Callable[[object], list] | None = None  # result -> its tables (pandas DataFrames), pure: figures.tables
    repro: ModuleType | None = None  # its repro module (check/script/key_figure): a standalone repro script exists
    cli: ModuleType | None = None  # its cli module (HELP/add_arguments/command): its CLI subcommand
    command: str | None = None  # its CLI subcommand as typed, derived from its folder by register() ("loading-trap";
    # a folder of several views declares "<folder command> <word>": "cache load")
    command_aliases: tuple[str, ...] = ()  # older subcommands that still run the view (argparse aliases)
    page: Page | None = None  # its page in the app
    memory: MemoryProfile | None = None  # what its memory plan counts (required: register() refuses a view without)
    runs: tuple[str, ...] = ()  # the names its page's runs have in pages/runner.run_cached (default: its name)
    scenario: Callable | None = None  # scenario.setup: setup(preset, device) -> (lm, config, settings)
    # (default: the preset's model, its controls as the config's fields, invariant mode as the preset says)
    scenarios: tuple = ()  # one-click scenarios of its own (kvviz.teach.presets.Preset), beside kvviz.teach.presets.PRESETS
    # the protocol (kvviz.core.protocol): its typed, validated config class and its `run(lm, config, ctx) -> result`
    config: type | None = None  # run.SplitConfig
    refuses: dict | None = None  # run.REFUSES: what its run cannot honour and why (kvviz.core.protocol.REFUSABLE):
    # its run refuses such a context in one line, its subcommand the matching flag
    run: Callable | None = None  # run.run
    package: str = field(default="", compare=False)  # the folder's package, set by register()

    def rebuild(self, d: dict):
        return self.reopen(d)

    def main_figures(self, result) -> list:
        return list(self.figures(result)) if self.figures else []

    def main_tables(self, result) -> list:
        return list(self.tables(result)) if self.tables else []

    def verdict_text(self, result) -> tuple[str, str]:
        if self.verdict is None:
            return getattr(result, "verdict", ""), getattr(result, "explanation", "")
        return self.verdict(result)

    def config_type(self) -> type:
        return self.config

    def refusals(self) -> dict:
        """What its run cannot honour, and why ({"invariant": why, "prove": why}; empty: it honours both)."""
        return dict(self.refuses or {})

    def runner(self) -> Callable:
        """The view's `run(lm, config, ctx: kvviz.core.protocol.RunContext) -> result` (kvviz.views.run calls it),
        timed: its result carries the estimate the run started with (ctx.estimate) and the seconds it took
        (kvviz.core.estimate.Timings)."""
        return _timed(self.run)

    def repro_module(self):
        return self.repro

    def cli_module(self):
        return self.cli

    def run_names(self) -> tuple[str, ...]:
        return self.runs or (self.name,)


def _timed(run: Callable) -> Callable:
    @functools.wraps(run)
    def timed(lm, config, ctx=DEFAULT_CONTEXT):
        t0 = time.perf_counter()
        result = run(lm, config, ctx)
        if isinstance(result, Timed):
            est = ctx.estimate.total_s if ctx.estimate is not None else None
            result.timed(Timings(est, time.perf_counter() - t0))
        return result

    return timed


_VIEWS: dict[str, View] = {}


def command_of(folder: str) -> str:
    """The CLI subcommand of a view folder: its name with '_' -> '-' (loading_trap -> loading-trap)."""
    return folder.replace("_", "-")


def register(view: View, package: str = "") -> View:
    """Add a view to the registry, deriving its subcommand, its page's URL path and settings prefix from its folder
    (the folder's last name, or the view's name without one). An entry that declares another subcommand, URL path,
    page script or prefix is refused: an older public name goes in `command_aliases` / `Page.url_aliases`."""
    if not isinstance(view.memory, MemoryProfile):
        raise KvvizError(f"view {view.name!r} has no memory profile (View(memory=MemoryProfile(...))): kvviz would "
                         "not know what its runs hold")
    if view.memory.proves:
        raise KvvizError(f"view {view.name!r} declares MemoryProfile(proves=True): whether its run proves is derived "
                         "from its entry (the float64 reference, and `refuses` without 'prove')")
    if not (view.config and view.run):
        raise KvvizError(f"view {view.name!r} names no config class and run (View(config=run.<Config>, "
                         "run=run.run)): every view runs through one protocol (kvviz.core.protocol)")
    named = [f for f in ("reopen", "figures", "verdict", "tables", "repro", "cli", "scenario", "config", "refuses",
                         "run") if isinstance(getattr(view, f), str)]
    if named:
        raise KvvizError(f"view {view.name!r} names its {named[0]} by a string ({getattr(view, named[0])!r}): an entry "
                         "names the function, class or module itself (its __init__ imports its own modules)")
    folder = (package or view.package or view.name).rsplit(".", 1)[-1]
    command = None
    if view.cli or (view.config and view.run and view.name == folder):  # no cli.py: one made from its config
        head = command_of(folder)
        if view.name == folder:  # the folder's own view: the subcommand is the folder's
            command = head
            if view.command not in (None, command):
                raise KvvizError(f"view {view.name!r}: its subcommand is {command!r} (its name, '_' -> '-'), not "
                                 f"{view.command!r}; an older subcommand goes in command_aliases")
        else:  # one of several views in a folder: "<folder's subcommand> <word>"
            words = (view.command or "").split(" ")
            if len(words) != 2 or words[0] != head or not words[1]:
                raise KvvizError(f"view {view.name!r} of the folder {folder!r}: its subcommand is {head!r} and a "
                                 f"word of its own ('{head} <word>'), not {view.command!r}")
            command = view.command
    elif view.command or view.command_aliases:
        raise KvvizError(f"view {view.name!r} names a subcommand but has no cli module")
    if view.page is not None:
        want = folder + "_"
        if view.page.prefix not in ("", want):
            raise KvvizError(f"view {view.name!r}: its page's controls take the prefix of its folder, {want!r}, not "
                             f"{view.page.prefix!r}")
        if view.page.url_path not in ("", folder):
            raise KvvizError(f"view {view.name!r}: its page's URL path is its folder, {folder!r}, not "
                             f"{view.page.url_path!r}; an older URL path goes in Page(url_aliases=...)")
        if folder in view.page.url_aliases:
            raise KvvizError(f"view {view.name!r}: {folder!r} is its page's own URL path, not an older one")
        if view.page.stem != folder:
            raise KvvizError(f"view {view.name!r}: its page script is pages/{folder}.py (its folder), not "
                             f"pages/{view.page.stem}.py")
    others = [v for v in _VIEWS.values() if v.name != view.name]
    pkg = package or view.package
    owners = {}  # a subcommand's first word -> (the folder's package, the view) that has it
    for v in others:
        for c in (v.command, *v.command_aliases):
            if c:
                owners.setdefault(c.split(" ")[0], (v.package, v.name))
    for c in (command, *view.command_aliases):
        owner = owners.get(c.split(" ")[0]) if c else None
        if owner and not (c == command and pkg and owner[0] == pkg):  # a folder's views share its subcommand
            raise KvvizError(f"view {view.name!r}: the subcommand {c!r} is already view {owner[1]!r}'s")
    if view.page is not None:
        urls = {u: v.name for v in others if v.page for u in (v.page.url_path, *v.page.url_aliases)}
        for u in (folder, *view.page.url_aliases):
            if u in urls:
                raise KvvizError(f"view {view.name!r}: the URL path {u!r} is already view {urls[u]!r}'s page's")
    if package and not view.package:
        object.__setattr__(view, "package", package)
    object.__setattr__(view, "command", command)
    if view.page is not None:
        object.__setattr__(view.page, "prefix", folder + "_")
        object.__setattr__(view.page, "url_path", folder)
    _VIEWS[view.name] = view
    return view


def add_folder(folder: str) -> tuple[View, ...]:
    """Import a view folder and register the View entries its __init__ declares (`VIEW`, named as the folder, or
    `VIEWS`: several views, one subcommand and one page between them)."""
    package = folder if "." in folder else f"{__name__}.{folder}"
    mod = importlib.import_module(package)
    entries = getattr(mod, "VIEWS", None)
    if not entries:
        entries = (getattr(mod, "VIEW"),)
        own = package.rsplit(".", 1)[-1]
        if entries[0].name != own:
            raise KvvizError(f"the view of the folder {own!r} is named {entries[0].name!r}: a view takes its "
                             "folder's name (its JSON `view`, subcommand, page and settings prefix derive from it)")
    return tuple(register(v, package) for v in entries)


def run(view: "str | View", lm, config, ctx: RunContext | None = None):
    """Run a view through the protocol: its entry's `run(lm, config, ctx)` (kvviz.core.protocol), `view` its name
    or its entry, `ctx` the run's context (default: kvviz.core.protocol.DEFAULT_CONTEXT). The one way code outside a
    view's folder runs it: the pages' runner, the CLI, the Lesson, the exercises, Prepare the meeting, the
    architecture sweep, bench/ and scripts/ (tests/test_one_path.py checks it)."""
    v = get(view) if isinstance(view, str) else view
    return v.runner()(lm, config, DEFAULT_CONTEXT if ctx is None else ctx)


def get(name: str) -> View:
    _ensure()
    if name not in _VIEWS:
        raise KvvizError(f"unknown view {name!r}")
    return _VIEWS[name]


def memory_profile(name: str) -> MemoryProfile:
    """The memory plan's profile of a view (kvviz.core.memory.profile looks views up through this), with `proves`
    derived from its entry: it runs the float64 reference and its run does not refuse "prove"."""
    v = get(name)
    return replace(v.memory, proves=v.memory.reference and "prove" not in v.refusals())


def all_views() -> tuple[View, ...]:
    _ensure()
    return tuple(_VIEWS.values())


def names(repro: bool | None = None) -> tuple[str, ...]:
    return tuple(v.name for v in all_views() if repro is None or bool(v.repro) == repro)


def for_command(command: str) -> View:
    """The view of a CLI subcommand as typed ("split", "cache load", or an alias: "serve-study"); a subcommand of a
    view folder that is no view of its own ("cache save") goes with the folder's first view."""
    views = all_views()
    for v in views:
        if command == v.command or command in v.command_aliases:
            return v
    head = command.split(" ")[0]
    for v in views:
        if v.command and (v.command.split(" ")[0] == head or head in v.command_aliases):
            return v
    raise KvvizError(f"unknown subcommand {command!r}")


def for_page(stem: str) -> View:
    """The view whose page is pages/<stem>.py."""
    for v in all_views():
        if v.page and v.page.stem == stem:
            return v
    raise KvvizError(f"no view has the page {stem!r}")


def for_run(name: str) -> View | None:
    """The view of a page's run (pages/runner.run_cached's name; an A/B twin "<run>_ab" is its run's)."""
    base = name.removesuffix("_ab")
    for v in all_views():
        if base in v.run_names():
            return v
    return None


def page_prefixes() -> dict[str, str]:
    """Page stem -> the prefix of its controls, for every view with a page."""
    return {v.page.stem: v.page.prefix for v in all_views() if v.page and v.page.prefix}


def page_urls() -> dict[str, str]:
    """Page stem -> its URL path in the app (the view's folder), for every view with a page."""
    return {v.page.stem: v.page.url_path for v in all_views() if v.page}


def page_url_aliases() -> dict[str, str]:
    """An older URL path of a view's page -> the page's stem (app.py sends such a URL on to the page's own)."""
    return {old: v.page.stem for v in all_views() if v.page for old in v.page.url_aliases}


def page_defaults() -> dict[str, dict]:
    """View folder -> its page's default controls, for every view with a page."""
    return {v.page.prefix.removesuffix("_"): v.page.defaults for v in all_views() if v.page}


def link_prefixes() -> dict[str, str]:
    """Another prefix a saved link may carry -> the prefix of those controls."""
    return {v.page.link_prefix: v.page.prefix for v in all_views() if v.page and v.page.link_prefix}


def of(result) -> View:
    """The view a result belongs to (by its type's name); KvvizError for anything else."""
    _ensure()
    name = type(result).__name__
    for v in _VIEWS.values():
        if v.result_type == name:
            return v
    raise KvvizError(f"cannot export a {name}")


_LOADED: list[str] = []


def _ensure() -> None:
    for folder in VIEW_FOLDERS:
        if folder not in _LOADED:
            add_folder(folder)
            _LOADED.append(folder)
