"""The serving view's standalone repro script (torch + transformers only): the same continuous-batching calls (alone / batch / warm, the same draws) made plainly with transformers' engine, and the no-cache reference; its last line is the number of prompts with 1 distinct completion."""
from __future__ import annotations

from ...core.errors import KvvizError
from ...engines import registry
from ...io.repro import NO_FLOAT64, float64_mode, header, require_plain
from .run import encode

TEMPLATE = '''
from transformers import GenerationConfig
from transformers import ContinuousBatchingConfig

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


def check(result) -> None:
    require_plain(result)
    if not registry.facts(result.settings.engine).repro:
        raise KvvizError(f"repro scripts are written for the {registry.default()} engine")


def script(res, lm, name: str) -> str:
    """The Serving study as a standalone script (torch + transformers) that makes the same engine calls plainly and
    prints the same distinct counts; its last line is `prompts with 1 distinct completion = N`."""
    s = res.settings
    ids = [encode(lm, s.shared_prefix + p.prompt) for p in res.prompts]
    prefix = encode(lm, s.shared_prefix) if s.shared_prefix else None
    title = (f"the Serving study of {s.model}: {len(ids)} prompts × {{{', '.join(s.conditions)}}} × {s.runs} runs, "
             f"{s.dtype} on {s.device}")
    body = TEMPLATE.format(dtype=s.dtype, ids=ids, source=s.prompt_source, prefix=prefix, n=s.max_new_tokens,
                         runs=s.runs, page=s.page_size, conditions=tuple(s.conditions),
                         batches={int(k): v for k, v in res.batches.items()})
    return header(title, name=name, folder=lm.source, model=s.model, device=s.device, attn=lm.attn_requested,
                   float64_mode=float64_mode() if s.dtype == "float64" else NO_FLOAT64) + body


def key_figure(result) -> float:
    return float(result.histogram.get(1, 0))
