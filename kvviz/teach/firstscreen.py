"""Why a page's first screen shows no difference, in one sentence, and which one setting would show one (every
page's default run shows a difference or says in its verdict line why there is none here). Pure: results in,
words out; the pages turn a fix into their one-click button."""
from __future__ import annotations

import numpy as np

from ..core.verdict import Verdict, worst as worst_of
from ..core.naming import layer_label, module_index


def split_identical_why(res, invariant: bool = False) -> tuple[str, str | None]:
    """(why, fix) for a Split point result that is bit for bit identical; fix: "step" (feed the rest token by
    token) or "bfloat16" (switch the dtype) or None. ("", None) when there is a gap or no gap is expected."""
    s = res.settings
    if res.verdict != "identical" or invariant or s.dtype == "float64":
        return "", None
    if s.mode == "chunk":
        return (f"Why nothing here: the rest went through the cache as one chunk of {len(res.compared)} rows, so both "
                f"runs were multi-row matrix products, and on {s.device} this machine's kernels summed every row in "
                "the same order for both shapes. Generation feeds one token at a time - a 1-row product, another "
                "kernel - and that is where the last bits differ.", "step")
    if s.dtype != "bfloat16":
        return (f"Why nothing here: on {s.device} even the 1-row products gave the same bits in {s.dtype}. "
                "bfloat16 keeps 8 bits of mantissa, so any reordering shows.", "bfloat16")
    return ("Why nothing here: on this device every shape's kernel summed in the same order for this prompt; try a "
            "longer prompt or another split.", None)


def greedy_closest_call(res) -> str:
    """Why no greedy path parted, in one sentence: the step whose top-2 margin came closest to the gap between the
    paths' logits."""
    rows = [(m - g, t, m, g) for p in res.pairs if "float64" not in (p.a, p.b)
            for t, (m, g) in enumerate(zip(res.paths[p.a].margins, p.max_abs_logit))]
    if not rows:
        return ""
    _, t, m, g = min(rows)
    if m <= g:  # within reach, and still no flip: the gap fell elsewhere (said so, not "stayed above the gap")
        return (f"Why nothing here: a path can flip only where its top two tokens are nearly tied (margin within the "
                f"gap between the paths' logits). At step {t} the margin {m:.3g} was within the gap of {g:.3g}, yet "
                "the choice held: the logits moved on other tokens than the top two, or both of them alike. "
                "bfloat16 and longer texts meet more such steps.")
    return (f"Why nothing here: a path flips only where its top two tokens are nearly tied (margin within the gap "
            f"between the paths' logits); the closest call was step {t}, margin {m:.3g}, above the gap of {g:.3g}. "
            "Ties are rarer in float32 and in short texts; bfloat16 and longer texts meet one.")


def dtypes_line(res) -> tuple[str, str, str | None]:
    """(verdict, explanation, fix) of a Dtypes sweep: the worst verdict over the compared dtypes, the counts per
    dtype, and for a dtype bit for bit identical on every prompt why, with fix "half-step" (cache half the prompt
    and feed the rest token by token: many 1-row products, where 16-bit roundings part) or None."""
    compared = [d for d in res.dtypes if d != "float64"]
    n = len(res.prompts)
    count = {d: {v: res.verdicts[d].count(v) for v in ("identical", "precision", "logic")} for d in compared}
    worst = worst_of((v for d in compared for v in res.verdicts[d]), Verdict.IDENTICAL)
    parts = [f"{d}: " + ", ".join(f"{v} on {k} of {n}" for v, k in count[d].items() if k) for d in compared]
    text = ("The cached run against the full forward, per dtype (float64 decides each verdict) - " + "; ".join(parts)
            + ".")
    same = [d for d in compared if count[d]["identical"] == n]
    s = res.settings
    if not same:
        return worst, text, None
    half_step = s.split == "half" and s.mode == "step"
    why = (f" Why nothing in {' and '.join(same)} here: "
           + ("with only the last token fed through the cache, " if s.split == "last" else "")
           + f"on {s.device} these kernels gave the cached and the full products the same bits"
           + (" - 16-bit products on a CPU are summed in float32 and rounded once at the end, so a last-bit "
              "difference of the sum rarely survives the rounding to 16 bits (GPU kernels round along the way)"
              if any(d in ("float16", "bfloat16") for d in same) else "")
           + "." + ("" if half_step else " Caching half the prompt and feeding the rest token by token makes many "
                                         "1-row products, and there the 16-bit roundings part."))
    return worst, text + why, None if half_step else "half-step"


def serving_why(res) -> tuple[str, str | None]:
    """(why, fix) for a Serving study where no run of any prompt parted from the reference: the closest call (the
    reference's smallest top-2 margin) and fix "bfloat16" (more near ties) unless it ran in a 16-bit dtype already;
    ("", None) when a prompt parted."""
    if any(p.first_divergence is not None for p in res.prompts):
        return "", None
    calls = [(m, p.index, t) for p in res.prompts for t, m in enumerate(p.reference_margins)]
    if not calls:
        return "", None
    m, i, t = min(calls)
    dtype = res.settings.dtype
    why = (f"Why nothing here: a condition changes a completion only where the reference's top two tokens are nearly "
           f"tied, its margin within the run-to-run gap of the logits (a few ε of {dtype}); the closest call was "
           f"prompt {i}, step {t}, margin {m:.3g}, far above that gap. ")
    if dtype in ("float16", "bfloat16"):
        return why + "More prompts or longer completions meet a near tie sooner.", None
    return why + "bfloat16 (ε = 2⁻⁷) makes near ties common.", "bfloat16"


def grid_cells(cells: list[dict]) -> str:
    """Grid cells named by the grid's own labels, row by row: 'row "alone": columns "cache, mask new-only" and
    "cache, omitted + new-only"; row "in a batch": column "cache, positions omitted"' (a label has commas of its own:
    each is quoted)."""
    rows: dict[str, list[str]] = {}
    for c in cells:
        rows.setdefault(str(c["placement"]), []).append(f'"{c["scenario"]}"')

    def listed(xs: list[str]) -> str:
        return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1]

    return "; ".join(f'row "{r}": column{"s" if len(cols) > 1 else ""} {listed(cols)}' for r, cols in rows.items())


def padding_line(res) -> tuple[str, str]:
    """(verdict, explanation) of the padding grid: its worst cell and which scenarios give each verdict; an all-
    identical grid says why."""
    by: dict[str, list[dict]] = {}
    for c in res.cells:
        by.setdefault(str(c["verdict"]), []).append(c)
    worst = worst_of(by, Verdict.IDENTICAL)
    n = len(res.cells)
    parts = []
    if "logic" in by:
        parts.append(f"logic in {len(by['logic'])} of {n} cells ({grid_cells(by['logic'])}): the gap stays in "
                     "float64, the cached run computes another function")
    if "precision" in by:
        parts.append(f"precision in {len(by['precision'])} (the gap closes in float64: rounding)")
    if "identical" in by:
        parts.append(f"bit for bit identical in {len(by['identical'])}")
    text = "Against the prompt alone without cache: " + "; ".join(parts) + "."
    if worst == "identical":
        text += (" Why nothing here: every scenario that ran summed its shapes in one order on this device (or "
                 "invariant mode is on); with left padding, the omitted position ids are logic on any machine.")
    return worst, text


def rounding_away_note(hidden_max_abs, first_module: str | None) -> str:
    """Where the bisector's first differing module lies before the heatmap's first differing row (or no row differs):
    one paragraph on why - its difference rounded away in the residual sum. hidden_max_abs: [hidden states,
    positions] (row 0 the embeddings, row k the output of decoder layer k-1); "" when they agree or nothing differs."""
    if first_module is None:
        return ""
    rows = np.flatnonzero(np.asarray(hidden_max_abs).max(axis=-1) > 0)
    i = module_index(first_module)
    row = 0 if i is None else i + 1  # the hidden-state row the module's layer writes
    if rows.size and rows[0] <= row:
        return ""
    where = (f"the heatmap's first differing row is {layer_label(int(rows[0]))}" if rows.size else
             "no hidden state in the heatmap differs at all")
    return (f"Why the bisector and the heatmap disagree: the bisector found a difference inside {first_module} "
            f"(its layer writes row {layer_label(row)}), but {where}. A difference of a last bit or so inside a "
            "layer can round away: the layer adds its output to the residual stream, and x + Δ rounds back to x when "
            "Δ is below half an ulp of x, so the layer's output comes out bit for bit equal. Only a difference large "
            "enough to survive that rounding reaches the hidden states the heatmap shows.")


def matrix_why(res, invariant: bool = False) -> tuple[str, str | None]:
    """(why, fix) for a backends matrix whose every cell that ran is bit for bit the reference; fix "bfloat16" unless
    it ran in a 16-bit dtype already. ("", None) when a cell differs, or in invariant mode (identical is the point)."""
    ran = [c for c in res.cells if not c.error]
    if invariant or not ran or any(c.verdict != "identical" for c in ran):
        return "", None
    dtype = res.settings["dtype"]
    why = (f"Why nothing here: every setting gave the eager no-cache reference's tokens and logits bit for bit - on "
           f"{res.settings['device']} these attention kernels and cache kinds summed each row in the same order for "
           "these shapes.")
    if dtype in ("float16", "bfloat16"):
        return why + " More tokens or a left-padded batch give other shapes.", None
    return why + " In bfloat16 (8 bits of mantissa) a reordering shows.", "bfloat16"
