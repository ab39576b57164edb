"""The quant view's standalone repro script (torch + transformers only): the unquantized run vs the quantized one teacher forced on its tokens; its last line is the largest |Δ logit| over the steps. The script also needs the quantization package the result used (optimum-quanto or hqq; fp8 needs none)."""
from __future__ import annotations

from ...core.errors import KvvizError
from ...io.repro import header, plain_head, require_plain
from ...core.inputs import encode
from .run import kv_group_size, parse_kv

TEMPLATE = '''
DTYPE = torch.{dtype}
PROMPT_IDS = {ids!r}  # {prompt!r}
STEPS = {steps!r}
KV = {kv!r}  # (backend, nbits, residual length, group size) or None
WEIGHTS = {weights!r}  # "int8" / "int4" weight-only (optimum-quanto) or None

input_ids = torch.tensor([PROMPT_IDS], device=DEVICE)
mask = torch.ones_like(input_ids)
positions = positions_from(mask)


def decode_with(model, cache, forced=None):
    """Prefill, then one token at a time through `cache` (None: the model's dynamic cache), mask and positions."""
    toks, logits, _, _ = decode(caller(model), input_ids, mask, STEPS, "cache", positions, cache=cache, forced=forced)
    return toks, torch.stack(logits)


def quantized_cache(model):
    if KV is None:
        return None
    from transformers import QuantizedCache

    backend, nbits, residual, group = KV
    if backend == "fp8":
        return QuantizedCache(backend="fp8", config=model.config)
    return QuantizedCache(backend=backend, config=model.config, nbits=nbits, residual_length=residual,
                          q_group_size=group)


def compat_quanto_unpack_in_pytorch():
    """optimum-quanto compiles a C++ extension at first use (and waits on its build's lock file) for one CPU
    kernel, unpack; the same masks and shifts in PyTorch give the same bytes, so this script compiles nothing."""
    try:
        from optimum.quanto.library.extensions import get_extension

        ext = get_extension("quanto_cpp")
    except (ImportError, KeyError):
        return

    class Unpack:
        @staticmethod
        def unpack(packed, bits):
            parts = [(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]
            return torch.cat(parts).to(torch.uint8)

    if getattr(ext, "_lib", "absent") is None:
        ext._lib = Unpack()


if WEIGHTS is not None or (KV is not None and KV[0] == "quanto"):
    compat_quanto_unpack_in_pytorch()
model = load(DTYPE)
with torch.no_grad():
    ref_toks, ref_logits = decode_with(model, None)
    if WEIGHTS is not None:
        from optimum.quanto import freeze, qint4, qint8, quantize

        model = load(DTYPE)
        quantize(model, weights={{"int8": qint8, "int4": qint4}}[WEIGHTS])
        freeze(model)
    _, q_logits = decode_with(model, quantized_cache(model), forced=ref_toks)
gap = (q_logits.double() - ref_logits.double()).abs().amax(-1)
print("unquantized:", repr(tok.decode(ref_toks)))
print("max |Δ logit| per step (quantized, teacher forced):", [float(g) for g in gap])
print("max |Δ logits| = " + repr(float(gap.max())))
'''


def check(result) -> None:
    require_plain(result)
    if result.settings.weights.startswith("bnb-"):
        raise KvvizError("bitsandbytes weights load through kvviz's CUDA path; no script for them")


def script(result, lm, name: str) -> str:
    s = result.settings
    backend, nbits = parse_kv(s.kv)
    kv = None if backend == "none" else (backend, nbits, s.residual_length, kv_group_size(lm))
    title = f"{s.model} unquantized vs {result.label}, {s.dtype} on {s.device}"
    body = TEMPLATE.format(dtype=s.dtype, ids=encode(lm, s.prompt), prompt=s.prompt, steps=s.max_new_tokens,
                           kv=kv, weights=None if s.weights == "none" else s.weights)
    return header(title, **plain_head(result, lm, name)) + body


def key_figure(result) -> float:
    return max(result.logits_max_abs)
