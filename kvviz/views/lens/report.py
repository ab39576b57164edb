"""The lens view's result rebuilt from its JSON export (no model runs), and its verdict line."""
from __future__ import annotations

from dataclasses import fields

from .run import LensPaths, LensResult


def _paths(d: dict | None) -> LensPaths | None:
    return None if d is None else LensPaths(**d)


def reopen(d: dict) -> LensResult:
    names = {f.name for f in fields(LensResult)}
    kw = {k: v for k, v in d.items() if k in names}  # `decision`, `parting` are derived
    same = kw.get("float64") is not None and kw["float64"] == kw["main"]
    kw["main"] = _paths(kw["main"])
    kw["float64"] = kw["main"] if same else _paths(kw.get("float64"))
    return LensResult(**kw)


def verdict(result: LensResult) -> tuple[str, str]:
    return result.verdict, result.explanation
