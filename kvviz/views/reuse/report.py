"""The reuse view's report: its result rebuilt from a JSON export (no model runs) and its verdict line."""
from __future__ import annotations

from ...io.export import typed


def reopen(d: dict):
    from .run import ReuseResult, ReuseSettings

    return ReuseResult(settings=typed(ReuseSettings, d["settings"], continuations=tuple), model=d["model"],
                       prefix_tokens=d["prefix_tokens"], runs=d["runs"])


def verdict(result) -> tuple[str, str]:
    return "see the table", result.table().to_html(index=False)
