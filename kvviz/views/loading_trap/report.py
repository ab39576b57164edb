"""The loading_trap view's report: its result rebuilt from a JSON export (no model runs) and its verdict line."""
from __future__ import annotations

from ...io.export import typed
from .run import BufferDiff, LoadingTrapResult, LoadingTrapSettings


def reopen(d: dict):
    return LoadingTrapResult(**{**d, "buffers": [BufferDiff(**b) for b in d["buffers"]],
                                "settings": typed(LoadingTrapSettings, d["settings"])})
