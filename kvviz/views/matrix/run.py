"""The backends matrix: attention implementation × cache kind × compile × precision flags, each cell decoding
greedily and compared with one reference - the eager no-cache loop in the same dtype - plus the float64 reference.

Every cell decodes with `generate(do_sample=False)` under its setting, or with a hand-written cached loop where
generate cannot express it (position ids omitted, a compiled forward). Over R repeats it counts the distinct outputs.
Verdict per cell: `identical` (tokens and logits bit for bit), `precision` / `logic` by kvviz's one rule (replay the
parting step - or the step with the largest gap - in float64 with the same cache kind, mask and positions),
`nondeterministic` when the repeats differ, `lossy` for quantized caches; a combination that cannot run is an error
cell with its one-line message, and the rest of the grid runs. Models are loaded once per attention implementation
and shared by the cells; the references are computed once.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch
import pandas as pd

from ...core.dtypes import dtype_name
from ...core.environment import environment
from ...core.errors import KvvizError, first_line, free_memory, is_out_of_memory
from ...core.memory import Workload
from ...core.execution import CacheKind, ExecSettings, Executor, Settings, StepPolicy
from ...core.replay import Replay, replay_step
from ...core.metrics import first_divergence
from ...core.inputs import POSITION_MODES, PromptInputs, check_mode, encode, left_pad_rows, pad_token_id, positions_from_mask
from ...models import loading
from ...models.loading import LoadedModel
from ...core.protocol import DEFAULT_CONTEXT, no_progress, Progress, RunContext
from ...core.verdict import Verdict, classify
from ...core.text import display_text
from ...core.estimate import Timed
from ...core.backends import compile_stats

WINDOW_LONG_PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and "
                      "wrote the weather in a leather log that his grandfather had started sixty years before.")
WINDOW_SHORT_PROMPT = "Hi there"


@dataclass(frozen=True)
class MatrixConfig:
    prompt: str
    max_new_tokens: int = 16
    attentions: tuple[str, ...] = ("eager", "sdpa")
    caches: tuple[CacheKind, ...] = (CacheKind.DYNAMIC, CacheKind.STATIC)
    compiles: tuple[str, ...] = ("off",)
    flag_sets: tuple[tuple[str, ...], ...] = ((),)
    repeats: int = 2
    left_pad: int = 0
    position_ids: str = "auto"
    batch_with: tuple[str, ...] = ()
    invariant: bool = False  # every cell in invariant mode

    def validate(self) -> None:
        check_mode(self.position_ids, POSITION_MODES, "position-ids mode")
        if isinstance(self.max_new_tokens, bool) or not 1 <= int(self.max_new_tokens) <= 256:
            raise KvvizError(f"new tokens must be between 1 and 256, not {self.max_new_tokens}")
        if not 1 <= int(self.repeats) <= 50:
            raise KvvizError(f"repeats must be between 1 and 50, not {self.repeats}")
        if self.left_pad < 0:
            raise KvvizError(f"left padding must be 0 or more, not {self.left_pad}")
        if not (self.attentions and self.caches and self.compiles and self.flag_sets):
            raise KvvizError("every axis needs at least one value")
        for cache, comp, flags in itertools.product(self.caches, self.compiles, self.flag_sets):
            ExecSettings(cache=cache, compile=comp, flags=tuple(flags)).validate()

    def cells(self):
        return list(itertools.product(self.attentions, self.caches, self.compiles, self.flag_sets))

    def workload(self) -> Workload:
        """What the run holds, for its memory plan: the prompt and its batch-mates in one batch (as wide as the
        longest), the new tokens, the largest attention."""
        # its time estimate: the reference (eager, no cache: the whole sequence each step; and the same in float64),
        # then each cell `repeats` times through its cache, every row of the batch; the model loaded once per
        # attention implementation, and its eager float64 twin
        rows, runs = 1 + len(self.batch_with), len(self.cells()) * int(self.repeats)
        return Workload(texts=(self.prompt, *self.batch_with), new_tokens=int(self.max_new_tokens),
                        left_pad=int(self.left_pad), batch=rows, attention=",".join(self.attentions),
                        forwards=float(rows * (runs + 2)), decode_paths=rows * runs, full_paths=rows,
                        float64_paths=rows, copies=tuple(dict.fromkeys(("@eager", *(f"@{a}" for a in self.attentions), "float64@eager"))))


@dataclass
class Cell:
    attention: str
    cache: str
    compile: str
    flags: list[str]
    verdict: str | None = None
    first_divergence: int | None = None
    distinct_outputs: int | None = None
    repeats_part_at: int | None = None
    max_abs_logit: float | None = None
    max_kl: float | None = None
    float64_gap: float | None = None
    seconds_per_token: float | None = None
    compiled: dict | None = None
    attention_used: str | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    step_max_abs_logit: list[float] = field(default_factory=list)
    step_kl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def setting(self) -> str:
        """The cell's row in the grid: cache kind, compile mode, flags."""
        return " · ".join([self.cache, f"compile {self.compile}"] + ([",".join(self.flags)] if self.flags else []))

    @property
    def label(self) -> str:
        return f"{self.attention} · {self.setting}"


@dataclass(frozen=True)
class MatrixSettings(Settings):
    model: str = ""
    dtype: str = ""
    device: str = ""
    prompt: str = ""
    max_new_tokens: int = 0
    repeats: int = 0
    left_pad: int = 0
    position_ids: str = "auto"
    batch_with: tuple = ()
    attentions: tuple = ()
    caches: tuple = ()
    compiles: tuple = ()
    flag_sets: tuple = ()
    invariant: bool = False


@dataclass
class MatrixResult(Timed):
    settings: MatrixSettings
    environment: dict
    reference: dict
    cells: list[Cell]
    elapsed_s: float

    def to_dict(self) -> dict:
        return {"settings": self.settings.to_dict(), "environment": self.environment, "reference": self.reference,
                "cells": [asdict(c) for c in self.cells], "elapsed_s": self.elapsed_s}

    def grid(self, value: str = "verdict"):
        rows = [{"attention": c.attention, "setting": c.setting,
                 "value": (c.error and "error") if c.error else getattr(c, value)} for c in self.cells]
        return pd.DataFrame(rows).pivot(index="setting", columns="attention", values="value")


# ------------------------------------------------------------------------------------------------------------------
# Inputs: the prompt (row 0), optionally left-padded and batched with longer prompts


def _batch(lm: LoadedModel, cfg: MatrixConfig, n: int) -> tuple[PromptInputs, torch.Tensor, torch.Tensor]:
    """Row 0 is the prompt; returns row 0 alone as PromptInputs (with the pad it has in the batch) and the batch's
    ids and mask."""
    rows = [encode(lm, cfg.prompt)] + [encode(lm, t) for t in cfg.batch_with]
    width = max(len(r) for r in rows) + cfg.left_pad
    if lm.max_positions is not None and width + n > lm.max_positions:
        raise KvvizError(f"the batch is {width} tokens + {n} new, more than the model's context of "
                         f"{lm.max_positions}")
    ids, mask = left_pad_rows(lm, rows, cfg.left_pad)
    pad0 = width - len(rows[0])
    inp = PromptInputs(ids=ids[:1], mask=mask[:1], positions=positions_from_mask(mask[:1]), pad=pad0,
                       token_ids=rows[0], token_texts=[lm.tokenizer.decode([i]) for i in rows[0]])
    return inp, ids, mask


# ------------------------------------------------------------------------------------------------------------------
# Decoding


def _loop(ex: Executor, ids, mask, n: int, policy: StepPolicy = StepPolicy.NO_CACHE,
          positions: str = "auto") -> tuple[list[int], torch.Tensor]:
    """Row 0's tokens and logits (every row grows greedily) of the reference - a full forward each step - or of the
    cached loop: prefill, then one token a step through the cache (position ids auto, or omitted: the model counts
    them)."""
    d = ex.decode(ids, mask, n, policy=policy, positions=positions_from_mask(mask) if positions == "auto" else None,
                  hidden=False)
    return d.tokens, torch.stack([lg.double() for lg in d.logits])


def _generate(ex: Executor, ids, mask, n: int) -> tuple[list[int], torch.Tensor]:
    out = ex.generate(ids, mask, n, pad_token_id(ex.lm.tokenizer), hidden=False)
    toks = out.sequences[0, ids.shape[1]:].tolist()
    return toks, torch.stack([lg[0].double() for lg in out.logits])


def _decode(ex: Executor, ids, mask, n: int, cfg: MatrixConfig) -> tuple[list[int], torch.Tensor]:
    if cfg.position_ids == "omit" or ex.settings.compile != "off":
        return _loop(ex, ids, mask, n, StepPolicy.CACHE, cfg.position_ids)
    return _generate(ex, ids, mask, n)


# ------------------------------------------------------------------------------------------------------------------
# One cell


def _kl(ref: torch.Tensor, got: torch.Tensor) -> list[float]:
    lr, lg = torch.log_softmax(ref, -1), torch.log_softmax(got.to(ref.device), -1)
    return (lr.exp() * (lr - lg)).sum(-1).clamp_min(0).cpu().tolist()


class _Runner:
    def __init__(self, spec, dtype, device, cfg: MatrixConfig, trust_remote_code: bool):
        self.spec, self.dtype, self.device, self.cfg, self.trust = spec, dtype, device, cfg, trust_remote_code
        self.models: dict[str, LoadedModel] = {}
        self.replays: dict = {}

    def model(self, attention: str) -> LoadedModel:
        if attention not in self.models:
            self.models[attention] = loading.load_model(self.spec, self.dtype, self.device, attention,
                                                trust_remote_code=self.trust)
        return self.models[attention]

    def reference(self, n: int) -> tuple[list[int], torch.Tensor, PromptInputs, list[int], torch.Tensor]:
        lm = self.model("eager")
        inp, ids, mask = _batch(lm, self.cfg, n)
        inv = self.cfg.invariant
        with Executor(lm, ExecSettings(invariant=inv, sdpa_as_eager=inv)).session() as ex:
            toks, logits = _loop(ex, ids, mask, n)
        lm64 = lm.reference()
        _, ids64, mask64 = _batch(lm64, self.cfg, n)
        with Executor(lm64).session() as ex64:
            toks64, logits64 = _loop(ex64, ids64, mask64, n)
        return toks, logits, inp, toks64, logits64

    def float64_gap(self, settings: ExecSettings, forced: list[int], inp: PromptInputs) -> float:
        """Replay the step in float64: the reference computation vs the cell's (same cache kind, positions)."""
        lm64 = self.model("eager").reference()
        logic = Replay.CACHED_OMIT if self.cfg.position_ids == "omit" else Replay.CACHED
        inp64 = replace(inp, ids=inp.ids.to(lm64.device), mask=inp.mask.to(lm64.device),
                        positions=inp.positions.to(lm64.device))
        key = (settings.cache, logic, tuple(forced))
        if key not in self.replays:
            ex64 = Executor(lm64, ExecSettings(cache=settings.cache), max_len=inp.total + len(forced) + 1)
            with ex64.session():
                full = replay_step(ex64, inp64, Replay.FULL, forced).double()
                cached = replay_step(ex64, inp64, logic, forced).double()
            self.replays[key] = float((full - cached).abs().max() / full.abs().max().clamp_min(1e-300))
        return self.replays[key]


def _run_cell(runner: _Runner, cell: Cell, ref: tuple, n: int, progress: Callable[[str], None]) -> None:
    cfg = runner.cfg
    settings = ExecSettings(cache=cell.cache, compile=cell.compile, flags=tuple(cell.flags),
                            invariant=runner.cfg.invariant, sdpa_as_eager=runner.cfg.invariant)
    lm = runner.model(cell.attention)
    cell.attention_used = lm.attn_implementation
    ref_toks, ref_logits, inp, _, _ = ref
    _, ids, mask = _batch(lm, cfg, n)
    outputs, seconds = [], []
    before = compile_stats()
    for r in range(cfg.repeats):
        progress(f"{cell.label}: repeat {r + 1}/{cfg.repeats}"
                 + (" (compiling on the first call…)" if cell.compile != "off" and r == 0 else ""))
        ex = Executor(lm, settings, max_len=ids.shape[1] + n)
        t0 = time.perf_counter()
        with ex.session():
            outputs.append(_decode(ex, ids, mask, n, cfg))
        seconds.append(time.perf_counter() - t0)
    after = compile_stats()
    cell.compiled = {k: after[k] - before[k] for k in after} | {"requested": cell.compile != "off"}
    toks, logits = outputs[0]
    distinct = {tuple(t) for t, _ in outputs}
    cell.distinct_outputs = len(distinct)
    cell.repeats_part_at = min((first_divergence(toks, t) for t, _ in outputs[1:]
                                if first_divergence(toks, t) is not None), default=None)
    cell.tokens, cell.text = toks, display_text(lm.tokenizer, toks)
    cell.seconds_per_token = min(seconds) / n
    div = first_divergence(toks, ref_toks)
    cell.first_divergence = div
    upto = n if div is None else div + 1
    gaps = (logits[:upto] - ref_logits[:upto].to(logits.device)).abs().amax(-1)
    cell.step_max_abs_logit = gaps.cpu().tolist()
    cell.step_kl = _kl(ref_logits[:upto], logits[:upto])
    cell.max_abs_logit, cell.max_kl = max(cell.step_max_abs_logit), max(cell.step_kl)
    bitwise = div is None and torch.equal(logits, ref_logits.to(logits.device))
    if settings.lossy:
        cell.verdict = Verdict.IDENTICAL if bitwise else Verdict.LOSSY
    elif len(distinct) > 1 or any(not torch.equal(lg, logits) for _, lg in outputs[1:]):
        cell.verdict = Verdict.NONDETERMINISTIC
    elif bitwise:
        cell.verdict = Verdict.IDENTICAL
    else:
        step = div if div is not None else int(gaps.argmax())
        cell.float64_gap = runner.float64_gap(settings, ref_toks[:step], inp)
        cell.verdict = classify(False, cell.float64_gap)


def run_matrix(spec, prompt_or_cfg: "str | MatrixConfig", dtype="float32", device="auto",
               trust_remote_code: bool = False, progress: Progress | None = None) -> MatrixResult:
    """Run every cell of the matrix (see the module docstring). `spec`: a model spec or a loaded model."""
    progress = progress or no_progress
    t0 = time.perf_counter()
    cfg = prompt_or_cfg if isinstance(prompt_or_cfg, MatrixConfig) else MatrixConfig(prompt_or_cfg)
    cfg.validate()
    if isinstance(spec, LoadedModel):
        spec, dtype, device = spec.spec, spec.dtype, spec.device
    runner = _Runner(spec, dtype, device, cfg, trust_remote_code)
    n = int(cfg.max_new_tokens)
    cells = [Cell(a, c, comp, list(flags)) for a, c, comp, flags in cfg.cells()]
    # the matrix compares attention implementations against the eager reference: its invariant runs set
    # ExecSettings(sdpa_as_eager=True), so SDPA takes eager attention's steps op for op and the two agree bit for bit
    progress(0.0, "Reference: the eager no-cache loop, and the same in float64…")
    ref = runner.reference(n)
    for i, cell in enumerate(cells):
        def report(msg: str, i=i) -> None:
            progress(0.1 + 0.9 * i / len(cells), f"Cell {i + 1}/{len(cells)}: {msg}")
        try:
            _run_cell(runner, cell, ref, n, report)
        except Exception as e:  # noqa: BLE001 - a cell that cannot run becomes an error cell; the grid goes on
            if is_out_of_memory(e):
                free_memory(e)
            cell.error = first_line(e) if isinstance(e, KvvizError) else first_line(e, 300, typed=True)
    progress(1.0, "Done")
    lm = runner.model("eager")
    ref_toks, ref_logits, inp, toks64, _ = ref
    return MatrixResult(
        settings=MatrixSettings(model=lm.name, dtype=dtype_name(lm.dtype), device=str(lm.device), prompt=cfg.prompt,
                                max_new_tokens=n, repeats=cfg.repeats, left_pad=cfg.left_pad,
                                position_ids=cfg.position_ids, batch_with=tuple(cfg.batch_with),
                                attentions=tuple(cfg.attentions), caches=tuple(cfg.caches),
                                compiles=tuple(cfg.compiles), flag_sets=tuple(tuple(f) for f in cfg.flag_sets),
                                invariant=cfg.invariant),
        environment=environment(lm.device),
        reference={"path": "eager no-cache loop", "tokens": ref_toks, "text": display_text(lm.tokenizer, ref_toks),
                   "float64_tokens": toks64, "float64_text": display_text(lm.tokenizer, toks64),
                   "float64_first_divergence": first_divergence(ref_toks, toks64), "row0_pad": inp.pad},
        cells=cells, elapsed_s=time.perf_counter() - t0)


def sliding_window_config(lm: LoadedModel, max_new_tokens: int | None = None) -> MatrixConfig:
    """The sliding-window scenario (the torch.compile report): a short left-padded prompt batched with one longer
    than the sliding window, generating past the window, over attention kinds and dynamic/static caches."""
    window = getattr(lm.config, "sliding_window", None)
    if not window:
        raise KvvizError(f"{lm.name} has no sliding window; the sliding-window preset (torch.compile report) needs "
                         f"a model with one (e.g. tiny:mistral, tiny:gemma2)")
    long_prompt = WINDOW_LONG_PROMPT
    while len(encode(lm, long_prompt)) <= window:
        long_prompt += " " + WINDOW_LONG_PROMPT
    n = max_new_tokens or min(256, window + 8)
    attns = ("eager",) if lm.arch.startswith("gemma2") else ("eager", "sdpa")
    return MatrixConfig(prompt=WINDOW_SHORT_PROMPT, max_new_tokens=n, attentions=attns, caches=("dynamic", "static"),
                        batch_with=(long_prompt,), repeats=2)


# what its run cannot honour (kvviz.core.protocol.RunContext.running; the CLI refuses the matching flag)
REFUSES = {'prove': 'the matrix runs no proof rerun (its invariant mode runs every cell in invariant mode)'}


def run(lm: LoadedModel, config: MatrixConfig, ctx: RunContext = DEFAULT_CONTEXT) -> MatrixResult:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    # its axes are its own settings; the context's invariant mode runs every cell in invariant mode
    cfg = replace(config, invariant=True) if ctx.settings.invariant else config
    with ctx.running(REFUSES) as progress:
        return run_matrix(lm, cfg, trust_remote_code=lm.trust_remote_code, progress=progress)
