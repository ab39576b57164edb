"""One-click scenarios for teaching: each shows its effect on any machine (constructed, or logic - which does not
depend on rounding). A preset is the sidebar model and dtype, the page, and that page's controls."""
from __future__ import annotations

from ..views import Preset  # noqa: F401 - the scenario type lives beside View (a view's entry declares its own)
from .. import views


PRESETS = (
    Preset("tie", "A word flips in 16-bit", "A tiny model built so its two top tokens differ by 2⁻¹² of a weight: "
           "float32 and float64 choose “b”, bfloat16 rounds both weights to the same number, ties exactly and "
           "chooses “a”. Precision, not logic - the float64 replay agrees.",
           "pages/greedy.py", "tiny:tie", "bfloat16",
           {"greedy_prompt": "Once upon a time", "greedy_n": 6, "greedy_paths": ["no_cache", "cache", "float64"]}),
    Preset("flip", "The cache changes a word", "A tiny Mamba built so that one rounding decides between “a” and "
           "“b”: its cached step rounds the skip term to bfloat16 before the gate, where the full forward keeps it "
           "in float32 (transformers' own code). No cache writes “aaaaaa”, the cache “abbbbb”, on every machine; "
           "float64 closes the gap (precision), invariant mode does not (not reduction order).",
           "pages/greedy.py", "tiny:flip", "bfloat16",
           {"greedy_prompt": "Once upon a time", "greedy_n": 6, "greedy_paths": ["no_cache", "cache", "float64"]}),
    Preset("padding", "Left padding without position ids", "The prompt is left-padded and the rest is fed through "
           "the cache without position ids: the model numbers the new tokens from the cache length, counting the "
           "pads. Logic: the gap stays in float64.",
           "pages/split.py", "tiny:llama", "float32",
           {"split_pad": 4, "split_pos": "omit", "split_mask": "full"}),
    Preset("newonly", "A mask that covers only the new tokens", "The attention mask passed with the rest covers only "
           "the new tokens; transformers lines it up with the first positions and blocks the latest keys. Logic.",
           "pages/split.py", "tiny:llama", "float32",
           {"split_pad": 0, "split_pos": "auto", "split_mask": "new-only"}),
    Preset("layers", "How a 16-bit gap grows across layers", "float64, float32, float16 and bfloat16 side by side "
           "over a few prompts: the cached-vs-full gap per layer, raw and in each dtype's ε.",
           "pages/dtypes.py", "tiny:llama", "bfloat16", {"dtypes_source": "built-in set", "dtypes_limit": 4, "dtypes_split": "half", "dtypes_mode": "step"}),
    Preset("bidirectional", "A model that is not causal", "RoBERTa-style attention sees later tokens too, so it "
           "returns no cache: appending tokens changes what the earlier ones compute. Logic - do not use "
           "its cache (`cache`, past_key_values before transformers 5.24).", "pages/split.py", "tiny:roberta", "float32",
           {"split_pad": 0, "split_pos": "auto", "split_mask": "full"}),
    Preset("proof", "Prove it is rounding", "The same comparison in invariant mode: every row computed the same way "
           "whatever the shape - the cached run equals the full forward bit for bit.",
           "pages/split.py", "tiny:llama", "bfloat16", {"split_pad": 0, "split_pos": "auto",
                                                              "split_mask": "full", "split_mode": "step"},
           invariant=True),
    Preset("window", "Sliding window in a padded batch", "A short left-padded prompt batched with one longer than "
           "the sliding window, generating past the window, across attention kinds and cache kinds (the "
           "torch.compile report).", "pages/matrix.py", "tiny:mistral", "bfloat16", {"_mx_preset": True}),
)
BY_KEY = {p.key: p for p in PRESETS}


def all_presets() -> tuple[Preset, ...]:
    """PRESETS and the scenarios views declare in their registry entry (View(scenarios=...))."""
    return PRESETS + tuple(p for v in views.all_views() for p in v.scenarios)


def by_key() -> dict[str, Preset]:
    return {p.key: p for p in all_presets()}


def preset_state(p: Preset) -> dict:
    """The session-state values a preset sets (sidebar and page controls)."""
    return {"model_preset": p.model, "dtype": p.dtype, "invariant": p.invariant, **p.controls}
