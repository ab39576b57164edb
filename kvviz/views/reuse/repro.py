"""The reuse view's standalone repro script (torch + transformers only): fresh / deep-copied / reused prefix cache per continuation; its last line is the largest |Δ logit| against fresh while the tokens agree."""
from __future__ import annotations

from ...io.repro import header, plain_head, require_plain
from .run import check_inputs

TEMPLATE = '''
DTYPE = torch.{dtype}
PREFIX_IDS = {prefix_ids!r}  # {prefix!r}
CONTINUATION_IDS = {cont_ids!r}  # {continuations!r}
STEPS = {steps!r}

model = load(DTYPE)


def decode_after(cache, ids):
    """Feed ids through cache (positions from the cache length, as people do), then decode STEPS tokens."""
    toks, logits, _, _ = decode(caller(model), ids, None, STEPS, "user_loop", cache=cache, hidden=False)
    return toks, torch.stack(logits)


worst = 0.0
with torch.inference_mode():
    pre = forward(model, torch.tensor([PREFIX_IDS], device=DEVICE), hidden=False)
    shared = copy.deepcopy(output_cache(pre))  # the one cache object "reused" grows
    for cont in CONTINUATION_IDS:
        c = torch.tensor([cont], device=DEVICE)
        runs = {{"fresh": decode_after(None, torch.tensor([PREFIX_IDS + cont], device=DEVICE)),
                "deepcopy": decode_after(copy.deepcopy(output_cache(pre)), c),
                "reused": decode_after(shared, c)}}
        ref_toks, ref_logits = runs["fresh"]
        for way in ("deepcopy", "reused"):
            toks, logits = runs[way]
            parting = next((t for t, (x, y) in enumerate(zip(toks, ref_toks)) if x != y), None)
            upto = STEPS if parting is None else parting + 1
            gap = float((logits[:upto].double() - ref_logits[:upto].double()).abs().amax(-1).max())
            worst = max(worst, gap)
            print(f"{{way:<9}} {{tok.decode(toks)!r}} vs fresh {{tok.decode(ref_toks)!r}}: max |Δ logit| {{gap!r}}")
print("max |Δ logits| = " + repr(worst))
'''


check = require_plain  # a plain run is all its script needs


def script(result, lm, name: str) -> str:
    s = result.settings
    conts, prefix_ids, cont_ids = check_inputs(lm, s.prefix, list(s.continuations), s.max_new_tokens)
    title = f"prompt-cache reuse with {s.model}, {len(conts)} continuation(s), {s.dtype} on {s.device}"
    body = TEMPLATE.format(dtype=s.dtype, prefix_ids=prefix_ids, prefix=s.prefix, cont_ids=cont_ids,
                           continuations=conts, steps=s.max_new_tokens)
    return header(title, **plain_head(result, lm, name)) + body


def key_figure(result) -> float:
    return max(r["logits_max_abs"] for r in result.runs if r["strategy"] != "fresh")
