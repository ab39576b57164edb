"""Why a page's first screen shows no difference, in one sentence, and which one setting would show one (issue 29:
every page's default run shows a difference or says in its verdict line why there is none here). Pure: results in,
words out; the pages turn a fix into their one-click button."""
from __future__ import annotations


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
    return (f"Why nothing here: a path flips only where its top two tokens are nearly tied (margin within the gap "
            f"between the paths' logits); the closest call was step {t}, margin {m:.3g} against a gap of {g:.3g}. "
            "Ties are rarer in float32 and in short texts; bfloat16 and longer texts meet one.")
