"""The split comparison: one full forward vs a prefix cached and the rest fed through past_key_values.

For a prompt and a split point k (in prompt tokens), the reference is one no-cache forward over the whole
(left-padded) prompt with the correct mask and position ids, as generate() builds them. The cached path runs the
prefix [0, k) with the same correct inputs, then feeds the rest [k, L) through the cache, in one chunk or token by
token, with the position ids and attention mask the user chose (the classic mistakes included).

The verdict: `identical` (bitwise equal), `precision` (the gap closes when the very same scenario is rerun in
float64) or `logic` (it stays in float64, or the model returns no cache at all).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch

from ...models.compat import output_cache, takes_logits_to_keep
from ...core.dtypes import dtype_name, machine_eps
from ...core.inputs import MODES, PromptInputs, SplitConfig, build_inputs, cached_mask, check_split  # noqa: F401 - MODES
from ...core.text import display_text
from ...core.execution import DEFAULT_SETTINGS, ExecSettings, Executor, RunInfo, RunSettings, cache_layers, has_cache
from ...models.loading import LoadedModel
from ...core.protocol import DEFAULT_CONTEXT, no_progress, Progress, RunContext
from ...core.estimate import Estimate
from ... import views
from ...core.naming import layer_labels, model_type
from ...core.memory import REFERENCE_LOGITS_BYTES, fits_beside  # float64 logits over REFERENCE_LOGITS_BYTES: in chunks
from ...core.metrics import HIDDEN_METRICS as HIDDEN_METRIC_LABELS
from ...core.metrics import describe_table, logits_divergence, logits_rows, tensor_diff
from ...core.streaming import HeldRows, LayerGaps
from ...core.verdict import Finding, Prove, Verdict, amplification, classify, layers_prefix, precision_sentence
from ...core.estimate import Timed


@dataclass(frozen=True)
class SplitSettings(RunSettings):
    """Everything a split result was computed with: the run's fields and SplitConfig's."""

    prompt: str = ""
    split: int = 0
    mode: str = "chunk"
    left_pad: int = 0
    position_ids: str = "auto"
    attention_mask: str = "full"

    @classmethod
    def of(cls, cfg: SplitConfig, run: RunInfo) -> "SplitSettings":
        return cls.from_run(run, **asdict(cfg))

    @property
    def config(self) -> SplitConfig:
        return SplitConfig(self.prompt, self.split, self.mode, self.left_pad, self.position_ids, self.attention_mask)


@dataclass
class Comparison:
    """The numbers of one run of the scenario in one dtype. Matrices are [hidden states, compared positions]."""

    dtype: str
    device: str
    attention: str
    has_cache: bool
    hidden: dict[str, np.ndarray] = field(default_factory=dict)
    logits: dict[str, np.ndarray] = field(default_factory=dict)
    describe: dict = field(default_factory=dict)
    kv: list[dict] = field(default_factory=list)
    reference_top1: list[str] = field(default_factory=list)
    cached_top1: list[str] = field(default_factory=list)
    bidirectional_change: float | None = None  # no-cache models: how much appending the rest moves the prefix

    @property
    def identical(self) -> bool:
        return (self.has_cache and all(float(m.max()) == 0.0 for m in (self.hidden["max_abs"], self.logits["max_abs"]))
                and all(row["keys_differ"] == 0 and row["values_differ"] == 0 for row in self.kv))

    @property
    def max_relative(self) -> float:
        """The largest relative gap anywhere: hidden states (max |Δ| / max |ref|) and logits."""
        if not self.has_cache:
            return float("inf")
        return float(max(self.hidden["relative"].max(), self.logits["relative"].max()))

    @property
    def max_abs(self) -> float:
        if not self.has_cache:
            return float("inf")
        return float(max(self.hidden["max_abs"].max(), self.logits["max_abs"].max()))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hidden"] = {k: v.tolist() for k, v in self.hidden.items()}
        d["logits"] = {k: v.tolist() for k, v in self.logits.items()}
        d["identical"] = self.identical
        d["max_relative"] = self.max_relative if self.has_cache else None
        d["max_abs"] = self.max_abs if self.has_cache else None
        return d


@dataclass
class SplitResult(Timed):
    settings: SplitSettings
    model: dict
    tokens: list[str]
    token_ids: list[int]
    compared: list[int]
    layer_labels: list[str]
    main: Comparison
    float64: Comparison | None
    verdict: str
    explanation: str
    notes: list[str]
    elapsed_s: float
    invariant: Comparison | None = None  # the same scenario in invariant mode: the proof of a precision verdict
    proof: str | None = None  # one line: what the invariant run shows
    proof_s: float | None = None  # seconds the invariant rerun for the proof took (None: no rerun)

    @property
    def proved(self) -> bool | None:
        """True: in invariant mode the gap is exactly 0 (precision, proved); False: a gap survives it; None: not
        checked."""
        return None if self.invariant is None else self.invariant.identical

    @property
    def proof_in_explanation(self) -> bool:
        """A precision verdict's explanation carries its proof state (verdict_for with proved); other verdicts show
        the proof line beside it."""
        return self.proof is not None and self.verdict == Verdict.PRECISION

    @property
    def compared_tokens(self) -> list[str]:
        return [self.tokens[i] for i in self.compared]

    def to_dict(self) -> dict:
        return {
            "settings": self.settings.to_dict(),
            "model": self.model,
            "tokens": self.tokens,
            "token_ids": self.token_ids,
            "cached_tokens": self.tokens[: self.settings.split],
            "compared_positions": self.compared,
            "compared_tokens": self.compared_tokens,
            "layer_labels": self.layer_labels,
            "metric_descriptions": dict(HIDDEN_METRIC_LABELS),
            "result": self.main.to_dict(),
            "verdict": self.verdict,
            "explanation": self.explanation,
            "float64_evidence": self.float64.to_dict() if self.float64 is not None else None,
            "invariant_check": self.invariant.to_dict() if self.invariant is not None else None,
            "proved": self.proved,
            "proof": self.proof,
            "proof_s": self.proof_s,
            "notes": self.notes,
            "elapsed_s": self.elapsed_s,
        }


def compare_caches(ref_cache, got_cache, total: int, pad: int) -> list[dict]:
    """Per layer: elements of K and V that differ (non-pad positions), and the max |Δ|.

    Sliding-window layers keep only the last positions; both caches then hold the same trailing slots."""
    rows = []
    for i, ((rk, rv), (gk, gv)) in enumerate(zip(cache_layers(ref_cache), cache_layers(got_cache))):
        n = min(rk.shape[-2], gk.shape[-2])
        first_abs = total - n  # absolute position of the first compared slot
        skip = max(0, pad - first_abs)
        sl = slice(rk.shape[-2] - n + skip, None)
        gsl = slice(gk.shape[-2] - n + skip, None)
        kd, kt, km = tensor_diff(rk[..., sl, :], gk[..., gsl, :])
        vd, vt, vm = tensor_diff(rv[..., sl, :], gv[..., gsl, :])
        rows.append({"layer": i, "positions": n - skip, "keys_differ": kd, "keys_total": kt, "keys_max_abs": km,
                     "values_differ": vd, "values_total": vt, "values_max_abs": vm})
    return rows


def _bidirectional(ex: Executor, inp: PromptInputs, a0: int, comp: Comparison) -> Comparison:
    """transformers returns no cache for a bidirectional model (e.g. RoBERTa without is_decoder). Show why a cache
    cannot work: appending the rest changes what the prefix tokens compute."""
    P = inp.pad
    pre_h = ex.forward(inp.ids[:, :a0], inp.mask[:, :a0], use_cache=False).hidden_states[-1][0, P:a0]
    full_h = ex.forward(inp.ids, inp.mask, use_cache=False).hidden_states[-1][0, P:a0]
    comp.has_cache = False
    comp.bidirectional_change = float((full_h.double() - pre_h.double()).abs().max().item())
    return comp


@dataclass
class _Compared:
    """Logits compared step by step as they were produced (token-by-token mode): the per-position metrics and the
    last row, instead of every step's row of the vocabulary."""

    metrics: dict
    last: torch.Tensor


def _rest_through_cache(ex: Executor, cfg: SplitConfig, inp: PromptInputs, a0: int, past, progress: Progress,
                        ref_logits: torch.Tensor | None, gaps: LayerGaps):
    """Feed tokens [a0, total) through `past`, in one chunk or one by one, with the position ids and mask the user
    chose; each layer's hidden states are compared with the reference's as they come (`gaps`). Returns the
    logits [n_rest, V] (token by token with `ref_logits` given: a _Compared, each step's row compared as it comes)
    and the grown cache."""
    rest = inp.ids[:, a0:]
    mask_of = (lambda s, e: cached_mask(cfg.attention_mask, inp, a0 + s, a0 + e))
    positions_of = (lambda s, e: inp.positions[:, a0 + s:a0 + e]) if cfg.position_ids == "auto" else None
    if cfg.mode == "chunk":
        progress(0.5, "Rest through the cache, one chunk…")
        _, _, got = next(ex.feed(rest, past, mask_of=mask_of, positions_of=positions_of,
                                 hidden=gaps.sink(lambda h: h[0])))
        return got.logits[0], output_cache(got)
    lg = []
    cache = past
    for j, _, out in ex.feed(rest, past, one_by_one=True, mask_of=mask_of, positions_of=positions_of,
                             hidden=gaps.stepping(lambda h: h[0, -1:])):
        progress(0.4 + 0.5 * j / max(1, inp.total - a0),
                 f"Rest through the cache, token {j + 1} of {inp.total - a0}…")
        cache = output_cache(out)
        if ref_logits is None:
            lg.append(out.logits[0, -1])
        else:
            lg.append(logits_divergence(ref_logits[j:j + 1], out.logits[0, -1:]))
            last = out.logits[0, -1].clone()
        del out
    if ref_logits is None:
        return torch.stack(lg), cache
    return _Compared({k: torch.cat([m[k] for m in lg]) for k in lg[0]}, last), cache


@dataclass
class _Rows:
    """What the comparison needs of the full forward: the compared positions' hidden states (held layer by layer
    as the forward produced them: kvviz.core.streaming) and logits (copies, so the whole prompt's logits - positions ×
    vocabulary - are freed at once) and its cache."""

    hidden: HeldRows  # n_hidden × [n_rest, H]
    logits: torch.Tensor  # [n_rest, V]
    cache: object

    @classmethod
    def of(cls, out, n: int, hidden: HeldRows) -> "_Rows":
        # the whole prompt's logits (copied: the rest is freed), or only the compared ones (see _full_forward: kept
        # as they are, a float64 copy of a large vocabulary's rows would double the peak)
        logits = out.logits[0] if out.logits.shape[1] == n else out.logits[0, -n:].clone()
        return cls(hidden, logits, output_cache(out))


def _measure(lm: LoadedModel, comp: Comparison, ref: _Rows, gaps: LayerGaps, got_logits, cache, inp) -> None:
    """Every metric, computed on the device (the hidden-state gaps already, layer by layer as the cached run
    produced them); only the small matrices come to the host."""
    ref_logits = ref.logits
    hd = gaps.matrices()
    if isinstance(got_logits, _Compared):  # compared step by step already
        ld, got_last = dict(got_logits.metrics), got_logits.last
    else:
        ld, got_last = logits_divergence(ref_logits, got_logits), got_logits[-1]
    if isinstance(ref_logits, _ChunkedLogits):  # every row was reached by the step-by-step comparison
        ref_lmax = ref_logits.lmax
    else:
        ref_lmax = torch.cat([c.double().abs().amax(-1) for c in ref_logits.split(logits_rows(ref_logits))])
    ld["relative"] = ld["max_abs"] / ref_lmax.clamp_min(torch.finfo(torch.float64).tiny)
    comp.hidden = {name: t.cpu().numpy() for name, t in hd.items()}
    top1 = {name: ld.pop(name).cpu().tolist() for name in ("ref_top1", "got_top1")}
    comp.logits = {name: t.cpu().numpy() for name, t in ld.items()}
    comp.reference_top1 = [display_text(lm.tokenizer, [i]) for i in top1["ref_top1"]]  # a lone byte as ⟨xx⟩
    comp.cached_top1 = [display_text(lm.tokenizer, [i]) for i in top1["got_top1"]]
    comp.describe = describe_table(ref_logits[-1], got_last)
    comp.kv = compare_caches(ref.cache, cache, inp.total, inp.pad)


def _run(lm: LoadedModel, cfg: SplitConfig, inp: PromptInputs, progress: Progress,
         settings: ExecSettings = DEFAULT_SETTINGS) -> Comparison:
    """One run of the scenario in lm's dtype: the prefix with correct inputs, the rest through its cache, and one
    full forward as the reference."""
    a0 = inp.pad + cfg.split  # absolute index of the first compared token
    comp = Comparison(dtype=dtype_name(lm.dtype), device=str(lm.device), attention=lm.attn_implementation,
                      has_cache=True)
    ex = Executor(lm, settings, max_len=inp.total)
    with ex.session():
        progress(0.1, "Prefix forward…")
        # only its cache is used: no logits for the prefix's positions (in float64 with a 262k vocabulary, 600
        # positions' logits would be 1.3 GB)
        pre = ex.forward(inp.ids[:, :a0], inp.mask[:, :a0], inp.positions[:, :a0], hidden=False,
                         logits_to_keep=1 if takes_logits_to_keep(lm.model) else None)
        if not has_cache(pre):
            return _bidirectional(ex, inp, a0, comp)
        progress(0.3, "Full forward without cache…")
        rows = _reference_rows(ex, inp, a0) if cfg.mode == "step" else None
        # the full forward's hidden states: only the compared positions are kept, layer by layer as they come
        held = HeldRows(lambda h: h[0, a0:])
        ref = _Rows.of(_full_forward(ex, inp, a0, rows, held), inp.total - a0, held)
        if rows is not None:  # float64 with a large vocabulary: the earlier positions' logits a chunk at a time
            ref.logits = _ChunkedLogits(ex, inp, a0, ref.logits)
        # the cached path's hidden states are compared with those layer by layer as it produces them
        gaps = LayerGaps(held, machine_eps(lm.dtype), free=cfg.mode == "chunk")
        got_logits, cache = _rest_through_cache(ex, cfg, inp, a0, output_cache(pre), progress,
                                                ref.logits if cfg.mode == "step" else None, gaps)
        progress(0.9, "Measuring…")
        _measure(lm, comp, ref, gaps, got_logits, cache, inp)
    return comp


def _full_forward(ex: Executor, inp: PromptInputs, a0: int, rows: int | None = None, hidden=True):
    """The full forward. In float64 (the reference) only the compared positions' logits are computed
    (logits_to_keep; with `rows`, only the last `rows` of them: see _ChunkedLogits): a large vocabulary's logits
    over a long prompt are gigabytes in float64, and float64 decides the verdict by the size of the gap, not its
    last bits. In the run's own dtype the full forward stays exactly the user's (every position's logits), as the
    comparison is about that forward."""
    keep = None
    if ex.lm.dtype == torch.float64 and takes_logits_to_keep(ex.lm.model):
        keep = rows or inp.total - a0
    return ex.forward(inp.ids, inp.mask, inp.positions, logits_to_keep=keep, hidden=hidden)


def _reference_rows(ex: Executor, inp: PromptInputs, a0: int) -> int | None:
    """Rows per chunk of the float64 full forward's logits when all of them would exceed REFERENCE_LOGITS_BYTES
    (None: all at once, as always for the run's own dtype and for small vocabularies)."""
    vocab = getattr(ex.lm.model.config.get_text_config(), "vocab_size", None) or 0
    n = inp.total - a0
    if ex.lm.dtype != torch.float64 or not takes_logits_to_keep(ex.lm.model) or 8 * n * vocab <= \
            REFERENCE_LOGITS_BYTES:
        return None
    return max(1, REFERENCE_LOGITS_BYTES // (8 * vocab))


class _ChunkedLogits:
    """The float64 full forward's logits of the compared positions [a0, total), held one chunk of rows at a time:
    the last chunk comes with the full forward; an earlier chunk [s, e) is a forward over the sequence up to e
    with logits_to_keep = e - s (causal: the same rows, to float64 rounding), computed when the step-by-step
    comparison reaches it. Each row's largest |logit| is kept as its chunk is made (the relative gaps need it)."""

    def __init__(self, ex: Executor, inp: PromptInputs, a0: int, last: torch.Tensor):
        self.ex, self.inp, self.a0, self.rows = ex, inp, a0, last.shape[0]
        self.n = inp.total - a0
        self.shape = (self.n, last.shape[-1])
        self.dtype, self.device = last.dtype, last.device
        self.last = last
        self.lmax = torch.empty(self.n, dtype=torch.float64, device=last.device)
        self.lmax[self.n - self.rows:] = last.abs().amax(-1)
        self.current: tuple[int, int, torch.Tensor] | None = None

    def _chunk(self, j: int) -> tuple[int, int, torch.Tensor]:
        if j >= self.n - self.rows:
            return self.n - self.rows, self.n, self.last
        if self.current is not None and self.current[0] <= j < self.current[1]:
            return self.current
        k = (self.n - self.rows - 1 - j) // self.rows  # chunks counted back from the last one
        e = self.n - self.rows * (k + 1)
        s = max(0, e - self.rows)
        self.current = None  # free the previous chunk first
        end = self.a0 + e
        out = self.ex.forward(self.inp.ids[:, :end], self.inp.mask[:, :end], self.inp.positions[:, :end],
                              use_cache=False, hidden=False, logits_to_keep=e - s)
        logits = out.logits[0]
        self.lmax[s:e] = logits.abs().amax(-1)
        self.current = (s, e, logits)
        return self.current

    def __getitem__(self, index):
        if isinstance(index, int):
            j = index % self.n
            s, _, chunk = self._chunk(j)
            return chunk[j - s]
        start, stop = index.start or 0, index.stop if index.stop is not None else self.n
        s, e, chunk = self._chunk(start)
        if stop > e or index.step not in (None, 1):
            raise IndexError("one chunk at a time")
        return chunk[start - s:stop - s]


def _likely_cause(cfg: SplitConfig, comp: Comparison) -> str:
    if not comp.has_cache:
        return ("the model returned no cache at all: it is bidirectional (every token attends to later ones too, "
                "e.g. RoBERTa without is_decoder), so the prefix's keys and values change when the rest is added")
    causes = []
    if cfg.position_ids == "omit" and cfg.left_pad > 0:
        causes.append(f"the position ids were omitted, so the model numbered the new tokens from the cache length, "
                      f"counting the {cfg.left_pad} pad tokens: they sit {cfg.left_pad} places too far away")
    if cfg.attention_mask == "new-only":
        causes.append("the attention mask covered only the new tokens: transformers silently lines a short mask up "
                      "with the first (cached) positions and pads it with zeros, so the new tokens are blocked from "
                      "the latest keys, their own included" + (", and see pad tokens as text" if cfg.left_pad else ""))
    if not causes:
        causes.append("the cached path of this model does not compute what its full forward computes")
    return "; and ".join(causes)


def verdict_for(cfg: SplitConfig, main: Comparison, f64: Comparison | None, proved: bool | None = None,
                inv: Comparison | None = None, first: Finding | None = None, prefix: str = "model.layers"
                ) -> tuple[str, str]:
    """The verdict and its explanation; a precision explanation carries its proof state (kvviz.core.verdict): proved,
    not run, or unproved with the invariant gap and the bisector's first finding - never "rounding, not a bug"
    while the proof failed."""
    if not main.has_cache:
        change = main.bidirectional_change
        extra = f" Appending the rest moved the prefix's last hidden state by up to {change:.3g}." if change else ""
        return "logic", f"Logic, not rounding: {_likely_cause(cfg, main)}.{extra} Do not use past_key_values here."
    assert main.identical or f64 is not None, "a gap needs its float64 rerun"
    gap64 = f64.max_relative if f64 is not None else 0.0
    verdict = classify(main.identical, gap64)
    if verdict == Verdict.IDENTICAL:
        return "identical", ("Identical, bit for bit: with this prompt and split the cached run computes exactly what "
                             "the full forward computes.")
    gap = main.max_relative
    eps = machine_eps(getattr(torch, main.dtype))
    sentence = precision_sentence(gap64, proved, inv.max_abs if inv is not None else None, first, main.max_abs)
    if main.dtype == "float64":
        if verdict == Verdict.PRECISION:
            return "precision", (f"This run is float64, kvviz's reference precision: the gap is {gap:.3g} of the "
                                 f"value's size ({gap / eps:.3g}× its epsilon). {sentence}")
        return "logic", (f"Logic, not rounding: even in float64 (kvviz's reference precision) the gap is {gap:.3g} "
                         f"of the value's size. Likely cause: {_likely_cause(cfg, main)}.")
    if verdict == Verdict.PRECISION:
        amp = amplification([float(v) for v in main.hidden["relative"].max(axis=1)], prefix)
        return "precision", (
            f"In {main.dtype} the cached run multiplies matrices of other shapes, so numbers are added in another "
            f"order and round differently: the largest gap is {gap:.3g} of the value's size, {gap / eps:.3g}× the "
            f"dtype's epsilon ({eps:.3g}). Rerun in float64, the very same scenario "
            + (f"differs by only {gap64:.3g}" if gap64 else "gives exactly the same numbers both ways")
            + f". {sentence}" + (f" {amp}" if amp else ""))
    return "logic", (
        f"Logic, not rounding: the gap is {gap:.3g} of the value's size in {main.dtype} and still {gap64:.3g} in "
        f"float64, where rounding could explain at most ~1e-12. Likely cause: {_likely_cause(cfg, main)}.")


def proof_line(verdict: str, main: Comparison, inv: Comparison, settings: ExecSettings) -> str:
    """What the invariant run says about the verdict, in one line."""
    if settings.invariant:
        return ("This run is in invariant mode: every kernel computes each row the same way however many rows or "
                "keys it sees" + (", and the gap is exactly 0." if main.identical else
                                  f"; a gap of {main.max_abs:.3g} survives, so it is not reduction order."))
    if inv.identical:
        if verdict == Verdict.PRECISION:
            return (f"Precision — proved: in invariant mode (each row computed by the same kernel in the same order "
                    f"whatever the shape) the gap is exactly 0, against a largest absolute gap of {main.max_abs:.3g} "
                    f"(hidden-state units) in the normal run; "
                    f"reduction order alone made it.")
        return "In invariant mode the gap is exactly 0 as well."
    return (f"In invariant mode a gap of {inv.max_abs:.3g} survives (normal run: {main.max_abs:.3g}): not reduction "
            f"order alone" + (" — logic." if verdict == Verdict.LOGIC else " — the precision verdict is unproved."))


def _registry_bisector(lm: LoadedModel, cfg: SplitConfig, settings: ExecSettings):
    """The bisector reached through the registry (split never imports the bisect view, which imports split)."""
    return views.get("bisect").runner()(lm, cfg, RunContext(settings=settings))


def _bisect_first(lm: LoadedModel, cfg: SplitConfig, settings: ExecSettings,
                  bisector: Callable | None = None) -> Finding | None:
    """What the bisector finds first for this scenario, typed (a failed proof's explanation names it); None if
    nothing differs at module level or it fails. bisector(lm, cfg, settings) -> BisectResult: the registry's bisect
    view where not given."""
    try:
        inp = build_inputs(lm, cfg.prompt, cfg.left_pad)
        if not fits_beside(lm, "bisect", inp.total, inp.total - inp.pad - cfg.split):
            return None  # not planned with the split (its proof holds as a rule): run only where it fits now
        res = (bisector or _registry_bisector)(lm, cfg, settings)
    except Exception:  # noqa: BLE001 - an explanation aid only
        return None
    return res.finding()


# Where the bar's phases end without an estimate (each automatic phase as a multiple of the normal run's time)
DEFAULT_PHASE_COST = {"run": 1.0, "float64": 1.0, "proof": 2.0}


def _phase_ends(proof: bool, estimate: Estimate | None = None) -> tuple[float, float]:
    """Where the normal run and the float64 rerun end on the bar (the proof takes the rest): from the run's estimate
    (each phase's share of its seconds), else DEFAULT_PHASE_COST."""
    cost = dict(DEFAULT_PHASE_COST)
    if estimate is not None and estimate.seconds("run") > 0:
        cost = {k: estimate.seconds(k) or (v * estimate.seconds("run")) for k, v in cost.items()}
    total = cost["run"] + cost["float64"] + (cost["proof"] if proof else 0.0)
    return cost["run"] / total, (cost["run"] + cost["float64"]) / total


def run_split(lm: LoadedModel, cfg: SplitConfig, progress: Progress | None = None,
              reference: LoadedModel | None = None, float64_comparison: Comparison | None = None,
              settings: ExecSettings | None = None, prove: Prove = None, auto_proof: bool = True,
              estimate: Estimate | None = None, on_phase: Callable[[str], None] | None = None,
              bisector: Callable | None = None) -> SplitResult:
    """Compare the full forward with the cached path for `cfg`; rerun in float64 for the verdict if needed.

    reference: the float64 model to use for the verdict (lm.reference() when not given);
    float64_comparison: the same scenario already run in float64 (the dtype sweep runs it once for all dtypes);
    settings: how the model runs (cache kind, compile, flags, invariant mode); the float64 rerun uses the same
    settings without compile. prove: also run the scenario in invariant mode (default: when the verdict is
    precision), so a precision verdict comes with its proof (the gap is exactly 0 there). auto_proof: False, no
    automatic proof (prove=True still proves); estimate: the run's time estimate (each phase's share of the bar);
    on_phase(name): told as each phase starts ("run", "float64", "proof"); bisector: what names a failed proof's
    first differing module (the registry's bisect view where not given)."""
    progress = progress or no_progress
    settings = settings or DEFAULT_SETTINGS  # validated once, by its RunContext
    t0 = time.perf_counter()
    cfg.validate()
    inp = build_inputs(lm, cfg.prompt, cfg.left_pad)
    check_split(inp.n_tokens, cfg.split)
    # the bar's share of each phase from the run's estimate, the automatic proof included
    phase = on_phase or (lambda name: None)
    ends = _phase_ends(not settings.invariant and prove is not False and auto_proof, estimate)
    phase("run")
    main = _run(lm, cfg, inp, lambda f, m: progress(ends[0] * f, m), settings)
    f64 = None
    if main.has_cache and not main.identical:
        if lm.dtype == torch.float64:
            f64 = main
        elif float64_comparison is not None:
            f64 = float64_comparison
        else:
            phase("float64")
            progress(ends[0], "float64: rerunning the same scenario for the verdict…")
            ref_lm = reference or lm.reference()
            f64 = _run(ref_lm, cfg, build_inputs(ref_lm, cfg.prompt, cfg.left_pad),
                       lambda f, m: progress(ends[0] + (ends[1] - ends[0]) * f, f"float64: {m}"),
                       settings.with_(compile="off"))
    verdict, explanation = verdict_for(cfg, main, f64, prefix=layers_prefix(lm.model))
    if settings.lossy and verdict in (Verdict.PRECISION, Verdict.LOGIC) and not np.isfinite(main.max_abs):
        verdict, explanation = "lossy", (
            f"Lossy, and worse: with the {settings.cache} cache the cached run produced non-finite values (NaN or "
            f"inf) on {main.device}, so the quantized cache does not work for this model and device.")
    elif settings.lossy and verdict in (Verdict.PRECISION, Verdict.LOGIC):
        verdict, explanation = "lossy", (
            f"Lossy by design: the {settings.cache} cache stores keys and values quantized, so the cached run differs "
            f"from the full forward by up to {main.max_abs:.3g} (max KL {float(main.logits['kl'].max()):.3g}, next "
            f"token agrees at {int(main.logits['argmax_agree'].sum())}/{len(main.logits['argmax_agree'])} "
            f"positions). Not rounding of the usual kind and not a logic error: measure whether it matters.")
    inv, proof, proof_s = None, None, None
    if main.has_cache and (settings.invariant or (prove if prove is not None else verdict == Verdict.PRECISION
                                                  and auto_proof)):
        inv = main if settings.invariant else None
        if inv is None:
            phase("proof")
            progress(ends[1], "invariant proof: rerunning in invariant mode…")
            t_proof = time.perf_counter()
            inv = _run(lm, cfg, inp, lambda f, m: progress(ends[1] + (1 - ends[1]) * f, f"invariant proof: {m}"),
                       settings.with_(invariant=True, compile="off"))
            proof_s = time.perf_counter() - t_proof
        proof = proof_line(verdict, main, inv, settings)
        if verdict == Verdict.PRECISION and not settings.lossy:
            first = None if inv.identical else _bisect_first(lm, cfg, settings.with_(invariant=True, compile="off"),
                                                             bisector)
            verdict, explanation = verdict_for(cfg, main, f64, inv.identical, inv, first, layers_prefix(lm.model))
    progress(1.0, "Done")
    return SplitResult(settings=SplitSettings.of(cfg, RunInfo.of(lm, settings)), model=lm.summary(),
                       tokens=inp.token_texts, token_ids=inp.token_ids, compared=list(range(cfg.split, inp.n_tokens)),
                       layer_labels=layer_labels(lm.n_layers + 1, model_type(lm)), main=main, float64=f64,
                       verdict=verdict, explanation=explanation, notes=list(lm.warnings),
                       elapsed_s=time.perf_counter() - t0, invariant=inv, proof=proof, proof_s=proof_s)


def run(lm: LoadedModel, config: SplitConfig, ctx: RunContext = DEFAULT_CONTEXT) -> SplitResult:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    with ctx.running() as progress:
        f64 = ctx.float64_run.main if ctx.float64_run is not None else None  # a composing view's float64 run
        return run_split(lm, config, progress, reference=ctx.reference, float64_comparison=f64,
                         settings=ctx.settings, prove=ctx.prove, auto_proof=ctx.auto_proof, estimate=ctx.estimate,
                         on_phase=ctx.on_phase)
