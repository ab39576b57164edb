"""A one-click scenario of the Backends & compile page, run ahead (kvviz.meeting): the sliding-window grid."""
from __future__ import annotations


def run(preset, device: str = "cpu", progress=None):
    from ...loading import load_model

    from .run import run_matrix, sliding_window_config

    lm = load_model(preset.model, preset.dtype, device)
    return run_matrix(lm, sliding_window_config(lm), progress=progress)
