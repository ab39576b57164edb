"""Serving: the same prompts under serving conditions, R runs each — how many distinct completions, where they
part from the reference, and why (precision or logic, proved in invariant mode).

Conditions (each run R times through the engine, see kvviz/engines/serving.py):
  reference  each prompt alone, without cache: kvviz's greedy no-cache loop (a full forward at every step) - the
             reference every engine run is compared with (run once: the same shapes give the same bits);
  alone      each prompt alone in the engine (one request in flight, prefix sharing off): the cache, cold;
  batch      in a continuous batch of k: each run the prompt set is shuffled (seeded) and cut into batches of k,
             the last batch filled up with random neighbours; k requests in flight, prefix sharing off;
  warm       the prefix warm: prefix sharing on, a warmer request (the shared prefix, or the identical prompt when
             there is none) runs first, then the prompt reuses its cached pages.
With a shared prefix every prompt is `prefix + prompt`. `ExecSettings(invariant=True)` runs every condition (and the
reference) in invariant mode; the engine's own thread runs under it too.

Per prompt: distinct completions per condition and over all runs; the first step where any run parts from the
reference; the reference's top-2 margin there (and the run's); the verdict of that step replayed in float64 on the
same tokens - the reference computation (kvviz's float64 replay) against the same engine condition run on the
float64 model - by kvviz's one rule (`split.classify`); and the proof: that condition rerun in invariant mode
gives the reference's tokens (precision, proved) or still parts (logic).
Summary: the histogram of distinct completions per prompt, the share of prompts whose warm output differs from
cold, the first-divergence positions, tokens/s per condition.
"""
from __future__ import annotations

import random
import time
from typing import Callable
from collections import Counter
from dataclasses import asdict, dataclass, field, fields

from ...engines import registry
from ...engines.base import Engine, Request
from ...engines.serving import MIN_PAGE
from ...core.memory import PAGE_SIZE, Workload
from ...core.errors import KvvizError
from ...core.metrics import first_divergence
from ...core.execution import COMPILE_OFF, DEFAULT_CACHE, DEFAULT_SETTINGS, ExecSettings, Executor, RunInfo, RunSettings
from ...core.inputs import build_inputs, encode
from ...core.replay import Replay, no_cache_tokens, replay_step
from ...models.loading import LoadedModel
from ...core.protocol import DEFAULT_CONTEXT, no_progress, Progress, RunContext
from ...core.verdict import Prove, Verdict, classify
from ...core.estimate import Timed
from ...engines.verdict import engine_verdicts
from ...core.prompts import load_prompts

CONDITIONS = ("alone", "batch", "warm")
CONDITION_LABELS = {
    "reference": "alone, no cache (reference)",
    "alone": "alone, with cache (cold)",
    "batch": "in a continuous batch",
    "warm": "prefix warm (reused pages)",
}
MAX_RUNS = 1000
MAX_NEW_TOKENS = 256
MAX_BATCH = 64
PAGE_REFUSED = ("the page size is a setting of transformers' continuous batching: vLLM runs its prefix cache in blocks "
                "of 32 tokens here and llama.cpp has no pages; leave the page size out for this engine")
DEFAULT_LIMIT = 20
# The warmer decodes 2 tokens: transformers' engine registers a request's full pages for sharing after a step only
# while the request is still running, so a 1-token request (finished by its prefill) would leave nothing cached.
WARMER_TOKENS = 2



@dataclass(frozen=True)
class ServeConfig:
    """A study's settings, normalised when made (with a server URL the default engine becomes the server; each
    condition once, in order; the page size where the engine keeps its pages here and none is named) and checked by
    `validate()`, which changes nothing."""
    prompts: list[str]
    shared_prefix: str = ""
    conditions: tuple[str, ...] = CONDITIONS
    runs: int = 5
    max_new_tokens: int = 16
    batch_size: int = 4
    seed: int = 0
    engine: str = registry.default()
    page_size: int | None = None  # transformers' continuous batching only (None: PAGE_SIZE there)
    prompt_source: str = ""
    tensor_parallel_size: int = 1  # the vLLM engine only
    server: str | None = None  # an OpenAI-compatible server's URL (server.py): the engine is the user's server

    def __post_init__(self):
        if self.server and registry.facts(self.engine).default:  # the user's server runs instead
            object.__setattr__(self, "engine", registry.served())
        if isinstance(self.conditions, (list, tuple)):
            object.__setattr__(self, "conditions", tuple(dict.fromkeys(self.conditions)))
        if self.page_size is None and registry.facts(self.engine).pages_here:
            object.__setattr__(self, "page_size", PAGE_SIZE)

    def workload(self) -> Workload:
        """What kvviz's process holds, for the memory plan: each prompt after the shared prefix, the requests in
        flight, the conditions, and transformers' pages (0: vLLM, llama.cpp or a server hold theirs elsewhere)."""
        # its time estimate: each prompt's no-cache reference decode (the whole sequence each step); then per
        # condition and run the prompts through the engine: alone and warm one request at a time (a prefill and its
        # decode steps; warm: a warming request's prefill first), batch k requests at a time (one prefill and one
        # decode step for the batch: a batch's step on a CPU costs about one request's for a small batch)
        n, k = len(self.prompts), max(1, int(self.batch_size))
        steps = {"alone": n, "batch": -(-n // k), "warm": n}  # decode paths per run
        prefills = {"alone": n, "batch": -(-n // k), "warm": 2 * n}
        runs = int(self.runs)
        return Workload(texts=tuple(self.shared_prefix + p for p in self.prompts), new_tokens=int(self.max_new_tokens),
                        batch=int(self.batch_size), conditions=tuple(self.conditions),
                        page_size=self.page_size if registry.facts(self.engine).pages_here else 0,
                        forwards=float(n + runs * sum(prefills.get(c, n) for c in self.conditions)), full_paths=n,
                        decode_paths=runs * sum(steps.get(c, n) for c in self.conditions))

    def validate(self) -> None:
        engine = registry.facts(self.engine)
        if self.server:
            if not engine.served or self.page_size is not None or self.tensor_parallel_size != 1:
                raise KvvizError("--server judges the user's running server: leave --engine, --page-size and "
                                 "--tensor-parallel-size out (they are the server's own settings)")
        if not isinstance(self.prompts, list) or not self.prompts:
            raise KvvizError("the study needs at least one prompt")
        for name, v, lo, hi in (("runs", self.runs, 1, MAX_RUNS),
                                ("new tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS),
                                ("batch size", self.batch_size, 2, MAX_BATCH)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise KvvizError(f"{name} must be a whole number from {lo} to {hi}, not {v!r}")
        conds = self.conditions if isinstance(self.conditions, tuple) else ()
        bad = [c for c in conds if c not in CONDITIONS]
        if bad:
            raise KvvizError(f"unknown condition '{bad[0]}'; choose from {', '.join(CONDITIONS)}")
        if not conds:
            raise KvvizError("choose at least one condition")
        if not self.server:
            registry.get(self.engine)  # one line: an unknown engine
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise KvvizError(f"tensor_parallel_size must be a whole number, 1 or more, not {tp!r}")
        if self.page_size is not None and not engine.pages_here:
            raise KvvizError(PAGE_REFUSED)
        if self.page_size is not None and (isinstance(self.page_size, bool) or not isinstance(self.page_size, int)
                                           or self.page_size < MIN_PAGE):
            raise KvvizError(f"the page size must be a whole number, {MIN_PAGE} or more, not {self.page_size!r}")
        if tp != 1 and not engine.tensor_parallel:
            raise KvvizError("tensor_parallel_size applies to the vLLM engine only (transformers' continuous "
                             "batching runs the model on one device)")
        if not isinstance(self.shared_prefix, str):
            raise KvvizError("the shared prefix must be text")
        if self.shared_prefix and not self.shared_prefix.strip():
            raise KvvizError("the shared prefix is only whitespace; leave it empty for no prefix, or give the text "
                             "every prompt starts with")


@dataclass(frozen=True)
class ServeSettings(RunSettings):
    prompt_source: str = ""
    shared_prefix: str = ""
    conditions: tuple[str, ...] = ()
    runs: int = 0
    max_new_tokens: int = 0
    batch_size: int = 0
    seed: int = 0
    engine: str = registry.default()
    page_size: int | None = PAGE_SIZE  # None: an engine without pages set by kvviz (vLLM, llama.cpp)
    tensor_parallel_size: int = 1


@dataclass
class PromptResult:
    index: int
    prompt: str
    reference: list[int]
    reference_text: str
    reference_margins: list[float]
    completions: dict[str, list[list[int]]]  # condition -> one token list per run
    texts: dict[str, list[str]]
    distinct: dict[str, int]
    distinct_all: int  # over every run of every condition, the reference included
    first_divergence: int | None = None
    condition: str | None = None  # the condition and run that part first
    run: int | None = None
    reference_token: str | None = None
    run_token: str | None = None
    margin: float | None = None  # the reference's top-2 margin at the first divergence
    run_margin: float | None = None  # the engine's top-2 margin there (as it read its scores)
    float64_gap: float | None = None
    verdict: str | None = None
    explanation: str | None = None
    proved: bool | None = None
    proof: str | None = None
    warm_differs: bool | None = None
    # real engines (vLLM, llama.cpp): each distinct path -> its distance from the float64 reference on its own tokens
    engine_paths: dict | None = None


@dataclass
class ConditionStats:
    name: str
    label: str
    runs: int
    new_tokens: int
    seconds: float
    parting_prompts: int  # prompts with a run that differs from the reference
    cached_tokens: int = 0  # prompt tokens the counted requests took from the cache (prefix sharing)
    prompt_tokens: int = 0  # prompt tokens of the counted requests

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ServeResult(Timed):
    settings: ServeSettings
    model: dict
    engine: dict
    prompts: list[PromptResult]
    conditions: dict[str, ConditionStats]
    notes: list[str]
    elapsed_s: float
    analysis_s: float = 0.0
    batches: dict = field(default_factory=dict)  # run -> the batches of prompt indices (batch condition)
    proof_s: float | None = None  # seconds the parting conditions' invariant-mode rerun took (None: no rerun)

    @property
    def histogram(self) -> dict[int, int]:
        """distinct completions (over all conditions and runs) -> number of prompts."""
        return dict(sorted(Counter(p.distinct_all for p in self.prompts).items()))

    def condition_histogram(self, condition: str) -> dict[int, int]:
        return dict(sorted(Counter(p.distinct.get(condition, 0) for p in self.prompts
                                   if condition in p.distinct).items()))

    @property
    def warm_differs_share(self) -> float | None:
        flags = [p.warm_differs for p in self.prompts if p.warm_differs is not None]
        return sum(flags) / len(flags) if flags else None

    @property
    def first_divergences(self) -> list[int]:
        return [p.first_divergence for p in self.prompts if p.first_divergence is not None]

    @property
    def float64(self) -> list | None:
        """The float64 evidence: each parting prompt's float64 gap (transformers' engine) or every prompt judged
        against the float64 reference (vLLM, llama.cpp, a server); None where the float64 reference never ran (no
        prompt parted: kvviz.core.memory.MemoryPlan.settle plans the run without it)."""
        if registry.facts(self.settings.engine).judged_by_logprobs:
            return [p.engine_paths for p in self.prompts]
        parting = [p.float64_gap for p in self.prompts if p.first_divergence is not None]
        return parting or None

    def verdict_counts(self) -> dict[str, int]:
        return dict(Counter(p.verdict or "identical" for p in self.prompts))

    def summary_line(self) -> str:
        n = len(self.prompts)
        parting = sum(p.first_divergence is not None for p in self.prompts)
        one = self.histogram.get(1, 0)
        share = self.warm_differs_share
        return (f"{one} of {n} prompts gave exactly 1 distinct completion; {parting} parted from the reference"
                + ("" if share is None else f"; a warm run's completion differed from the cold one's for "
                                            f"{share:.0%} of prompts"))

    def to_dict(self) -> dict:
        return {"settings": self.settings.to_dict(), "model": self.model, "engine": self.engine,
                "prompts": [asdict(p) for p in self.prompts],
                "conditions": {k: {**asdict(v), "tokens_per_s": v.tokens_per_s} for k, v in self.conditions.items()},
                "histogram": {str(k): v for k, v in self.histogram.items()},
                "warm_differs_share": self.warm_differs_share, "first_divergences": self.first_divergences,
                "notes": self.notes, "elapsed_s": self.elapsed_s, "analysis_s": self.analysis_s,
                "proof_s": self.proof_s,
                "batches": {str(k): v for k, v in self.batches.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "ServeResult":
        names = {f.name for f in fields(ServeSettings)}
        s = {k: v for k, v in d["settings"].items() if k in names}
        s["conditions"] = tuple(s.get("conditions", ()))
        s["execution"] = ExecSettings.from_dict(d["settings"].get("execution") or {})
        conds = {k: ConditionStats(**{f.name: v[f.name] for f in fields(ConditionStats) if f.name in v})
                 for k, v in d["conditions"].items()}
        return cls(settings=ServeSettings(**s), model=d["model"], engine=d["engine"],
                   prompts=[PromptResult(**p) for p in d["prompts"]], conditions=conds, notes=d.get("notes", []),
                   elapsed_s=d.get("elapsed_s", 0.0), analysis_s=d.get("analysis_s", 0.0), proof_s=d.get("proof_s"),
                   batches={int(k): v for k, v in d.get("batches", {}).items()})


# ----------------------------------------------------------------------------------------------------------------
# Planning the engine calls (pure functions of the config: the same plan on every machine)


def plan_batches(n: int, k: int, runs: int, seed: int) -> dict[int, list[list[int]]]:
    """For each run: the prompt indices shuffled (seeded) and cut into batches of k; the last batch is filled up
    with random other prompts (neighbours whose outputs are not counted)."""
    rng = random.Random(seed)
    plan: dict[int, list[list[int]]] = {}
    for r in range(runs):
        order = list(range(n))
        rng.shuffle(order)
        batches = [order[i:i + k] for i in range(0, n, k)]
        last = batches[-1]
        while len(last) < k:
            last.append(rng.randrange(n))
        plan[r] = batches
    return plan


def _requests(cond: str, ids: list[list[int]], n: int, run: int, plan: dict, prefix_ids: list[int] | None,
              only: int | None = None, forced: list[int] | None = None, keep: bool = False):
    """The engine requests of one run of one condition: (requests, requests per batch, prefix sharing, sequential
    keys, counted keys -> prompt index). only/forced: just the prompt `only` (with `forced` tokens appended to its
    prompt), with exactly the neighbours or warmer it had in that run."""
    def target(i: int, key: str) -> Request:
        if only is not None and i == only:
            return Request(key, ids[i] + list(forced or []), n if forced is None else 1, keep_scores=keep)
        return Request(key, ids[i], n)

    reqs, seq, counted = [], set(), {}
    if cond == "alone":
        for i in range(len(ids)) if only is None else [only]:
            key = f"p{i}"
            reqs.append(target(i, key))
            counted[key] = i
        return reqs, 1, False, seq, counted
    if cond == "batch":
        batches = plan[run]
        k = len(batches[0])
        real = len(ids) - k * (len(batches) - 1)  # counted slots of the last batch; the rest are fill-ups
        for b, batch in enumerate(batches):
            slots = k if b < len(batches) - 1 else real
            if only is not None and only not in batch[:slots]:
                continue
            for j, i in enumerate(batch):
                key = f"b{b}_{j}_p{i}"
                if j < slots and (only is None or i == only):
                    reqs.append(target(i, key))
                    counted[key] = i
                else:
                    reqs.append(Request(key, ids[i], n))
        return reqs, k, False, seq, counted
    for i in range(len(ids)) if only is None else [only]:  # warm
        wkey, key = f"w{i}", f"p{i}"
        reqs.append(Request(wkey, list(prefix_ids or ids[i]), WARMER_TOKENS))
        reqs.append(target(i, key))
        seq.update((wkey, key))
        counted[key] = i
    return reqs, 1, True, seq, counted


# ----------------------------------------------------------------------------------------------------------------
# The study


def _reference(ex: Executor, lm: LoadedModel, text: str, n: int) -> tuple[list[int], list[float]]:
    inp = build_inputs(lm, text, 0, extra_tokens=n)
    with ex.session():
        return no_cache_tokens(ex, inp, n)


def _engine_run(engine: Engine, ex: Executor, reqs, per_batch, sharing, seq):
    with ex.session():
        return engine.generate(ex.lm, reqs, max_in_flight=per_batch, prefix_sharing=sharing, sequential_keys=seq,
                               invariant=ex.settings.invariant)


def run_serving(lm: LoadedModel, cfg: ServeConfig, progress: Progress | None = None,
                settings: ExecSettings | None = None, reference: LoadedModel | None = None,
                prove: Prove = None) -> ServeResult:
    """Run the study (see the module docstring). settings: how the model runs (invariant mode included); reference:
    the float64 model for the verdicts (lm.reference() when needed); prove (None or True; False: never): rerun
    parting conditions in invariant mode (not needed when the study already runs in it)."""
    progress = progress or no_progress
    settings = settings or DEFAULT_SETTINGS  # validated once, by its RunContext
    if settings.compile != COMPILE_OFF or settings.cache != DEFAULT_CACHE:
        raise KvvizError("the Serving view runs the engine's own paged cache without compile; leave the cache kind "
                         "and compile at their defaults")
    cfg.validate()
    kind = registry.check(cfg.engine)
    kind.check_settings(settings)  # what the engine cannot honour here, in one line before anything runs
    t_start = time.perf_counter()
    engine = registry.open_engine(cfg.engine, page_size=cfg.page_size, tensor_parallel_size=cfg.tensor_parallel_size,
                                  url=cfg.server)
    try:
        if kind.served:
            progress(0.0, f"Probing the server at {engine.url}…")
            engine.probe(lm, settings)  # one line: unreachable, or not the local weights
            t_start = time.perf_counter()
        return study(lm, cfg, engine, settings=settings, reference=reference, prove=prove, progress=progress,
                     started=t_start)
    finally:
        engine.close()  # vLLM: free the GPU the last LLM holds


@dataclass
class _Prepared:
    """A study's inputs: the texts (prefix + prompt), their token ids, the prefix's ids, the batch plan."""
    texts: list[str]
    ids: list[list[int]]
    prefix_ids: list[int] | None
    plan: dict


@dataclass
class _EngineRuns:
    """Every counted request's outputs, per condition and prompt (one entry per run), and the conditions' stats."""
    completions: dict[str, list[list[list[int]]]]
    margins: dict[str, list[list[list[float]]]]
    logps: dict[str, list[list[tuple]]]
    stats: dict[str, ConditionStats]


def study(lm: LoadedModel, cfg: ServeConfig, engine: Engine, *, settings: ExecSettings,
          reference: LoadedModel | None = None, prove: Prove = None, progress: Progress = no_progress,
          started: float | None = None, memo: dict | None = None) -> ServeResult:
    """The study on an open engine (run_serving opens and closes it; a sweep keeps one open for its grid). memo:
    what a sweep's cells share (the same prompts recur in every cell of a row): each prompt's no-cache reference
    decode and each token path's float64 (and own-format) log-probs, computed once for the whole sweep (the same
    settings, the same model: the same numbers)."""
    t_start = time.perf_counter() if started is None else started
    prep = _prepare(lm, cfg)
    ex = Executor(lm, settings)
    total = len(prep.ids) + len(cfg.conditions) * cfg.runs
    refs, ref_stats = _references(ex, lm, prep.texts, n=cfg.max_new_tokens, memo=memo if memo is not None else {},
                                  progress=lambda done, what: progress(0.8 * done / total, what))
    runs = _run_conditions(engine, ex, cfg=cfg, prep=prep, done=len(prep.ids),
                           progress=lambda done, what: progress(0.8 * done / total, what))
    runs.stats = {"reference": ref_stats, **runs.stats}
    t_an = time.perf_counter()
    results = _compare(lm, cfg, refs=refs, runs=runs)
    analysis_s = time.perf_counter() - t_an
    proof_s = _verdicts(lm, cfg, engine, results, prep=prep, runs=runs, settings=settings, reference=reference,
                        prove=prove, progress=progress, memo=memo)
    notes = list(lm.warnings)
    if settings.invariant:
        notes.append("invariant mode: every condition, the engine's own thread included, ran in it")
    notes += engine.notes()
    progress(1.0, "Done")
    own = {f.name: getattr(cfg, f.name) for f in fields(ServeSettings)
           if f.name not in RunSettings.__dataclass_fields__}  # the study's own settings, named as in its config
    return ServeResult(settings=ServeSettings.from_run(RunInfo.of(lm, settings), **own), model=lm.summary(),
                       engine={"page_size": cfg.page_size, **engine.info()}, prompts=results, conditions=runs.stats,
                       notes=notes, elapsed_s=time.perf_counter() - t_start, analysis_s=analysis_s,
                       batches=prep.plan, proof_s=proof_s)


def _prepare(lm: LoadedModel, cfg: ServeConfig) -> _Prepared:
    texts = [cfg.shared_prefix + p for p in cfg.prompts]
    ids = [encode(lm, t) for t in texts]
    for t in texts:  # length checks, one line each
        build_inputs(lm, t, 0, extra_tokens=cfg.max_new_tokens)
    prefix_ids = encode(lm, cfg.shared_prefix) if cfg.shared_prefix else None
    plan = plan_batches(len(ids), cfg.batch_size, cfg.runs, cfg.seed) if "batch" in cfg.conditions else {}
    return _Prepared(texts, ids, prefix_ids, plan)


def _references(ex: Executor, lm: LoadedModel, texts: list[str], *, n: int, memo: dict,
                progress: Callable[[int, str], None]) -> tuple[list[tuple[list[int], list[float]]], ConditionStats]:
    """Each prompt's no-cache reference decode (tokens, top-2 margins), from the memo where it is there."""
    refs = []
    t0 = time.perf_counter()
    for i, t in enumerate(texts):
        progress(i, f"reference (no cache): prompt {i + 1}/{len(texts)}")
        key = ("no-cache reference", t, n)
        if key not in memo:
            memo[key] = _reference(ex, lm, t, n)
        refs.append(memo[key])
    return refs, ConditionStats("reference", CONDITION_LABELS["reference"], 1, len(texts) * n,
                                time.perf_counter() - t0, 0)


def _run_conditions(engine: Engine, ex: Executor, *, cfg: ServeConfig, prep: _Prepared, done: int,
                    progress: Callable[[int, str], None]) -> _EngineRuns:
    """Every condition, cfg.runs times, through the engine."""
    N, n = len(prep.ids), cfg.max_new_tokens
    runs = _EngineRuns({c: [[] for _ in range(N)] for c in cfg.conditions},
                       {c: [[] for _ in range(N)] for c in cfg.conditions},
                       {c: [[] for _ in range(N)] for c in cfg.conditions}, {})
    for cond in cfg.conditions:
        secs, new, cached, ptoks = 0.0, 0, 0, 0
        for r in range(cfg.runs):
            progress(done, f"{CONDITION_LABELS[cond]}: run {r + 1}/{cfg.runs}")
            reqs, per_batch, sharing, seq, counted = _requests(cond, prep.ids, n, r, prep.plan, prep.prefix_ids)
            out = _engine_run(engine, ex, reqs, per_batch, sharing, seq)
            secs += out.seconds
            new += out.new_tokens
            for key, i in counted.items():
                o = out.outputs[key]
                runs.completions[cond][i].append(o.tokens)
                runs.margins[cond][i].append(o.margins)
                runs.logps[cond][i].append((o.logprobs, o.chosen))
                cached += o.cached_tokens
                ptoks += len(prep.ids[i])
            done += 1
        runs.stats[cond] = ConditionStats(cond, CONDITION_LABELS[cond], cfg.runs, new, secs, 0, cached, ptoks)
    return runs


def _compare(lm: LoadedModel, cfg: ServeConfig, *, refs, runs: _EngineRuns) -> list[PromptResult]:
    """Per prompt: its distinct completions, the first run that parts from the reference, the margins there, whether
    warm differs from cold (and each condition's count of parting prompts)."""
    tok = lm.tokenizer
    results: list[PromptResult] = []
    for i, (ref, ref_m) in enumerate(refs):
        comp = {c: runs.completions[c][i] for c in cfg.conditions}
        every = {tuple(ref)} | {tuple(x) for c in cfg.conditions for x in comp[c]}
        pr = PromptResult(index=i, prompt=cfg.prompts[i], reference=ref, reference_text=tok.decode(ref),
                          reference_margins=ref_m, completions=comp,
                          texts={c: [tok.decode(x) for x in comp[c]] for c in cfg.conditions},
                          distinct={c: len({tuple(x) for x in comp[c]}) for c in cfg.conditions},
                          distinct_all=len(every))
        best = None
        for c in cfg.conditions:
            for r, x in enumerate(comp[c]):
                d = first_divergence(ref, x)
                if d is not None and (best is None or d < best[0]):
                    best = (d, c, r)
            if any(x != ref for x in comp[c]):
                runs.stats[c].parting_prompts += 1
        if best is not None:
            d, c, r = best
            pr.first_divergence, pr.condition, pr.run = d, c, r
            pr.reference_token = tok.decode([ref[d]])
            # a run shorter than the reference ended there (a server without ignore_eos stops on its end token)
            pr.run_token = tok.decode([comp[c][r][d]]) if d < len(comp[c][r]) else "(end of sequence)"
            pr.margin = ref_m[d]
            rm = runs.margins[c][i][r]
            pr.run_margin = rm[d] if d < len(rm) else None
        if "warm" in cfg.conditions and "alone" in cfg.conditions:
            cold = {tuple(x) for x in comp["alone"]}
            pr.warm_differs = any(tuple(x) not in cold for x in comp["warm"])
        results.append(pr)
    return results


def _verdicts(lm: LoadedModel, cfg: ServeConfig, engine: Engine, results: list[PromptResult], *, prep: _Prepared,
              runs: _EngineRuns, settings: ExecSettings, reference: LoadedModel | None, prove: Prove,
              progress: Progress, memo: dict | None) -> float | None:
    """The verdicts: an engine judged by its log-probs against the float64 reference on every path; else each first
    divergence replayed in float64 and, unless prove is False, proved in invariant mode. Returns the proof's
    seconds (None: no proof ran)."""
    parting = [p for p in results if p.first_divergence is not None]
    if engine.judged_by_logprobs:
        progress(0.85, "Comparing the engine's log-probs with the float64 reference on each path…")
        engine_verdicts(results, lm, reference or lm.reference(), settings, engine, prep.ids, runs.completions,
                        runs.logps, memo)
        return None
    if not parting:
        return None
    progress(0.85, f"Replaying {len(parting)} first divergences in float64 for the verdicts…")
    lm64 = reference or lm.reference()
    ex64 = Executor(lm64, settings.with_(invariant=False))
    for p in parting:
        _explain(p, lm, lm64, ex64, engine, prep.ids, cfg.max_new_tokens, prep.plan, prep.prefix_ids, cfg)
    if prove is False or settings.invariant:
        return None
    progress(0.93, "Rerunning the parting conditions in invariant mode for the proof…")
    t_proof = time.perf_counter()
    exi = Executor(lm, settings.with_(invariant=True))
    for p in parting:
        _prove(p, lm, exi, engine, prep.texts, prep.ids, cfg.max_new_tokens, prep.plan, prep.prefix_ids)
    return time.perf_counter() - t_proof


def _explain(p: PromptResult, lm, lm64, ex64: Executor, engine, ids, n, plan, prefix_ids, cfg) -> None:
    """The first divergence replayed in float64 on the same tokens: the reference computation (a full forward)
    against the same engine condition (same neighbours or warmer) run on the float64 model."""
    t, cond = p.first_divergence, p.condition
    forced = p.reference[:t]
    ids64 = [encode(lm64, cfg.shared_prefix + q) for q in cfg.prompts]
    inp64 = build_inputs(lm64, cfg.shared_prefix + cfg.prompts[p.index], 0, extra_tokens=n)
    with ex64.session():
        ref64 = replay_step(ex64, inp64, Replay.FULL, forced).double().cpu()
    reqs, per_batch, sharing, seq, counted = _requests(cond, ids64, n, p.run, plan, prefix_ids, only=p.index,
                                                       forced=forced, keep=True)
    out = _engine_run(engine, ex64, reqs, per_batch, sharing, seq)
    key = next(k for k, i in counted.items() if i == p.index)
    rows = out.outputs[key].scores
    if not rows:
        p.verdict, p.explanation = None, "the engine's float64 scores could not be read; no verdict"
        return
    eng64 = rows[0]
    gap64 = float((eng64 - ref64).abs().max() / ref64.abs().max().clamp_min(1e-300))
    p.float64_gap = gap64
    p.verdict = classify(False, gap64)
    head = (f"At step {t} run {p.run + 1} {CONDITION_LABELS[cond]} chose {p.run_token!r} where the reference chose "
            f"{p.reference_token!r}; the reference's top-2 margin there was {p.margin:.3g}"
            + (f" and the engine's {p.run_margin:.3g}" if p.run_margin is not None else "") + ".")
    head += f" Replayed in float64 on the same tokens, the engine ({cond}) and the full forward "
    p.explanation = head + (f"agree to {gap64:.2g} (relative): rounding, not a bug." if p.verdict == Verdict.PRECISION
                            else f"still differ by {gap64:.3g} (relative): a logic difference, not rounding.")


def _prove(p: PromptResult, lm, exi: Executor, engine, texts, ids, n, plan, prefix_ids) -> None:
    """The parting condition (the same run's neighbours or warmer) and the reference, rerun in invariant mode."""
    t, cond = p.first_divergence, p.condition
    steps = min(n, t + 1)
    ref_i, _ = _reference(exi, lm, texts[p.index], steps)
    reqs, per_batch, sharing, seq, counted = _requests(cond, ids, steps, p.run, plan, prefix_ids, only=p.index)
    out = _engine_run(engine, exi, reqs, per_batch, sharing, seq)
    key = next(k for k, i in counted.items() if i == p.index)
    got = out.outputs[key].tokens
    p.proved = got == ref_i
    if p.proved:
        p.proof = (f"Precision — proved: in invariant mode {CONDITION_LABELS[cond]} (the same neighbours/warmer) and "
                   f"the reference choose the same {steps} tokens.")
    else:
        d = first_divergence(ref_i, got)
        parts = (f"in invariant mode {CONDITION_LABELS[cond]} still parts from the reference"
                 + (f" at step {d}" if d is not None else ""))
        if p.verdict == Verdict.PRECISION:
            # the proof failed: "rounding, not a bug" must not stand beside it (kvviz.core.verdict's rule)
            p.explanation = p.explanation.replace(": rounding, not a bug.", ": rounding by the numbers, but unproved.")
            p.proof = (f"Precision, unproved: {parts}, so reduction order alone does not explain it and it is not "
                       f"shown to be rounding.")
        else:
            p.proof = f"{parts[0].upper()}{parts[1:]}: not reduction order — logic."


def load_prompt_set(source: str | None = None, prompt: str | None = None, limit: int | None = DEFAULT_LIMIT
                    ) -> tuple[list[str], str]:
    """The prompts of a study: one prompt, or a set ('builtin', 'builtin:<category>', a .txt/.jsonl file)."""
    if prompt is not None:
        if not prompt.strip():
            raise KvvizError("the prompt is empty; type some text to compare")
        return [prompt], "one prompt"
    src = source or "builtin"
    return load_prompts(src, limit), src


def summary_text(res: ServeResult) -> str:
    """The study as text (CLI, `open`)."""
    s = res.settings
    lines = [f"model: {res.model.get('description', s.model)}",
             f"{s.dtype} on {s.device}, engine {s.engine}" + (f" (page size {s.page_size})" if s.page_size else "")
             + f", {len(res.prompts)} prompts × "
             f"{{{', '.join(s.conditions)}}} × {s.runs} runs, {s.max_new_tokens} new tokens, batch of {s.batch_size}"
             + (", INVARIANT MODE" if s.execution.invariant else "")
             + (f", shared prefix {s.shared_prefix!r}" if s.shared_prefix else ""), "",
             res.summary_line(), "",
             "distinct completions per prompt (all conditions and runs, the reference included) -> prompts:"]
    lines += [f"  {k}: {v}" for k, v in res.histogram.items()]
    lines += ["", "per condition:"]
    for c in res.conditions.values():
        lines.append(f"  {c.label:<34} {c.tokens_per_s:8.1f} tokens/s"
                     + ("" if c.name == "reference" else f"   prompts parting from the reference: {c.parting_prompts}")
                     + (f"   prompt tokens from the cache: {c.cached_tokens}/{c.prompt_tokens}" if c.cached_tokens
                        else ""))
    if res.first_divergences:
        lines += ["", "first divergence positions: " + ", ".join(map(str, sorted(res.first_divergences)))]
    judged = [p for p in res.prompts if p.engine_paths]
    if judged:
        lines += ["", f"{res.engine.get('name')} {res.engine.get('version', '')} ({res.engine.get('dtype', '')}) "
                      "against the float64 reference on each path's own tokens (largest log-prob gap, nats):"]
        for c in res.settings.conditions:
            ds = [(v["distance"], v["rounding"]) for p in judged for k, v in p.engine_paths.items()
                  if k.startswith(c + " ")]
            if ds:
                worst = max(ds, key=lambda x: x[0] / x[1] if x[1] else x[0])
                lines.append(f"  {CONDITION_LABELS[c]:<34} max {max(d for d, _ in ds):.3g}   rounding distance "
                             f"{min(r for _, r in ds):.2g}..{max(r for _, r in ds):.2g}   worst/rounding "
                             f"{worst[0] / worst[1] if worst[1] else float('inf'):.2f}")
        owns = [v["own"] for p in judged for v in p.engine_paths.values() if v.get("own") is not None]
        if owns:
            lines.append(f"  (kvviz's own {res.settings.dtype} forward on the same tokens: max {max(owns):.3g} nats "
                         f"from float64; the rounding distance is 16x that)")
    parting = [p for p in res.prompts if p.first_divergence is not None or p.verdict == "logic"]
    if parting:
        lines.append("")
        for p in parting:
            where = ("no parting" if p.first_divergence is None else
                     f"parts at step {p.first_divergence} ({p.condition}, run {p.run + 1})")
            lines.append(f"[{p.index}] {p.prompt[:50]!r}: distinct {p.distinct_all}, {where}"
                         f" — {(p.verdict or '?').upper()}: {p.explanation}"
                         + (f" {p.proof}" if p.proof else ""))
    if res.proof_s is not None:
        lines.append(f"proof: the parting conditions' invariant-mode rerun took {res.proof_s:.2f} s "
                     f"(the whole study {res.elapsed_s:.2f} s)")
    for note in res.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def run(lm: LoadedModel, config: ServeConfig, ctx: RunContext = DEFAULT_CONTEXT) -> ServeResult:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    with ctx.running() as progress:
        return run_serving(lm, config, progress, settings=ctx.settings, reference=ctx.reference, prove=ctx.prove)
