"""The quant view's report: its result rebuilt from a JSON export (no model runs) and its verdict line."""
from __future__ import annotations

from ...io.export import typed
from .run import QuantResult, QuantSettings


def reopen(d: dict):
    d = {k: v for k, v in d.items() if k not in ("kl_max", "kl_mean", "worst_layer")}
    return QuantResult(**{**d, "settings": typed(QuantSettings, d["settings"])})
