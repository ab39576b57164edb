"""A one-click scenario of the Backends & compile page, run ahead (kvviz.teach.meeting): the sliding-window grid."""
from __future__ import annotations

from .run import sliding_window_config
from ...core.execution import DEFAULT_SETTINGS
from ...models import loading


def setup(preset, device: str = "cpu"):
    """(model, config, settings) of the scenario: kvviz.teach.meeting runs them through the view's run."""
    lm = loading.load_model(preset.model, preset.dtype, device)
    return lm, sliding_window_config(lm), DEFAULT_SETTINGS
