"""The matrix view's report: its result rebuilt from a JSON export (no model runs) and its verdict line."""
from __future__ import annotations

from collections import Counter

from ...io.export import typed
from .run import Cell, MatrixResult, MatrixSettings


def reopen(d: dict):
    return MatrixResult(settings=typed(MatrixSettings, d["settings"], batch_with=tuple, attentions=tuple, caches=tuple,
                                       compiles=tuple, flag_sets=lambda f: tuple(tuple(x) for x in f)), environment=d["environment"], reference=d["reference"],
                        cells=[typed(Cell, c) for c in d["cells"]], elapsed_s=d.get("elapsed_s", 0.0))


def verdict(result) -> tuple[str, str]:
    counts = Counter(c.verdict or "error" for c in result.cells)
    return "cells", ", ".join(f"{v}: {n}" for v, n in counts.items())
