"""The split view's report: its result rebuilt from a JSON export (no model runs) and its verdict line."""
from __future__ import annotations

import numpy as np

from ...io.export import typed, arrays
from .run import Comparison, SplitResult, SplitSettings


def comparison(d: dict | None):
    if d is None:
        return None
    c = Comparison(dtype=d["dtype"], device=d["device"], attention=d["attention"], has_cache=d["has_cache"],
                   hidden=arrays(d.get("hidden")), logits=arrays(d.get("logits")), describe=d.get("describe", {}),
                   kv=d.get("kv", []), reference_top1=d.get("reference_top1", []),
                   cached_top1=d.get("cached_top1", []), bidirectional_change=d.get("bidirectional_change"))
    for name, dtype in (("argmax_agree", bool), ("top5_overlap", np.int64)):
        if name in c.logits:
            c.logits[name] = c.logits[name].astype(dtype)
    return c


def reopen(d: dict):
    return SplitResult(settings=typed(SplitSettings, d["settings"]), model=d["model"], tokens=d["tokens"],
                       token_ids=d["token_ids"], compared=d["compared_positions"], layer_labels=d["layer_labels"],
                       main=comparison(d["result"]), float64=comparison(d.get("float64_evidence")),
                       verdict=d["verdict"], explanation=d["explanation"], notes=d.get("notes", []),
                       elapsed_s=d.get("elapsed_s", 0.0), invariant=comparison(d.get("invariant_check")),
                       proof=d.get("proof"), proof_s=d.get("proof_s"))


def verdict(result) -> tuple[str, str]:
    proof = result.proof if result.proof and not result.proof_in_explanation else None
    return result.verdict, result.explanation + (f" {proof}" if proof else "")
