"""The matrix view's standalone repro script (torch + transformers only): every cell that ran without torch.compile (attention x cache kind x precision flags) against the eager no-cache loop; its last line is the largest cell's max |Δ logit|. Compiled cells are left out (compiled kernels are not a bit-for-bit contract) and the script says which."""
from __future__ import annotations

from ...core.errors import KvvizError
from ...core.inputs import encode
from ...io.repro import NO_FLOAT64, float64_mode, header, module_body
from ...core.backends import kv_group_size

TEMPLATE = '''
DTYPE = torch.{dtype}
ROWS = {rows!r}  # row 0 is the prompt {prompt!r}; the others are its batch-mates
LEFT_PAD, STEPS, POSITIONS = {left_pad!r}, {steps!r}, {positions!r}
CELLS = {cells!r}  # (attention, cache kind, precision flags): the cells that ran without torch.compile
SKIPPED = {skipped!r}  # compiled or failed cells: not rebuilt here
QUANT_GROUP = {group!r}  # the quantized caches' group size kvviz chose (it must divide kv_heads x head_dim)
import contextlib

from transformers import DynamicCache, GenerationConfig, QuantizedCache, StaticCache

pad_id = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)
width = max(len(r) for r in ROWS) + LEFT_PAD
IDS = torch.tensor([[pad_id] * (width - len(r)) + r for r in ROWS], device=DEVICE)
MASK = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ROWS], device=DEVICE)


def no_cache_loop(model):
    """The reference: a full forward each step; every row grows greedily; row 0's logits."""
    toks, logits, _, _ = decode(caller(model), IDS, MASK, STEPS, "no_cache", positions_from(MASK), hidden=False)
    return toks, torch.stack([lg.double() for lg in logits])


def new_cache(model, kind):
    max_len = IDS.shape[1] + STEPS
    if kind == "dynamic":
        return None
    if kind in ("static", "offloaded_static"):
        return StaticCache(config=model.config, max_cache_len=max_len, offloading=kind == "offloaded_static")
    if kind == "offloaded":
        return DynamicCache(config=model.config, offloading=True)
    backend = kind.split(":")[1] if ":" in kind else "fp8"
    if backend == "fp8":
        return QuantizedCache(backend="fp8", config=model.config)
    return QuantizedCache(backend=backend, config=model.config, q_group_size=QUANT_GROUP)


def cached_loop(model, kind):
    """Prefill, then one token a step through the cache (position ids auto, or omitted: the model counts them)."""
    toks, logits, _, _ = decode(caller(model), IDS, MASK, STEPS, "cache",
                                positions_from(MASK) if POSITIONS == "auto" else None, cache=new_cache(model, kind),
                                hidden=False)
    return toks, torch.stack([lg.double() for lg in logits])


def generate(model, kind):
    gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=STEPS, min_new_tokens=0, eos_token_id=[],
                          pad_token_id=pad_id, output_logits=True, output_hidden_states=False,
                          return_dict_in_generate=True, use_cache=True)
    kw = dict(input_ids=IDS, attention_mask=MASK, generation_config=gc, disable_compile=True)
    cache = new_cache(model, kind)
    if cache is not None:
        kw[CACHE_KW] = cache
    out = model.generate(**kw)
    return out.sequences[0, IDS.shape[1]:].tolist(), torch.stack([lg[0].double() for lg in out.logits])


{flags_source}

models = {{}}
with torch.inference_mode():
    ref_toks, ref_logits = no_cache_loop(models.setdefault("eager", load_attn(DTYPE, "eager")))
    worst = 0.0
    for attention, kind, flags in CELLS:
        model = models.setdefault(attention, load_attn(DTYPE, attention))
        with precision_flags(flags):
            toks, logits = (cached_loop if POSITIONS == "omit" else generate)(model, kind)
        parting = next((t for t, (x, y) in enumerate(zip(toks, ref_toks)) if x != y), None)
        upto = STEPS if parting is None else parting + 1
        gap = float((logits[:upto] - ref_logits[:upto]).abs().amax(-1).max())
        worst = max(worst, gap)
        print(f"{{attention}} · {{kind}} · {{','.join(flags) or 'no flags'}}: part at {{parting}}, max |Δ logit| {{gap!r}}")
for label in SKIPPED:
    print(f"not rebuilt here: {{label}}")
print("max |Δ logits| = " + repr(worst))
'''


def cells(result) -> tuple[list, list]:
    kept = [c for c in result.cells if c.compile == "off" and c.error is None and c.verdict != "nondeterministic"]
    skipped = [c.label + (f" ({c.error})" if c.error else " (compiled)" if c.compile != "off" else
                          " (nondeterministic)") for c in result.cells if c not in kept]
    return kept, skipped


def check(result) -> None:
    if result.settings.get("invariant"):
        raise KvvizError("a repro script rebuilds the plain run; this matrix ran in invariant mode")
    if not cells(result)[0]:
        raise KvvizError("every cell of this matrix was compiled or failed: no cell a script can rebuild bit "
                         "for bit")


def script(result, lm, name: str) -> str:
    s = result.settings
    kept, skipped = cells(result)
    rows = [encode(lm, s["prompt"])] + [encode(lm, t) for t in s.get("batch_with", [])]
    title = f"the backends matrix of {s['model']} ({len(kept)} cells), {s['dtype']} on {s['device']}"
    body = TEMPLATE.format(dtype=s["dtype"], rows=rows, prompt=s["prompt"], left_pad=s["left_pad"],
                           steps=s["max_new_tokens"], positions=s["position_ids"],
                           cells=[(c.attention, c.cache, tuple(c.flags)) for c in kept], skipped=skipped,
                           group=kv_group_size(lm), flags_source=module_body("core.flags"))
    return header(title, name=name, folder=lm.source, model=s["model"], device=s["device"], attn="auto",
                  float64_mode=float64_mode() if s["dtype"] == "float64" else NO_FLOAT64) + body


def key_figure(result) -> float:
    return max(c.max_abs_logit for c in cells(result)[0])
