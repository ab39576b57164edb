"""A one-click scenario of the Greedy paths page, run ahead (kvviz.teach.meeting)."""
from __future__ import annotations

from .run import DEFAULT_PATHS, GreedyConfig
from ...core.execution import ExecSettings
from ...models import loading


def setup(preset, device: str = "cpu"):
    """(model, config, settings) of the scenario: kvviz.teach.meeting runs them through the view's run."""
    c = preset.controls
    lm = loading.load_model(preset.model, preset.dtype, device)
    cfg = GreedyConfig(prompt=c.get("greedy_prompt", "This is a "), max_new_tokens=int(c.get("greedy_n", 24)),
                       paths=tuple(c.get("greedy_paths", DEFAULT_PATHS)))
    return lm, cfg, ExecSettings(invariant=preset.invariant)
