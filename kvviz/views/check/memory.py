"""What the cache-safety card holds (its memory plan): its checks run on the float64 reference, past the model's
sliding window when there is one (kvviz.views.check.run). Declared in its entry: View(memory=CheckMemory(...))."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.inputs import Workload
from ...core.memory import MemoryProfile, model_shape


@dataclass(frozen=True)
class CheckMemory(MemoryProfile):
    def sizes(self, spec, w: Workload, tokens: int, batch: int, compared: int | None) -> tuple[int, int, int | None]:
        """The card's own prompts run past the sliding window when there is one: at least 2 windows + 4 tokens, 64."""
        sh = model_shape(spec)
        return max(tokens, 2 * int((sh.sliding_window if sh else 0) or 0) + 4, 64), batch, compared
