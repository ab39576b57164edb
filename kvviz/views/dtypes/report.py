"""The dtypes view's report: its result rebuilt from a JSON export (no model runs) and its verdict line."""
from __future__ import annotations

import numpy as np

from ...io.export import typed
from .run import DtypesResult, DtypesSettings


def reopen(d: dict):
    per_prompt = {m: {k: np.array(v, dtype=float) for k, v in by.items()} for m, by in d["per_prompt"].items()}
    return DtypesResult(settings=typed(DtypesSettings, d["settings"], skipped_dtypes=tuple), model=d["model"],
                        dtypes=d["dtypes"], prompts=d["prompts"], layer_labels=d["layer_labels"],
                        per_prompt=per_prompt, logits_max_abs=d["logits_max_abs"], verdicts=d["verdicts"],
                        elapsed_s=d.get("elapsed_s", 0.0), proved=d.get("proved", {}))


def verdict(result) -> tuple[str, str]:
    return "see the table", result.verdict_counts().to_html()
