"""Repro scripts: a standalone Python file (torch and transformers only, no kvviz) that rebuilds a scenario and
prints its key figures; its last line `max |Δ logits| = <repr>` equals the result's figure bit for bit on the same
machine (same model folder, dtype, device, attention implementation, inputs, masks and position ids).

Each view's script makes exactly the model calls kvviz made (same shapes, same masks and position ids, same
cache objects in the same order), so the numbers agree to the last bit, not just closely:
  split    the prefix cached, the rest in one chunk or token by token, vs one full forward;
  greedy   the no-cache loop vs the cached loop (the figure: the largest |Δ logit| while both saw the same tokens);
  dtypes   the split comparison per dtype (float64 aside) and prompt (the figure: the largest over all);
  padding  the prompt alone, left-padded and in a batch, every cache setting (the figure: the largest over cells);
  reuse    fresh / deep-copied / reused prefix cache per continuation (the figure: the largest against fresh while
           the tokens agree);
  loading_trap  from_pretrained(dtype) vs float32 + .to(dtype), greedy without cache (the figure: the largest over
           the steps);
  quant    the unquantized run vs the quantized one teacher forced on its tokens (the figure: the largest over the
           steps). This script also needs the quantization package the result used (optimum-quanto or hqq; fp8
           needs none);
  matrix   every cell that ran without torch.compile (attention × cache kind × precision flags) against the eager
           no-cache loop (the figure: the largest cell's max |Δ logit|); compiled cells are left out (compiled
           kernels are not a bit-for-bit contract) and the script says which;
  serving  the same continuous-batching calls (alone / batch / warm, the same draws) made plainly with
           transformers' engine, and the no-cache reference (the figure: prompts with 1 distinct completion);
  check    the cache-safety card's split-based checks in float64 (cached vs full in one chunk and token by token,
           left padding, past the sliding window; the figure: the largest |Δ logit| over them).
"""
from __future__ import annotations

from .errors import KvvizError
from .export import view_of
from .loading import LoadedModel

def repro_views() -> tuple[str, ...]:
    """The views with a standalone repro script (the registry's `repro` entries)."""
    from .views import names

    return names(repro=True)

_HEADER = '''# kvviz repro: {title}
# Standalone: needs only torch and transformers. Run: python {name}
import copy

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = {folder!r}  # the model folder kvviz loaded ({model})
DEVICE = {device!r}
ATTN = {attn!r}
{float64_mode}
tok = AutoTokenizer.from_pretrained(MODEL, local_files_only=True)


def load(dtype):
    kw = {{}} if ATTN == "auto" else {{"attn_implementation": ATTN}}
    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype, local_files_only=True, **kw).to(DEVICE).eval()
    if dtype == torch.float64:
        keep_float64(m)
    return m


def load_attn(dtype, attention):
    """The model with a given attention implementation (the backends matrix loads one per implementation)."""
    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype, local_files_only=True,
                                             attn_implementation=attention).to(DEVICE).eval()
    if dtype == torch.float64:
        keep_float64(m)
    return m


def forward(model, ids, mask=None, positions=None, past=None, use_cache=True, hidden=True, keep=None):
    """One model call, as kvviz makes it: mask / positions / past left out when None; keep: logits_to_keep."""
    kw = dict(input_ids=ids, use_cache=use_cache, output_hidden_states=hidden, return_dict=True)
    if keep is not None:
        kw["logits_to_keep"] = keep
    if mask is not None:
        kw["attention_mask"] = mask
    if positions is not None:
        kw["position_ids"] = positions
    if past is not None:
        kw["past_key_values"] = past
    return model(**kw)


def positions_from(mask):
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def caller(model):
    """One model call as the loops below take it."""
    def call(ids, mask, positions, past, use_cache=True, hidden=True):
        return forward(model, ids, mask, positions, past, use_cache=use_cache, hidden=hidden)
    return call

{loops}

def split_gap(model, ids, split, left_pad=0, mode="chunk", positions_mode="auto", mask_mode="full"):
    """The split comparison: the prefix [0, split) cached, the rest fed through the cache, vs one full forward.
    Returns the per-token max |Δ logit| (float64) and whether the next token agrees."""
    pad_id = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)
    input_ids = torch.tensor([[pad_id] * left_pad + ids], device=DEVICE)
    mask = torch.tensor([[0] * left_pad + [1] * len(ids)], device=DEVICE)
    positions = positions_from(mask)
    a0, total = left_pad + split, left_pad + len(ids)

    def rest_mask(start, end):
        return mask[:, :end] if mask_mode == "full" else mask[:, start:end]

    def rest_positions(start, end):
        return positions[:, start:end] if positions_mode == "auto" else None

    past = forward(model, input_ids[:, :a0], mask[:, :a0], positions[:, :a0]).past_key_values
    # in float64 (the reference) kvviz computes only the compared positions' logits (logits_to_keep)
    import inspect

    keep = total - a0 if model.dtype == torch.float64 and \
        "logits_to_keep" in inspect.signature(model.forward).parameters else None
    ref = forward(model, input_ids, mask, positions, keep=keep).logits[0, -(total - a0):]
    rows = [out.logits[0] for _, _, out in feed(caller(model), input_ids[:, a0:], past, mode != "chunk",
                                                 lambda s, e: rest_mask(a0 + s, a0 + e),
                                                 lambda s, e: rest_positions(a0 + s, a0 + e))]
    got = torch.cat(rows)
    return (got.double() - ref.double()).abs().amax(-1), (got.argmax(-1) == ref.argmax(-1))

'''

_SPLIT = '''
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

_GREEDY = '''
DTYPE = torch.{dtype}
PROMPT_IDS = {ids!r}  # {prompt!r}
LEFT_PAD, STEPS, POSITIONS = {left_pad!r}, {steps!r}, {positions!r}  # POSITIONS: the cached loop's position ids

model = load(DTYPE)
pad_id = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)
input_ids = torch.tensor([[pad_id] * LEFT_PAD + PROMPT_IDS], device=DEVICE)
mask = torch.tensor([[0] * LEFT_PAD + [1] * len(PROMPT_IDS)], device=DEVICE)
positions = positions_from(mask)


def no_cache_loop():
    """A full forward over the whole sequence at every step."""
    toks, logits, _, _ = decode(caller(model), input_ids, mask, STEPS, "no_cache", positions)
    return toks, torch.stack(logits)


def cached_loop():
    """Prefill, then one token at a time through past_key_values with the full mask (and position ids)."""
    toks, logits, _, _ = decode(caller(model), input_ids, mask, STEPS, "cache", positions, POSITIONS)
    return toks, torch.stack(logits)


with torch.inference_mode():
    a_toks, a_logits = no_cache_loop()
    b_toks, b_logits = cached_loop()
    parting = next((t for t, (x, y) in enumerate(zip(a_toks, b_toks)) if x != y), None)
    upto = STEPS if parting is None else parting + 1  # while both loops saw the same tokens
    gap = (b_logits[:upto].double() - a_logits[:upto].double()).abs().amax(-1)
print("no cache:", repr(tok.decode(a_toks)))
print("cache:   ", repr(tok.decode(b_toks)))
print("first parting step:", parting)
print("max |Δ logit| per step:", [float(g) for g in gap])
print("max |Δ logits| = " + repr(float(gap.max())))
'''

_DTYPES = '''
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

_PADDING = '''
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
                  pos[:, c:] if pos_mode == "auto" else None, pre.past_key_values)
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

_REUSE = '''
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
    shared = copy.deepcopy(pre.past_key_values)  # the one cache object "reused" grows
    for cont in CONTINUATION_IDS:
        c = torch.tensor([cont], device=DEVICE)
        runs = {{"fresh": decode_after(None, torch.tensor([PREFIX_IDS + cont], device=DEVICE)),
                "deepcopy": decode_after(copy.deepcopy(pre.past_key_values), c),
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


_TRAP = '''
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

_QUANT = '''
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


_MATRIX = '''
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
        kw["past_key_values"] = cache
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


_CARD = '''
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


def _card_checks(result) -> list:
    return [c for c in result.checks if c.logits_max_abs is not None and c.scenario]


def _matrix_cells(result) -> tuple[list, list]:
    kept = [c for c in result.cells if c.compile == "off" and c.error is None and c.verdict != "nondeterministic"]
    skipped = [c.label + (f" ({c.error})" if c.error else " (compiled)" if c.compile != "off" else
                          " (nondeterministic)") for c in result.cells if c not in kept]
    return kept, skipped


def check_reproducible(result) -> str:
    """The result's view name when a repro script can rebuild it; KvvizError with the one-line reason otherwise."""
    view = view_of(result)
    if view not in repro_views():
        raise KvvizError(f"repro scripts are written for {', '.join(repro_views())}; this {view} result has its JSON and "
                         "HTML exports")
    s = result.settings
    if view == "loading_trap":
        return view
    if view == "check":
        if not _card_checks(result):
            raise KvvizError("this card has no split-based check to rebuild (the model returned no cache)")
        return view
    if view == "matrix":
        if s.get("invariant"):
            raise KvvizError("a repro script rebuilds the plain run; this matrix ran in invariant mode")
        if not _matrix_cells(result)[0]:
            raise KvvizError("every cell of this matrix was compiled or failed: no cell a script can rebuild bit "
                             "for bit")
        return view
    if not s.execution.is_default:
        raise KvvizError(f"a repro script rebuilds the plain run; this one used {s.execution.label()} "
                         "(invariant mode, cache kinds and flags live in kvviz)")
    if view == "quant" and s.weights.startswith("bnb-"):
        raise KvvizError("bitsandbytes weights load through kvviz's CUDA path; no script for them")
    if view == "split" and not result.main.has_cache:
        raise KvvizError("this model returns no cache: there is no cached run to reproduce")
    if view == "greedy":
        if not {"no_cache", "cache"} <= set(s.paths):
            raise KvvizError("the greedy repro compares the no-cache loop with the cached loop; run both paths")
        if s.fast:
            raise KvvizError("this greedy result used the fast preview; the repro rebuilds the exact loops, so run "
                             "without fast")
    if view == "dtypes" and not [d for d in result.dtypes if d != "float64" and d not in s.skipped_dtypes]:
        raise KvvizError("the sweep has no dtype besides float64 to reproduce")
    return view


def repro_script(result, lm: LoadedModel, name: str = "kvviz_repro.py") -> str:
    """A standalone script for a result of one of repro_views() computed with `lm` (any dtype of the same model: the script
    loads the dtypes the result used); KvvizError with one line for what no script can rebuild."""
    view = check_reproducible(result)
    s = result.settings
    if view == "serving":
        return _serving_script(result, lm, name)
    if view == "loading_trap":
        from .inputs import encode

        title = f"from_pretrained(dtype={s['dtype']}) vs float32 + .to({s['dtype']}) for {s['model']}"
        body = _TRAP.format(dtype=s["dtype"], ids=encode(lm, s["prompt"]), prompt=s["prompt"],
                            steps=s["max_new_tokens"])
        return _header(title, name=name, folder=lm.source, model=s["model"],
                              device=s.get("device", str(lm.device)), attn=lm.attn_requested,
                              float64_mode=_NO_FLOAT64) + body
    if view == "matrix":
        from .inputs import encode
        from .quant import kv_group_size

        kept, skipped = _matrix_cells(result)
        rows = [encode(lm, s["prompt"])] + [encode(lm, t) for t in s.get("batch_with", [])]
        title = f"the backends matrix of {s['model']} ({len(kept)} cells), {s['dtype']} on {s['device']}"
        body = _MATRIX.format(dtype=s["dtype"], rows=rows, prompt=s["prompt"], left_pad=s["left_pad"],
                              steps=s["max_new_tokens"], positions=s["position_ids"],
                              cells=[(c.attention, c.cache, tuple(c.flags)) for c in kept], skipped=skipped,
                              group=kv_group_size(lm), flags_source=_module_body("flags"))
        return _header(title, name=name, folder=lm.source, model=s["model"], device=s["device"],
                              attn="auto", float64_mode=_float64_mode() if s["dtype"] == "float64"
                              else _NO_FLOAT64) + body
    if view == "check":
        kept = _card_checks(result)
        checks = [(c.name, c.scenario["prompt"], c.scenario["split"], c.scenario["mode"], c.scenario["left_pad"])
                  for c in kept]
        title = f"the cache-safety card of {result.model}: its float64 split checks"
        body = _CARD.format(checks=checks, others=[c.name for c in result.checks if c not in kept])
        return _header(title, name=name, folder=lm.source, model=result.model,
                              device=s.get("float64_device", s.get("device", "cpu")), attn=lm.attn_requested,
                              float64_mode=_float64_mode()) + body
    uses64 = s.dtype == "float64" and view != "dtypes"
    head = dict(name=name, folder=lm.source, model=s.model, device=s.device, attn=lm.attn_requested,
                float64_mode=_float64_mode() if uses64 else _NO_FLOAT64)
    if view == "split":
        title = f"split of {s.model} at {s.split} ({s.mode}), {s.dtype} on {s.device}"
        body = _SPLIT.format(dtype=s.dtype, prompt=s.prompt, split=s.split, left_pad=s.left_pad, mode=s.mode,
                             positions=s.position_ids, mask=s.attention_mask)
    elif view == "greedy":
        from .inputs import encode

        title = f"greedy decoding of {s.model}, no cache vs cache, {result.steps} steps, {s.dtype} on {s.device}"
        body = _GREEDY.format(dtype=s.dtype, ids=encode(lm, s.prompt), prompt=s.prompt, left_pad=s.left_pad,
                              steps=result.steps, positions=s.position_ids)
    elif view == "dtypes":
        from .inputs import encode
        from .dtype_sweep import split_point

        prompts = []
        for p in result.prompts:
            ids = encode(lm, p)
            prompts.append((p, ids, split_point(len(ids), s.split)))
        dtypes = [d for d in result.dtypes if d != "float64" and d not in s.skipped_dtypes]
        title = f"the split comparison of {s.model} in {', '.join(dtypes)} over {len(prompts)} prompt(s) on {s.device}"
        body = _DTYPES.format(dtypes=dtypes, prompts=prompts, mode=s.mode)
    elif view == "padding":
        from .inputs import encode
        from .padding import PLACEMENTS, SCENARIOS, companion_ids

        ids = encode(lm, s.prompt)
        comps = companion_ids(lm, ids, None, s.left_pad)
        if tuple(len(c) for c in comps) != tuple(s.companions):
            raise KvvizError("this padding result used other batch companions than kvviz's default ones")
        title = f"padding and batching of {s.model}, {s.dtype} on {s.device}"
        body = _PADDING.format(dtype=s.dtype, ids=ids, prompt=s.prompt, companions=comps, split=s.split,
                               left_pad=s.left_pad, placements=tuple(p for p in PLACEMENTS
                                                                     if p != "left-padded" or s.left_pad > 0),
                               scenarios=SCENARIOS)
    elif view == "quant":
        from .inputs import encode
        from .quant import kv_group_size, parse_kv

        backend, nbits = parse_kv(s.kv)
        kv = None if backend == "none" else (backend, nbits, s.residual_length, kv_group_size(lm))
        title = f"{s.model} unquantized vs {result.label}, {s.dtype} on {s.device}"
        body = _QUANT.format(dtype=s.dtype, ids=encode(lm, s.prompt), prompt=s.prompt, steps=s.max_new_tokens,
                             kv=kv, weights=None if s.weights == "none" else s.weights)
    else:
        from .reuse import check_inputs as reuse_inputs

        conts, prefix_ids, cont_ids = reuse_inputs(lm, s.prefix, list(s.continuations), s.max_new_tokens)
        title = f"prompt-cache reuse with {s.model}, {len(conts)} continuation(s), {s.dtype} on {s.device}"
        body = _REUSE.format(dtype=s.dtype, prefix_ids=prefix_ids, prefix=s.prefix, cont_ids=cont_ids,
                             continuations=conts, steps=s.max_new_tokens)
    return _header(title, **head) + body


def _header(title: str, **head) -> str:
    """The script's first lines. User text (a model path such as C:\\Users\\..., a prompt) goes only into comments
    with its line breaks removed, or into string literals through repr(): no spec can break the script's syntax."""
    one_line = {k: (" ".join(str(v).splitlines()) if k in ("title", "model", "name") else v) for k, v in head.items()}
    return _HEADER.format(title=" ".join(title.splitlines()), loops=_loops_source(), **one_line)


def _loops_source() -> str:
    """kvviz's decode loop and feed (kvviz/loops.py), copied into the script: the script runs the library's loop."""
    return ("\n# kvviz's loops: a copy of loops.py in the kvviz package (Executor.decode and Executor.feed run them)"
            + _module_body("loops"))


def _module_body(name: str) -> str:
    """A torch-only kvviz module's source without its docstring and its imports (the script has them), to copy into
    a script: the script then runs the library's own code (kvviz.loops, kvviz.flags)."""
    import importlib
    import inspect

    src = inspect.getsource(importlib.import_module(f"kvviz.{name}")).split('"""', 2)[2]
    return "\n".join(line for line in src.splitlines() if line not in ("import torch", "import contextlib"))


_NO_FLOAT64 = "\n\ndef keep_float64(model):  # not needed here\n    pass\n"


def _float64_mode() -> str:
    """kvviz's own KeepFloat64 mode (kvviz/float64.py), copied into the script so it needs no kvviz."""
    import inspect

    from . import float64

    src = inspect.getsource(float64)
    body = src.split('"""', 2)[2].replace("from __future__ import annotations\n", "")
    return ("\n# kvviz keeps float64 models in float64 (transformers' float32 'upcasts' would round): its mode, "
            "a copy of float64.py in the kvviz package\n" + body)


def key_figure(result) -> float:
    """The figure a repro script's last line reproduces (see the module's docstring)."""
    view = check_reproducible(result)
    if view == "serving":
        return float(result.histogram.get(1, 0))
    if view == "split":
        return float(result.main.logits["max_abs"].max())
    if view == "greedy":
        pair = result.pair("no_cache", "cache")
        return max(g for g, same in zip(pair.max_abs_logit, pair.same_history) if same)
    if view == "dtypes":
        return max(max(v) for d, v in result.logits_max_abs.items()
                   if d != "float64" and d not in result.settings.skipped_dtypes)
    if view == "padding":
        return max(c["logits_max_abs"] for c in result.cells)
    if view == "loading_trap":
        return max(result.max_abs_logit)
    if view == "quant":
        return max(result.logits_max_abs)
    if view == "matrix":
        return max(c.max_abs_logit for c in _matrix_cells(result)[0])
    if view == "check":
        return max(c.logits_max_abs for c in _card_checks(result))
    return max(r["logits_max_abs"] for r in result.runs if r["strategy"] != "fresh")


_SERVING = '''
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

DTYPE = torch.{dtype}
PROMPTS = {ids!r}  # token ids of {source!r} (shared prefix included)
PREFIX = {prefix!r}  # token ids of the shared prefix (None: the warmer is the identical prompt)
N_NEW, RUNS, PAGE = {n}, {runs}, {page}
CONDITIONS = {conditions!r}
BATCHES = {batches!r}  # run -> the batches of prompt indices kvviz drew (seeded), the last one filled up
model = load(DTYPE)


def reference(ids):
    """The no-cache greedy loop: a full forward at every step."""
    ids = torch.tensor([ids], device=DEVICE)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        return decode(caller(model), ids, mask, N_NEW, "no_cache", positions_from(mask), hidden=False)[0]


def engine(requests, per_batch, sharing, sequential=()):
    """transformers' continuous batching with the toggles kvviz used; requests: [(key, ids, new tokens)]."""
    longest = max(len(ids) + n for _, ids, n in requests)
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=(-(-longest // PAGE) + 1) * (len(requests) + 2) + 8,
                                  max_batch_tokens=max(64, per_batch * longest), max_requests_per_batch=per_batch,
                                  allow_block_sharing=sharing, use_async_batching=False, use_cuda_graph=False,
                                  auto_switch_to_flash=False, scheduler_type="fifo", max_blocks_per_request=0)
    gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=N_NEW, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cb)
    done = {{}}

    def collect(keys):
        keys = set(keys)
        while keys:
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished() and r.request_id in keys:
                done[r.request_id] = list(r.generated_tokens)
                keys.discard(r.request_id)

    try:
        first = [(k, ids, n) for k, ids, n in requests if k not in sequential]
        for k, ids, n in first:
            manager.add_request(ids, request_id=k, max_new_tokens=n, eos_token_id=-1)
        manager.start()
        collect(k for k, _, _ in first)
        for k, ids, n in requests:
            if k in sequential:
                manager.add_request(ids, request_id=k, max_new_tokens=n, eos_token_id=-1)
                collect([k])
    finally:
        manager.stop(block=True)
        manager.destroy()
    return done


runs = {{i: [] for i in range(len(PROMPTS))}}
refs = [reference(p) for p in PROMPTS]
for i, r in enumerate(refs):
    runs[i].append(tuple(r))
for cond in CONDITIONS:
    for run in range(RUNS):
        if cond == "alone":
            out = engine([(f"p{{i}}", p, N_NEW) for i, p in enumerate(PROMPTS)], 1, False)
            got = {{i: out[f"p{{i}}"] for i in range(len(PROMPTS))}}
        elif cond == "batch":
            batches, k = BATCHES[run], len(BATCHES[run][0])
            real = len(PROMPTS) - k * (len(batches) - 1)
            reqs, got_keys = [], {{}}
            for b, batch in enumerate(batches):
                for j, i in enumerate(batch):
                    reqs.append((f"b{{b}}_{{j}}_p{{i}}", PROMPTS[i], N_NEW))
                    if j < (k if b < len(batches) - 1 else real):
                        got_keys[i] = f"b{{b}}_{{j}}_p{{i}}"
            out = engine(reqs, k, False)
            got = {{i: out[key] for i, key in got_keys.items()}}
        else:
            reqs, seq = [], set()
            for i, p in enumerate(PROMPTS):
                reqs += [(f"w{{i}}", PREFIX or p, 2), (f"p{{i}}", p, N_NEW)]
                seq |= {{f"w{{i}}", f"p{{i}}"}}
            out = engine(reqs, 1, True, seq)
            got = {{i: out[f"p{{i}}"] for i in range(len(PROMPTS))}}
        for i, toks in got.items():
            runs[i].append(tuple(toks))
        parting = sum(tuple(got[i]) != tuple(refs[i]) for i in got)
        print(f"{{cond}} run {{run + 1}}: {{parting}} of {{len(got)}} prompts part from the reference")
distinct = {{i: len(set(v)) for i, v in runs.items()}}
hist = {{}}
for d in distinct.values():
    hist[d] = hist.get(d, 0) + 1
print("distinct completions per prompt -> prompts:", dict(sorted(hist.items())))
print("prompts with 1 distinct completion =", hist.get(1, 0))
'''


def _serving_script(res, lm: LoadedModel, name: str = "kvviz_repro.py") -> str:
    """The Serving study as a standalone script (torch + transformers) that makes the same engine calls plainly and
    prints the same distinct counts; its last line is `prompts with 1 distinct completion = N`."""
    from .serving import encode

    s = res.settings
    if s.engine != "transformers":
        raise KvvizError("repro scripts are written for the transformers engine")
    ids = [encode(lm, s.shared_prefix + p.prompt) for p in res.prompts]
    prefix = encode(lm, s.shared_prefix) if s.shared_prefix else None
    title = (f"the Serving study of {s.model}: {len(ids)} prompts × {{{', '.join(s.conditions)}}} × {s.runs} runs, "
             f"{s.dtype} on {s.device}")
    body = _SERVING.format(dtype=s.dtype, ids=ids, source=s.prompt_source, prefix=prefix, n=s.max_new_tokens,
                         runs=s.runs, page=s.page_size, conditions=tuple(s.conditions),
                         batches={int(k): v for k, v in res.batches.items()})
    return _header(title, name=name, folder=lm.source, model=s.model, device=s.device, attn=lm.attn_requested,
                   float64_mode=_float64_mode() if s.dtype == "float64" else _NO_FLOAT64) + body
