"""The dtypes view's standalone repro script (torch + transformers only): the split comparison per dtype (float64 aside) and prompt; its last line is the largest |Δ logit| over all."""
from __future__ import annotations

from ...core.errors import KvvizError
from ...io.repro import header, plain_head, require_plain
from ...core.inputs import encode
from .run import split_point

TEMPLATE = '''
DTYPES = {dtypes!r}  # float64 is kvviz's reference and left out of the figure
PROMPTS = {prompts!r}  # (prompt, token ids, split)
MODE = {mode!r}

worst = {{}}
for name in DTYPES:
    model = load(getattr(torch, name))
    with torch.inference_mode():
        gaps = [float(split_gap(model, ids, k, mode=MODE)[0].max()) for _, ids, k in PROMPTS]
    worst[name] = max(gaps)
    print(f"{{name}}: max |Δ logit| per prompt {{gaps}}")
    del model
print("max |Δ logits| = " + repr(max(worst.values())))
'''


def _dtypes(result) -> list:
    return [d for d in result.dtypes if d != "float64" and d not in result.settings.skipped_dtypes]


def check(result) -> None:
    require_plain(result)
    if not _dtypes(result):
        raise KvvizError("the sweep has no dtype besides float64 to reproduce")


def script(result, lm, name: str) -> str:
    s = result.settings
    prompts = []
    for p in result.prompts:
        ids = encode(lm, p)
        prompts.append((p, ids, split_point(len(ids), s.split)))
    dtypes = _dtypes(result)
    title = f"the split comparison of {s.model} in {', '.join(dtypes)} over {len(prompts)} prompt(s) on {s.device}"
    body = TEMPLATE.format(dtypes=dtypes, prompts=prompts, mode=s.mode)
    return header(title, **plain_head(result, lm, name, float64=False)) + body


def key_figure(result) -> float:
    return max(max(v) for d, v in result.logits_max_abs.items() if d in _dtypes(result))
