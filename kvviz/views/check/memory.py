"""What the cache-safety card holds (its memory plan): its checks run on the float64 reference (float64_only), past
the model's sliding window when there is one, and its window check compares token by token (kvviz.views.check.run).
Declared in its entry: View(memory=CheckMemory(...))."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.inputs import Workload
from ...core.memory import MemoryProfile, hidden_bytes, model_shape, stepwise_reference_bytes, working_bytes


@dataclass(frozen=True)
class CheckMemory(MemoryProfile):
    def sizes(self, spec, w: Workload, tokens: int, batch: int, compared: int | None) -> tuple[int, int, int | None]:
        """The card's own prompts run past the sliding window when there is one: at least 2 windows + 4 tokens, 64."""
        sh = model_shape(spec)
        return max(tokens, 2 * int((sh.sliding_window if sh else 0) or 0) + 4, 64), batch, compared

    def activations(self, shape, dtype, tokens, batch, reference, compared=None, steps=None, reference_decodes=True,
                    runs=None, attention="sdpa", device="cpu") -> int:
        """Only the float64 reference runs (a float64 run: the model itself), compared token by token (the window
        check: kvviz.views.split.run._ChunkedLogits): one forward's working set, the step loop's logits and the
        hidden states."""
        if not (reference or dtype == "float64"):
            return 0
        n = max(1, min(compared or tokens, tokens))
        return int(working_bytes(shape, 8, tokens, batch, attention, device)
                   + stepwise_reference_bytes(shape, tokens, n, batch) + hidden_bytes(self, shape, 8, tokens, batch, n))
