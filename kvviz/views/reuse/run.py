"""Prompt-cache reuse: a shared prefix cached once and reused for several continuations.

Three ways to continue after a prefix: `fresh` (no prefix cache: prefix + continuation prefilled afresh - the
reference), `deepcopy` (the prefix cache copied for each continuation) and `reused` (the same cache object for
every continuation, so later ones also see the earlier continuations - the common bug). Each non-reference way is
compared with `fresh` and judged by the one rule (kvviz.views.split.run.classify) from the same runs in float64.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import pandas as pd
import torch

from ...models.compat import output_cache
from ...core.errors import KvvizError
from ...core.execution import DEFAULT_SETTINGS, ExecSettings, Executor, RunInfo, RunSettings, StepPolicy, has_cache
from ...core.metrics import first_divergence
from ...core.inputs import Workload, encode, token_texts
from ...models.loading import LoadedModel
from ...core.protocol import DEFAULT_CONTEXT, no_progress, Progress, RunContext
from ...core.verdict import Prove, Verdict, classify
from ...core.estimate import Timed

REFERENCE = "fresh"
REUSE_STRATEGIES = {
    "fresh": "no prefix cache: prefix + continuation prefilled afresh (the reference)",
    "deepcopy": "prefix cached once, a deep copy per continuation",
    "reused": "prefix cached once, the same cache object reused (grown by earlier continuations)",
}
MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class ReuseSettings(RunSettings):
    prefix: str = ""
    continuations: tuple[str, ...] = ()
    max_new_tokens: int = 0


@dataclass
class ReuseResult(Timed):
    settings: ReuseSettings
    model: dict
    prefix_tokens: list[str]
    runs: list[dict]  # per continuation × strategy: tokens, text, first divergence vs fresh, gaps, verdict

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{k: r[k] for k in ("continuation", "strategy", "text", "first_divergence",
                                                "logits_relative", "float64_relative", "verdict")}
                             for r in self.runs])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["settings"] = self.settings.to_dict()
        return d


def _decode_after(ex: Executor, cache, cont: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
    """Feed the continuation through `cache` (positions inferred from the cache length, as people do), then decode
    greedily n tokens. Returns the tokens and the logits of each step [n, V]."""
    d = ex.decode(cont, None, n, policy=StepPolicy.USER_LOOP, cache=cache, hidden=False)
    return d.tokens, d.stacked_logits()


def _reuse_runs(lm: LoadedModel, settings: ExecSettings, prefix: list[int], conts: list[list[int]], n: int,
                ways: tuple[str, ...] = tuple(REUSE_STRATEGIES)) -> dict:
    dev = lm.device
    longest = len(prefix) + sum(len(c) + n for c in conts)
    ex = Executor(lm, settings, max_len=longest)
    res = {}
    with ex.session():
        pre = ex.forward(torch.tensor([prefix], device=dev), hidden=False)
        if not has_cache(pre):
            raise KvvizError(f"{lm.name} returns no cache (a bidirectional model): past_key_values cannot be used")
        prefix_cache = output_cache(pre)
        del pre  # only the prefix's cache is used: its logits (every prefix position's) are freed
        shared = copy.deepcopy(prefix_cache)  # the object every continuation of "reused" shares
        for i, cont in enumerate(conts):
            c = torch.tensor([cont], device=dev)
            res[(i, "fresh")] = _decode_after(ex, None, torch.tensor([prefix + cont], device=dev), n)
            if "deepcopy" in ways:
                res[(i, "deepcopy")] = _decode_after(ex, copy.deepcopy(prefix_cache), c, n)
            if "reused" in ways:
                res[(i, "reused")] = _decode_after(ex, shared, c, n)
    return res


def _gaps(toks, logits, ref_toks, ref_logits) -> tuple[int | None, float, float]:
    """First parting step, the largest relative and absolute logits gaps while both saw the same tokens."""
    div = first_divergence(toks, ref_toks)
    upto = len(toks) if div is None else div + 1
    a, b = logits[:upto].double(), ref_logits[:upto].double()
    gap = (a - b).abs().amax(-1)
    return div, float((gap / b.abs().amax(-1)).max()), float(gap.max())


def check_inputs(lm: LoadedModel, prefix: str, continuations: list[str], max_new_tokens: int):
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise KvvizError(f"new tokens must be between 1 and {MAX_NEW_TOKENS}, not {max_new_tokens}")
    conts = [c for c in continuations if c and c.strip()]
    if not conts:
        raise KvvizError("give at least one continuation")
    if not isinstance(prefix, str) or not prefix.strip():
        raise KvvizError("the prefix is empty; give the shared text to cache once (e.g. a system prompt)")
    prefix_ids = encode(lm, prefix)
    cont_ids = [lm.tokenizer(c, add_special_tokens=False)["input_ids"] for c in conts]
    if any(len(c) == 0 for c in cont_ids):
        raise KvvizError("a continuation gives no tokens")
    longest = len(prefix_ids) + sum(len(c) + max_new_tokens for c in cont_ids)  # what the reused cache grows to
    if lm.max_positions is not None and longest > lm.max_positions:
        raise KvvizError(f"prefix + continuations + new tokens reach {longest} tokens, more than the model's "
                         f"context of {lm.max_positions}")
    return conts, prefix_ids, cont_ids


def run_reuse(lm: LoadedModel, prefix: str, continuations: list[str], max_new_tokens: int = 12,
              progress: Progress | None = None, settings: ExecSettings | None = None,
              prove: Prove = None, ways: tuple[str, ...] = tuple(REUSE_STRATEGIES)) -> ReuseResult:
    """A shared prefix cached once and reused for several continuations, three ways, against a fresh prefill.
    prove: rerun in invariant mode and mark each way `proved` (bit for bit the fresh run there) - by default when a
    way is "precision". ways: a subset of fresh/deepcopy/reused to run (fresh, the reference, always runs)."""
    progress = progress or no_progress
    settings = settings or DEFAULT_SETTINGS  # validated once, by its RunContext
    conts, prefix_ids, cont_ids = check_inputs(lm, prefix, continuations, max_new_tokens)
    progress(0.1, f"Decoding {len(conts)} continuation(s) three ways…")
    bad = [w for w in ways if w not in REUSE_STRATEGIES]
    if bad:
        raise KvvizError(f"unknown way '{bad[0]}'; choose from {', '.join(REUSE_STRATEGIES)}")
    ways = tuple(w for w in REUSE_STRATEGIES if w in ways or w == REFERENCE)
    main = _reuse_runs(lm, settings, prefix_ids, cont_ids, max_new_tokens, ways)
    lm64 = lm.reference()
    progress(0.55, "The same in float64…")
    f64 = main if lm64 is lm else _reuse_runs(lm64, settings.with_(compile="off"), prefix_ids, cont_ids,
                                               max_new_tokens, ways)
    runs = []
    tok = lm.tokenizer
    for i, cont in enumerate(conts):
        ref_toks, ref_logits = main[(i, REFERENCE)]
        for strategy in ways:
            toks, logits = main[(i, strategy)]
            row = {"continuation": cont, "index": i, "strategy": strategy, "token_ids": toks,
                   "text": tok.decode(toks)}
            if strategy == REFERENCE:
                runs.append(row | {"first_divergence": None, "logits_relative": None, "logits_max_abs": None,
                                   "float64_relative": None, "verdict": "reference", "proved": None})
                continue
            div, rel, gap = _gaps(toks, logits, ref_toks, ref_logits)
            _, rel64, _ = _gaps(*f64[(i, strategy)], *f64[(i, REFERENCE)])
            same = div is None and torch.equal(logits, ref_logits)
            runs.append(row | {"first_divergence": div, "logits_relative": rel, "logits_max_abs": gap,
                               "float64_relative": rel64, "verdict": classify(same, rel64), "proved": None})
    if not settings.invariant and (prove if prove is not None
                                   else any(r["verdict"] == Verdict.PRECISION for r in runs)):
        progress(0.9, "Rerunning in invariant mode for the proof…")
        inv = _reuse_runs(lm, settings.with_(invariant=True, compile="off"), prefix_ids, cont_ids, max_new_tokens,
                          ways)
        for r in runs:
            if r["strategy"] != REFERENCE:
                (t, lg), (tf, lgf) = inv[(r["index"], r["strategy"])], inv[(r["index"], REFERENCE)]
                r["proved"] = t == tf and torch.equal(lg, lgf)
    progress(1.0, "Done")
    run = RunInfo.of(lm, settings)
    info = ReuseSettings.from_run(run, prefix=prefix, continuations=tuple(conts), max_new_tokens=max_new_tokens)
    return ReuseResult(settings=info, model=lm.summary(), prefix_tokens=token_texts(tok, prefix_ids), runs=runs)


@dataclass(frozen=True)
class ReuseConfig:
    """A shared prefix cached once, reused for several continuations (run_reuse)."""
    prefix: str
    continuations: tuple[str, ...]
    max_new_tokens: int = 12
    ways: tuple[str, ...] = tuple(REUSE_STRATEGIES)

    def validate(self) -> "ReuseConfig":
        bad = [w for w in self.ways if w not in REUSE_STRATEGIES]
        if bad:
            raise KvvizError(f"unknown way '{bad[0]}'; choose from {', '.join(REUSE_STRATEGIES)}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise KvvizError(f"new tokens must be between 1 and {MAX_NEW_TOKENS}, not {self.max_new_tokens}")
        return self

    def workload(self) -> Workload:
        """What the run holds, for its memory plan: the prefix, its longest continuation, the new tokens of each."""
        # its time estimate: the prefix's forward; per continuation the fresh prefill (prefix + continuation) and
        # the other ways' short prefills (a continuation through the cached prefix: a quarter of a forward, about),
        # each way decoding the new tokens; all again in float64, and in invariant mode where a way is precision
        conts = len([c for c in self.continuations if c and c.strip()]) or 1
        ways = len(set(self.ways) | {REFERENCE})
        return Workload(texts=(self.prefix,), continuations=tuple(self.continuations),
                        new_tokens=int(self.max_new_tokens), forwards=1.0 + conts * (1 + 0.25 * (ways - 1)),
                        decode_paths=conts * ways, float64_certain=True, copies=("float64",), proves=True)


def run(lm: LoadedModel, config: ReuseConfig, ctx: RunContext = DEFAULT_CONTEXT) -> ReuseResult:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    config.validate()
    with ctx.running() as progress:
        return run_reuse(lm, config.prefix, list(config.continuations), config.max_new_tokens, progress,
                         settings=ctx.settings, prove=ctx.prove, ways=tuple(config.ways))
