"""The bisect view's report: its result rebuilt from a JSON export (no model runs) and its verdict line."""
from __future__ import annotations

from ...io.export import typed
from .run import BisectResult, BisectSettings, ModuleGap, OpGap
from ...core.naming import module_label


def reopen(d: dict):
    return BisectResult(settings=typed(BisectSettings, d["settings"]), first=ModuleGap(**d["first"]) if d.get("first") else None,
                        modules=[ModuleGap(**m) for m in d.get("modules", [])], explanation=d.get("explanation", ""),
                        first_op=OpGap(**d["first_op"]) if d.get("first_op") else None,
                        ops_compared=int(d.get("ops_compared", 0)))


def verdict(result) -> tuple[str, str]:
    return (("first difference: " + module_label(result.first.name)) if result.first else "no difference",
            result.explanation)
