"""Greedy decoding along several paths, and where (and why) they part.

Paths:
  no_cache   a full forward over the whole sequence at every step (the loop the original greedy-cache report compares against);
  cache      prefill, then one token at a time through past_key_values with a correct mask and position ids
             (position ids `omit` reproduces the classic left-padding bug);
  generate   model.generate(do_sample=False), same number of new tokens, EOS does not stop it;
  user_loop  the cached loop as people write it : prefill with the mask, then only the new token;
  float64    the no_cache loop on a float64 copy of the model: the reference "truth".

Exact by default: every path does its own forwards, shaped exactly as the naive loops shape them, and kvviz only
keeps what the views need (last position's logits, last token's hidden state per layer), on the device.
`fast` previews the no_cache (and float64) paths with one teacher-forced forward over the cache path's tokens and
only runs its own forwards after it parts from them; steps whose top-2 margin is within the measured gap are marked
not settled.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Callable

import numpy as np
import torch

from ...core.dtypes import machine_eps
from ...core.errors import KvvizError
from ...core.memory import Workload
from ...core.inputs import POSITION_MODES, PromptInputs, build_inputs, check_mode, pad_token_id, positions_from_mask
from ...core.execution import DEFAULT_SETTINGS, ExecSettings, Executor, RunInfo, RunSettings, StepPolicy
from ...models.loading import LoadedModel
from ...core.protocol import DEFAULT_CONTEXT, no_progress, Progress, RunContext
from ...core.metrics import first_divergence, hidden_divergence
from ...core.text import display_tokens
from ...core.naming import layer_labels, model_type
from ...core.replay import Replay, replay_step, top2
from ...core.streaming import HeldRows
from ...core.verdict import Prove, Verdict, classify, precision_sentence
from ...core.estimate import Timed


class GreedyPath(StrEnum):
    """A greedy path (the module docstring). A str: it compares and exports as its word ("no_cache"), so JSON
    results, old exports and the page's saved choices read the same."""
    NO_CACHE = "no_cache"
    CACHE = "cache"
    GENERATE = "generate"
    USER_LOOP = "user_loop"
    FLOAT64 = "float64"


PATHS = tuple(GreedyPath)
DEFAULT_PATHS = (GreedyPath.NO_CACHE, GreedyPath.CACHE, GreedyPath.GENERATE)
_FULL_FORWARD = (GreedyPath.NO_CACHE, GreedyPath.FLOAT64)  # the paths that run a full forward each step
MAX_NEW_TOKENS = 1024
PATH_LABELS = {
    GreedyPath.NO_CACHE: "no cache (full forward each step)",
    GreedyPath.CACHE: "cache (the cache passed back each step)",
    GreedyPath.GENERATE: "model.generate",
    GreedyPath.USER_LOOP: "the loop people write (no mask or positions after the prompt)",
    GreedyPath.FLOAT64: "float64 reference (no cache)",
}
# Run cheap paths first so that `stop_at_divergence` can cut the expensive ones short.
_RUN_ORDER = (GreedyPath.CACHE, GreedyPath.GENERATE, GreedyPath.USER_LOOP, GreedyPath.NO_CACHE, GreedyPath.FLOAT64)



@dataclass(frozen=True)
class GreedyConfig:
    prompt: str
    max_new_tokens: int = 20
    left_pad: int = 0
    position_ids: str = "auto"  # for the `cache` path
    paths: tuple[GreedyPath, ...] = DEFAULT_PATHS
    fast: bool = False
    stop_at_divergence: bool = False

    def validate(self) -> None:
        check_mode(self.position_ids, POSITION_MODES, "position-ids mode")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise KvvizError(f"the number of new tokens must be a whole number, not {self.max_new_tokens!r}")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise KvvizError(f"new tokens must be between 1 and {MAX_NEW_TOKENS}, not {self.max_new_tokens}")
        paths = tuple(dict.fromkeys(self.paths))
        bad = [p for p in paths if p not in PATHS]
        if bad:
            raise KvvizError(f"unknown path '{bad[0]}'; choose from {', '.join(PATHS)}")
        if len(paths) < 2:
            raise KvvizError("choose at least two paths to compare")
        object.__setattr__(self, "paths", tuple(GreedyPath(p) for p in paths))  # normalised once, as it is checked

    def workload(self) -> Workload:
        """What the run holds, for its memory plan (as the CLI's arguments give it)."""
        paths = set(self.paths)  # its time estimate: each path prefills the prompt and decodes the new tokens,
        full = paths & set(_FULL_FORWARD) if not self.fast else set()  # no_cache and float64 rerunning the
        return Workload(texts=(self.prompt,), new_tokens=int(self.max_new_tokens), left_pad=int(self.left_pad),
                        paths=tuple(str(p) for p in self.paths), forwards=float(len(paths) + int(self.fast)),
                        decode_paths=len(paths - full - {GreedyPath.FLOAT64}), full_paths=len(full - {GreedyPath.FLOAT64}),
                        float64_paths=int(GreedyPath.FLOAT64 in full),  # whole sequence each step (not in fast mode)
                        copies=("float64",) if GreedyPath.FLOAT64 in paths else ())


@dataclass(frozen=True)
class GreedySettings(RunSettings):
    """Everything a greedy result was computed with: the run's fields and GreedyConfig's."""

    prompt: str = ""
    max_new_tokens: int = 0
    left_pad: int = 0
    position_ids: str = "auto"
    paths: tuple[str, ...] = ()
    fast: bool = False
    stop_at_divergence: bool = False

    @classmethod
    def of(cls, cfg: GreedyConfig, run: RunInfo) -> "GreedySettings":
        return cls.from_run(run, **{f.name: getattr(cfg, f.name) for f in fields(GreedyConfig)})

    @property
    def config(self) -> GreedyConfig:
        return GreedyConfig(**{f.name: getattr(self, f.name) for f in fields(GreedyConfig)})


@dataclass
class PathRun:
    """One path's decoding. Device tensors (`logits`, `hidden`) stay out of the serialised result."""

    name: str
    token_ids: list[int]
    margins: list[float]
    top2_ids: list[int]
    forwards: int
    seconds: float
    preview: bool = False
    settled: list[bool] | None = None
    logits: torch.Tensor | None = field(default=None, repr=False)  # [steps, vocab]
    hidden: torch.Tensor | None = field(default=None, repr=False)  # [steps, n_hidden, hidden]
    log_probs: torch.Tensor | None = field(default=None, repr=False)  # float64, computed once for the pairs

    @property
    def label(self) -> str:
        return PATH_LABELS[self.name] + (" — fast preview" if self.preview else "")


@dataclass
class PathResult:
    name: str
    label: str
    token_ids: list[int]
    tokens: list[str]
    text: str
    margins: list[float]
    top2: list[str]
    forwards: int
    seconds: float
    preview: bool
    settled: list[bool] | None
    float64_gap: list[float | None] | None = None  # max |Δ logit| vs the float64 path while histories agree


@dataclass
class PairResult:
    a: str
    b: str
    first_divergence: int | None
    a_token: str | None
    b_token: str | None
    max_abs_logit: list[float]
    kl: list[float]
    hidden_relative: np.ndarray  # [n_hidden, steps]
    same_history: list[bool]  # per step: both paths fed the same tokens so far
    verdict: str | None = None
    explanation: str | None = None
    float64_gap: float | None = None
    proved: bool | None = None  # invariant mode: do the two paths agree bit for bit there? (None: not checked)
    proof: str | None = None
    parting: str | None = None  # the explanation's first part: the step, the two tokens, their margins, the logit gap
    near_tie: bool | None = None  # at the parting step: both top-2 margins under NEAR_TIE_REL of the largest |logit|
    logit_scale: float | None = None  # the largest |logit| of the two paths at the parting step

    @property
    def proof_in_explanation(self) -> bool:
        """A precision pair's explanation carries its proof state (the invariant replay rewrote it); other verdicts
        show the proof line beside it."""
        return self.proof is not None and self.verdict == Verdict.PRECISION

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hidden_relative"] = self.hidden_relative.tolist()
        return d


@dataclass
class GreedyResult(Timed):
    settings: GreedySettings
    model: dict
    prompt_tokens: list[str]
    layer_labels: list[str]
    paths: dict[str, PathResult]
    pairs: list[PairResult]
    notes: list[str]
    elapsed_s: float
    proof_s: float | None = None  # seconds the parting steps' invariant-mode replay took (None: no replay)
    # whether the float64 reference was built (a float64 path, or a parting replayed for its verdict): the memory
    # plan drops the reference after a run without it (kvviz.core.memory.MemoryPlan.settle)
    reference_ran: bool = True

    def pair(self, a: str, b: str) -> PairResult:
        for p in self.pairs:
            if {p.a, p.b} == {a, b}:
                return p
        raise KeyError((a, b))

    @property
    def steps(self) -> int:
        return min(len(p.token_ids) for p in self.paths.values())

    def to_dict(self) -> dict:
        return {"settings": self.settings.to_dict(), "model": self.model, "prompt_tokens": self.prompt_tokens,
                "layer_labels": self.layer_labels, "paths": {k: asdict(v) for k, v in self.paths.items()},
                "pairs": [p.to_dict() for p in self.pairs], "notes": self.notes, "elapsed_s": self.elapsed_s,
                "proof_s": self.proof_s}


# ----------------------------------------------------------------------------------------------------------------
# One forward helpers


class StepRecorder:
    def __init__(self, name: str, n: int, on_step: Callable[[], None]):
        self.name, self.n, self.on_step = name, n, on_step
        self.tokens: list[int] = []
        self.margins: list[float] = []
        self.top2: list[int] = []
        self.logits: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        self.forwards = 0
        self.t0 = time.perf_counter()

    def add(self, logits: torch.Tensor, hidden: torch.Tensor, token: int | None = None) -> int:
        t1, t2, margin = top2(logits)
        self.tokens.append(t1 if token is None else token)
        self.margins.append(margin)
        self.top2.append(t2)
        self.logits.append(logits)
        self.hidden.append(hidden)
        self.on_step()
        return self.tokens[-1]

    def done(self, **kw) -> PathRun:
        return PathRun(self.name, self.tokens, self.margins, self.top2, self.forwards, time.perf_counter() - self.t0,
                       logits=torch.stack(self.logits), hidden=torch.stack(self.hidden), **kw)


def _grow(ids, mask, pos, token: int):
    dev = ids.device
    ids = torch.cat([ids, torch.tensor([[token]], device=dev)], 1)
    mask = torch.cat([mask, torch.ones((1, 1), dtype=mask.dtype, device=dev)], 1)
    pos = torch.cat([pos, pos[:, -1:] + 1], 1)
    return ids, mask, pos


# ----------------------------------------------------------------------------------------------------------------
# The paths


def _record(rec: StepRecorder):
    def on_step(t, logits, hidden, token):
        rec.add(logits, hidden, token=token)
        rec.forwards += 1
    return on_step


def no_cache_loop(ex: Executor, inp: PromptInputs, n: int, rec: StepRecorder, ids=None, mask=None, pos=None) -> None:
    """A full forward over the sequence so far at every step (the plain no-cache loop)."""
    ids, mask, pos = (inp.ids, inp.mask, inp.positions) if ids is None else (ids, mask, pos)
    ex.decode(ids, mask, n, policy=StepPolicy.NO_CACHE, positions=pos, on_step=_record(rec))


def _cache(ex: Executor, inp: PromptInputs, n: int, rec: StepRecorder, positions: str = "auto") -> None:
    """Prefill, then one token at a time through the cache with the full mask and (auto) position ids."""
    ex.decode(inp.ids, inp.mask, n, policy=StepPolicy.CACHE, positions=inp.positions, step_positions=positions,
              on_step=_record(rec))


def _generate(ex: Executor, inp: PromptInputs, n: int, rec: StepRecorder) -> None:
    out = ex.generate(inp.ids, inp.mask, n, pad_token_id(ex.lm.tokenizer))
    rec.forwards = len(out.logits)
    new = out.sequences[0, inp.ids.shape[1]:].tolist()
    for t, logits in enumerate(out.logits):
        hidden = torch.stack([h[0, -1] for h in out.hidden_states[t]])
        rec.add(logits[0], hidden, token=int(new[t]))


def _fast_no_cache(ex: Executor, inp: PromptInputs, n: int, rec: StepRecorder, guide: PathRun) -> PathRun:
    """Preview of the no-cache loop: one teacher-forced forward over the guide's tokens gives every step's
    no-cache logits at once; own full forwards only after the first step where the argmax differs."""
    g = guide.token_ids[:n]
    ids = torch.cat([inp.ids, torch.tensor([g[:-1]], device=inp.ids.device, dtype=inp.ids.dtype)], 1) \
        if n > 1 else inp.ids
    mask = torch.cat([inp.mask, torch.ones((1, ids.shape[1] - inp.ids.shape[1]), dtype=inp.mask.dtype,
                                           device=inp.mask.device)], 1)
    pos = positions_from_mask(mask)
    start = inp.ids.shape[1] - 1
    held = HeldRows(lambda h: h[0, start:start + n])  # only the steps' rows of each layer, as they come
    out = ex.forward(ids, mask, pos, use_cache=False, hidden=held)
    rec.forwards += 1
    logits_all = out.logits[0, start:start + n]
    hidden_all = torch.stack(held.layers, 1)  # [n, n_hidden, H]
    eps = machine_eps(ex.lm.dtype)
    settled: list[bool] = []
    ok = True
    diverged = None
    for t in range(n):
        tok = rec.add(logits_all[t], hidden_all[t])
        same_dtype = guide.logits is not None and guide.logits.dtype == logits_all.dtype
        gap = float((logits_all[t].double() - guide.logits[t].double()).abs().max()) if same_dtype else 0.0
        floor = 4 * eps * float(logits_all[t].abs().max())
        ok = ok and rec.margins[-1] > 2 * max(gap, floor)
        settled.append(ok)
        if tok != g[t]:
            diverged = t
            break
    if diverged is not None and diverged < n - 1:
        cut = inp.ids.shape[1] + diverged
        own_ids, own_mask, own_pos = _grow(ids[:, :cut], mask[:, :cut], pos[:, :cut], rec.tokens[-1])
        before = len(rec.tokens)
        no_cache_loop(ex, inp, n - diverged - 1, rec, ids=own_ids, mask=own_mask, pos=own_pos)
        settled += [ok] * (len(rec.tokens) - before)
    return rec.done(preview=True, settled=settled)


# ----------------------------------------------------------------------------------------------------------------
# Comparing paths


def _log_probs(run: PathRun) -> torch.Tensor:
    if run.log_probs is None:
        run.log_probs = torch.log_softmax(run.logits.to(torch.float64), -1)
    return run.log_probs


def _compare(a: PathRun, b: PathRun, eps: float) -> PairResult:
    n = min(len(a.token_ids), len(b.token_ids))
    div = first_divergence(a.token_ids[:n], b.token_ids[:n])
    dev = a.logits.device
    la, lb = a.logits[:n].to(torch.float64), b.logits[:n].to(dev, torch.float64)
    lsa, lsb = _log_probs(a)[:n], _log_probs(b)[:n].to(dev)
    kl = (lsa.exp() * (lsa - lsb)).sum(-1).clamp_min(0)
    hd = hidden_divergence(a.hidden[:n].transpose(0, 1), b.hidden[:n].to(dev).transpose(0, 1), eps)
    same = [div is None or t <= div for t in range(n)]
    return PairResult(a.name, b.name, div, None, None, (lb - la).abs().amax(-1).cpu().tolist(), kl.cpu().tolist(),
                      hd["relative"].cpu().numpy(), same)


NEAR_TIE_REL = 0.01  # a top-2 margin under 1% of the step's largest |logit| is a near tie


def near_tie_words(margins: tuple[float, float], scale: float) -> tuple[bool, str]:
    """Whether the top-2 margins at a parting step make a near tie, and the words that say so from the numbers:
    both margins under NEAR_TIE_REL of the largest |logit| (`scale`) there."""
    near = scale > 0 and max(margins) <= NEAR_TIE_REL * scale
    return near, (f" - a near tie (under {NEAR_TIE_REL:.0%} of the largest logit, {scale:.3g})" if near else
                  f" - not a near tie (the largest logit was {scale:.3g})")


def _logic(path: GreedyPath, positions: str) -> Replay:
    """Which computation a path's logits come from, as far as exact arithmetic is concerned."""
    if path in _FULL_FORWARD:
        return Replay.FULL
    if path == GreedyPath.USER_LOOP:
        return Replay.USER
    return Replay.CACHED_OMIT if path == GreedyPath.CACHE and positions == "omit" else Replay.CACHED


def _replay_memo(memo: dict, ex64: Executor, inp64, logic: str, forced: list[int]) -> torch.Tensor:
    key = (logic, tuple(forced))
    if key not in memo:
        memo[key] = replay_step(ex64, inp64, logic, forced).double()
    return memo[key]


def _explain(pair: PairResult, runs: dict[str, PathRun], lm: LoadedModel, cfg: GreedyConfig,
             ex64: Executor, inp64: PromptInputs, memo: dict) -> None:
    t = pair.first_divergence
    a, b = runs[pair.a], runs[pair.b]
    tok = lm.tokenizer.decode
    pair.a_token, pair.b_token = tok([a.token_ids[t]]), tok([b.token_ids[t]])
    name_a = f"{pair.a_token!r} (id {a.token_ids[t]})"
    name_b = f"{pair.b_token!r} (id {b.token_ids[t]})"
    forced = a.token_ids[:t]
    la, lb = (_replay_memo(memo, ex64, inp64, _logic(name, cfg.position_ids), forced)
              for name in (pair.a, pair.b))
    gap64 = float((la - lb).abs().max() / la.abs().max().clamp_min(1e-300))
    pair.float64_gap = gap64
    ma, mb = a.margins[t], b.margins[t]
    scale = max(float(a.logits[t].double().abs().max()), float(b.logits[t].double().abs().max()))
    pair.logit_scale = scale
    pair.near_tie, qual = near_tie_words((ma, mb), scale)
    head = pair.parting = (f"At step {t} {PATH_LABELS[pair.a]} chose {name_a} and {PATH_LABELS[pair.b]} chose "
                           f"{name_b}; their top-2 margins there were {ma:.3g} and {mb:.3g}{qual}, and the logits "
                           f"differed by up to {pair.max_abs_logit[t]:.3g}.")
    pair.verdict = classify(False, gap64)  # the tokens differ, so the bits do
    if pair.verdict == Verdict.PRECISION:
        pair.explanation = _precision_explanation(head, gap64, near_tie=pair.near_tie)
    else:
        cause = ""
        if GreedyPath.USER_LOOP in (pair.a, pair.b) and cfg.left_pad:
            cause = (" The user loop passes no mask or position ids after the prompt, so with left padding the new "
                     "tokens attend to pads and are numbered from the cache length.")
        elif GreedyPath.CACHE in (pair.a, pair.b) and cfg.position_ids == "omit" and cfg.left_pad:
            cause = " The cache path omits position ids, so the new tokens are numbered counting the pads."
        pair.explanation = (head + f" Replayed in float64 on the same tokens they still differ by {gap64:.3g} "
                                   f"(relative): a logic difference, not rounding." + cause)


def _precision_explanation(parting: str, gap64: float, proved: bool | None = None,
                           invariant_gap: float | None = None, near_tie: bool | None = True) -> str:
    """A precision pair's explanation from its parts: where the paths part, then the float64 replay and its proof
    (an unproved one never says "flipped by rounding"; "a near tie" only where the margins make one)."""
    return (parting + " Replayed in float64 on the same tokens: "
            + ("" if proved is False else "a near tie flipped by rounding. " if near_tie else
               "rounding flipped the choice. ")
            + precision_sentence(gap64, proved, invariant_gap))


class _Progress:
    """Step counting across paths: "cache: step 3/20", with the share of the run done."""

    def __init__(self, progress: Progress, n_paths: int, n: int):
        self.progress, self.total, self.n, self.done = progress, max(1, n_paths * n), n, 0

    def step(self, name: str) -> Callable[[], None]:
        def f() -> None:
            self.done += 1
            self.progress(min(0.9, 0.9 * self.done / self.total),
                          f"{PATH_LABELS[name]}: step {self.done % self.n or self.n}/{self.n}")
        return f


def _run_path(name: str, ex: Executor, inp: PromptInputs, steps: int, rec: StepRecorder, cfg: GreedyConfig,
              runs: dict[str, PathRun]) -> PathRun:
    """One path on `ex` (the float64 path gets a float64 executor and inputs)."""
    guided = cfg.fast and GreedyPath.CACHE in runs and name in _FULL_FORWARD
    with ex.session():
        if guided:
            return _fast_no_cache(ex, inp, steps, rec, runs[GreedyPath.CACHE])
        if name in _FULL_FORWARD:
            no_cache_loop(ex, inp, steps, rec)
        elif name == GreedyPath.CACHE:
            _cache(ex, inp, steps, rec, cfg.position_ids)
        elif name == GreedyPath.GENERATE:
            _generate(ex, inp, steps, rec)
        else:  # the user loop: the prompt with its mask, then only the new token (no mask, no position ids)
            ex.decode(inp.ids, inp.mask, steps, policy=StepPolicy.USER_LOOP, on_step=_record(rec))
    return rec.done()


def _truncate(runs: dict[str, PathRun], limit: int) -> None:
    for r in runs.values():
        k = min(limit, len(r.token_ids))
        r.token_ids, r.margins, r.top2_ids = r.token_ids[:k], r.margins[:k], r.top2_ids[:k]
        r.logits, r.hidden = r.logits[:k], r.hidden[:k]
        if r.settled is not None:
            r.settled = r.settled[:k]


class _Float64:
    """The float64 side of a greedy run, built only when needed: model, executor and inputs."""

    def __init__(self, lm: LoadedModel, cfg: GreedyConfig, settings: ExecSettings, reference: LoadedModel | None):
        self.lm, self.cfg, self.settings, self.given = lm, cfg, settings.with_(compile="off"), reference
        self._ex: Executor | None = None
        self.inp: PromptInputs | None = None

    @property
    def ex(self) -> Executor:
        if self._ex is None:
            lm64 = self.given or self.lm.reference()
            self.inp = build_inputs(lm64, self.cfg.prompt, self.cfg.left_pad, extra_tokens=self.cfg.max_new_tokens)
            self._ex = Executor(lm64, self.settings, max_len=self.inp.total + self.cfg.max_new_tokens)
        return self._ex

    @property
    def built(self) -> bool:
        """Was the float64 side ever needed (its model loaded)?"""
        return self._ex is not None


def _decode_paths(lm: LoadedModel, cfg: GreedyConfig, settings: ExecSettings, inp: PromptInputs, f64: _Float64,
                  progress: Progress) -> dict[str, PathRun]:
    order = [p for p in _RUN_ORDER if p in cfg.paths]
    if cfg.fast and GreedyPath.CACHE not in order and (set(_FULL_FORWARD) & set(order)):
        order.insert(0, GreedyPath.CACHE)  # the preview is guided by the cache path
    n = cfg.max_new_tokens
    counter = _Progress(progress, len(order), n)
    ex = Executor(lm, settings, max_len=inp.total + n)
    runs: dict[str, PathRun] = {}
    limit = n
    for name in order:
        rec = StepRecorder(name, limit, counter.step(name))
        if name == GreedyPath.FLOAT64:
            run = _run_path(name, f64.ex, f64.inp, limit, rec, cfg, runs)
            run.logits, run.hidden = run.logits.to(lm.device), run.hidden.to(lm.device)
        else:
            run = _run_path(name, ex, inp, limit, rec, cfg, runs)
        runs[name] = run
        if cfg.stop_at_divergence:
            for other in runs.values():
                d = first_divergence(other.token_ids, run.token_ids)
                if d is not None:
                    limit = min(limit, d + 1)
    if cfg.stop_at_divergence:
        _truncate(runs, limit)
    return runs


def _path_results(lm: LoadedModel, runs: dict[str, PathRun], names: list[str]) -> dict[str, PathResult]:
    tok = lm.tokenizer
    results: dict[str, PathResult] = {}
    ref = runs.get(GreedyPath.FLOAT64)
    for name in names:
        r = runs[name]
        gap = None
        if ref is not None and name != GreedyPath.FLOAT64:
            m = min(len(r.token_ids), len(ref.token_ids))
            div = first_divergence(r.token_ids[:m], ref.token_ids[:m])
            d = (r.logits[:m].double() - ref.logits[:m].double()).abs().amax(-1).cpu().tolist()
            gap = [v if div is None or t <= div else None for t, v in enumerate(d)]
        results[name] = PathResult(
            name=name, label=r.label, token_ids=r.token_ids, tokens=display_tokens(tok, r.token_ids),
            text=tok.decode(r.token_ids), margins=r.margins, top2=[tok.decode([i]) for i in r.top2_ids],
            forwards=r.forwards, seconds=r.seconds, preview=r.preview, settled=r.settled, float64_gap=gap)
    return results


def _notes(lm: LoadedModel, cfg: GreedyConfig, runs: dict[str, PathRun]) -> list[str]:
    notes = list(lm.warnings)
    if GreedyPath.GENERATE in runs and lm.dtype == torch.float64:
        notes.append("generate() casts the logits it returns to float32, so its logits carry float32 rounding "
                     "(~1e-7 relative); its tokens and hidden states are float64")
    if cfg.fast:
        notes.append("fast preview: the no-cache logits come from one teacher-forced forward over the cache path's "
                     "tokens; steps marked not settled have a top-2 margin within the measured gap")
    return notes


def prove_pairs(lm: LoadedModel, cfg: GreedyConfig, settings: ExecSettings, inp: PromptInputs,
                pairs: list[PairResult], progress: Progress, runs: dict[str, PathRun] | None = None) -> None:
    """The proof of each same-dtype pair (the float64 path is another dtype, not another order): both paths'
    computations replayed in invariant mode on the same tokens at one step - where they part, else their last step -
    and compared bit for bit: equal is precision, proved; different is logic. In invariant mode shapes do not
    matter, so each computation is one prefill and one chunk (a few forwards, not a second decode of every path)."""
    todo = [p for p in pairs if GreedyPath.FLOAT64 not in (p.a, p.b)]
    if not todo:
        return
    progress(0.95, "Replaying the parting step in invariant mode for the proof…")
    if runs is None:  # the paths' tokens (a caller without them: decode once, normally)
        runs = _decode_paths(lm, GreedyConfig(cfg.prompt, cfg.max_new_tokens, cfg.left_pad, cfg.position_ids,
                                              tuple(n for n in _RUN_ORDER if any(n in (p.a, p.b) for p in todo))),
                             settings, inp, None, no_progress)
    ex = Executor(lm, settings.with_(invariant=True, compile="off"), max_len=inp.total + cfg.max_new_tokens)
    memo: dict = {}
    with ex.session():
        for p in todo:
            a, b = runs[p.a], runs[p.b]
            t = p.first_divergence if p.first_divergence is not None else min(len(a.token_ids), len(b.token_ids)) - 1
            forced = a.token_ids[:t]
            la, lb = (_replay_memo(memo, ex, inp, _logic(name, cfg.position_ids), forced) for name in (p.a, p.b))
            p.proved = bool(torch.equal(la, lb))
            inv_gap = float((la - lb).abs().max())
            where = f"at step {t}" + (", where they part" if p.first_divergence is not None else ", the last")
            if p.verdict == Verdict.PRECISION and p.float64_gap is not None:  # the explanation carries its proof
                p.explanation = _precision_explanation(p.parting, p.float64_gap, p.proved, inv_gap, p.near_tie)
            if p.proved:
                p.proof = (f"Precision — proved: replayed in invariant mode on the same {t} tokens (every row "
                           f"computed the same way whatever the shape), {p.a} and {p.b} give bit for bit the same "
                           f"logits {where}.")
            else:
                p.proof = (f"In invariant mode {p.a} and {p.b} still differ {where} (by up to {inv_gap:.3g}): not "
                           + ("reduction order alone (float64 closes the gap: precision of another kind, such as one "
                              "path rounding an intermediate the other keeps wider)."
                              if p.verdict == Verdict.PRECISION else "reduction order - logic."))


def run_greedy(lm: LoadedModel, cfg: GreedyConfig, progress: Progress | None = None,
               reference: LoadedModel | None = None, settings: ExecSettings | None = None,
               prove: Prove = None) -> GreedyResult:
    """Decode greedily along cfg.paths and compare every pair of paths (see the module docstring).

    reference: the float64 model (lm.reference() when not given); settings: how the model runs (cache kind,
    compile, flags, invariant mode) - the float64 path and replays use the same settings without compile.
    prove: rerun the same-dtype paths in invariant mode and mark each pair proved or not (default: when a pair
    parts with a precision verdict)."""
    progress = progress or no_progress
    settings = settings or DEFAULT_SETTINGS  # validated once, by its RunContext
    t_start = time.perf_counter()
    cfg.validate()
    inp = build_inputs(lm, cfg.prompt, cfg.left_pad, extra_tokens=cfg.max_new_tokens)
    f64 = _Float64(lm, cfg, settings, reference)
    proof_s = None
    runs = _decode_paths(lm, cfg, settings, inp, f64, progress)
    names = [p for p in cfg.paths if p in runs]
    pairs = [_compare(runs[a], runs[b], machine_eps(lm.dtype)) for i, a in enumerate(names) for b in names[i + 1:]]
    diverging = [p for p in pairs if p.first_divergence is not None]
    if diverging:
        progress(0.92, "Replaying the first divergences in float64 for the verdicts…")
        memo: dict = {}
        with f64.ex.session():
            for p in diverging:
                _explain(p, runs, lm, cfg, f64.ex, f64.inp, memo)
    if not settings.invariant and (prove if prove is not None else
                                   any(p.verdict == Verdict.PRECISION and GreedyPath.FLOAT64 not in (p.a, p.b)
                                       for p in pairs)):
        t_proof = time.perf_counter()
        prove_pairs(lm, cfg, settings, inp, pairs, progress, runs)
        proof_s = time.perf_counter() - t_proof
    progress(1.0, "Done")
    labels = layer_labels(runs[names[0]].hidden.shape[1], model_type(lm))
    return GreedyResult(settings=GreedySettings.of(cfg, RunInfo.of(lm, settings)), model=lm.summary(),
                        prompt_tokens=inp.token_texts, layer_labels=labels,
                        paths=_path_results(lm, runs, names), pairs=pairs, notes=_notes(lm, cfg, runs),
                        elapsed_s=time.perf_counter() - t_start, proof_s=proof_s, reference_ran=f64.built)


def run(lm: LoadedModel, config: GreedyConfig, ctx: RunContext = DEFAULT_CONTEXT) -> GreedyResult:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    with ctx.running() as progress:
        return run_greedy(lm, config, progress, reference=ctx.reference, settings=ctx.settings, prove=ctx.prove)
