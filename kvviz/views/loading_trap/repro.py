"""The loading_trap view's standalone repro script (torch + transformers only): from_pretrained(dtype) vs float32 + .to(dtype), greedy without cache; its last line is the largest |Δ logit| over the steps."""
from __future__ import annotations

from ...core.inputs import encode
from ...io.repro import NO_FLOAT64, header

TEMPLATE = '''
DTYPE = torch.{dtype}
PROMPT_IDS = {ids!r}  # {prompt!r}
STEPS = {steps!r}


def greedy(model):
    """A full forward at every step (no cache), the mask given, positions left to the model."""
    ids = torch.tensor([PROMPT_IDS], device=DEVICE)
    toks, logits, _, _ = decode(caller(model), ids, torch.ones_like(ids), STEPS, "no_cache", hidden=False)
    return toks, torch.stack([lg.double() for lg in logits])


with torch.inference_mode():
    a_toks, a_logits = greedy(load(DTYPE))  # from_pretrained(dtype=...)
    b_toks, b_logits = greedy(load(torch.float32).to(DTYPE))  # float32, then .to(dtype)
gap = (a_logits - b_logits).abs().amax(-1)
print("from_pretrained(dtype):", repr(tok.decode(a_toks)))
print("float32 + .to(dtype):  ", repr(tok.decode(b_toks)))
print("max |Δ logit| per step:", [float(g) for g in gap])
print("max |Δ logits| = " + repr(float(gap.max())))
'''


def check(result) -> None:
    """Always reproducible: two plain loadings of the model, each decoded plainly."""


def script(result, lm, name: str) -> str:
    s = result.settings
    title = f"from_pretrained(dtype={s['dtype']}) vs float32 + .to({s['dtype']}) for {s['model']}"
    body = TEMPLATE.format(dtype=s["dtype"], ids=encode(lm, s["prompt"]), prompt=s["prompt"],
                           steps=s["max_new_tokens"])
    return header(title, name=name, folder=lm.source, model=s["model"], device=s.get("device", str(lm.device)),
                  attn=lm.attn_requested, float64_mode=NO_FLOAT64) + body


def key_figure(result) -> float:
    return max(result.max_abs_logit)
