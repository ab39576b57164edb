"""An eager attention that computes in the tensors' own dtype.

Most eager attention functions in transformers run the softmax in float32 and cast back ("upcast"). That is a
sensible trick for 16-bit dtypes, but in float64 it silently *down*casts and adds float32 rounding (~1e-7) to a
run that is meant to be the exact reference. kvviz uses this function instead whenever a float64 model would
otherwise use such an eager function, so that float64 cached and uncached runs agree to ~1e-15.
"""
from __future__ import annotations

import inspect
import sys

import torch

NAME = "kvviz_exact_eager"
_registered = False


def exact_eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                          **kwargs):
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            weights = weights.masked_fill(~attention_mask, torch.finfo(weights.dtype).min)
        else:
            weights = weights + attention_mask[..., : key.shape[-2]]
    weights = torch.softmax(weights, dim=-1)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


def register() -> str:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionInterface.register(NAME, exact_eager_attention)
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
        _registered = True
    return NAME


def eager_upcasts(model) -> bool:
    """Whether the model's own eager attention runs its softmax in float32 (and so loses float64 precision)."""
    module = sys.modules.get(type(model).__module__)
    fn = getattr(module, "eager_attention_forward", None)
    if fn is None:
        return False
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return "torch.float32" in src
