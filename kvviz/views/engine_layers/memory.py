"""What the Engine layers view holds in kvviz's process (its memory plan): two no-cache forwards of the prompt (the
float64 reference and its own run in the engine's dtype), every hidden state kept (they go to the worker as a file) -
MemoryProfile(forwards=3, streamed_hidden=False) - and, after the engine is closed, the logit lens of both sides
(lens_bytes): the two sides' saved hidden states (llama.cpp's .npz read whole in float32; vLLM's safetensors a row at
a time, less), one chunk of positions' lens logits of both sides and the float64 temporaries of their KL
(kvviz.core.lens.lens_pair: a chunk of LOGITS_CHUNK_BYTES of float64 at a time, never a layer's logits for every
position). The engine's own memory is its own process's. Declared in its entry: View(memory=EngineLayersMemory(...))."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.lens import lens_chunk
from ...core.memory import BYTES, MemoryProfile, ModelShape, comparison_temporaries


def lens_bytes(shape: ModelShape, dtype: str, tokens: int) -> int:
    """The lens phase's peak: both sides' states [layers + 1, tokens, hidden] in float32, the lens logits of one chunk
    of positions for both sides in the model's dtype, and the KL's float64 temporaries over that chunk."""
    rows, chunk = shape.layers + 1, min(max(1, tokens), lens_chunk(shape.vocab))
    states = 2 * rows * tokens * shape.hidden * 4
    width = BYTES.get(dtype, 4)
    return int(states + 2 * chunk * shape.vocab * width + comparison_temporaries(width, chunk * shape.vocab * 8))


@dataclass(frozen=True)
class EngineLayersMemory(MemoryProfile):
    def activations(self, shape, dtype, tokens, batch, reference, compared=None, steps=None, reference_decodes=True,
                    runs=None, attention="sdpa", device="cpu") -> int:
        """The larger of its forwards' phase (MemoryProfile's) and the lens phase (lens_bytes), which come one after
        the other."""
        forwards = super().activations(shape, dtype, tokens, batch, reference, compared, steps, reference_decodes,
                                       runs, attention, device)
        return int(max(forwards, lens_bytes(shape, dtype, tokens)))
