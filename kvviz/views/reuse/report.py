"""The reuse view's report: its result rebuilt from a JSON export (no model runs) and its verdict line."""
from __future__ import annotations

from ...core.verdict import Verdict, worst
from ...io.export import typed
from .run import ReuseResult, ReuseSettings


def reopen(d: dict):
    return ReuseResult(settings=typed(ReuseSettings, d["settings"], continuations=tuple), model=d["model"],
                       prefix_tokens=d["prefix_tokens"], runs=d["runs"])


def verdict(result) -> tuple[str, str]:
    return "see the table", result.table().to_html(index=False)


def worst_way(result) -> tuple[str, str]:
    """The page's verdict: the worst way of reusing the prefix against the fresh prefill, and which ways it is."""
    ways = [r for r in result.runs if r["strategy"] != "fresh"]
    v = worst((r["verdict"] for r in ways), Verdict.IDENTICAL)
    bad = sorted({r["strategy"] for r in ways if r["verdict"] == v})
    return v, {"logic": f"Logic: {' and '.join(bad)} compute{'s' if len(bad) == 1 else ''} something else than a "
                        "fresh prefill (the gap stays in float64)"
                        + (": the reused cache still holds the earlier continuations' tokens. Deep-copy the prefix "
                           "cache for every continuation." if bad == ["reused"] else "."),
               "precision": f"Precision: {' and '.join(bad)} differ from a fresh prefill only by rounding (the gap "
                            "closes in float64); the reuse logic is right.",
               "identical": "Identical: every way of reusing the prefix gives the fresh run's numbers bit for "
                            "bit."}[v]
