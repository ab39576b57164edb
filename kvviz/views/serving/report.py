"""The serving view's report: its result rebuilt from a JSON export (no model runs) and its verdict line."""
from __future__ import annotations

from ...core.verdict import Tally


def reopen(d: dict):
    from .run import ServeResult

    return ServeResult.from_dict(d)


def verdict(res) -> tuple[str, str]:
    parting = [p for p in res.prompts if p.first_divergence is not None or p.verdict == "logic"]
    if not parting:
        return "identical", res.summary_line() + "."
    head = Tally(res.verdict_counts())
    first = min(parting, key=lambda p: (p.verdict != "logic", p.first_divergence if p.first_divergence is not None
                                        else 10 ** 9))
    return head, res.summary_line() + ". " + (first.explanation or "") + (f" {first.proof}" if first.proof else "")
