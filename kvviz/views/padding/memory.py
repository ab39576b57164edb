"""What a Padding and batching run holds (its memory plan): the prompt with its batch-mates in one batch, as wide as
its longest row, cell by cell (kvviz.views.padding.run). Declared in its entry: View(memory=PaddingMemory(...))."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.inputs import Workload
from ...core.memory import BYTES, MemoryProfile, ModelShape, head_slice_bytes, tokens_of_text, working_bytes


@dataclass(frozen=True)
class PaddingMemory(MemoryProfile):
    batch_texts: tuple[str, ...] = ()  # texts that join the prompt in a batch, each made longer than it

    @property
    def streamed_head_apart(self) -> bool:  # the grid's phases are not built on one working set: left as is
        return False

    @property
    def probes_in_first_forward(self) -> bool:
        return False

    def sizes(self, spec, w: Workload, tokens: int, batch: int, compared: int | None) -> tuple[int, int, int | None]:
        """The batch is as wide as its longest row: each batch-mate made longer than the prompt."""
        prompt = tokens - int(w.left_pad or 0) - int(w.new_tokens or 0)
        # the prompt's positions after the split, half of them where none is named (its padding is not compared)
        compared = max(1, prompt - (min(int(w.split), prompt - 1) if compared is not None else max(1, prompt // 2)))
        for text in self.batch_texts:
            c = tokens_of_text(spec, text)
            tokens = max(tokens, c + max(c - 1, 0) * (prompt // max(1, c - 1) + 1))
        return tokens, batch, compared

    def activations(self, shape, dtype, tokens, batch, reference, compared=None, steps=None, reference_decodes=True,
                    runs=None, attention="sdpa", device="cpu") -> int:
        return batch_grid_bytes(shape, dtype, tokens, batch, compared, reference)


def batch_grid_bytes(shape: ModelShape, dtype: str, width: int, batch: int, compared: int | None,
                     reference: bool) -> int:
    """The padding grid (kvviz.views.padding.run): the prompt alone without cache (every position's logits in the
    run's dtype, its compared rows kept; float64 computes only those), then each scenario over a batch of `batch`
    rows `width` wide: without cache every row's logits (float64: the compared positions only), with cache the
    compared positions of every row; the target's compared rows copied out, then compared with the reference's in
    float64 (both upcast, the difference and its absolute value)."""
    b, W, B, V = BYTES[dtype], width, batch, shape.vocab
    n = max(1, min(compared or W, W))

    def phases(w: int) -> int:
        rows = n if w == 8 else W  # float64 computes only the compared positions' logits
        sliced = head_slice_bytes if w == 8 else (lambda shape, rows: 0)  # the streamed reference's head

        # each forward: its working set and logits (a big head's slice beside them), then its rows copied out
        alone = max(working_bytes(shape, w, W) + rows * V * w + sliced(shape, rows), rows * V * w + n * V * w)
        scenario = n * V * w + n * (shape.layers + 1) * shape.hidden * w + max(  # beside the reference's rows
            working_bytes(shape, w, W, B) + B * rows * V * w + sliced(shape, B * rows),
            B * rows * V * w + n * V * w)
        cell = 2 * n * V * w + (2 if w == 8 else 3) * n * V * 8  # an upcast of a float64 tensor is itself
        return max(alone, scenario, cell)

    run = phases(b)
    if not reference:
        return int(run)
    return int(max(run, phases(8)))
