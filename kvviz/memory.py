"""Memory plans: what a run will hold, against what the device has free, before anything is loaded."""
from __future__ import annotations

import torch

TWIN_MAX_BYTES = 2 * 1024 ** 3  # a full float64 twin up to this size is kept when memory allows (it runs faster)


def choose_reference(lm) -> str:
    """'twin' where a float64 copy of the model is small and fits easily, 'streamed' otherwise."""
    n = sum(p.numel() for p in lm.model.parameters())
    twin = 8 * n
    free = free_bytes(lm.device)
    return "twin" if twin <= TWIN_MAX_BYTES and (free is None or twin <= free // 4) else "streamed"


def free_bytes(device: torch.device) -> int | None:
    return None
