"""The greedy view's standalone repro script (torch + transformers only): the no-cache loop vs the cached loop; its last line is the largest |Δ logit| while both saw the same tokens."""
from __future__ import annotations

from ...core.errors import KvvizError
from ...io.repro import header, plain_head, require_plain
from ...core.inputs import encode
from .run import GreedyPath

TEMPLATE = '''
DTYPE = torch.{dtype}
PROMPT_IDS = {ids!r}  # {prompt!r}
LEFT_PAD, STEPS, POSITIONS = {left_pad!r}, {steps!r}, {positions!r}  # POSITIONS: the cached loop's position ids

model = load(DTYPE)
pad_id = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)
input_ids = torch.tensor([[pad_id] * LEFT_PAD + PROMPT_IDS], device=DEVICE)
mask = torch.tensor([[0] * LEFT_PAD + [1] * len(PROMPT_IDS)], device=DEVICE)
positions = positions_from(mask)


def no_cache_loop():
    """A full forward over the whole sequence at every step."""
    toks, logits, _, _ = decode(caller(model), input_ids, mask, STEPS, "no_cache", positions)
    return toks, torch.stack(logits)


def cached_loop():
    """Prefill, then one token at a time through past_key_values with the full mask (and position ids)."""
    toks, logits, _, _ = decode(caller(model), input_ids, mask, STEPS, "cache", positions, POSITIONS)
    return toks, torch.stack(logits)


with torch.inference_mode():
    a_toks, a_logits = no_cache_loop()
    b_toks, b_logits = cached_loop()
    parting = next((t for t, (x, y) in enumerate(zip(a_toks, b_toks)) if x != y), None)
    upto = STEPS if parting is None else parting + 1  # while both loops saw the same tokens
    gap = (b_logits[:upto].double() - a_logits[:upto].double()).abs().amax(-1)
print("no cache:", repr(tok.decode(a_toks)))
print("cache:   ", repr(tok.decode(b_toks)))
print("first parting step:", parting)
print("max |Δ logit| per step:", [float(g) for g in gap])
print("max |Δ logits| = " + repr(float(gap.max())))
'''


def check(result) -> None:
    require_plain(result)
    s = result.settings
    if not {GreedyPath.NO_CACHE, GreedyPath.CACHE} <= set(s.paths):
        raise KvvizError("the greedy repro compares the no-cache loop with the cached loop; run both paths")
    if s.fast:
        raise KvvizError("this greedy result used the fast preview; the repro rebuilds the exact loops, so run "
                         "without fast")


def script(result, lm, name: str) -> str:
    s = result.settings
    title = f"greedy decoding of {s.model}, no cache vs cache, {result.steps} steps, {s.dtype} on {s.device}"
    body = TEMPLATE.format(dtype=s.dtype, ids=encode(lm, s.prompt), prompt=s.prompt, left_pad=s.left_pad,
                           steps=result.steps, positions=s.position_ids)
    return header(title, **plain_head(result, lm, name)) + body


def key_figure(result) -> float:
    pair = result.pair(GreedyPath.NO_CACHE, GreedyPath.CACHE)
    return max(g for g, same in zip(pair.max_abs_logit, pair.same_history) if same)
