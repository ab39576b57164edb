"""A one-click scenario of the Split point page, run ahead (kvviz.teach.meeting): the page's controls from the preset,
its defaults for the rest."""
from __future__ import annotations

from .run import SplitConfig
from ...core.execution import ExecSettings
from ...core.inputs import encode
from ...models import loading


def setup(preset, device: str = "cpu"):
    """(model, config, settings) of the scenario: kvviz.teach.meeting runs them through the view's run."""
    c = preset.controls
    lm = loading.load_model(preset.model, preset.dtype, device)
    prompt = c.get("split_prompt", "The capital of France is Paris, and the capital of Italy is")
    n = len(encode(lm, prompt))
    cfg = SplitConfig(prompt=prompt, split=int(c.get("split_k", min(max(1, n // 2), n - 1))),
                      mode=c.get("split_mode", "chunk"), left_pad=int(c.get("split_pad", 0)),
                      position_ids=c.get("split_pos", "auto"), attention_mask=c.get("split_mask", "full"))
    return lm, cfg, ExecSettings(invariant=preset.invariant)
