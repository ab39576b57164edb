"""The decode loop and the feed of known tokens through a cache: kvviz's only loops over model calls.

Pure functions over a `call(ids, mask, positions, past, use_cache=..., hidden=...)` that makes one model call:
`Executor.decode` / `Executor.feed` (kvviz.core.execution) run them with the executor's forward, and every repro script
(kvviz.io.repro) embeds this module's source with its own `forward`, so a script's loop is the library's loop, not a
copy of it. Keep this module to torch only (a repro script needs only torch and transformers).
"""
from enum import StrEnum

import torch

from ..models.compat import output_cache  # a repro script defines its own copy (kvviz.io.repro)


class StepPolicy(StrEnum):
    """How decode feeds each new token. A str: it compares and exports as its word ("no_cache")."""
    NO_CACHE = "no_cache"
    CACHE = "cache"
    USER_LOOP = "user_loop"


STEP_POLICIES = {
    StepPolicy.NO_CACHE: "a full forward over the sequence so far at every step (the reference)",
    StepPolicy.CACHE: "prefill, then one token a step through the cache, the mask grown and the position ids given",
    StepPolicy.USER_LOOP: "prefill with the mask, then only the new token (no mask, no position ids), as people "
                          "write it",
}


def feed(call, ids, cache, one_by_one=False, mask_of=None, positions_of=None, hidden=True):
    """Feed the known tokens `ids` [B, n] through `cache`: in one chunk, or one token per call. mask_of(s, e) and
    positions_of(s, e) give the mask and position ids of ids[:, s:e] (None: left out, as a user's loop would).
    Yields (s, e, output) per call; the grown cache is carried from one call to the next."""
    n = ids.shape[1]
    spans = [(j, j + 1) for j in range(n)] if one_by_one else [(0, n)]
    for s, e in spans:
        out = call(ids[:, s:e], mask_of(s, e) if mask_of else None, positions_of(s, e) if positions_of else None,
                   cache, use_cache=True, hidden=hidden)
        cache = output_cache(out)
        yield s, e, out


def decode(call, ids, mask, n, policy=StepPolicy.CACHE, positions=None, step_positions=None, cache=None, forced=None,
           hidden=True, on_step=None, on_prefill=None):
    """Greedy decoding of n tokens under a step policy (STEP_POLICIES). Every row takes its own argmax, or
    forced[t] (the same for every row) while forced tokens last. Returns (tokens, logits, hidden, last output):
    row 0's tokens, its last-position logits [V] and hidden states [n_hidden, H] (hidden=True) per step; on_step(t,
    logits, hidden, token) sees each step as it comes, on_prefill(output) the first call's output.
    positions: the prompt's position ids (None: left out); step_positions "auto" (the last one + 1, counted from the
    mask when positions is None) or "omit" (the default when positions is None)."""
    if policy not in STEP_POLICIES:
        raise ValueError(f"unknown step policy '{policy}'; choose one of {', '.join(STEP_POLICIES)}")
    policy = StepPolicy(policy)
    step_positions = step_positions or ("auto" if positions is not None else "omit")
    cached = policy != StepPolicy.NO_CACHE
    out = call(ids, mask, positions, cache, use_cache=cached, hidden=hidden)
    if on_prefill is not None:
        on_prefill(out)
    last = None
    if cached and step_positions == "auto":
        start = positions if positions is not None else (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        last = start[:, -1:]
    tokens, logits, hiddens = [], [], []
    for t in range(n):
        row = out.logits[:, -1]
        if out.logits.shape[1] > 1:  # a copy: the call's whole logits (positions x vocabulary) are freed
            row = row.clone()
        if forced is not None and t < len(forced):
            nxt = torch.full((ids.shape[0], 1), int(forced[t]), dtype=ids.dtype, device=ids.device)
        else:
            nxt = row.argmax(-1, keepdim=True).to(ids.dtype)
        h = torch.stack([x[0, -1] for x in out.hidden_states]) if hidden else None
        tokens.append(int(nxt[0, 0]))
        logits.append(row[0])
        if h is not None:
            hiddens.append(h)
        if on_step is not None:
            on_step(t, row[0], h, tokens[-1])
        if t == n - 1:
            break
        if mask is not None and policy != StepPolicy.USER_LOOP:
            mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=mask.device)], 1)
        if not cached:
            ids = torch.cat([ids, nxt], 1)
            if positions is not None:
                positions = torch.cat([positions, positions[:, -1:] + 1], 1)
            out = None  # the last call's logits (every position's) are freed before the next call
            out = call(ids, mask, positions, None, use_cache=False, hidden=hidden)
            continue
        if last is not None:
            last = last + 1
        user = policy == StepPolicy.USER_LOOP
        past, out = output_cache(out), None  # only the cache goes on: the last call's logits are freed first
        out = call(nxt, None if user else mask, None if user else last, past, use_cache=True, hidden=hidden)
    return tokens, logits, hiddens, out
