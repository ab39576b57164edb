"""Padding and batching: the same prompt alone, left-padded and in a batch with longer prompts, × the cache
settings people get wrong (no cache, cache, position ids omitted, mask new-only, both). Every cell is compared
with the prompt alone without cache and judged by the one rule (kvviz.views.split.run.classify) from its float64 rerun.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import pandas as pd
import torch

from ...models.compat import output_cache, takes_logits_to_keep
from ...core.dtypes import machine_eps
from ...core.errors import KvvizError, first_line
from ...core.execution import DEFAULT_SETTINGS, ExecSettings, Executor, RunInfo, RunSettings, has_cache
from ...core.inputs import (Workload, check_split, encode, left_pad_rows, positions_from_mask, split_point, token_texts,
                      validate_prompt)
from ...models.loading import LoadedModel
from ...core.protocol import DEFAULT_CONTEXT, no_progress, Progress, RunContext
from ...core.streaming import HeldRows, LayerGaps
from ...core.verdict import Prove, Verdict, classify
from ...core.estimate import Timed


PLACEMENTS = ("alone", "left-padded", "in a batch")
SCENARIOS = (  # (label, use cache, position ids, attention mask)
    ("no cache", False, "auto", "full"),
    ("cache", True, "auto", "full"),
    ("cache, positions omitted", True, "omit", "full"),
    ("cache, mask new-only", True, "auto", "new-only"),
    ("cache, omitted + new-only", True, "omit", "new-only"),
)
CANNOT_RUN = "cannot run"  # a cell's verdict when the model's own forward fails on it (its `reason` says why)
DEFAULT_COMPANIONS = (
    "The museum guard knew every painting in the building, but he had a favourite one hanging in the far corner.",
    "Every summer the children built a raft from old planks and empty barrels, and every summer it sank in the lake.",
)


def _placements(left_pad: int) -> list[str]:
    """The placements that apply: no "left-padded" row when the padding is 0 (it would be "alone" again)."""
    return [p for p in PLACEMENTS if p != "left-padded" or left_pad > 0]


def _check_left_pad(left_pad) -> None:
    if isinstance(left_pad, bool) or not isinstance(left_pad, int) or left_pad < 0:
        raise KvvizError(f"left padding must be 0 or more, not {left_pad}")


@dataclass(frozen=True)
class PaddingSettings(RunSettings):
    prompt: str = ""
    split: int = 0
    left_pad: int = 0
    companions: tuple[int, ...] = ()  # token counts of the longer prompts in the batch


@dataclass
class PaddingResult(Timed):
    settings: PaddingSettings
    model: dict
    tokens: list[str]
    compared: list[int]
    cells: list[dict]  # one per placement × scenario
    proof_s: float | None = None  # seconds the grid's invariant-mode rerun took (None: no rerun)

    @property
    def placements(self) -> list[str]:
        return _placements(self.settings.left_pad)

    def grid(self, field_name: str = "verdict") -> pd.DataFrame:
        df = pd.DataFrame(self.cells)
        return df.pivot(index="placement", columns="scenario", values=field_name).loc[
            self.placements, [s[0] for s in SCENARIOS]]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["settings"] = self.settings.to_dict()
        return d


def _batch(lm: LoadedModel, rows: list[list[int]], target: int, extra_pad: int):
    """Left-pad rows to one length (plus extra_pad for all). Returns ids, mask, auto positions, target's pad."""
    ids, mask = left_pad_rows(lm, rows, extra_pad)
    return ids, mask, positions_from_mask(mask), ids.shape[1] - len(rows[target])


def _scenario(ex: Executor, rows, target: int, extra_pad: int, k: int, use_cache: bool, pos_mode: str,
              mask_mode: str, gaps: LayerGaps) -> torch.Tensor:
    """The target row's tokens [k, L): their logits [n_compared, V]; their hidden states are compared with the
    reference's layer by layer as they come (`gaps`)."""
    ids, mask, pos, pad = _batch(ex.lm, rows, target, extra_pad)
    c = pad + k  # the column where the cache ends, the same for every row
    # float64 (the reference) computes only the compared positions' logits, and the prefix none: a 262k vocabulary's
    # logits over a padded batch are gigabytes in float64 (the run's own dtype keeps the user's full forward)
    keep = takes_logits_to_keep(ex.lm.model)
    if not use_cache:
        out = ex.forward(ids, mask, pos, use_cache=False, hidden=gaps.sink(lambda h: h[target, c:]),
                         logits_to_keep=ids.shape[1] - c if keep and ex.lm.dtype == torch.float64 else None)
        return out.logits[target, -(ids.shape[1] - c):].clone()  # the target's rows: the batch's are freed
    pre = ex.forward(ids[:, :c], mask[:, :c], pos[:, :c], hidden=False, logits_to_keep=1 if keep else None)
    if not has_cache(pre):
        raise KvvizError(f"{ex.lm.name} returns no cache (a bidirectional model): past_key_values cannot be used")
    past, pre = output_cache(pre), None  # only the prefix's cache goes on
    out = ex.forward(ids[:, c:], mask if mask_mode == "full" else mask[:, c:],
                     pos[:, c:] if pos_mode == "auto" else None, past, hidden=gaps.sink(lambda h: h[target]))
    return out.logits[target].clone()


def _cell(gaps: LayerGaps, ref_l, lg) -> dict:
    hd = gaps.matrices()
    ldiff = (lg.double() - ref_l.double()).abs().amax(-1)
    return {
        "hidden_relative": float(hd["relative"].max()),
        "hidden_max_abs": float(hd["max_abs"].max()),
        "logits_max_abs": float(ldiff.max()),
        "logits_relative": float((ldiff / ref_l.double().abs().amax(-1)).max()),
        "argmax_agree": bool((lg.argmax(-1) == ref_l.argmax(-1)).all()),
        "bitwise_equal": bool(gaps.equal and torch.equal(lg, ref_l)),
    }


def _padding_cells(lm: LoadedModel, settings: ExecSettings, ids: list[int], companions: list[list[int]], k: int,
                   left_pad: int, only: tuple[tuple[str, str], ...] | None = None) -> dict:
    width = max(len(c) for c in companions + [ids]) + left_pad
    ex = Executor(lm, settings, max_len=width)
    with ex.session():
        held = HeldRows(lambda h: h[0, k:])  # the reference's compared rows, layer by layer as they come
        # float64 computes only the compared positions' logits (as its scenarios do); the run's own dtype keeps the
        # user's full forward, and only the compared rows are kept of it
        keep = len(ids) - k if takes_logits_to_keep(lm.model) and lm.dtype == torch.float64 else None
        ref = ex.forward(torch.tensor([ids], device=lm.device), use_cache=False, hidden=held, logits_to_keep=keep)
        ref_l = ref.logits[0, -(len(ids) - k):].clone()
        del ref
        out = {}
        for placement in _placements(left_pad):
            rows = [ids] + (companions if placement == "in a batch" else [])
            extra = left_pad if placement == "left-padded" else 0
            for label, use_cache, pm, mm in SCENARIOS:
                if only is not None and (placement, label) not in only:
                    continue
                gaps = LayerGaps(held, machine_eps(lm.dtype), "a padding scenario", equal=True)
                try:
                    lg = _scenario(ex, rows, 0, extra, k, use_cache, pm, mm, gaps)
                except KvvizError:
                    raise
                except Exception as e:  # noqa: BLE001 - the model's own forward fails on this cell: say why, go on
                    out[(placement, label)] = {"error": cell_failure(lm, mm, e)}
                    continue
                out[(placement, label)] = _cell(gaps, ref_l, lg)
                del gaps, lg  # before the next scenario's forward
    return out


def cell_failure(lm: LoadedModel, mask_mode: str, e: BaseException) -> str:
    """One line for a cell the model's forward cannot run."""
    err = first_line(e, 180, typed=True)
    kind = getattr(lm.config, "model_type", None) or lm.name
    if mask_mode == "new-only":
        return (f"cannot run: {kind}'s forward fails on a mask of the new tokens only ({err}) - a model that builds "
                f"its positions or alibi from the attention mask (OPT, BLOOM) needs it to cover the cached tokens too")
    return f"cannot run: {kind}'s forward fails on this scenario ({err})"


def companion_ids(lm: LoadedModel, ids: list[int], companions: list[str] | None, left_pad: int) -> list[list[int]]:
    """The batch-mates, each made longer than the prompt (so the prompt is the padded row)."""
    comp_ids = [encode(lm, c) for c in (companions or DEFAULT_COMPANIONS)]
    comp_ids = [c if len(c) > len(ids) else c + c[1:] * (len(ids) // max(1, len(c) - 1) + 1) for c in comp_ids]
    width = max(len(c) for c in comp_ids + [ids]) + left_pad
    if lm.max_positions is not None and width > lm.max_positions:
        raise KvvizError(f"the padded batch is {width} tokens, longer than the model's context of "
                         f"{lm.max_positions} tokens")
    return comp_ids


def run_padding(lm: LoadedModel, prompt: str, split: int | None = None, left_pad: int = 4,
                companions: list[str] | None = None, progress: Progress | None = None,
                settings: ExecSettings | None = None, prove: Prove = None,
                only: tuple[tuple[str, str], ...] | None = None) -> PaddingResult:
    """The same prompt alone, left-padded, and in a batch with longer prompts; with and without cache, position
    ids auto or omitted, mask full or new-only. Each cell is compared with the prompt alone, no cache, no padding.
    With left_pad 0 the "left-padded" placement is the same as "alone" and is left out. prove (None or True; False:
    never): when a cell is "precision", rerun the grid in invariant mode; each cell's `proved` says whether its gap is exactly 0 there.
    only: the (placement, scenario) cells to run (None: all); the cache-safety card needs one, and a model that
    builds its positions or alibi from the mask (OPT, BLOOM) cannot run the new-only-mask scenarios at all."""
    progress = progress or no_progress
    settings = settings or DEFAULT_SETTINGS  # validated once, by its RunContext
    _check_left_pad(left_pad)
    ids = encode(lm, prompt)
    k = split_point(len(ids), "half" if split is None else split)
    check_split(len(ids), k if split is None else split)
    comp_ids = companion_ids(lm, ids, companions, left_pad)
    progress(0.1, f"Running the scenarios in {lm.name} {RunInfo.of(lm).dtype}…")
    main = _padding_cells(lm, settings, ids, comp_ids, k, left_pad, only)
    lm64 = lm.reference()
    progress(0.55, "Rerunning every scenario in float64…")
    f64 = main if lm64 is lm else _padding_cells(lm64, settings.with_(compile="off"), ids, comp_ids, k, left_pad,
                                                 only)
    cells = []
    nan = float("nan")
    for (placement, label), c in main.items():
        c64 = f64[(placement, label)]
        failed = c.get("error") or c64.get("error")
        if failed:  # a cell the model cannot run: its one-line reason, no numbers
            cells.append({"placement": placement, "scenario": label, "hidden_relative": nan, "hidden_max_abs": nan,
                          "logits_max_abs": nan, "logits_relative": nan, "argmax_agree": None,
                          "bitwise_equal": None, "float64_relative": nan, "verdict": CANNOT_RUN, "proved": None,
                          "reason": failed if c.get("error") else f"float64 rerun {failed}"})
            continue
        gap64 = max(c64["hidden_relative"], c64["logits_relative"])
        cells.append({"placement": placement, "scenario": label, **c, "float64_relative": gap64,
                      "verdict": classify(c["bitwise_equal"], gap64), "proved": None, "reason": None})
    proof_s = None
    if prove is not False and not settings.invariant and any(c["verdict"] == Verdict.PRECISION for c in cells):
        progress(0.8, "Rerunning the grid in invariant mode for the proof…")
        t_proof = time.perf_counter()
        inv = _padding_cells(lm, settings.with_(invariant=True, compile="off"), ids, comp_ids, k, left_pad, only)
        for c in cells:
            if c["verdict"] == Verdict.PRECISION:
                c["proved"] = inv[(c["placement"], c["scenario"])].get("bitwise_equal")
        proof_s = time.perf_counter() - t_proof
    progress(1.0, "Done")
    run = RunInfo.of(lm, settings)
    info = PaddingSettings.from_run(run, prompt=prompt, split=k, left_pad=left_pad,
                                    companions=tuple(len(c) for c in comp_ids))
    return PaddingResult(settings=info, model=lm.summary(), tokens=token_texts(lm.tokenizer, ids),
                         compared=list(range(k, len(ids))), cells=cells, proof_s=proof_s)


@dataclass(frozen=True)
class PaddingConfig:
    """The prompt alone, left-padded and in a batch (run_padding)."""
    prompt: str
    split: int | None = None  # tokens to the cache (None: half the prompt)
    left_pad: int = 4
    companions: tuple[str, ...] | None = None  # the batch's longer prompts (None: built from the prompt)
    only: tuple[tuple[str, str], ...] | None = None  # the (placement, scenario) cells to run (None: all)

    def validate(self) -> "PaddingConfig":
        validate_prompt(self.prompt)
        _check_left_pad(self.left_pad)
        if self.split is not None and (isinstance(self.split, bool) or not isinstance(self.split, int)):
            raise KvvizError(f"the split must be a whole number, not {self.split!r}")
        return self

    def workload(self) -> Workload:
        """What the run holds, for its memory plan: the prompt, its left padding, the split (None: half the prompt);
        its batch-mates are the view's memory profile's."""
        # its time estimate: the reference forward, then each cell (a forward, or the prefix and the rest through the
        # cache: about one) over the placement's rows (the prompt, and its batch-mates in a batch); the whole grid
        # again in float64 (every cell's verdict), and in invariant mode where a cell is precision
        rows = {"alone": 1, "left-padded": 1, "in a batch": 1 + len(self.companions or DEFAULT_COMPANIONS)}
        cells = self.only if self.only is not None else [(p, s[0]) for p in _placements(int(self.left_pad))
                                                         for s in SCENARIOS]
        return Workload(texts=(self.prompt,), left_pad=int(self.left_pad), split=self.split,
                        forwards=1.0 + sum(rows.get(p, 1) for p, _ in cells), float64_certain=True,
                        copies=("float64",), proves=True)


def run(lm: LoadedModel, config: PaddingConfig, ctx: RunContext = DEFAULT_CONTEXT) -> PaddingResult:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    config.validate()
    with ctx.running() as progress:
        return run_padding(lm, config.prompt, config.split, config.left_pad,
                           None if config.companions is None else list(config.companions), progress,
                           settings=ctx.settings, prove=ctx.prove, only=config.only)
