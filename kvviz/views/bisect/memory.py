"""What a bisector run holds (its memory plan): a Split point's forwards and what it records of every module and op
(kvviz.views.bisect.run). Declared in its entry: View(memory=BisectMemory(...)); a split whose proof fails runs
the bisector only where this fits beside its model (kvviz.core.memory.fits_beside)."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.memory import BYTES, MemoryProfile, ModelShape, working_bytes


@dataclass(frozen=True)
class BisectMemory(MemoryProfile):
    """The bisector runs in the run's own dtype (no float64 rerun, no proof phase of a split)."""

    @property
    def float64_run_is_reference(self) -> bool:  # it records every position's full forward, float64 or not
        return False

    @property
    def reruns_where_parted(self) -> bool:
        return False

    def activations(self, shape, dtype, tokens, batch, reference, compared=None, steps=None, reference_decodes=True,
                    runs=None, attention="sdpa", device="cpu") -> int:
        n = max(1, min(compared or tokens, tokens))
        return max(super().activations(shape, dtype, tokens, batch, reference, compared, steps, reference_decodes,
                                       runs, attention, device),
                   bisect_bytes(shape, BYTES[dtype], tokens, n, batch))


def bisect_bytes(shape: ModelShape, width: int, tokens: int, compared: int, batch: int = 1) -> int:
    """The bisector (kvviz.views.bisect.run): one full forward's working set and logits over every position, plus
    what it records of the compared positions - the outputs and inputs of every module of a layer (norms,
    projections, attention, MLP parts), then, in its op trace, the output of every op (the same tensors and the
    attention scores against every key; at least float32: a 16-bit model computes its norms, softmaxes and rotary
    embeddings in float32, and the trace records those outputs as they are), and the head's logits rows in both."""
    T, B, H, L, V, n = tokens, batch, shape.hidden, shape.layers, shape.vocab, compared
    q, kv, inter = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    modules = 2 * (10 * H + 2 * q + 2 * kv + 4 * inter)
    ops = 12 * H + 6 * inter + 3 * q + 3 * kv + 3 * shape.heads * T
    working = working_bytes(shape, width, T, B)  # sdpa on the CPU: one score tensor, at least float32
    return int(working + B * T * V * width + B * n * (L * modules * width + L * ops * max(width, 4)
                                                      + (2 * V + 8 * H) * width))
