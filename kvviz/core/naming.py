"""The one layer-naming rule every output of kvviz follows (heatmaps, per-layer charts, the bisector's text, tables,
exports and the CLI).

Rows of a per-layer view are the model's hidden states: row 0 is "embeddings" (the input of the first decoder layer),
row k >= 1 is "layer k" = the OUTPUT of the decoder layer module with index k-1 (e.g. `model.layers.{k-1}`). Labels
are 1-based; module paths keep the model's own 0-based indices and are shown beside the label or on hover, e.g.
"layer 2 (model.layers.1.self_attn)". The last hidden state of a transformers model is taken after the final norm,
so its label says so.

State-space models (transformers' Mamba, FalconMamba, RWKV: AFTER_BLOCKS) return no embeddings row: their loops
append the hidden state after each block, and the final norm's output last. Their rows are "layer 1" .. "layer N"
and "layer N + final norm" (layer_labels with the model's type).
"""
from __future__ import annotations

import re

EMBEDDINGS = "embeddings"
FINAL_NORM = " + final norm"
DEFAULT_BASE = "model.layers"  # Llama-style path; other families name it differently (verdict.layers_prefix)

# model types whose output_hidden_states tuple has no embeddings row: one entry after each block, the last after the
# final norm (transformers' Mamba, FalconMamba and RWKV loops append after the block)
AFTER_BLOCKS = ("mamba", "falcon_mamba", "rwkv")

_INDEX = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d+)(?:\.|$)")


def layer_label(k: int) -> str:
    """Row k of the hidden states: "embeddings" for 0, else "layer k" (the output of decoder layer module k-1)."""
    if k < 0:
        raise ValueError(f"a hidden-state row is 0 or more, not {k}")
    return EMBEDDINGS if k == 0 else f"layer {k}"


def layer_labels(n_hidden: int, model_type: str = "") -> list[str]:
    """The labels of all `n_hidden` hidden states (embeddings + one per decoder layer; the last after the final
    norm, as transformers returns it). A state-space model (model_type in AFTER_BLOCKS) has no embeddings row: layer
    1 .. N after its blocks, then layer N + final norm."""
    if model_type in AFTER_BLOCKS and n_hidden > 1:
        return [layer_label(k) for k in range(1, n_hidden)] + [layer_label(n_hidden - 1) + FINAL_NORM]
    labels = [layer_label(k) for k in range(n_hidden)]
    if n_hidden > 1:
        labels[-1] += FINAL_NORM
    return labels


def model_type(lm) -> str:
    """A loaded model's type as its config names it ("llama", "mamba", ...; "" where it has none): what
    layer_labels needs to name its rows."""
    model = getattr(lm, "model", lm)
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "model_type", "") or "")


def label_of_module_index(index: int) -> str:
    """The row label of the output of decoder layer module `index` (0-based, as in `model.layers.{index}`)."""
    return layer_label(index + 1)


def module_index(name: str) -> int | None:
    """The 0-based decoder layer index in a module path (`model.layers.3.mlp` -> 3; `transformer.h.0` -> 0)."""
    m = _INDEX.search(name)
    return int(m.group(1)) if m else None


def module_row(name: str) -> str:
    """The row label a module's output belongs to ("layer 2" for model.layers.1.mlp), or "outside the layers"."""
    i = module_index(name)
    return "outside the layers" if i is None else label_of_module_index(i)


def module_label(name: str) -> str:
    """A module path with its layer label: "layer 2 (model.layers.1.self_attn)"; a module outside the decoder
    layers keeps its path with where it is ("model.embed_tokens (before the layers)")."""
    i = module_index(name)
    if i is None:
        return f"{name} (outside the decoder layers)"
    return f"{label_of_module_index(i)} ({name})"


def layer_module(k: int, base: str = DEFAULT_BASE) -> str:
    """The module whose output hidden-state row k is: the embeddings for 0, else `{base}.{k-1}`."""
    return "the embeddings (input of the first layer)" if k == 0 else f"{base}.{k - 1}"


def hover_text(label: str, base: str = DEFAULT_BASE) -> str:
    """What a hover over a row shows beside its label: the module path whose output it is."""
    m = re.match(r"layer (\d+)", label)
    if not m:
        return label
    k = int(m.group(1))
    extra = " then the final norm" if label.endswith(FINAL_NORM) else ""
    return f"{label}: output of {base}.{k - 1}{extra}"
