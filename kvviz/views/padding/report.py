"""The padding view's report: its result rebuilt from a JSON export (no model runs) and its verdict line."""
from __future__ import annotations

from ...io.export import typed
from .run import PaddingResult, PaddingSettings


def reopen(d: dict):
    return PaddingResult(settings=typed(PaddingSettings, d["settings"], companions=tuple), model=d["model"],
                         tokens=d["tokens"], compared=d["compared"], cells=d["cells"], proof_s=d.get("proof_s"))


def verdict(result) -> tuple[str, str]:
    return "see the grid", result.grid().to_html()
