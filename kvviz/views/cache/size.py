"""How big is a KV cache? The formula, and the measured size of a live cache.

Bytes per token = 2 (keys and values) × layers × KV heads × head dim × bytes per value. A sliding-window layer
stores at most its window (transformers' dynamic sliding layers keep the last window − 1 tokens between steps), so
it stops growing there. A quantized cache stores `nbits` per value plus a scale and zero point per group, and keeps
the last `residual_length` tokens unquantized; the fp8 backend stores one byte per value and one scale per tensor.
Well-known configurations ship as small JSON files in kvviz/data/configs (no download).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import pandas as pd
from transformers import DynamicCache

from ...models.compat import output_cache
from ...core.dtypes import DTYPE_NAMES, parse_dtype
from ...core.errors import KvvizError
from ...core.inputs import Workload
from ...core.execution import Executor, cache_layers
from ...models.loading import LoadedModel
from ...core.protocol import DEFAULT_CONTEXT, RunContext
from ...core.estimate import Timed

CONFIG_DIR = Path(__file__).resolve().parents[2] / "data" / "configs"
BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class KVShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    layer_windows: list[int | None] = field(default_factory=list)  # per layer: None (full) or its sliding window
    max_positions: int | None = None
    dtype: str = "bfloat16"

    @classmethod
    def from_dict(cls, name: str, d: dict) -> "KVShape":
        layers = d.get("num_hidden_layers") or d.get("n_layer")
        heads = d.get("num_attention_heads") or d.get("n_head")
        kv = d.get("num_key_value_heads") or heads
        hidden = d.get("hidden_size") or d.get("n_embd")
        head_dim = d.get("head_dim") or (hidden // heads if hidden and heads else None)
        if not (layers and kv and head_dim):
            raise KvvizError(f"{name}: the config lacks layers, KV heads or head dim")
        window = d.get("sliding_window")
        types = d.get("layer_types") or (["sliding_attention" if window else "full_attention"] * layers)
        windows = [window if t == "sliding_attention" and window else None for t in types]
        return cls(name=d.get("name", name), layers=int(layers), kv_heads=int(kv), head_dim=int(head_dim),
                   layer_windows=windows, max_positions=d.get("max_position_embeddings") or d.get("n_positions"),
                   dtype=d.get("dtype", "bfloat16"))

    @classmethod
    def from_model(cls, lm: LoadedModel) -> "KVShape":
        """From the loaded model; sliding layers as transformers' own cache builds them for this config."""
        cfg = lm.config.get_text_config(decoder=True).to_dict()
        shape = cls.from_dict(lm.name, cfg)
        layers = DynamicCache(config=lm.config).layers
        if len(layers) == shape.layers:
            shape.layer_windows = [getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False)
                                   else None for layer in layers]
        shape.max_positions = lm.max_positions
        shape.dtype = str(lm.dtype).removeprefix("torch.")
        return shape


def known_configs() -> list[KVShape]:
    return [KVShape.from_dict(p.stem, json.loads(p.read_text(encoding="utf-8")))
            for p in sorted(CONFIG_DIR.glob("*.json"))]


def _bytes(dtype: str) -> int:
    return BYTES[str(parse_dtype(dtype)).removeprefix("torch.")]


def per_token_bytes(shape: KVShape, dtype: str | None = None) -> int:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * _bytes(dtype or shape.dtype)


def stored_tokens(window: int | None, tokens: int) -> int:
    """How many tokens a layer keeps: all of them, or a sliding layer's last window − 1 (transformers' dynamic
    sliding layer) once the sequence is longer."""
    return tokens if window is None else min(tokens, window - 1)


def formula_bytes(shape: KVShape, tokens: int, dtype: str | None = None, batch: int = 1,
                  quantized: dict | None = None) -> int:
    """Bytes of the cache after `tokens` tokens for `batch` sequences. quantized: {"backend": "fp8"} or
    {"nbits": 4, "residual_length": 128, "group_size": 64, "scale_bytes": 2}."""
    per_value = _bytes(dtype or shape.dtype)
    total = 0
    for window in shape.layer_windows or [None] * shape.layers:
        n = stored_tokens(window, tokens)
        values = 2 * batch * shape.kv_heads * shape.head_dim * n  # keys and values
        if quantized is None:
            total += values * per_value
        elif quantized.get("backend") == "fp8":
            total += values * 1 + 2 * 4  # one byte per value, one float32 scale per tensor
        else:
            r = min(n, int(quantized.get("residual_length", 128)))
            q_vals = values * (n - r) // max(1, n)
            groups = -(-q_vals // int(quantized.get("group_size", 64)))
            total += (q_vals * int(quantized["nbits"]) + 7) // 8 + groups * 2 * int(quantized.get("scale_bytes", 2)) \
                + (values - q_vals) * per_value
    return total


def measured_bytes(lm: LoadedModel, tokens: int, batch: int = 1) -> int:
    """Run `tokens` tokens (batch of `batch`) through the model and sum the live cache's key and value bytes."""
    if lm.max_positions is not None and tokens > lm.max_positions:
        raise KvvizError(f"{tokens} tokens do not fit the model's context of {lm.max_positions}")
    vocab = int(lm.config.get_text_config(decoder=True).vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, tokens), generator=g).to(lm.device)
    ex = Executor(lm)
    with ex.session():
        out = ex.forward(ids, torch.ones_like(ids), hidden=False, logits_to_keep=1)
    layers = cache_layers(output_cache(out))
    if not layers:
        raise KvvizError(f"{lm.name} returns no cache (a bidirectional model): there is nothing to measure")
    return int(sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers))


@dataclass
class SizeReport(Timed):
    model: str
    tokens: int
    batch: int
    dtype: str
    per_token_bytes: int
    formula_bytes: int
    measured_bytes: int | None
    sliding_layers: int
    fp8_formula_bytes: int
    int4_formula_bytes: int
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def size_report(lm: LoadedModel, tokens: int, batch: int = 1, measure: bool = True) -> SizeReport:
    SizeConfig(tokens, batch, measure).validate()
    shape = KVShape.from_model(lm)
    dtype = shape.dtype
    measured, note = None, ""
    if measure:
        try:
            measured = measured_bytes(lm, tokens, batch)
        except KvvizError as e:
            note = str(e)
    return SizeReport(model=lm.name, tokens=tokens, batch=batch, dtype=dtype, per_token_bytes=per_token_bytes(shape),
                      formula_bytes=formula_bytes(shape, tokens, dtype, batch), measured_bytes=measured,
                      sliding_layers=sum(w is not None for w in shape.layer_windows),
                      fp8_formula_bytes=formula_bytes(shape, tokens, dtype, batch, {"backend": "fp8"}),
                      int4_formula_bytes=formula_bytes(shape, tokens, dtype, batch, {"nbits": 4}), note=note)


def known_table(tokens: int = 4096, dtype: str | None = None):
    """The shipped configurations: bytes per token and the cache at `tokens` tokens (in their usual dtype, or
    `dtype`)."""
    rows = []
    for s in known_configs():
        d = dtype or s.dtype
        rows.append({"model": s.name, "layers": s.layers, "KV heads": s.kv_heads, "head dim": s.head_dim,
                     "sliding layers": sum(w is not None for w in s.layer_windows), "dtype": d,
                     "KiB per token": per_token_bytes(s, d) / 1024,
                     f"MiB at {tokens} tokens": formula_bytes(s, tokens, d) / 2 ** 20})
    return pd.DataFrame(rows)


def growth(shapes: list[KVShape], max_tokens: int, dtypes=DTYPE_NAMES[1:], points: int = 40) -> list[dict]:
    """Bytes against context length per dtype (rows for a chart)."""
    out = []
    for s in shapes:
        top = min(max_tokens, s.max_positions or max_tokens)
        for t in sorted({max(1, int(top * k / points)) for k in range(1, points + 1)}):
            for d in dtypes:
                out.append({"model": s.name, "dtype": d, "tokens": t, "bytes": formula_bytes(s, t, d)})
    return out


@dataclass(frozen=True)
class SizeConfig:
    """The cache's size for `tokens` tokens and `batch` rows: the formula, and measured unless measure is False."""
    tokens: int = 1024
    batch: int = 1
    measure: bool = True

    def validate(self) -> "SizeConfig":
        for name, v in (("--tokens", self.tokens), ("--batch", self.batch)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KvvizError(f"{name} must be 1 or more, not {v}")
        return self

    def workload(self) -> Workload:
        """What the run holds, for its memory plan: its own tokens and batch."""
        return Workload(tokens=int(self.tokens), batch=int(self.batch))


# what its run cannot honour (kvviz.core.protocol.RunContext.running; the CLI refuses the matching flag)
REFUSES = {'invariant': 'sizes do not depend on it', 'prove': 'it runs no proof rerun'}


def run(lm: LoadedModel, config: SizeConfig, ctx: RunContext = DEFAULT_CONTEXT) -> SizeReport:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    config.validate()
    with ctx.running(REFUSES):
        return size_report(lm, config.tokens, config.batch, measure=config.measure)
