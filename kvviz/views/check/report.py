"""The check view's report: its result rebuilt from a JSON export (no model runs) and its verdict line."""
from __future__ import annotations

from ...io.export import typed
from .run import Check, CheckCard, CheckSettings


def reopen(d: dict):
    return CheckCard(**{**d, "checks": [Check(**c) for c in d["checks"]], "settings": typed(CheckSettings, d["settings"])})


def verdict(result) -> tuple[str, str]:
    return result.overall, result.summary
