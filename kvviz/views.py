"""The view registry: one entry per view, read by export (JSON, reopen, HTML), repro and the CLI's `open`.

A view is a scenario kvviz can run and show (split, greedy, …). Its entry says what its result type is called, how a
JSON export of it is rebuilt, which figures and verdict line its report shows, and whether a standalone repro script
exists for it. Everything that used to compare view names (`if view == "split": …`) looks the view up here instead,
so adding a view is its module plus one `register(View(...))` line (see docs/architecture.md).

Entries name their functions as "module:function" strings, resolved on first use, so this module imports nothing
from the views and the views never import it back: no import cycles.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from .errors import KvvizError


def _resolve(ref: "str | Callable | None") -> "Callable | None":
    if ref is None or callable(ref):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class View:
    name: str  # the `view` of its JSON export
    title: str  # as the pages call it
    result_type: str  # the class name of its result
    reopen: "str | Callable[[dict], object]"  # JSON dict (header removed) -> the result
    figures: "str | Callable[[object], list] | None" = None  # result -> its main figures (pure)
    verdict: "str | Callable[[object], tuple[str, str]] | None" = None  # result -> (verdict, one paragraph)
    verdict_is_html: bool = False  # the paragraph is an HTML table (dtypes, padding, reuse, check)
    repro: bool = False  # a standalone repro script exists (kvviz.repro)
    command: str | None = None  # its CLI subcommand

    def rebuild(self, d: dict):
        return _resolve(self.reopen)(d)

    def main_figures(self, result) -> list:
        fn = _resolve(self.figures)
        return list(fn(result)) if fn else []

    def verdict_text(self, result) -> tuple[str, str]:
        fn = _resolve(self.verdict)
        if fn is None:
            return getattr(result, "verdict", ""), getattr(result, "explanation", "")
        return fn(result)


_VIEWS: dict[str, View] = {}


def register(view: View) -> View:
    _VIEWS[view.name] = view
    return view


def get(name: str) -> View:
    _ensure()
    if name not in _VIEWS:
        raise KvvizError(f"unknown view {name!r}")
    return _VIEWS[name]


def all_views() -> tuple[View, ...]:
    _ensure()
    return tuple(_VIEWS.values())


def names(repro: bool | None = None) -> tuple[str, ...]:
    return tuple(v.name for v in all_views() if repro is None or v.repro == repro)


def of(result) -> View:
    """The view a result belongs to (by its type's name); KvvizError for anything else."""
    _ensure()
    name = type(result).__name__
    for v in _VIEWS.values():
        if v.result_type == name:
            return v
    raise KvvizError(f"cannot export a {name}")


def _ensure() -> None:
    if not _VIEWS:
        importlib.import_module("kvviz.view_entries")
