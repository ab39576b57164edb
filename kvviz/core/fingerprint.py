"""A model's fingerprint: architecture, config hash, weights files' size+mtime hash, tokenizer hash, dtype, layers.

Saved with every exported result and every saved KV cache, so a result or a cache is never silently read against
another model."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .dtypes import dtype_name
from ..models.loading import LoadedModel

_IGNORED_CONFIG_KEYS = ("_name_or_path", "dtype", "torch_dtype", "transformers_version", "_attn_implementation",
                        "_attn_implementation_internal", "architectures", "_commit_hash")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def config_hash(lm: LoadedModel) -> str:
    d = lm.config.to_dict()
    for k in _IGNORED_CONFIG_KEYS:
        d.pop(k, None)
    return _sha(json.dumps(d, sort_keys=True, default=str).encode())


def weights_hash(lm: LoadedModel) -> str:
    """Size and modification time of every weights file of the model's folder (cheap; a changed file changes it)."""
    folder = Path(lm.source)
    files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")) if folder.is_dir() else []
    if not files:
        return _sha(lm.source.encode())
    return _sha("|".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files).encode())


def tokenizer_hash(lm: LoadedModel) -> str:
    vocab = lm.tokenizer.get_vocab()
    return _sha(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())


def fingerprint(lm: LoadedModel) -> dict:
    return {"architecture": lm.arch, "config": config_hash(lm), "weights": weights_hash(lm),
            "tokenizer": tokenizer_hash(lm), "dtype": dtype_name(lm.dtype), "layers": lm.n_layers}
