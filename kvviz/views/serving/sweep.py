"""Where determinism ends (issue 41 item 4): requests in flight × prompt length against one engine.

Per cell (c requests in flight, prompts of about L tokens, built deterministically from one text): the serving
study's own conditions - each prompt alone (the cache, cold) and, for c > 1, in a continuous batch of c (the prompts
with seeded random neighbours filling the batch up to c) - through one engine kept open for the whole grid, judged by
the serving study's code (`run.study`: distinct completions, first divergence, top-2 margins, the verdict against
kvviz's float64 reference). The cell reads: distinct completions per prompt, the share of prompts whose batched
output parts from the same prompt run alone, the earliest first divergence and the reference's top-2 margin there,
and the cell's verdict (logic if any prompt's is, else precision if any parted, else identical).

The sweep stops cleanly between cells when its time budget is spent (the cells not run are listed) and at every
kvviz.core.cancel checkpoint inside one. A cell whose engine fails (a worker that dies or gives no answer within its
limit) or that passes `cell_limit_s` (_cell_limit; a server's request waits at most that long) is recorded as not
finished with its one-line reason, its engine is restarted for the next cell, and the cells at least as large
(_at_least) are listed as not run; the cells finished are kept. Only a sweep with no cell finished fails, with the
first cell's line.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import pandas as pd
import plotly.graph_objects as go

from ...core.errors import KvvizError
from ...engines.server import _timeout
from ...engines import ANSWER_LIMIT_S, registry
from ...core.memory import Workload
from ...core.inputs import encode
from ...core import theme
from ...core.protocol import DEFAULT_CONTEXT, no_progress, RunContext
from ...core.estimate import Timed
from . import run as study_run
from .run import ServeConfig, ServeResult
from ...core import cancel
from ...core.execution import DEFAULT_SETTINGS
from ...core.prompts import load_prompts
from ...core.text import fmt_number

CONCURRENCY = (1, 2, 4, 8, 16, 32)
LENGTHS = (16, 64, 256, 1024)
PROMPTS_PER_CELL = 4
VERDICT_COLOURS = {v: theme.VERDICT_COLOURS[v] for v in ("identical", "precision", "logic", "not finished", "not run")}


@dataclass
class SweepConfig:
    concurrency: tuple[int, ...] = CONCURRENCY
    lengths: tuple[int, ...] = LENGTHS
    prompts_per_cell: int = PROMPTS_PER_CELL
    max_new_tokens: int = 16
    runs: int = 1
    seed: int = 0
    engine: str = "vllm"
    server: str | None = None
    text: str = ""  # the text the prompts are cut from ("" : the built-in prompts, joined)
    budget_s: float | None = None  # stop between cells once this many seconds have passed
    cell_limit_s: float | None = None  # a cell still running after this many seconds is stopped, not finished

    def workload(self) -> Workload:
        """What kvviz's process holds, for the memory plan: one prompt's float64 reference at a time (the longest
        prompt and its new tokens) and, on transformers' engine (its pages in this process), the largest batch."""
        return Workload(tokens=max(self.lengths) + int(self.max_new_tokens),
                        batch=max(self.concurrency) if registry.facts(self.engine).pages_here and not self.server
                        else 1)

    def validate(self) -> None:
        for name, vals, lo, hi in (("concurrency", self.concurrency, 1, 64), ("lengths", self.lengths, 1, 8192)):
            if not vals or any(isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi for v in vals):
                raise KvvizError(f"{name} must be whole numbers from {lo} to {hi}, not {vals!r}")
        self.concurrency, self.lengths = tuple(sorted(set(self.concurrency))), tuple(sorted(set(self.lengths)))
        if not isinstance(self.prompts_per_cell, int) or not 1 <= self.prompts_per_cell <= 64:
            raise KvvizError(f"prompts per cell must be a whole number from 1 to 64, not {self.prompts_per_cell!r}")
        if self.budget_s is not None and not self.budget_s > 0:
            raise KvvizError(f"the time budget must be a positive number of seconds, not {self.budget_s!r}")
        if self.cell_limit_s is not None and not self.cell_limit_s > 0:
            raise KvvizError(f"the cell limit must be a positive number of seconds, not {self.cell_limit_s!r}")


@dataclass
class Cell:
    concurrency: int
    length: int  # the prompts' target length in tokens
    prompt_tokens: list[int]  # each prompt's real length
    distinct: list[int]  # per prompt: distinct completions over its runs, alone and batched, the reference included
    parting_alone: float | None  # share of prompts whose batched output parts from the same prompt run alone
    parting_reference: float  # share of prompts with a run that parts from the reference
    first_divergence: int | None
    margin: float | None  # the reference's top-2 margin at that first divergence
    verdict: str  # identical, precision or logic
    verdicts: dict  # verdict -> prompts
    seconds: float
    tokens_per_s: float


@dataclass
class SweepResult(Timed):
    config: dict
    model: dict
    engine: dict
    cells: list[Cell]
    skipped: list[list[int]] = field(default_factory=list)  # [concurrency, length] cells the budget left out
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    # [concurrency, length, reason]: cells started and not finished (the engine failed or the cell limit passed),
    # and the cells at least as large, not run after one of them
    unfinished: list[list] = field(default_factory=list)

    @property
    def settings(self) -> dict:
        """What the sweep ran, for the report's settings table and Open a result's caption."""
        return {"model": self.model.get("spec") or self.model.get("description"), "dtype": self.config.get("dtype"),
                "device": self.config.get("device") or self.model.get("device"),
                "engine": self.engine.get("name", self.config.get("engine")), **{
                    k: self.config.get(k) for k in ("server", "concurrency", "lengths", "prompts_per_cell",
                                                     "max_new_tokens", "runs", "seed", "budget_s", "cell_limit_s")}}

    def cell(self, c: int, length: int) -> Cell | None:
        return next((x for x in self.cells if x.concurrency == c and x.length == length), None)

    def to_dict(self) -> dict:
        return {"kind": "SweepResult", "config": self.config, "model": self.model, "engine": self.engine,
                "cells": [asdict(c) for c in self.cells], "skipped": self.skipped, "elapsed_s": self.elapsed_s,
                "notes": self.notes, "unfinished": self.unfinished}

    @classmethod
    def from_dict(cls, d: dict) -> "SweepResult":
        return cls(config=d["config"], model=d["model"], engine=d["engine"], cells=[Cell(**c) for c in d["cells"]],
                   skipped=[list(x) for x in d.get("skipped", [])], elapsed_s=d.get("elapsed_s", 0.0),
                   notes=d.get("notes", []), unfinished=[list(x) for x in d.get("unfinished", [])])


def source_text() -> str:
    return "\n".join(load_prompts("builtin"))


def build_prompts(lm, text: str, length: int, count: int) -> list[str]:
    """`count` prompts of `length` tokens cut from `text` (repeated as needed) at evenly spaced token offsets: the
    same prompts on every machine for the same tokenizer. Decoding and re-encoding can move a length by a token."""
    ids = encode(lm, text)
    if not ids:
        raise KvvizError("the sweep's source text has no tokens")
    stride = max(1, min(length, len(ids) // max(count, 1)))
    need = stride * (count - 1) + length
    ids = ids * (need // len(ids) + 1)
    return [lm.tokenizer.decode(ids[j * stride:j * stride + length]) for j in range(count)]


def cell_of(res: ServeResult, c: int, length: int, seconds: float, prompt_tokens: list[int]) -> Cell:
    """A serving study's result (conditions alone and, for c > 1, batch) as one cell of the grid."""
    ps = res.prompts
    parting_alone = None
    if "batch" in res.settings.conditions:
        parting_alone = sum(any(tuple(b) not in {tuple(a) for a in p.completions["alone"]}
                                for b in p.completions["batch"]) for p in ps) / len(ps)
    parted = [p for p in ps if p.first_divergence is not None]
    first = min(parted, key=lambda p: p.first_divergence) if parted else None
    verdicts = dict(Counter(p.verdict or ("identical" if p.first_divergence is None else "precision") for p in ps))
    verdict = "logic" if "logic" in verdicts else "precision" if parted or "precision" in verdicts else "identical"
    new = sum(s.new_tokens for k, s in res.conditions.items() if k != "reference")
    secs = sum(s.seconds for k, s in res.conditions.items() if k != "reference")
    return Cell(concurrency=c, length=length, prompt_tokens=list(prompt_tokens),
                distinct=[p.distinct_all for p in ps], parting_alone=parting_alone,
                parting_reference=len(parted) / len(ps), first_divergence=None if first is None
                else first.first_divergence, margin=None if first is None else first.margin, verdict=verdict,
                verdicts=verdicts, seconds=seconds, tokens_per_s=new / secs if secs > 0 else 0.0)


# what its run cannot honour (kvviz.core.protocol.RunContext.running; `serving --sweep` refuses --no-proof)
REFUSES = {"prove": "the sweep runs no proof rerun: its cells are judged against the float64 reference"}


def run(lm, config: SweepConfig, ctx: RunContext = DEFAULT_CONTEXT) -> SweepResult:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    with ctx.running(REFUSES) as progress:
        return run_sweep(lm, config, progress, settings=ctx.settings)


def run_sweep(lm, cfg: SweepConfig, progress=None, settings=None, reference=None) -> SweepResult:
    """The grid, cell by cell through one engine (see the module docstring)."""
    progress = progress or no_progress
    cfg.validate()
    settings = settings or DEFAULT_SETTINGS  # validated once, by its RunContext
    limit = cfg.cell_limit_s
    if cfg.server:
        engine = registry.open_engine(registry.served(), url=cfg.server)
        engine.probe(lm, settings)
        cfg.engine = engine.name
        if limit is not None:  # a request in flight is not a checkpoint: it waits at most the cell limit
            engine.timeout_s = min(_timeout(), limit)
    else:
        registry.check(cfg.engine).check_settings(settings)
        # vLLM starts once for the grid, with room for its largest cell (no restart between cells); its worker
        # waits for an answer at least as long as the cell limit (kvviz's checkpoint stops it at the limit);
        # transformers' pages: 8 tokens
        engine = registry.open_engine(cfg.engine, page_size=8, max_in_flight=max(cfg.concurrency),
                                      timeout_s=max(ANSWER_LIMIT_S, (limit or 0) + 60))
    t0 = time.perf_counter()
    grid = [(c, n) for n in cfg.lengths for c in cfg.concurrency]
    cells, skipped, unfinished, info = [], [], [], {}
    failed: list[tuple[int, int]] = []  # the cells started and not finished
    try:  # the engine (vLLM's worker process) is ended however the sweep ends: done, failed or stopped
        ref = reference or lm.reference() if engine.judged_by_logprobs else reference
        text = cfg.text or source_text()
        memo: dict = {}  # each prompt's reference and each token path's scores, once for the whole grid
        for k, (c, n) in enumerate(grid):
            cancel.check(f"sweep cell {k + 1}/{len(grid)}")
            if k and cfg.budget_s is not None and time.perf_counter() - t0 > cfg.budget_s:  # one cell at least
                skipped = [[c2, n2] for c2, n2 in grid[k:] if not _at_least(c2, n2, failed)]
                break
            after = _at_least(c, n, failed)
            if after:
                unfinished.append([c, n, f"not run: the {after[0]} in flight × {after[1]} tokens cell did not finish"])
                continue
            progress(k / len(grid), f"cell {k + 1}/{len(grid)}: {c} in flight, {n}-token prompts")
            prompts = build_prompts(lm, text, n, cfg.prompts_per_cell)
            scfg = ServeConfig(prompts=prompts, conditions=("alone",) if c == 1 else ("alone", "batch"),
                               runs=cfg.runs, max_new_tokens=cfg.max_new_tokens, batch_size=max(c, 2),
                               seed=cfg.seed, engine=cfg.engine,
                               server=cfg.server, prompt_source=f"sweep:{n}")
            scfg.validate()
            tc = time.perf_counter()
            try:
                with _cell_limit(limit):
                    res = study_run.study(lm, scfg, engine, settings=settings, reference=ref, prove=False,
                                          started=tc, memo=memo)
            except (KvvizError, _CellLimit) as e:  # this cell only: the engine starts again for the next one
                why = f"passed the cell limit ({limit:g} s)" if isinstance(e, _CellLimit) else str(e)
                unfinished.append([c, n, f"{why} after {time.perf_counter() - tc:.0f} s"])
                failed.append((c, n))
                engine.close()
                continue
            cells.append(cell_of(res, c, n, time.perf_counter() - tc, [len(encode(lm, p)) for p in prompts]))
            info = res.engine
    finally:
        engine.close()
    if not cells and failed:  # nothing to show: the first cell's line
        raise KvvizError(f"no cell of the sweep finished: the first ({unfinished[0][0]} in flight × "
                         f"{unfinished[0][1]} tokens) {unfinished[0][2]}")
    progress(1.0, "Done")
    notes = list(lm.warnings)
    if skipped:
        notes.append(f"the time budget ({cfg.budget_s:g} s) ran out: {len(skipped)} cells not run")
    if unfinished:
        notes.append(f"{len(failed)} cell(s) did not finish and {len(unfinished) - len(failed)} at least as large "
                     "were not run; the cells that finished are kept")
    conf = asdict(cfg)
    conf["dtype"] = str(lm.dtype).replace("torch.", "") if hasattr(lm, "dtype") else None
    conf["device"] = str(getattr(lm, "device", "cpu"))
    return SweepResult(config=conf, model=lm.summary(), engine=info, cells=cells, skipped=skipped,
                       elapsed_s=time.perf_counter() - t0, notes=notes, unfinished=unfinished)


class _CellLimit(Exception):
    """A cell passed SweepConfig.cell_limit_s (raised in place of the cell's Cancelled, the run itself not stopped)."""


def _at_least(c: int, n: int, failed: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The cell that did not finish which this one is at least as large as (as many in flight or more, prompts as
    long or longer), else None: such a cell is not run."""
    return next(((c0, n0) for c0, n0 in failed if c >= c0 and n >= n0), None)


@contextlib.contextmanager
def _cell_limit(limit: float | None):
    """The cell's own stop signal inside the run's: cancelled when the run is (Stop: Cancelled goes on up) or when
    `limit` seconds have passed (then _CellLimit: this cell is not finished, the sweep goes on). Checked at kvviz's
    checkpoints: every second of an engine worker's wait (which kills the worker), every layer in this process."""
    if limit is None:
        yield
        return
    outer, deadline = cancel.current(), time.monotonic() + limit
    token = cancel.Token()

    def probe() -> bool:
        if outer is not None and outer.cancelled:
            token.cancel(outer.why or "stopped")
        elif time.monotonic() > deadline:
            token.cancel("the cell limit")
        return token.is_set

    token.probe = probe
    try:
        with cancel.scope(token):
            yield
    except cancel.Cancelled:
        if outer is not None and outer.is_set:
            raise
        if time.monotonic() <= deadline:
            raise
        raise _CellLimit() from None


def summary_text(res: SweepResult) -> str:
    cfg = res.config
    lines = [f"model: {res.model.get('description', '')}",
             f"engine {res.engine.get('name', cfg.get('engine'))} {res.engine.get('version', '')}, "
             f"{cfg['prompts_per_cell']} prompts a cell, {cfg['max_new_tokens']} new tokens, {cfg['runs']} run(s), "
             f"{res.elapsed_s:.1f} s", "",
             f"{'in flight':>9} {'length':>6} {'verdict':>9} {'parts/alone':>11} {'parts/ref':>9} {'distinct':>10}"
             f" {'first div':>9} {'margin':>8} {'tok/s':>7} {'s':>6}"]
    for x in res.cells:
        pa = "—" if x.parting_alone is None else f"{x.parting_alone:.0%}"
        lines.append(f"{x.concurrency:>9} {x.length:>6} {x.verdict:>9} {pa:>11} {x.parting_reference:>9.0%} "
                     f"{','.join(map(str, x.distinct)):>10} {'—' if x.first_divergence is None else x.first_divergence:>9}"
                     f" {'—' if x.margin is None else f'{x.margin:.3g}':>8} {x.tokens_per_s:>7.1f} {x.seconds:>6.1f}")
    for c, n, why in res.unfinished:
        lines.append(f"{c:>9} {n:>6}   not finished: {why}")
    for c, n in res.skipped:
        lines.append(f"{c:>9} {n:>6}   not run (time budget)")
    lines += [f"note: {n}" for n in res.notes]
    return "\n".join(lines)


def figure(res: SweepResult):
    """The grid: requests in flight (x) × prompt length (y), each cell coloured by its verdict (explicit colours)
    with the share of prompts whose batched output parts from the same prompt alone as its text."""
    gone = {(c, n) for c, n, _ in res.unfinished}
    cs = sorted({x.concurrency for x in res.cells} | {c for c, _ in res.skipped} | {c for c, _ in gone})
    ns = sorted({x.length for x in res.cells} | {n for _, n in res.skipped} | {n for _, n in gone})
    order = list(VERDICT_COLOURS)
    z, text = [], []
    for n in ns:
        zr, tr = [], []
        for c in cs:
            x = res.cell(c, n)
            v = x.verdict if x is not None else "not finished" if (c, n) in gone else "not run"
            zr.append(order.index(v))
            tr.append(v if x is None else
                      ("alone" if x.parting_alone is None else f"{x.parting_alone:.0%} part") +
                      ("" if x.first_divergence is None else f"<br>step {x.first_divergence}"))
        z.append(zr)
        text.append(tr)
    k = len(order)
    scale = [[j / k, VERDICT_COLOURS[v]] for i, v in enumerate(order) for j in (i, i + 1)]  # a band per verdict
    fig = go.Figure(go.Heatmap(z=z, x=[str(c) for c in cs], y=[str(n) for n in ns], text=text,
                               texttemplate="%{text}", zmin=-0.5, zmax=k - 0.5, colorscale=scale, xgap=2, ygap=2,
                               colorbar=dict(tickvals=list(range(k)), ticktext=order, title="verdict")))
    fig.update_layout(title=f"Where determinism ends: {res.engine.get('name', res.config.get('engine'))}, "
                            "requests in flight × prompt length", xaxis_title="requests in flight",
                      yaxis_title="prompt tokens", xaxis_type="category", yaxis_type="category", height=420)
    return fig


def figures(res: SweepResult) -> list:
    """Its charts (the page, the HTML report and Open a result draw the same): the grid by verdict."""
    return [figure(res)]


def frame(res: SweepResult):
    """One row per cell, in the grid's order; the cells the time budget left out, as not run."""
    rows = [{"in flight": x.concurrency, "prompt tokens": x.length, "verdict": x.verdict,
             "part from alone": "—" if x.parting_alone is None else f"{x.parting_alone:.0%}",
             "part from reference": f"{x.parting_reference:.0%}",
             "distinct per prompt": ", ".join(map(str, x.distinct)),
             "first divergence": "—" if x.first_divergence is None else x.first_divergence,
             "ref margin": fmt_number(x.margin), "tokens/s": round(x.tokens_per_s, 1), "s": round(x.seconds, 1)}
            for x in res.cells]
    blank = dict.fromkeys(rows[0] if rows else (), "—")
    rows += [{**blank, "in flight": c, "prompt tokens": n, "verdict": f"not finished: {why}"}
             for c, n, why in res.unfinished]
    rows += [{**blank, "in flight": c, "prompt tokens": n, "verdict": "not run (time budget)"} for c, n in res.skipped]
    return pd.DataFrame(rows)


def tables(res: SweepResult) -> list:
    return [frame(res)]


def reopen(d: dict) -> SweepResult:
    return SweepResult.from_dict(d)


def verdict(res: SweepResult) -> tuple[str, str]:
    """(the grid's verdict: logic if any cell's is, precision if any parted, else identical; one paragraph saying
    where batched completions first part from the same prompt alone and what the float64 reference says)."""
    cfg, cells = res.config, res.cells
    name = res.engine.get("name", cfg.get("engine"))
    model = (res.model.get("description") or res.model.get("spec") or "the model").split(" (")[0]  # its name
    head = (f"{name} {res.engine.get('version') or ''}".strip() + f", {model} in "
            f"{cfg.get('dtype') or '?'}: {len(cells)} cell(s) of {cfg.get('prompts_per_cell')} prompts "
            f"({', '.join(map(str, sorted({x.concurrency for x in cells})))} in flight × "
            f"{', '.join(map(str, sorted({x.length for x in cells})))} tokens)"
            + (f", {len(res.unfinished)} not finished (the engine failed, the cell limit passed, or a smaller cell "
               "did not finish)" if res.unfinished else "")
            + (f", {len(res.skipped)} not run (time budget)" if res.skipped else "") + ". ")
    if not cells:
        return "not run", head
    logic = [x for x in cells if x.verdict == "logic"]
    parted = [x for x in cells if x.parting_reference > 0 or x.verdict != "identical"]
    if not parted:
        return "identical", head + ("Every prompt gave one completion alone, in a batch and as the float64 "
                                    "reference in every cell: determinism did not end within this grid.")
    batch = [x for x in cells if x.parting_alone]
    if batch:
        b = min(batch, key=lambda x: (x.concurrency, x.length))
        where = "" if b.first_divergence is None else f", first divergence from the reference at step " \
            f"{b.first_divergence}" + ("" if b.margin is None else f", its top-2 margin there {b.margin:.3g}")
        head += (f"Batched completions first part from the same prompt alone at {b.concurrency} in flight "
                 f"({b.length}-token prompts: {b.parting_alone:.0%} of them{where}). ")
    else:
        head += "No batched completion parted from the same prompt alone. "
    head += f"Completions part from the float64 reference in {len(parted)} of {len(cells)} cells"
    if logic:
        return "logic", head + ("; beyond the engine's rounding (logic) at "
                                + ", ".join(f"{x.concurrency} × {x.length}" for x in logic) + ".")
    return "precision", head + " - each within the engine's rounding of the reference (precision: near ties)."
