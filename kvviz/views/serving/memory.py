"""What a Serving study holds (its memory plan): its prompts through a paged serving engine in kvviz's process
(transformers' continuous batching, kvviz.engines.serving), one engine per call. Declared in its entry:
View(memory=ServingMemory(...)); kvviz.core.memory.paged_study_bytes counts the calls."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...core.inputs import Workload
from ...core.memory import PAGE_SIZE, MemoryProfile, PagedCalls


@dataclass(frozen=True)
class ServingMemory(MemoryProfile):
    # per condition: its name, the engine requests one call holds per prompt, whether they run in batches of the
    # workload's batch; each call's paged cache, attention mask and batch forward are counted (paged_call_bytes).
    # The float64 reference replays one prompt's call where a prompt parted
    engine_calls: tuple[tuple[str, int, bool], ...] = ()

    no_rerun: ClassVar[str] = "no prompt parted from its reference"

    def engine(self, w: Workload) -> PagedCalls | None:
        """The engine calls of a study as the workload runs it; None where it runs no paged engine in this process
        (vLLM, llama.cpp, a server: page_size 0)."""
        if not self.engine_calls or w.page_size == 0:
            return None
        n, k = max(1, len(w.texts)), max(1, int(w.batch or 1))
        calls, replays = [], []
        for name, per_prompt, batched in self.engine_calls:
            if w.conditions and name not in w.conditions:
                continue
            if batched:  # the prompts cut into batches of k, the last filled up with neighbours
                calls.append((-(-n // k) * k, k))
                replays.append((k, k))
            else:
                calls.append((per_prompt * n, 1))
                replays.append((per_prompt, 1))
        return PagedCalls(tuple(calls), tuple(replays), int(w.page_size or PAGE_SIZE)) if calls else None
