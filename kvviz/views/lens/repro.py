"""The lens view's standalone repro script (torch + transformers only): the split scenario's two paths (the prefix
cached, the rest in one chunk or token by token, vs one full forward), each hidden state of both through the model's
final norm and head; its last line is the largest |Δ lens logit| over every layer and compared position."""
from __future__ import annotations

from types import SimpleNamespace

from ...core.errors import KvvizError
from ...core.execution import ExecSettings
from ...io.repro import float64_mode, header, NO_FLOAT64
from .run import NORM_NAMES

TEMPLATE = '''
DTYPE = torch.{dtype}
PROMPT = {prompt!r}
SPLIT, LEFT_PAD, MODE = {split!r}, {left_pad!r}, {mode!r}
POSITIONS, MASK = {positions!r}, {mask!r}  # "auto"/"omit" position ids; "full"/"new-only" mask for the rest
NORM_NAMES = {norm_names!r}


def lens_of(model):
    """The logit lens: a hidden state through the model's final norm and head (the last hidden state transformers
    returns is after the final norm already), with its logit scale and final soft-capping."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    norm = next((getattr(base, n) for n in NORM_NAMES if isinstance(getattr(base, n, None), torch.nn.Module)), None)
    head = model.get_output_embeddings()
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap, scale = getattr(cfg, "final_logit_softcapping", None), getattr(cfg, "logit_scale", None)
    scale = scale if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale != 1 else None

    def lens(h, normed):
        logits = head(h if normed or norm is None else norm(h))
        if scale is not None:
            logits = logits * scale
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
    return lens


def lens_gap(model, ids):
    """Per hidden state: max |Δ lens logit| (float64) over the compared positions, and how many of them the two
    paths' lens top-1 differ at."""
    pad_id = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)
    input_ids = torch.tensor([[pad_id] * LEFT_PAD + ids], device=DEVICE)
    mask = torch.tensor([[0] * LEFT_PAD + [1] * len(ids)], device=DEVICE)
    positions = positions_from(mask)
    a0, total = LEFT_PAD + SPLIT, LEFT_PAD + len(ids)
    n = total - a0
    import inspect

    keep = n if "logits_to_keep" in inspect.signature(model.forward).parameters else None
    lens = lens_of(model)
    past = output_cache(forward(model, input_ids[:, :a0], mask[:, :a0], positions[:, :a0], hidden=False,
                                keep=1 if keep else None))
    full = forward(model, input_ids, mask, positions, use_cache=False, keep=keep).hidden_states
    held = [h[0, a0:] for h in full]  # the full forward's compared rows, per hidden state
    L = len(held)
    gap = torch.zeros(L, n, dtype=torch.float64)
    differ = torch.zeros(L, n, dtype=torch.bool)
    for s, e, out in feed(caller(model), input_ids[:, a0:], past, MODE != "chunk",
                          lambda s, e: mask[:, :a0 + e] if MASK == "full" else mask[:, a0 + s:a0 + e],
                          lambda s, e: positions[:, a0 + s:a0 + e] if POSITIONS == "auto" else None):
        for i, h in enumerate(out.hidden_states):
            got = h[0, -(e - s):] if MODE != "chunk" else h[0]
            lf, lc = lens(held[i][s:e], i == L - 1), lens(got, i == L - 1)
            gap[i, s:e] = (lc.double() - lf.double()).abs().amax(-1)
            differ[i, s:e] = lf.argmax(-1) != lc.argmax(-1)
    return gap, differ


model = load(DTYPE)
ids = tok(PROMPT, add_special_tokens=True)["input_ids"]
with torch.inference_mode():
    gap, differ = lens_gap(model, ids)
rows = differ.any(-1).nonzero()
print("compared tokens:", [tok.decode([i]) for i in ids[SPLIT:]])
print("max |Δ lens logit| per hidden state:", [float(g) for g in gap.amax(-1)])
print("decision depth (first hidden state where the lens top-1 differ):",
      int(rows[0]) if len(rows) else None, "(0 = embeddings)")
print("max |Δ logits| = " + repr(float(gap.max())))
'''


def _settings(result) -> SimpleNamespace:
    """The lens result's settings (a dict: the run's and the split scenario's fields) as attributes."""
    s = dict(result.settings)
    s["execution"] = ExecSettings.from_dict(s.get("execution")) if isinstance(s.get("execution"), dict) \
        else s.get("execution") or ExecSettings()
    return SimpleNamespace(**s)


def check(result) -> None:
    s = _settings(result)
    if not s.execution.is_default:
        raise KvvizError(f"a repro script rebuilds the plain run; this one used {s.execution.label()} "
                         "(invariant mode, cache kinds and flags live in kvviz)")


def script(result, lm, name: str) -> str:
    s = _settings(result)
    title = f"logit lens of {s.model} at split {s.split} ({s.mode}), {s.dtype} on {s.device}"
    body = TEMPLATE.format(dtype=s.dtype, prompt=s.prompt, split=s.split, left_pad=s.left_pad, mode=s.mode,
                           positions=s.position_ids, mask=s.attention_mask, norm_names=NORM_NAMES)
    head = dict(name=name, folder=lm.source, model=s.model, device=s.device, attn=lm.attn_requested,
                float64_mode=float64_mode() if s.dtype == "float64" else NO_FLOAT64)
    return header(title, **head) + body


def key_figure(result) -> float:
    return float(result.main.max_abs)
