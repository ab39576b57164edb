"""The padding view's standalone repro script (torch + transformers only): the prompt alone, left-padded and in a batch, every cache setting; its last line is the largest |Δ logit| over the cells."""
from __future__ import annotations

from ...core.errors import KvvizError
from ...io.repro import header, plain_head, require_plain
from ...core.inputs import encode
from .run import SCENARIOS, companion_ids

TEMPLATE = '''
DTYPE = torch.{dtype}
PROMPT_IDS = {ids!r}  # {prompt!r}
COMPANION_IDS = {companions!r}  # the batch-mates, each longer than the prompt
SPLIT, LEFT_PAD = {split!r}, {left_pad!r}
PLACEMENTS = {placements!r}
SCENARIOS = {scenarios!r}  # (label, use cache, position ids, attention mask)

model = load(DTYPE)
pad_id = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)


def batch(rows, extra_pad):
    width = max(len(r) for r in rows) + extra_pad
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=DEVICE)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=DEVICE)
    return ids, mask, positions_from(mask), width - len(rows[0])


def scenario(rows, extra_pad, use_cache, pos_mode, mask_mode):
    """The prompt's (row 0's) logits for its tokens [SPLIT, end)."""
    ids, mask, pos, pad = batch(rows, extra_pad)
    c = pad + SPLIT
    if not use_cache:
        return forward(model, ids, mask, pos, use_cache=False).logits[0, c:]
    pre = forward(model, ids[:, :c], mask[:, :c], pos[:, :c], hidden=False)
    out = forward(model, ids[:, c:], mask if mask_mode == "full" else mask[:, c:],
                  pos[:, c:] if pos_mode == "auto" else None, output_cache(pre))
    return out.logits[0]


worst = 0.0
with torch.inference_mode():
    ref = forward(model, torch.tensor([PROMPT_IDS], device=DEVICE), use_cache=False).logits[0, SPLIT:]
    for placement in PLACEMENTS:
        rows = [PROMPT_IDS] + (COMPANION_IDS if placement == "in a batch" else [])
        extra = LEFT_PAD if placement == "left-padded" else 0
        for label, use_cache, pos_mode, mask_mode in SCENARIOS:
            lg = scenario(rows, extra, use_cache, pos_mode, mask_mode)
            gap = float((lg.double() - ref.double()).abs().amax(-1).max())
            worst = max(worst, gap)
            print(f"{{placement:<12}} {{label:<28}} max |Δ logit| {{gap!r}}")
print("max |Δ logits| = " + repr(worst))
'''


check = require_plain  # a plain run is all its script needs


def script(result, lm, name: str) -> str:
    s = result.settings
    ids = encode(lm, s.prompt)
    comps = companion_ids(lm, ids, None, s.left_pad)
    if tuple(len(c) for c in comps) != tuple(s.companions):
        raise KvvizError("this padding result used other batch companions than kvviz's default ones")
    title = f"padding and batching of {s.model}, {s.dtype} on {s.device}"
    body = TEMPLATE.format(dtype=s.dtype, ids=ids, prompt=s.prompt, companions=comps, split=s.split,
                           left_pad=s.left_pad, placements=tuple(result.placements), scenarios=SCENARIOS)
    return header(title, **plain_head(result, lm, name)) + body


def key_figure(result) -> float:
    return max(c["logits_max_abs"] for c in result.cells)
