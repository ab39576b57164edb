"""kvviz's one verdict rule and the words that go with it - used by every view (split, greedy, padding, reuse,
the cache-safety card, the backends matrix, the architecture sweep), so a verdict and its proof never contradict.

The rule: `identical` when the bits agree; else rerun the very same scenario in float64 and judge the gap relative
to the size of the values it is a gap in (max |Δ| / max |value|): a gap that closes to float64 rounding
(<= FLOAT64_CLOSED_REL) is `precision`, a gap that stays is `logic` (`classify`).

Where kvviz cannot rerun the scenario in float64 - an engine's own kernels (vLLM, llama.cpp, a server), judged by
kvviz.engines.verdict and the Engine layers view against a rounding bound measured on torch's kernels - the same
words by the same rule as far as the evidence goes (`classify_bounded`): `identical` when the bits agree; `logic`
only on evidence that survives precision (a gap beyond the bound that float64 does not close on either side, a token
the engine did not rank first, uniform log-probs, a margin rounding cannot cross); `undecided` past the heuristic
bound without such evidence (never logic: an engine's kernels may round more than torch's); else `precision`.

The proof of a precision verdict is the invariant-mode rerun (kvviz.core.invariant): a gap of exactly 0 there proves that
reduction order alone made the gap. The words:

* proved (invariant gap exactly 0): "Rounding, not a bug - proved";
* not run: "Rounding, not a bug by the numbers" (the float64 gap is rounding by the numbers) and "not proved";
* the proof failed (a gap survives invariant mode): never "rounding, not a bug" - "Precision, unproved", why, and
  what the bisector found first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from .naming import layer_label as _row_label, layer_module as _row_module

FLOAT64_CLOSED_REL = 1e-9  # float64 rounding gives ~1e-15 relative; a logic error gives far more than this
FLOAT64_EPS = 2.0 ** -52
AMPLIFIED_REL = 0.05  # a precision gap this large a fraction of the value: rounding was amplified on the way
ROUNDING_NOT_A_BUG = "Rounding, not a bug"


class Verdict(StrEnum):
    """A comparison's verdict. A str: it compares, prints and exports as its word ("precision"), so JSON results and
    old exports read the same."""
    IDENTICAL = "identical"
    PRECISION = "precision"
    LOGIC = "logic"
    # beyond a heuristic rounding bound with nothing that survives precision to call it logic (an engine's kernels
    # judged against a bound measured on torch's): not decided, and the sentence names the step that decides it
    UNDECIDED = "undecided"
    LOSSY = "lossy"  # a quantized cache or quantized weights: different numbers by design
    NONDETERMINISTIC = "nondeterministic"  # repeats of the same run differ (the backends matrix)


# Worst first: the one place the verdicts' order is written. A logic error outranks a gap not decided (it may be one),
# which outranks repeats that differ, which outrank rounding, which outranks a lossy-by-design difference, which
# outranks bit for bit identical.
SEVERITY = (Verdict.LOGIC, Verdict.UNDECIDED, Verdict.NONDETERMINISTIC, Verdict.PRECISION, Verdict.LOSSY,
            Verdict.IDENTICAL)
_RANK = {v: i for i, v in enumerate(SEVERITY)}


def severity(verdict) -> int:
    """0 for the worst verdict (logic), larger for better ones; a word that is no verdict ranks after them all."""
    return _RANK.get(verdict, len(SEVERITY))


def worst(verdicts, default: Verdict | None = None) -> Verdict | None:
    """The worst of `verdicts` (Verdicts or their words, in any order; words that are no verdict, such as "cannot
    run" or None, are skipped); `default` when none is a verdict."""
    known = [Verdict(v) for v in verdicts if v in _RANK]
    return min(known, key=_RANK.__getitem__) if known else default


class Tally(str):
    """A verdict line counting several verdicts ("logic: 1, precision: 3"): a str as before (it prints and exports as
    its text), with the worst of them typed beside it (`verdict`): what its box takes its colour from. Never parsed
    back from its text."""
    verdict: Verdict | None

    def __new__(cls, counts: dict) -> "Tally":
        self = super().__new__(cls, ", ".join(f"{v}: {n}" for v, n in sorted(counts.items())))
        self.verdict = worst(counts)
        return self


# Whether a run proves a precision verdict in invariant mode: True (always), False (never), None (when its verdict is
# precision - the default of the views that decide it themselves). One type for every view's `prove`.
Prove = bool | None


@dataclass(frozen=True)
class Finding:
    """What the bisector finds first: the module (its path, kind and 0-based decoder-layer index) and, where the op
    trace lines it up, the first torch op that differs with its input shapes. Split and the explanations read these
    fields; `describe()` is the one place they become words."""
    module: str  # "model.layers.1.self_attn"
    kind: str  # "attention output", "MLP down projection", ...
    layer: int | None  # 0-based decoder-layer index (None: outside the decoder layers)
    max_abs: float
    relative: float
    op: str | None = None  # "matmul", "softmax", ... (None: not traced, or no single op lines up)
    shapes: list = field(default_factory=list)  # the op's input shapes in the full forward

    def describe(self) -> str:
        """ "layer 2 (model.layers.1.self_attn), attention output: max |Δ| 0.0123 (0.001 of its size)" """
        from .naming import module_label

        what = ("the attention computation itself (scores, softmax, weighted sum - not a module of its own)"
                if self.kind.startswith("attention weights") else self.kind)
        return (f"{module_label(self.module)}, {what}: max |Δ| {self.max_abs:.3g} ({self.relative:.3g} of its "
                f"size)")


def classify(bitwise_equal: bool, float64_gap: float | None) -> Verdict:
    """`identical` when the bits agree; else a float64 gap (relative to the values' size) that closes is `precision`,
    one that stays is `logic`. Every verdict in kvviz comes from here."""
    if bitwise_equal:
        return Verdict.IDENTICAL
    if float64_gap is None or not math.isfinite(float64_gap):
        return Verdict.LOGIC
    return Verdict.PRECISION if float64_gap <= FLOAT64_CLOSED_REL else Verdict.LOGIC


def classify_bounded(bitwise_equal: bool, past_bound: bool, survives: bool) -> Verdict:
    """The rule where kvviz judges against a heuristic rounding bound instead of a float64 rerun (module
    docstring): identical when the bits agree; logic when evidence survives precision; undecided past the bound
    without it; else precision."""
    if bitwise_equal:
        return Verdict.IDENTICAL
    if survives:
        return Verdict.LOGIC
    return Verdict.UNDECIDED if past_bound else Verdict.PRECISION


def label(verdict: str, proved: bool | None = None) -> str:
    """A short table cell: "precision (proved)", "precision (unproved)", or the verdict itself."""
    if verdict != Verdict.PRECISION or proved is None:
        return verdict
    return f"precision ({'proved' if proved else 'unproved'})"


_HEADLINES = {
    Verdict.IDENTICAL: "Bit for bit the same both ways.",
    Verdict.LOGIC: "The two paths compute different things: a gap float64 does not close.",
    Verdict.UNDECIDED: "Beyond the rounding bound, but not decided: not shown to be a bug.",
    Verdict.LOSSY: "Different numbers by design (a quantized cache or weights).",
    Verdict.NONDETERMINISTIC: "Repeats of the very same run differ.",
}
UNKNOWN = object()  # `headline`'s proof state when the caller does not know it


def headline(verdict, proved=UNKNOWN) -> str:
    """The verdict in one sentence, for a room (presenter mode): from the verdict and its proof state, never cut
    out of an explanation's text."""
    if verdict == Verdict.PRECISION:
        if proved is UNKNOWN:
            return "Precision: the gap closes in float64."
        return {True: f"{ROUNDING_NOT_A_BUG} - proved.", None: f"{ROUNDING_NOT_A_BUG} by the numbers (not proved).",
                False: "Precision, unproved: a gap survives invariant mode."}[proved]
    return _HEADLINES.get(verdict, f"{str(verdict).capitalize()}.")


def precision_sentence(float64_gap: float, proved: bool | None, invariant_gap: float | None = None,
                       first: Finding | None = None, normal_gap: float | None = None) -> str:
    """The one sentence that says why a precision verdict is (or is not yet shown to be) rounding."""
    f64 = (f"float64 closes the gap to {float64_gap:.3g} of the value's size ({float64_gap / FLOAT64_EPS:.3g}× "
           f"float64's epsilon)" if float64_gap else "float64 gives exactly the same numbers both ways")
    if proved:
        return (f"{ROUNDING_NOT_A_BUG} - proved: in invariant mode (each row computed by the same kernel in the "
                f"same order whatever the shape) the gap is exactly 0"
                + (f", against a largest absolute gap of {normal_gap:.3g} (in the hidden state's own units) in the "
                   "normal run" if normal_gap else "")
                + f"; reduction order alone made it ({f64}).")
    if proved is None:
        return (f"{ROUNDING_NOT_A_BUG} by the numbers: {f64}, far below anything a logic error leaves "
                f"(<= {FLOAT64_CLOSED_REL:g}). Not proved: the invariant-mode rerun was not run.")
    inv = f"a gap of {invariant_gap:.3g}" if invariant_gap is not None else "a gap"
    return (f"Precision, unproved: {f64}, but in invariant mode {inv} survives"
            + (f" (normal run: {normal_gap:.3g})" if normal_gap is not None else "")
            + ", so reduction order alone does not explain it and this is not shown to be rounding. "
            + (f"The bisector finds first: {first.describe()}." if first else
               "Run the bisector to see where it starts."))


def _layer_label(index: int, prefix: str) -> str:
    """kvviz.core.naming's rule with the module path: "embeddings", "layer k (model.layers.{k-1})"."""
    return _row_label(index) if index == 0 else f"{_row_label(index)} ({_row_module(index, prefix)})"


def amplification(per_layer_rel: "list[float]", module_prefix: str = "model.layers") -> str | None:
    """When the gap is a large fraction of the value: one sentence saying rounding was amplified and where the gap
    jumps most (the hidden state whose relative gap grows by the largest factor over the one before it).
    per_layer_rel: the largest relative gap of each hidden state, embeddings first."""
    vals = [float(v) for v in per_layer_rel]
    if not vals or max(vals) < AMPLIFIED_REL:
        return None
    first_nonzero = next(i for i, v in enumerate(vals) if v > 0)
    top = max(range(len(vals)), key=lambda i: vals[i])
    # the jump that matters: the largest growth factor after the gap first appears (its first appearance is
    # "from 0", an infinite factor, which says where it starts rather than where it grows)
    growth = [(vals[i] / vals[i - 1], i) for i in range(first_nonzero + 1, len(vals)) if vals[i - 1] > 0]
    if growth:
        jump, best = max(growth)
    n = len(vals)
    name = lambda i: ("the output after the final norm" if i == n - 1 and i > 0  # noqa: E731
                      else _layer_label(i, module_prefix))
    where = (f"it grows most at {name(best)} (×{jump:.3g}, to {vals[best]:.3g} of the value's size)"
             if growth else f"it appears at {name(first_nonzero)}")
    return (f"Rounding was amplified: the gap starts at {name(first_nonzero)} ({vals[first_nonzero]:.3g} of the "
            f"value's size), {where}, and reaches {vals[top]:.3g} at {name(top)} - large activations and many layers "
            f"turn last-bit differences into a gap this size.")


def layers_prefix(model) -> str:
    """The module path of a model's decoder layers ("model.layers", "transformer.h", …): the longest ModuleList of
    blocks."""
    import torch

    best, size = "model.layers", 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > size and name.rsplit(".", 1)[-1] in (
                "layers", "h", "layer", "blocks", "decoder_layers"):
            best, size = name, len(mod)
    return best
