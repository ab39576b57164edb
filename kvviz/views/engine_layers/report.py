"""The engine-layers view's report: its result rebuilt from a JSON export (no engine runs) and its verdict line."""
from __future__ import annotations

from .run import EngineLayersResult


def reopen(d: dict):
    return EngineLayersResult.from_dict(d)


def verdict(res) -> tuple[str, str]:
    return res.verdict, res.summary_line() + ". " + res.explanation
