"""The split view's standalone repro script (torch + transformers only): the prefix cached, the rest in one chunk or token by token, vs one full forward; its last line is the largest |Δ logit|."""
from __future__ import annotations

from ...core.errors import KvvizError
from ...io.repro import header, plain_head, require_plain

TEMPLATE = '''
DTYPE = torch.{dtype}
PROMPT = {prompt!r}
SPLIT, LEFT_PAD, MODE = {split!r}, {left_pad!r}, {mode!r}
POSITIONS, MASK = {positions!r}, {mask!r}  # "auto"/"omit" position ids; "full"/"new-only" mask for the rest

model = load(DTYPE)
ids = tok(PROMPT, add_special_tokens=True)["input_ids"]
with torch.inference_mode():
    gap, agree = split_gap(model, ids, SPLIT, LEFT_PAD, MODE, POSITIONS, MASK)
print("compared tokens:", [tok.decode([i]) for i in ids[SPLIT:]])
print("max |Δ logit| per compared token:", [float(g) for g in gap])
print("next token agrees:", agree.tolist())
print("max |Δ logits| = " + repr(float(gap.max())))
'''


def check(result) -> None:
    require_plain(result)
    if not result.main.has_cache:
        raise KvvizError("this model returns no cache: there is no cached run to reproduce")


def script(result, lm, name: str) -> str:
    s = result.settings
    title = f"split of {s.model} at {s.split} ({s.mode}), {s.dtype} on {s.device}"
    body = TEMPLATE.format(dtype=s.dtype, prompt=s.prompt, split=s.split, left_pad=s.left_pad, mode=s.mode,
                           positions=s.position_ids, mask=s.attention_mask)
    return header(title, **plain_head(result, lm, name)) + body


def key_figure(result) -> float:
    return float(result.main.logits["max_abs"].max())
