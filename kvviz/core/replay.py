"""One decoding step replayed, and the greedy choice at a step: the pieces greedy, matrix and serving share.

`replay_step` gives the logits a computation (a full forward, or one of the cached ways) produces after being fed
given tokens; `top2` is the greedy choice with its runner-up and margin; `no_cache_tokens` is the plain no-cache
greedy loop's tokens and margins (a full forward a step), the reference a serving engine is compared with."""
from __future__ import annotations

from enum import StrEnum

import torch

from ..models.compat import output_cache
from .execution import Executor, StepPolicy
from .inputs import PromptInputs, positions_from_mask


class Replay(StrEnum):
    """Which computation a path's logits come from, as far as exact arithmetic is concerned (replay_step)."""
    FULL = "full"  # a full forward over the sequence
    USER = "user"  # through the cache with no mask or position ids after the prompt
    CACHED = "cached"  # through the cache with the grown mask and position ids
    CACHED_OMIT = "cached_omit"  # through the cache with the mask, position ids omitted


def top2(logits: torch.Tensor) -> tuple[int, int, float]:
    """The greedy choice exactly as argmax makes it (on ties topk may pick another index), the runner-up and the
    margin between them (0 for a tie, common in 16-bit dtypes)."""
    t1 = int(logits.argmax())
    rest = logits.clone()
    rest[t1] = float("-inf")
    t2 = int(rest.argmax())
    return t1, t2, float(logits[t1].double() - logits[t2].double())


def replay_step(ex: Executor, inp: PromptInputs, logic: Replay, forced: list[int]) -> torch.Tensor:
    """The logits a computation gives after being fed `forced` tokens, with the masks and position ids that path
    uses. Run in float64, where shapes do not matter, so the fed tokens go in one chunk."""
    dev = inp.ids.device
    extra = torch.tensor([forced], dtype=inp.ids.dtype, device=dev)
    mask = torch.cat([inp.mask, torch.ones_like(extra)], 1)
    logic = Replay(logic)
    if logic == Replay.FULL:
        return ex.forward(torch.cat([inp.ids, extra], 1), mask, positions_from_mask(mask), use_cache=False,
                          hidden=False, logits_to_keep=1).logits[0, -1]
    user = logic == Replay.USER
    out = ex.forward(inp.ids, inp.mask, None if user else inp.positions, hidden=False, logits_to_keep=1)
    if not forced:
        return out.logits[0, -1]
    pos = inp.positions[:, -1:] + torch.arange(1, len(forced) + 1, device=dev)
    return ex.forward(extra, None if user else mask, None if logic in (Replay.USER, Replay.CACHED_OMIT) else pos,
                      output_cache(out), hidden=False, logits_to_keep=1).logits[0, -1]


def no_cache_tokens(ex: Executor, inp: PromptInputs, n: int) -> tuple[list[int], list[float]]:
    """The plain no-cache greedy loop (a full forward over the sequence so far at every step): its n tokens and
    each step's top-2 margin."""
    tokens: list[int] = []
    margins: list[float] = []

    def on_step(t, logits, hidden, token):
        t1, _, margin = top2(logits)
        tokens.append(t1 if token is None else token)
        margins.append(margin)

    ex.decode(inp.ids, inp.mask, n, policy=StepPolicy.NO_CACHE, positions=inp.positions, on_step=on_step)
    return tokens, margins
