"""A one-click scenario of the Dtypes side by side page, run ahead (kvviz.meeting): the built-in prompts (as many
as the preset's limit) in float32, float16 and bfloat16 against float64, with the preset's split and feed mode."""
from __future__ import annotations


def run(preset, device: str = "cpu", progress=None):
    from ...loading import parse_spec
    from ...prompts import builtin_prompts

    from .run import run_dtypes

    prompts = [r["prompt"] for r in builtin_prompts()][: int(preset.controls.get("dtypes_limit", 8))]
    return run_dtypes(parse_spec(preset.model), prompts, ["float32", "float16", "bfloat16"], device, "auto",
                      split=preset.controls.get("dtypes_split", "last"), mode=preset.controls.get("dtypes_mode", "chunk"),
                      progress=progress)
