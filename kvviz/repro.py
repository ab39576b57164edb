"""Repro scripts: a standalone Python file (torch and transformers only, no kvviz) that rebuilds a split scenario
and prints its key figures; its last line `max |Δ logits| = <repr>` equals the result's figure bit for bit on the
same machine (same model folder, dtype, device, attention implementation, inputs, masks and position ids).
"""
from __future__ import annotations

from .errors import KvvizError
from .export import view_of
from .loading import LoadedModel

_TEMPLATE = '''"""kvviz repro: {title}
Standalone: needs only torch and transformers. Run: python {name}
"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = {folder!r}  # the model folder kvviz loaded ({model})
DTYPE = torch.{dtype}
DEVICE = {device!r}
ATTN = {attn!r}
PROMPT = {prompt!r}
SPLIT, LEFT_PAD, MODE = {split!r}, {left_pad!r}, {mode!r}
POSITIONS, MASK = {positions!r}, {mask!r}  # "auto"/"omit" position ids; "full"/"new-only" mask for the rest
{float64_mode}
tok = AutoTokenizer.from_pretrained(MODEL, local_files_only=True)
kw = {{}} if ATTN == "auto" else {{"attn_implementation": ATTN}}
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=DTYPE, local_files_only=True, **kw).to(DEVICE).eval()
if DTYPE == torch.float64:
    keep_float64(model)

ids = tok(PROMPT, add_special_tokens=True)["input_ids"]
pad_id = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)
input_ids = torch.tensor([[pad_id] * LEFT_PAD + ids], device=DEVICE)
mask = torch.tensor([[0] * LEFT_PAD + [1] * len(ids)], device=DEVICE)
positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
a0, total = LEFT_PAD + SPLIT, LEFT_PAD + len(ids)


def forward(i, m, p, past):
    kw = dict(input_ids=i, use_cache=True, output_hidden_states=True, return_dict=True)
    if m is not None:
        kw["attention_mask"] = m
    if p is not None:
        kw["position_ids"] = p
    if past is not None:
        kw["past_key_values"] = past
    return model(**kw)


def rest_mask(start, end):
    return mask[:, :end] if MASK == "full" else mask[:, start:end]


def rest_positions(start, end):
    return positions[:, start:end] if POSITIONS == "auto" else None


with torch.inference_mode():
    past = forward(input_ids[:, :a0], mask[:, :a0], positions[:, :a0], None).past_key_values
    ref = forward(input_ids, mask, positions, None).logits[0, a0:]
    if MODE == "chunk":
        got = forward(input_ids[:, a0:], rest_mask(a0, total), rest_positions(a0, total), past).logits[0]
    else:
        rows, cache = [], past
        for a in range(a0, total):
            out = forward(input_ids[:, a:a + 1], rest_mask(a, a + 1), rest_positions(a, a + 1), cache)
            cache = out.past_key_values
            rows.append(out.logits[0, -1])
        got = torch.stack(rows)
    gap = (got.double() - ref.double()).abs().amax(-1)
    print("compared tokens:", [tok.decode([i]) for i in ids[SPLIT:]])
    print("max |Δ logit| per compared token:", [float(g) for g in gap])
    print("next token agrees:", (got.argmax(-1) == ref.argmax(-1)).tolist())
print("max |Δ logits| = " + repr(float(gap.max())))
'''

def _float64_mode() -> str:
    """kvviz's own KeepFloat64 mode (kvviz/float64.py), copied into the script so it needs no kvviz."""
    import inspect

    from . import float64

    src = inspect.getsource(float64)
    body = src.split('"""', 2)[2].replace("from __future__ import annotations\n", "")
    return ("\n# kvviz keeps float64 models in float64 (transformers' float32 'upcasts' would round): its mode, "
            "a copy of float64.py in the kvviz package\n" + body)


def key_figure(result) -> float:
    """The figure a repro script's last line reproduces: split: max |Δ| of the compared logits."""
    if view_of(result) != "split":
        raise KvvizError("repro scripts are written for the split view")
    return float(result.main.logits["max_abs"].max())


def repro_script(result, lm: LoadedModel, name: str = "kvviz_repro.py") -> str:
    """A standalone script for a split result computed with `lm` (the default execution settings)."""
    if view_of(result) != "split":
        raise KvvizError("repro scripts are written for the split view (greedy, dtypes, padding and reuse: export "
                         "the JSON or the HTML report)")
    s = result.settings
    if not s.execution.is_default:
        raise KvvizError(f"a repro script rebuilds the plain run; this one used {s.execution.label()} "
                         "(invariant mode, cache kinds and flags live in kvviz)")
    if not result.main.has_cache:
        raise KvvizError("this model returns no cache: there is no cached run to reproduce")
    return _TEMPLATE.format(title=f"split of {s.model} at {s.split} ({s.mode}), {s.dtype} on {s.device}", name=name,
                            folder=lm.source, model=s.model, dtype=s.dtype, device=s.device,
                            attn=lm.attn_requested, prompt=s.prompt, split=s.split, left_pad=s.left_pad,
                            mode=s.mode, positions=s.position_ids, mask=s.attention_mask,
                            float64_mode=_float64_mode() if s.dtype == "float64" else "")
