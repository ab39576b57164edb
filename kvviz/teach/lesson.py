"""The Lesson: precision-error accumulation step by step, each step one live computation on the real model.

Eight steps in the order a numerical-analysis course takes them: what a float is, non-associative sums, one row
alone vs inside a batch (the cached path in miniature, on the model's own weights), one layer's amplification, the
error by layer in float32/float16/bfloat16, when a gap changes the text (greedy parting at a near tie), the referee
(float64 closes the gap, invariant mode makes it 0), and a bug that float64 does not close (left padding without
position ids).

Every step is a pure function returning a `StepResult`: the question ("predict, then reveal"), its choices, which
choice the live numbers make right, the answer in words with those numbers, a one-paragraph explanation and the
numbers the figure draws (kvviz/teach/lesson_figures.py turns a result into its figure; the page and the HTML handout
show the same). Model calls go through kvviz.core.execution.Executor. No Streamlit here.
"""
from __future__ import annotations

import functools
import math
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch

from .. import views
from ..models.compat import output_cache
from ..core.dtypes import DTYPES, dtype_name, machine_eps, parse_dtype
from ..core.errors import KvvizError
from ..core.execution import ExecSettings, Executor
from ..core.inputs import build_inputs
from ..models.loading import LoadedModel
from ..core.metrics import hidden_divergence
from ..core.protocol import RunContext

LESSON_PROMPT = "The capital of France is Paris, and the capital of Italy is"
# The default model's own greedy text after "This is a ", cut just before a step where (on one 2-core x86 CPU, bfloat16)
# its cached and no-cache paths met a near tie and parted. Machine-dependent, so step 6 decodes a constructed case that
# parts on every machine (CONSTRUCTED) instead; kept for the one-click fixes' greedy settings.
GREEDY_PROMPT = "This is a 100% chance of being correct.\n\nThis is a fundamental concept"
SWEEP = ("float32", "float16", "bfloat16")  # the dtypes of the by-layer step
Models = Callable[[str], LoadedModel]  # dtype name -> the lesson's model in that dtype ("float64": its reference)


@dataclass
class StepResult:
    """One lesson step, computed: what the page and the handout show."""

    step: int
    title: str
    question: str
    choices: list[str]
    answer: int | None  # the choice the measured numbers make right (None: not observed on this run)
    reveal: str  # the answer, in words, with the measured numbers
    explanation: str  # one paragraph: why
    data: dict = field(default_factory=dict)  # the numbers the figure draws
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def is_right(self, choice: int | None) -> bool | None:
        """Whether a prediction matches the measured answer (None: no prediction, or this run cannot grade it)."""
        return None if choice is None or self.answer is None else choice == self.answer

    def graded(self, choice: int | None) -> str | None:
        """One line on a student's prediction: right, or what the numbers say instead (None: no prediction)."""
        if choice is None:
            return None
        if self.answer is None:
            return f"You predicted “{self.choices[choice]}”; this run cannot grade it (see the answer)."
        if self.is_right(choice):
            return f"Right: “{self.choices[choice]}”."
        return f"Not this time: you predicted “{self.choices[choice]}”, the numbers say “{self.choices[self.answer]}”."


TITLES = {
    1: "What a float is",
    2: "Addition is not associative",
    3: "One row alone vs inside a batch",
    4: "One layer: does it amplify the gap?",
    5: "The whole model: the gap by layer, in three dtypes",
    6: "When it changes the text: a near tie",
    7: "The referee: float64 and invariant mode",
    8: "A bug looks different",
}
STEPS = tuple(TITLES)


def _timed(fn):
    @functools.wraps(fn)
    def wrapper(*a, **k) -> StepResult:
        t0 = time.perf_counter()
        res = fn(*a, **k)
        res.elapsed_s = time.perf_counter() - t0
        return res
    return wrapper


# ------------------------------------------------------------------------------------------------------------------
# Step 1: what a float is

# (exponent bits, stored mantissa bits) of each format; the mantissa has one more, implicit, leading bit
LAYOUT = {"float64": (11, 52), "float32": (8, 23), "float16": (5, 10), "bfloat16": (8, 7)}
_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def bits_of(value: float, dtype: str) -> tuple[str, str, str]:
    """(sign, exponent, mantissa) bit strings of `value` rounded to `dtype`."""
    dt = parse_dtype(dtype)
    t = torch.tensor([value], dtype=dt)
    size = t.element_size()
    raw = int(t.view(_INT[size]).item()) & ((1 << (8 * size)) - 1)
    s = format(raw, f"0{8 * size}b")
    e, _ = LAYOUT[dtype_name(dt)]
    return s[0], s[1:1 + e], s[1 + e:]


def neighbours(value: float, dtype: str) -> tuple[float, float, float]:
    """(the next number below, `value` as stored, the next above) in `dtype`."""
    dt = parse_dtype(dtype)
    x = torch.tensor([value], dtype=dt)
    lo = torch.nextafter(x, torch.tensor([-math.inf], dtype=dt))
    hi = torch.nextafter(x, torch.tensor([math.inf], dtype=dt))
    return float(lo.item()), float(x.item()), float(hi.item())


def ulp(value: float, dtype: str) -> float:
    """The gap from `value` (as stored) to the next number away from zero: one unit in the last place there."""
    lo, x, hi = neighbours(abs(value), dtype)
    return hi - x


def _check_number(value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise KvvizError(f"not a number: {value!r}") from None
    if not math.isfinite(v):
        raise KvvizError("pick a finite number (inf and nan have no neighbours to show)")
    return v


@_timed
def step_float(value: float = 0.1, dtype: str = "bfloat16") -> StepResult:
    """Step 1: a number in a dtype: its neighbours, the ulp at its size, ε, the bit fields."""
    v = _check_number(value)
    name = dtype_name(parse_dtype(dtype))
    if abs(v) > float(torch.finfo(DTYPES[name]).max):
        raise KvvizError(f"{v:g} is larger than the largest {name} ({float(torch.finfo(DTYPES[name]).max):.4g})")
    lo, stored, hi = neighbours(v, name)
    eps = machine_eps(DTYPES[name])
    m_bits = LAYOUT[name][1]
    rows = {d: {"eps": machine_eps(DTYPES[d]), "ulp": ulp(v, d), "stored": neighbours(v, d)[1],
                "mantissa_bits": LAYOUT[d][1] + 1, "exponent_bits": LAYOUT[d][0]} for d in LAYOUT}
    order = ["float64", "float32", "float16", "bfloat16"]
    choices = [f"2^-{LAYOUT[d][1]} ≈ {machine_eps(DTYPES[d]):.3g}" for d in order]  # values only: no dtype names
    sign, exp, man = bits_of(v, name)
    rel = abs(stored - v) / abs(v) if v else 0.0
    reveal = (f"ε of {name} is 2^-{m_bits} = {eps:.6g}: {name} stores {m_bits} mantissa bits (plus one implicit "
              f"leading 1, so {m_bits + 1} bits of precision). Your number {v!r} is stored as {stored:.17g} "
              f"(off by {rel:.3g} of its size); its neighbours are {lo:.17g} and {hi:.17g}, one ulp = {hi - stored:.6g} "
              f"apart at this size. Bits: sign {sign} · exponent {exp} · mantissa {man}.")
    explanation = (
        "A float is a sign, an exponent and a mantissa: it can only hold numbers of the form ±1.m × 2^e. Between two "
        "powers of two the representable numbers are evenly spaced, one ulp (unit in the last place) apart, and "
        "ε = the ulp at 1.0 = 2^-(mantissa bits). Any result is rounded to the nearest representable number, so "
        "every operation can add an error of up to half an ulp: a relative error of ε/2. bfloat16 keeps float32's "
        "8 exponent bits (the same range, and a conversion that simply drops float32's low 16 bits) and pays with "
        "the mantissa: 7 stored bits, ε = 2^-7 ≈ 0.0078, so only 2-3 significant decimal digits. float16 spends more "
        "on the mantissa (ε = 2^-10) and has a far smaller range (largest 65504).")
    return StepResult(1, TITLES[1], f"What is ε (the gap between 1 and the next number up) in {name}?", choices,
                      order.index(name), reveal, explanation,
                      {"value": v, "dtype": name, "below": lo, "stored": stored, "above": hi, "ulp": hi - stored,
                       "eps": eps, "relative_error": rel, "bits": [sign, exp, man], "dtypes": rows})


# ------------------------------------------------------------------------------------------------------------------
# Step 2: sums in two orders


def sequential_sum(values: torch.Tensor) -> list[float]:
    """The running sums of `values` added one at a time, left to right, each sum rounded to the values' dtype."""
    s = torch.zeros((), dtype=values.dtype)
    out = []
    for x in values:
        s = s + x
        out.append(float(s))
    return out


def ulps_between(a: float, b: float, dtype: str) -> float:
    """|a - b| in units of the ulp at max(|a|, |b|) in `dtype` (a whole number for two numbers of that dtype in one
    binade)."""
    if a == b:
        return 0.0
    return abs(a - b) / ulp(max(abs(a), abs(b)), dtype)


@_timed
def step_sums(n: int = 1000, dtype: str = "float32", seed: int = 0, drift_value: float = 0.1,
              drift_n: int = 3000) -> StepResult:
    """Step 2: the same n numbers summed in several orders; a long sum of one value drifting in each dtype."""
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 20000:
        raise KvvizError(f"the count must be a whole number from 2 to 20000, not {n!r}")
    name = dtype_name(parse_dtype(dtype))
    dt = DTYPES[name]
    g = torch.Generator().manual_seed(int(seed))
    values = torch.randn(n, generator=g, dtype=torch.float64).to(dt)
    exact = math.fsum(float(x) for x in values)  # the exact sum of the stored values, rounded once to float64
    orders = {
        "left to right": values,
        "right to left": values.flip(0),
        "small to large": values[values.abs().argsort()],
        "large to small": values[values.abs().argsort(descending=True)],
    }
    sums = {k: sequential_sum(v)[-1] for k, v in orders.items()}
    sums["pairwise (torch.sum)"] = float(values.sum())
    fwd, bwd = sums["left to right"], sums["right to left"]
    diff = ulps_between(fwd, bwd, name)
    err = {k: abs(s - exact) / ulp(exact, name) for k, s in sums.items()}
    drift = {d: sequential_sum(torch.full((int(drift_n),), drift_value, dtype=DTYPES[d])) for d in SWEEP}
    stall = {d: next((i + 1 for i in range(1, len(r)) if r[i] == r[i - 1]), None) for d, r in drift.items()}
    answer = 0 if diff == 0 else (1 if diff <= 64 else 2)
    reveal = (f"Left to right the {n} numbers sum to {fwd:.9g}, right to left to {bwd:.9g}: "
              + ("bit for bit the same this time (try another seed or count)." if diff == 0 else
                 f"they differ by {diff:.0f} ulp{'s' if diff != 1 else ''} of {name}.")
              + f" The exact sum is {exact:.12g}; each order's error: "
              + ", ".join(f"{k} {e:.3g} ulp" for k, e in err.items()) + ". "
              + f"Adding {drift_value:g} {drift_n} times (exact {drift_value * drift_n:g}): "
              + "; ".join(f"{d} ends at {drift[d][-1]:.6g}" + (f" (stuck from addition {stall[d]} on)" if stall[d]
                                                                  else "") for d in SWEEP) + ".")
    explanation = (
        "Every addition rounds, and which roundings happen depends on the order: (a + b) + c and a + (b + c) are "
        "different computations in floating point. So the same numbers summed in another order end in different "
        f"low bits (here {diff:.0f} ulp apart: within the last {math.ceil(math.log2(diff + 1)) if diff else 0} bits) - neither "
        "is wrong, both are within the dtype's rounding of the exact sum. A long running "
        "sum drifts: once the sum is large, each small addend is rounded against the sum's ulp, and when the addend "
        "falls below half an ulp the sum stops growing at all (bfloat16 gets stuck early). Pairwise summation "
        "(what torch.sum does) keeps partial sums small and the error low. A matrix product is many such sums, and "
        "a kernel's choice of order is the whole story of the next steps.")
    return StepResult(2, TITLES[2], f"The same {n} random numbers summed left to right and right to left in {name}: "
                                    "what do you get?",
                      ["exactly the same result", "results that differ in their low bits (1 to 64 ulps)",
                       "results that differ a lot (more than 64 ulps)"], answer, reveal, explanation,
                      {"n": n, "dtype": name, "seed": int(seed), "sums": sums, "exact": exact, "diff_ulps": diff,
                       "error_ulps": err, "drift_value": drift_value, "drift_n": int(drift_n), "drift": drift,
                       "stall": stall, "ulp": ulp(exact, name)})


# ------------------------------------------------------------------------------------------------------------------
# Step 3: one row alone vs in a batch, on the model's own weights


def first_projection(lm: LoadedModel) -> tuple[str, torch.Tensor]:
    """The first linear layer that reads the hidden state (e.g. layer 0's q_proj): its name and weight [out, in]."""
    width = lm.model.get_input_embeddings().weight.shape[-1]
    for name, mod in lm.model.named_modules():
        if isinstance(mod, torch.nn.Linear) and mod.in_features == width and "embed" not in name:
            return name, mod.weight
    head = lm.model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear):
        return "lm_head", head.weight
    raise KvvizError(f"{lm.name} has no linear layer reading the hidden state to show this step with")


@_timed
def step_row_vs_batch(lm: LoadedModel, prompt: str = LESSON_PROMPT,
                      dtypes: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")) -> StepResult:
    """Step 3: the prompt's last embedding row times a real weight matrix, alone and inside the batch of all rows."""
    inp = build_inputs(lm, prompt)
    if inp.n_tokens < 2:
        raise KvvizError("the prompt needs at least 2 tokens for a batch")
    name, weight = first_projection(lm)
    with lm.lock, torch.inference_mode():
        rows64 = lm.model.get_input_embeddings()(inp.ids)[0].to(torch.float64)
        w64 = weight.to(torch.float64)
        per = {}
        for d in dtypes:
            dt = DTYPES[d]
            x, w = rows64.to(lm.device, dt), w64.to(lm.device, dt)
            batch = torch.nn.functional.linear(x, w)[-1]
            alone = torch.nn.functional.linear(x[-1:], w)[0]
            a, b = batch.double().cpu(), alone.double().cpu()
            spacing = (torch.nextafter(batch.abs(), torch.tensor(math.inf, dtype=dt, device=batch.device))
                       - batch.abs()).double().cpu()
            units = ((a - b).abs() / spacing).numpy()
            hist = {"0": int((units == 0).sum()), "1": int((units == 1).sum()), "2": int((units == 2).sum()),
                    "3+": int((units > 2).sum())}
            worst = int(units.argmax())
            top = float(a.abs().max())
            per[d] = {"differ": int((a != b).sum()), "total": int(a.numel()), "max_abs": float((a - b).abs().max()),
                      "max_ulps": float(units.max()), "ulps": hist,
                      # the output with the most ulps: its size against the largest output's (small: a sum that
                      # cancelled, whose own ulp is tiny), and the gap in ulps of the largest output (the scale)
                      "worst_size": float(a[worst].abs()) / top if top else 0.0,
                      "ulps_of_largest": float((a - b).abs().max()) / ulp(top, d) if top else 0.0}
    ref = "float32" if "float32" in per else dtypes[0]
    frac = per[ref]["differ"] / per[ref]["total"]
    answer = 0 if per[ref]["differ"] == 0 else (1 if frac < 0.1 else 2)
    rows, cols = inp.total, weight.shape[0]
    reveal = (f"{name} ({cols} outputs) applied to the last of the prompt's {rows} embedding rows, alone (a 1-row "
              f"product) vs inside the {rows}-row batch: "
              + "; ".join(f"{d}: {p['differ']} of {p['total']} outputs differ (at most {p['max_ulps']:.0f} ulp of "
                          f"the output itself)" for d, p in per.items()) + ". " + _ulp_words(per))
    explanation = (
        "The same row times the same matrix should give the same numbers - in exact arithmetic. But a CPU or GPU "
        "library picks its kernel by the shape it sees: a single row (a matrix-vector product) and a block of rows "
        "(a matrix-matrix product) are split into different tiles and summed in a different order, and step 2 showed "
        "what that does. This is exactly the cached path: after the prompt is cached, each new token goes through "
        "every layer as a 1-row product, while the full forward computes that token inside a block of all rows. "
        "Each output's rounding error is a few ulps of the terms it adds up, so counted in ulps of the output "
        "itself it looks large where the terms nearly cancel (a small output has a small ulp); counted at the scale "
        "of the largest output it is a last bit or few. Whether it shows depends on the dtype: a 16-bit product is "
        "usually accumulated in float32 and then rounded, which can hide (or, rarely, round up) a float32 difference; "
        "float64 kernels here may happen to sum in one order. Which dtype shows most is a property of this machine's "
        "kernels - the numbers on this page were measured here.")
    return StepResult(3, TITLES[3], f"In float32, the last row of the prompt's embeddings times the model's {name} "
                                    f"weights, alone vs inside the batch of all {rows} rows: how many of the {cols} "
                                    "outputs differ?",
                      ["none", "a few (under 10%)", "many (10% or more)"], answer, reveal, explanation,
                      {"module": name, "rows": rows, "outputs": cols, "dtypes": per})


def _ulp_words(per: dict) -> str:
    """Step 3's sizes in words, from its numbers: how many differing outputs are within 2 ulp, and the largest count
    beside the size of that output and the gap in ulps of the largest output."""
    out = []
    for d, p in per.items():
        if not p["differ"]:
            continue
        near = p["ulps"]["1"] + p["ulps"]["2"]
        line = f"{d}: {near} of the {p['differ']} differing outputs are 1-2 ulp apart"
        if p["max_ulps"] > 2:
            line += (f"; the largest, {p['max_ulps']:.0f} ulp, is at an output {p['worst_size']:.2g} the size of the largest "
                     f"(a sum that nearly cancelled), and measured in ulps of the largest output every gap is at most "
                     f"{p['ulps_of_largest']:.2g} ulp")
        out.append(line)
    return ("How far apart: " + "; ".join(out) + ".") if out else "Every dtype gave bit for bit the same outputs."


# ------------------------------------------------------------------------------------------------------------------
# Steps 4, 5, 7, 8: the cached path vs the full forward, layer by layer


@dataclass
class Gaps:
    """Cached vs full, per hidden state (embeddings first): the relative gap max |Δ| / max |x| over the compared
    positions, the full forward's rows (for the format's own error against float64) and the logits' gap."""

    dtype: str
    labels: list[str]
    relative: list[float]  # per hidden state, the largest over the compared positions
    max_abs: float
    logits_relative: float
    full_rows: torch.Tensor  # [n_hidden, n_rest, H] float64, on the CPU: the full forward's compared rows


_MEMO: "OrderedDict[tuple, Gaps]" = OrderedDict()  # steps 4, 5 and 7 share runs: a lesson walk pays each once
_MEMO_SIZE = 24
_MEMO_LOCK = threading.Lock()


def clear_memo() -> None:
    _MEMO.clear()


def cached_vs_full(lm: LoadedModel, prompt: str = LESSON_PROMPT, n_rest: int = 2, left_pad: int = 0,
                   positions: str = "auto", invariant: bool = False) -> Gaps:
    """The prompt's last `n_rest` tokens fed one by one through the cache of the rest vs one full forward, with
    the position ids given ("auto") or left out ("omit"); optionally in invariant mode. The same run asked again
    (another step of the lesson) is answered from a small memo."""
    key = (id(lm), lm.name, dtype_name(lm.dtype), str(lm.device), prompt, n_rest, left_pad, positions, invariant)
    with _MEMO_LOCK:
        if key in _MEMO:
            _MEMO.move_to_end(key)
            return _MEMO[key]
    g = _cached_vs_full(lm, prompt, n_rest, left_pad, positions, invariant)
    with _MEMO_LOCK:
        _MEMO[key] = g
        while len(_MEMO) > _MEMO_SIZE:
            _MEMO.popitem(last=False)
    return g


def _cached_vs_full(lm: LoadedModel, prompt: str, n_rest: int, left_pad: int, positions: str,
                    invariant: bool) -> Gaps:
    from ..models.compat import takes_logits_to_keep

    inp = build_inputs(lm, prompt, left_pad)
    if inp.n_tokens < n_rest + 1:
        raise KvvizError(f"the prompt needs more than {n_rest} tokens (it has {inp.n_tokens})")
    a0 = inp.total - n_rest
    ex = Executor(lm, ExecSettings(invariant=invariant), max_len=inp.total)
    with ex.session():
        keep = takes_logits_to_keep(lm.model)  # only the compared rows' logits (the vocabulary is the costly part)
        full = ex.forward(inp.ids, inp.mask, inp.positions, use_cache=False, hidden=True,
                          logits_to_keep=n_rest if keep else None)
        ref = torch.stack([h[0, a0:] for h in full.hidden_states]).double()
        ref_logits = full.logits[0, -n_rest:].double()
        del full
        pre = ex.forward(inp.ids[:, :a0], inp.mask[:, :a0], inp.positions[:, :a0], hidden=False,
                         logits_to_keep=1 if keep else None)
        cache = output_cache(pre)
        if cache is None:
            raise KvvizError(f"{lm.name} returns no cache (a bidirectional model): this step needs a causal model")
        got_h, got_l = [], []
        pos_of = (lambda s, e: inp.positions[:, a0 + s:a0 + e]) if positions == "auto" else None
        for _, _, out in ex.feed(inp.ids[:, a0:], cache, one_by_one=True, mask_of=lambda s, e: inp.mask[:, :a0 + e],
                                 positions_of=pos_of):
            got_h.append(torch.stack([h[0, -1] for h in out.hidden_states]).double())
            got_l.append(out.logits[0, -1].double())
    got = torch.stack(got_h, 1)
    hd = hidden_divergence(ref, got, machine_eps(lm.dtype))
    dl = (torch.stack(got_l) - ref_logits).abs()
    from ..core.naming import layer_labels, model_type

    labels = layer_labels(ref.shape[0], model_type(lm))
    return Gaps(dtype_name(lm.dtype), labels, hd["relative"].amax(-1).cpu().tolist(),
                float(hd["max_abs"].max()), float(dl.max() / ref_logits.abs().max()), ref.cpu())


def format_error(g: Gaps, g64: Gaps) -> list[float]:
    """The full forward's own rounding against float64, per hidden state: max |Δ| / max |x| over the rows."""
    d = hidden_divergence(g64.full_rows, g.full_rows, 1.0)
    return d["relative"].amax(-1).tolist()


def _growth(rel: list[float]) -> list[float | None]:
    """Per hidden state after the embeddings: gap leaving / gap entering (None when nothing entered)."""
    return [None if rel[i - 1] == 0 else rel[i] / rel[i - 1] for i in range(1, len(rel))]


@_timed
def step_one_layer(models: Models, prompt: str = LESSON_PROMPT, layer: int | None = None,
                   dtype: str = "bfloat16", n_rest: int = 2) -> StepResult:
    """Step 4: the cached-vs-full gap entering and leaving one decoder layer, and that layer's growth factor."""
    name = dtype_name(parse_dtype(dtype))
    g = cached_vs_full(models(name), prompt, n_rest)
    rel, growth = g.relative, _growth(g.relative)
    n_layers = len(rel) - 1
    if layer is None:  # the middle layer with a gap entering it
        cands = [i for i in range(1, n_layers + 1) if rel[i - 1] > 0]
        layer = cands[len(cands) // 2] if cands else max(1, n_layers // 2)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= n_layers:
        raise KvvizError(f"pick a layer from 1 to {n_layers}, not {layer!r}")
    g_in, g_out = rel[layer - 1], rel[layer]
    f = growth[layer - 1]
    if f is None:
        answer = None
        what = (f"no gap entered layer {layer} (the hidden states were bit for bit equal), and "
                + (f"it left with {g_out:.3g}: the gap is born in this layer." if g_out else "none left it either."))
    else:
        answer = 0 if f < 0.5 else (1 if f <= 2 else 2)
        what = f"the gap entered layer {layer} at {g_in:.3g} and left it at {g_out:.3g}: a factor ×{f:.3g}."
    finite = [x for x in growth if x is not None]
    reveal = (f"In {name}, comparing the cached run (the last {n_rest} tokens fed through the cache) with the full "
              f"forward, {what} Over all {n_layers} hidden states after the embeddings the factor ranges from "
              + (f"×{min(finite):.3g} to ×{max(finite):.3g}" if finite else "- (no gap anywhere)")
              + (f"; overall the gap grows from {next((r for r in rel if r), 0):.3g} where it appears to "
                 f"{rel[-1]:.3g} at the output." if finite else "."))
    explanation = (
        "A layer does not only add its own rounding; it also transforms the gap it receives. Attention and the MLP "
        "multiply the hidden state by weight matrices whose largest stretching factor can exceed 1, the nonlinearity "
        "can sit on a steep part of its curve, and RMSNorm divides by the state's size, so a gap can grow or shrink on "
        "its way through. The growth factor of a layer is (relative gap leaving) / (relative gap entering): above 1 it "
        "amplifies, below 1 it damps. The residual connection keeps the old state in the sum, so most factors stay "
        "near 1 and the gap creeps up layer by layer rather than exploding - until a near tie somewhere turns it "
        "into a different word (step 6).")
    return StepResult(4, TITLES[4], f"In {name}, a gap between the cached and the full hidden state enters layer "
                                    f"{layer}. Leaving the layer, is it…",
                      ["smaller (damped below ×0.5)", "about the same (×0.5 to ×2)", "larger (amplified above ×2)"],
                      answer, reveal, explanation,
                      {"dtype": name, "layer": layer, "labels": g.labels, "relative": rel, "growth": growth,
                       "gap_in": g_in, "gap_out": g_out, "factor": f})


@_timed
def step_layers(models: Models, prompt: str = LESSON_PROMPT, n_rest: int = 2,
                dtypes: tuple[str, ...] = SWEEP) -> StepResult:
    """Step 5: the cached-vs-full gap by layer in each dtype, with each dtype's ε and its own error vs float64."""
    g64 = cached_vs_full(models("float64"), prompt, n_rest)
    per = {}
    for d in dtypes:
        g = cached_vs_full(models(d), prompt, n_rest)
        per[d] = {"relative": g.relative, "format_error": format_error(g, g64), "eps": machine_eps(DTYPES[d]),
                  "max_abs": g.max_abs, "logits_relative": g.logits_relative}
    last = {d: p["relative"][-1] for d, p in per.items()}
    worst = max(last, key=last.get)
    answer = list(dtypes).index(worst) if last[worst] > 0 else None
    in_eps = {d: p["relative"][-1] / p["eps"] for d, p in per.items()}
    reveal = ("At the output (after the final norm) the cached-vs-full gap is "
              + ", ".join(f"{d} {last[d]:.3g} ({in_eps[d]:.3g} ε)" for d in dtypes)
              + f": the largest is {worst}." + (" " if last[worst] > 0 else " (no gap at all in any dtype here.) ")
              + "Each dtype's own rounding against float64 (the dotted lines) ends at "
              + ", ".join(f"{d} {per[d]['format_error'][-1]:.3g}" for d in dtypes)
              + f"; in float64 the cached run differs by {g64.relative[-1]:.3g}.")
    explanation = (
        "Each line is one row of Split point's heatmap summarised: the largest relative gap of each hidden state, "
        "from the embeddings (identical: the same token ids) to the output. The dashed horizontal lines are each "
        "dtype's ε: a gap of a few ε is a few roundings. The gap appears in the first layers and then grows slowly "
        "with depth as roundings accumulate and layers pass them on; its size tracks the dtype's ε, so bfloat16 "
        "(ε = 2^-7) sits about 2^16 above float32 (ε = 2^-23). The dotted lines are each dtype's full forward against "
        "float64: the error the format itself makes. The cached-vs-full gap is of the same size - it is the "
        "difference between two equally good roundings of the same exact computation, not a defect of the cache.")
    return StepResult(5, TITLES[5], "Which dtype ends with the largest gap between the cached run and the full "
                                    "forward at the model's output?", list(dtypes), answer, reveal, explanation,
                      {"labels": g64.labels, "dtypes": per, "float64": g64.relative})


def _greedy_run(lm: LoadedModel, prompt: str, n: int, fast: bool) -> dict:
    """Greedy with and without cache, stopped where they part: the numbers step 6 draws."""
    from ..views import greedy

    res = views.run(greedy.VIEW, lm, greedy.GreedyConfig(prompt, int(n), paths=("cache", "no_cache"), fast=fast,
                                                         stop_at_divergence=True), RunContext(prove=False))
    pair = res.pairs[0]
    nc, ca = res.paths["no_cache"], res.paths["cache"]
    steps = min(len(nc.margins), len(pair.max_abs_logit))
    tok = {pair.a: pair.a_token, pair.b: pair.b_token}
    return {"model": lm.name, "dtype": res.settings.dtype, "prompt": prompt, "n": int(n), "fast": fast,
            "parting": pair.first_divergence, "margins": nc.margins[:steps], "gaps": pair.max_abs_logit[:steps],
            "tokens": nc.tokens[:steps], "cache_tokens": ca.tokens[:steps], "no_cache_text": nc.text,
            "cache_text": ca.text, "no_cache_token": tok.get("no_cache"), "cache_token": tok.get("cache"),
            "float64_gap": pair.float64_gap, "verdict": pair.verdict, "near_tie": pair.near_tie,
            "logit_scale": pair.logit_scale, "settled": nc.settled[:steps] if nc.settled else None}


def _no_flip_words(d: dict) -> str:
    """Why the paths did not part, from the run's numbers: a margin within the logits' gap is needed, not enough."""
    m, g = d["margins"], d["gaps"]
    if not m:
        return "no steps were decoded."
    i = int(np.argmin(m))
    close = sum(1 for a, b in zip(m, g) if 0 < b and a <= b)  # a gap that could flip the choice, and a margin in it
    words = (f"the smallest top-2 margin was {m[i]:.3g} at step {i}" + (" (an exact tie)" if m[i] == 0 else "")
             + (f", where the two paths' logits differed by up to {g[i]:.3g}. " if g[i] else
                ", where the two paths' logits were bit for bit equal. "))
    if close:
        return words + (f"{close} of {len(m)} steps had a margin within that gap, yet the top two tokens' own "
                        "logits never swapped: the largest difference fell on other tokens of the vocabulary, "
                        "and a flip needs it on the two tied ones.")
    if not any(g):
        return words + ("The two paths' logits were bit for bit equal at every step, so even an exact tie is broken "
                        "the same way on both: rounding had nothing to flip.")
    return words + "At every step the margin was larger than the gap, so no rounding could flip the choice."


CONSTRUCTED = "tiny:flip"  # a tiny Mamba whose cached and no-cache greedy paths part in bfloat16 (kvviz/models/tiny.py)
CONSTRUCTED_PROMPT = "Once upon a time"


def _flip_lens(lm: LoadedModel, prompt: str, d: dict) -> dict | None:
    """The logit lens (the lens view, through the run protocol) of the step where the two greedy paths part: the
    prompt prefilled into the cache, the agreed tokens after it one per forward, as greedy's cached path ran them.
    At the parting position, per hidden state: each path's lens top-1, runner-up and margin; the decision depth (the
    first layer whose top-1 differ) and the last layer from which they differ to the output. None where the agreed
    tokens do not re-tokenise to the same ids (the scenario would not be the decoded one)."""
    from ..views import lens
    from ..views.lens.run import LensConfig

    t = d["parting"]
    text = prompt + "".join(d["tokens"][:t])
    n_prompt = len(lm.tokenizer(prompt)["input_ids"])
    if t < 1 or len(lm.tokenizer(text)["input_ids"]) != n_prompt + t:
        return None
    res = views.run(lens.VIEW, lm, LensConfig(prompt=text, split=n_prompt, mode="step"), RunContext())
    j = len(res.compared) - 1  # the parting position: the last one
    side = {k: {"top1": [res.token(r[j]) for r in getattr(res.main, k)["top1"]],
                "top2": [res.token(r[j]) for r in getattr(res.main, k)["top2"]],
                "margin": [float(r[j]) for r in getattr(res.main, k)["margin"]]} for k in ("full", "cached")}
    differ = [a != b for a, b in zip(side["full"]["top1"], side["cached"]["top1"])]
    depth = differ.index(True) if any(differ) else None
    stays = len(differ)
    while stays > 0 and differ[stays - 1]:
        stays -= 1
    return {"labels": res.layer_labels, "n_layers": lm.n_layers, "position": res.compared[j], **side,
            "kl": [float(r[j]) for r in res.main.kl], "depth": depth, "apart_from": stays if stays < len(differ)
            else None, "verdict": res.verdict}


def _lens_words(v: dict) -> str:
    """One sentence on the lens of the parting step, from its numbers."""
    k = v["depth"]
    if k is None:
        return (" The logit lens of that step (each layer's hidden state through the final norm and head) ranks the "
                "same token first on both paths at every layer: only the model's own head parts them.")
    f, c = ({key: v[s][key][k] for key in ("top1", "top2", "margin")} for s in ("full", "cached"))
    later = ("and they stay apart to the output" if v["apart_from"] == k else
             f"then agree again and part for good from {v['labels'][v['apart_from']]}"
             if v["apart_from"] is not None else "and they agree again at the output")
    return (f" The logit lens of that step (each layer's hidden state through the final norm and head) decides it at "
            f"{v['labels'][k]} of {v['n_layers']}: there the full forward already ranks {f['top1']!r} "
            f"{f['margin']:.3g} over {f['top2']!r} and the cached path {c['top1']!r} {c['margin']:.3g} over "
            f"{c['top2']!r}, {later}.")


@_timed
def step_greedy(lm: LoadedModel, prompt: str = CONSTRUCTED_PROMPT, n: int = 6, fast: bool = False) -> StepResult:
    """Step 6: greedy decoding with and without cache; where they part, the top-2 margin there against the gap.
    Where a real model meets a near tie depends on the machine's kernels, so the step always decodes the constructed
    tiny:flip in bfloat16 (on `lm`'s device): its paths part at step 1 on every machine, by one rounding that
    transformers' own code makes in the cached step only. Every sentence's numbers come from the run."""
    from ..models.loading import load_model
    from ..models.tiny import FLIP_BUILT

    flip = load_model(CONSTRUCTED, "bfloat16", lm.device)
    d = _greedy_run(flip, prompt, max(2, int(n)), fast)
    d["constructed"] = True
    d["flip_lens"] = _flip_lens(flip, prompt, d) if d["parting"] is not None else None
    t = d["parting"]
    if t is None:  # the construction parts at step 1 on every machine: only a broken build gets here
        answer, reveal = None, f"In {d['dtype']} the two paths chose the same {len(d['margins'])} tokens: " \
                               + _no_flip_words(d)
    else:
        m, g, scale = d["margins"][t], d["gaps"][t], d["logit_scale"]
        answer = 1 if m <= g else 0
        reveal = (f"On {d['model']} in {d['dtype']} the paths part at step {t}: no cache chose "
                  f"{d['no_cache_token']!r}, the cache {d['cache_token']!r}. The top-2 margin there was {m:.3g} and "
                  f"the two runs' logits differed by up to {g:.3g}: "
                  + ("the margin was within the gap" if m <= g else "the margin was larger than the gap")
                  + (f", a near tie (under 1% of the largest logit, {scale:.3g})" if d["near_tie"] else
                     f", not a near tie (the largest logit was {scale:.3g})")
                  + (f"; replayed in float64 on the same tokens the two differ by {d['float64_gap']:.3g}: "
                     f"{d['verdict']}" if d["float64_gap"] is not None else "") + "."
                  + (_lens_words(d["flip_lens"]) if d["flip_lens"] else ""))
    explanation = (
        FLIP_BUILT + " Greedy decoding takes the top logit, so a last-bit difference changes the text only where the "
        "top two are nearly tied, and from then on the two texts are fed different tokens and part for good. A real "
        "model meets such a tie in a long 16-bit generation, where the gap comes from kernels that sum in another "
        "order (transformers#25420: precision, not a bug).")
    return StepResult(6, TITLES[6], "When the cached and the no-cache greedy paths choose different tokens, what was "
                                    "the top-2 margin at that step?",
                      ["large: a confident choice, far above the gap between the runs",
                       "within the gap between the runs: a near tie"], answer, reveal, explanation, d)


@_timed
def step_referee(models: Models, prompt: str = LESSON_PROMPT, dtype: str = "float32", n_rest: int = 2) -> StepResult:
    """Step 7: the same scenario in the dtype, in float64, and in invariant mode."""
    name = dtype_name(parse_dtype(dtype))
    normal = cached_vs_full(models(name), prompt, n_rest)
    f64 = cached_vs_full(models("float64"), prompt, n_rest)
    inv = cached_vs_full(models(name), prompt, n_rest, invariant=True)
    a, b, c = max(normal.relative), max(f64.relative), max(inv.relative)
    # the choice these numbers make right; none when they fit no choice (said in the reveal, never graded)
    if a == 0:
        answer = None
    elif b == 0 and c == 0:
        answer = 2
    elif c == 0 and b < a * 1e-6:
        answer = 1
    elif b > a * 0.1 and c > a * 0.1:
        answer = 0
    else:
        answer = None
    reveal = (f"The largest relative gap in {name}: {a:.3g}. The very same scenario in float64: {b:.3g}"
              + (f" ({a / b:.2g}× smaller)" if b else " (exactly 0)")
              + f". In invariant mode, still {name}: " + ("exactly 0 on every layer." if c == 0 else f"{c:.3g}.")
              + (" Both point the same way: precision." if answer == 1 else "")
              + (" Invariant mode did not make the two runs' arithmetic the same on this run, so it proves nothing "
                 "here; float64 alone says precision." if a and c and b < a * 1e-6 else ""))
    explanation = (
        "How do we know a gap is rounding and not a bug? Two referees. float64: the same computation with 52 "
        "mantissa bits instead of 7 or 23 - rounding errors shrink by many orders of magnitude (to ~1e-16), while a "
        "logic error (a wrong position, a wrong mask) does not care about the dtype and stays. Invariant mode goes "
        "further: every kernel computes each row the same way, in the same order, whatever the shape (one row or "
        "many, a short key range or a long one). Then the cached run and the full forward do literally the same "
        "arithmetic on every number, and a precision gap becomes exactly 0, in the same dtype: the proof that "
        "reduction order alone made it. kvviz uses this rule for every verdict.")
    return StepResult(7, TITLES[7], f"The cached-vs-full gap in {name} is rerun (a) in float64 and (b) in invariant "
                                    f"mode, still in {name}. What happens?",
                      ["the gap stays about the same in both", "float64 shrinks it by orders of magnitude; invariant "
                       "mode makes it exactly 0", "both make it exactly 0"], answer, reveal, explanation,
                      {"dtype": name, "labels": normal.labels, "normal": normal.relative, "float64": f64.relative,
                       "invariant": inv.relative, "max": {"normal": a, "float64": b, "invariant": c}})


@_timed
def step_bug(models: Models, prompt: str = LESSON_PROMPT, left_pad: int = 3, dtype: str = "float32",
             n_rest: int = 2) -> StepResult:
    """Step 8: a left-padded prompt, the cached tokens fed without position ids: the gap stays in float64."""
    if isinstance(left_pad, bool) or not isinstance(left_pad, int) or not 1 <= left_pad <= 64:
        raise KvvizError(f"left padding must be 1 to 64 pad tokens for this step, not {left_pad!r}")
    name = dtype_name(parse_dtype(dtype))
    rows = {}
    for label, pos in (("position ids given", "auto"), ("position ids omitted", "omit")):
        for d in (name, "float64"):
            g = cached_vs_full(models(d), prompt, n_rest, left_pad=left_pad, positions=pos)
            rows[(label, d)] = {"hidden": max(g.relative), "logits": g.logits_relative}
    bug64 = rows[("position ids omitted", "float64")]["hidden"]
    ok64 = rows[("position ids given", "float64")]["hidden"]
    answer = 1 if bug64 > 1e-9 else 0
    reveal = (f"With {left_pad} pad tokens and the position ids omitted, the gap is "
              f"{rows[('position ids omitted', name)]['hidden']:.3g} in {name} and still {bug64:.3g} in float64 "
              + ("- it does not close: logic." if answer else "- it closes.")
              + f" With the position ids given it is {rows[('position ids given', name)]['hidden']:.3g} in {name} "
                f"and {ok64:.3g} in float64: precision.")
    explanation = (
        "Left padding puts pad tokens before the prompt (batches of prompts of different lengths need it). "
        "generate() numbers the real tokens from 0 by the attention mask; a hand-written loop that leaves the "
        "position ids out lets the model count from the cache length instead, pads included, so every new token "
        "sits left_pad places too far from the ones before it (with rotary embeddings the attention scores depend "
        "on that distance). That is a different function, not a different rounding of the same one: float64 "
        "computes the wrong function very precisely, and the gap stays. This is how kvviz tells a bug from "
        "rounding: rerun in float64; a gap that closes is precision, a gap that stays is logic.")
    return StepResult(8, TITLES[8], f"The prompt is left-padded with {left_pad} pad tokens and the cached tokens are "
                                    "fed without position ids. Rerun in float64: does the gap close?",
                      ["yes: it shrinks to rounding size (~1e-16)", "no: it stays about as large"], answer, reveal,
                      explanation,
                      {"dtype": name, "left_pad": left_pad,
                       "rows": [{"scenario": k[0], "dtype": k[1], **v} for k, v in rows.items()]})


# ------------------------------------------------------------------------------------------------------------------
# The whole lesson


def model_loader(spec="default", device: str = "cpu", attn: str = "auto", trust_remote_code: bool = False,
                 progress: Callable[[float, str], None] | None = None) -> Models:
    """dtype -> the lesson's model in that dtype (loaded once each, kvviz's model cache); "float64": the float32
    model's float64 reference."""
    from ..models.loading import load_model

    def get(dtype: str) -> LoadedModel:
        if dtype == "float64":
            return get("float32").reference()
        return load_model(spec, dtype, device, attn, trust_remote_code=trust_remote_code, progress=progress)
    return get


def run_step(step: int, models: Models, **options) -> StepResult:
    """Step `step` (1-8) with its options (each step's keyword arguments), on `models`."""
    if step in (1, 2):  # no model
        return (step_float, step_sums)[step - 1](**options)
    if step == 3:
        return step_row_vs_batch(models("float32"), **options)
    if step == 6:
        return step_greedy(models(options.pop("dtype", "bfloat16")), **options)
    if step in (4, 5, 7, 8):
        return {4: step_one_layer, 5: step_layers, 7: step_referee, 8: step_bug}[step](models, **options)
    raise KvvizError(f"the lesson has steps 1 to {len(STEPS)}, not {step!r}")
