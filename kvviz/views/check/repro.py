"""The check view's standalone repro script (torch + transformers only): the cache-safety card's split-based checks in float64 (cached vs full in one chunk and token by token, left padding, past the sliding window); its last line is the largest |Δ logit| over them."""
from __future__ import annotations

from ...core.errors import KvvizError
from ...io.repro import float64_mode, header

TEMPLATE = '''
CHECKS = {checks!r}  # (name, prompt, split, mode, left_pad): the card's split-based checks, run in float64
OTHERS = {others!r}  # the card's other checks (batching, reuse, ...): their own views have scripts

model = load(torch.float64)
worst = 0.0
with torch.inference_mode():
    for name, prompt, split, mode, left_pad in CHECKS:
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
        gap = float(split_gap(model, ids, split, left_pad, mode)[0].max())
        worst = max(worst, gap)
        print(f"{{name}}: float64 max |Δ logit| {{gap!r}}")
for name in OTHERS:
    print(f"not rebuilt here: {{name}}")
print("max |Δ logits| = " + repr(worst))
'''


def card_checks(result) -> list:
    return [c for c in result.checks if c.logits_max_abs is not None and c.scenario]


def check(result) -> None:
    if not card_checks(result):
        raise KvvizError("this card has no split-based check to rebuild (the model returned no cache)")


def script(result, lm, name: str) -> str:
    s = result.settings
    kept = card_checks(result)
    checks = [(c.name, c.scenario["prompt"], c.scenario["split"], c.scenario["mode"], c.scenario["left_pad"])
              for c in kept]
    title = f"the cache-safety card of {result.model}: its float64 split checks"
    body = TEMPLATE.format(checks=checks, others=[c.name for c in result.checks if c not in kept])
    return header(title, name=name, folder=lm.source, model=result.model,
                  device=s.get("float64_device", s.get("device", "cpu")), attn=lm.attn_requested,
                  float64_mode=float64_mode()) + body


def key_figure(result) -> float:
    return max(c.logits_max_abs for c in card_checks(result))
