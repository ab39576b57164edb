"""The greedy view's report: its result rebuilt from a JSON export (no model runs) and its verdict line."""
from __future__ import annotations

import numpy as np

from ...io.export import typed
from ...core.verdict import Verdict
from .run import GreedyPath, GreedyResult, GreedySettings, PairResult, PathResult


def reopen(d: dict):
    paths = {GreedyPath(k): typed(PathResult, v, name=GreedyPath) for k, v in d["paths"].items()}
    pairs = [PairResult(**{**p, "a": GreedyPath(p["a"]), "b": GreedyPath(p["b"]),
                           "hidden_relative": np.array(p["hidden_relative"], dtype=float)}) for p in d["pairs"]]
    return GreedyResult(settings=typed(GreedySettings, d["settings"], paths=lambda v: tuple(map(GreedyPath, v))),
                        model=d["model"],
                        prompt_tokens=d["prompt_tokens"], layer_labels=d["layer_labels"], paths=paths, pairs=pairs,
                        notes=d.get("notes", []), elapsed_s=d.get("elapsed_s", 0.0), proof_s=d.get("proof_s"))


def verdict(result) -> tuple[str, str]:
    parting = [p for p in result.pairs if p.first_divergence is not None]
    if not parting:
        return Verdict.IDENTICAL, f"All paths chose the same {result.steps} tokens."
    first = min(parting, key=lambda p: p.first_divergence)
    return first.verdict, first.explanation
