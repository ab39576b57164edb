"""A one-click scenario of the Dtypes side by side page, run ahead (kvviz.teach.meeting): the built-in prompts (as many
as the preset's limit) in float32, float16 and bfloat16 against float64, with the preset's split and feed mode."""
from __future__ import annotations

from .run import DtypesConfig
from ...core.execution import DEFAULT_SETTINGS
from ...core.prompts import builtin_prompts
from ...models import loading


def setup(preset, device: str = "cpu"):
    """(model, config, settings) of the scenario: kvviz.teach.meeting runs them through the view's run (the float32
    model's twins give the other dtypes)."""
    prompts = tuple(r["prompt"] for r in builtin_prompts())[: int(preset.controls.get("dtypes_limit", 8))]
    cfg = DtypesConfig(prompts, ("float32", "float16", "bfloat16"), split=preset.controls.get("dtypes_split", "last"),
                       mode=preset.controls.get("dtypes_mode", "chunk"))
    return loading.load_model(preset.model, "float32", device), cfg, DEFAULT_SETTINGS
