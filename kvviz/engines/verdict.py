"""Engine vs reference: an engine's per-step log-probs on its own token path, compared with kvviz's
float64 reference from the same weights on the same token path.

For each completion (token path) an engine gave, the float64 model (the same folder; for llama.cpp the same GGUF,
dequantized) runs ONE teacher-forced full forward over prompt + completion; at every step the engine's top-k
log-probs (the chosen token's included) are compared with the reference's log-probs of the same tokens. The
path's distance is the largest gap (nats) over its steps and top-k tokens.

Rounding distance, for an engine computing in a float format (vLLM float32, bfloat16, float16): measured, not
assumed. kvviz runs the same teacher-forced forward in the engine's dtype (its own kernels, the same weights); that
run's largest gap from float64 over the path's steps and the engine's top-k tokens is what this dtype's rounding does
to this model on these tokens, and the rounding distance is C_OWN = 16 times it (an engine's kernels may round more
than torch's: docs/engines.md has the measured ratios), never less than 2^4 · u · S (u the dtype's
unit round-off, S the step's largest |reference log-prob|, at least 1). For llama.cpp's quantized kernels (8-bit
activations, which kvviz does not run) it is K · u · S with u = 2^-8 and K = 2^7, calibrated on the default model
(docs/engines.md: its largest distance was 0.23 of it).
A verdict per prompt where its paths part:
  precision  every path within the rounding distance of the reference, and the reference's top-2 margin at the
             parting step within it too (a near tie that rounding can flip);
  logic      a path farther from the reference than rounding explains (uniform logits, a stale buffer, a wrong
             position), or a parting step whose margin rounding cannot cross, or an engine choosing a token it
             does not rank first;
  undecided  (the Engine layers view's outputs, judge(far_verdict="undecided")) a path farther than the rounding
             distance with none of logic's other evidence: that distance is 16× torch's rounding, and an engine's
             kernels may round more - not decided, never logic.
"""
from __future__ import annotations

import torch

from ..core.verdict import Verdict, classify_bounded
from ..core.dtypes import dtype_name
from ..core.execution import Executor

K_GROWTH = {"float": 2 ** 4, "q8": 2 ** 7}
C_OWN = 16
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "q8": 2.0 ** -8}


def float_format(engine_dtype: str) -> str | None:
    """The torch float format the engine computes in (kvviz can run the same), or None (llama.cpp's kernels)."""
    d = str(engine_dtype)
    return next((k for k in UNIT_ROUNDOFF if k != "q8" and d.startswith(k)), None)


def rounding_scale(engine_dtype: str) -> float:
    """K · u per unit of log-prob magnitude: the floor of the rounding distance for a float format (where kvviz's
    own run in that dtype sets it), the whole of it for llama.cpp's quantized kernels."""
    k = float_format(engine_dtype)
    if k is not None:
        return K_GROWTH["float"] * UNIT_ROUNDOFF[k]
    return K_GROWTH["q8"] * UNIT_ROUNDOFF["q8"]  # a quantized GGUF on llama.cpp's kernels (8-bit activations)


def reference_logprobs(ex64, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float64 log-probs: step t's distribution given prompt + tokens[:t] (one full forward; with
    an executor in another dtype, that dtype's forward, its log-probs taken in float64)."""
    ids = torch.tensor([list(prompt_ids) + list(tokens[:-1])], device=ex64.lm.device)
    with ex64.session():
        logits = ex64.forward(ids, use_cache=False, hidden=False).logits[0].double()
    return torch.log_softmax(logits[len(prompt_ids) - 1:], dim=-1).cpu()


def own_gap(own: torch.Tensor, ref: torch.Tensor, top: list) -> float:
    """kvviz's own run in the engine's dtype against float64, on the engine's top-k tokens of every step: the
    largest gap (nats)."""
    gaps = [abs(float(own[t, i]) - float(ref[t, i])) for t, step in enumerate(top[: ref.shape[0]]) for i, _ in step]
    return max(gaps, default=0.0)


def path_distance(ref: torch.Tensor, top: list, chosen: list, u: float, own: torch.Tensor | None = None) -> dict:
    """The engine path against the reference on the same tokens: the largest log-prob gap, the step where it is, the
    rounding distance there, whether the engine's chosen token was its own top-ranked one, and whether its top-k
    log-probs are (nearly) uniform. own: kvviz's log-probs in the engine's dtype on the same tokens (a float
    format): the rounding distance is C_OWN times its gap from float64, at least u · S."""
    worst, at, tol_at, chose_top, uniform = 0.0, None, None, True, False
    tols = []
    measured = None if own is None else C_OWN * own_gap(own, ref, top)
    for t, step in enumerate(top[: ref.shape[0]]):
        if not step:
            continue
        s = max(1.0, max(abs(float(ref[t, i])) for i, _ in step))
        tol = u * s if measured is None else max(measured, u * s)
        tols.append(tol)
        gap = max(abs(v - float(ref[t, i])) for i, v in step)
        if gap / tol > (worst / tol_at if tol_at else -1):
            worst, at, tol_at = gap, t, tol
        if t < len(chosen) and (chosen[t] is None or chosen[t] < step[0][1] - 1e-9):
            chose_top = False  # None: the chosen token is not even among the engine's top-k
        if len(step) > 1 and step[0][1] - step[-1][1] < 1e-6:
            uniform = True
    return {"distance": worst, "step": at, "rounding": tol_at if tol_at is not None else (tols[0] if tols else 0.0),
            "chose_top": chose_top, "uniform": uniform, "own": None if measured is None else measured / C_OWN}


def margin_at(ref: torch.Tensor, t: int) -> float:
    top2 = ref[t].topk(2).values
    return float(top2[0] - top2[1])


def judge(paths: dict[str, dict], parting_step: int | None, margin: float | None, rounding: float,
          far_verdict: str = "logic", decides: str = "") -> tuple[str, str]:
    """paths: label -> path_distance(...). Returns (verdict, explanation), the verdict by kvviz's one rule
    (kvviz.core.verdict.classify_bounded): logic on evidence that survives precision, undecided past the rounding
    distance without it, else precision.
    far_verdict: what a path farther from float64 than the rounding distance alone is ("logic", the Serving view's
    rule: that distance counts as evidence; "undecided" where the distance is a heuristic bound the engine's kernels
    may pass by rounding - then the rules that survive precision, a choice the engine did not rank first and a margin
    rounding cannot cross, come first). decides: the sentence naming what would decide an undecided verdict."""
    far = {k: v for k, v in paths.items() if v["distance"] > v["rounding"]}
    dist = "; ".join(f"{k}: {v['distance']:.3g} nats (rounding {v['rounding']:.2g})" for k, v in paths.items())
    if far:
        k, v = max(far.items(), key=lambda kv: kv[1]["distance"] / kv[1]["rounding"])
        if far_verdict != Verdict.LOGIC:
            # the engine's kernels round more than the heuristic distance says: a margin is judged against what they did
            rounding = max(rounding, max(x["distance"] for x in far.values()))
    evidence = _surviving(paths, far, far_verdict, parting_step, margin, rounding, dist)
    verdict = classify_bounded(False, past_bound=bool(far), survives=evidence is not None)
    if verdict == Verdict.LOGIC:
        return verdict.value, evidence
    where = ("" if parting_step is None else
             f" They part at step {parting_step}" + ("." if margin is None else
                                                     f", where the reference's top-2 margin is {margin:.3g} nats "
                                                     f"(within rounding: a near tie)."))
    if verdict == Verdict.UNDECIDED:
        how = (f"{C_OWN}× kvviz's own run in the engine's dtype" if v.get("own") is not None
               else "K · u for the engine's format")
        return verdict.value, (f"{k} is {v['distance']:.3g} nats from the float64 reference at step {v['step']} on "
                               f"its own tokens, {v['distance'] / v['rounding']:.3g}× the rounding distance "
                               f"({v['rounding']:.2g}, {how}): beyond the rounding bound - not decided, the engine's "
                               f"kernels may round more than torch's." + (f" {decides}" if decides else "")
                               + f"{where} {dist}.")
    return verdict.value, (f"every path is within the engine's rounding distance of the float64 reference.{where} "
                           f"{dist}.")


def _surviving(paths, far, far_verdict, parting_step, margin, rounding, dist) -> str | None:
    """The first evidence that survives precision, as its sentence (None: none)."""
    uniform = [k for k, v in paths.items() if v["uniform"]]
    if uniform:
        return (f"{', '.join(uniform)}: the engine's top log-probs are uniform (every token equally likely): its "
                f"logits carry nothing of the model - a missing or zero weight, not rounding. {dist}.")
    if far and far_verdict == Verdict.LOGIC:
        k, v = max(far.items(), key=lambda kv: kv[1]["distance"] / kv[1]["rounding"])
        return (f"{k} is {v['distance']:.3g} nats from the float64 reference at step {v['step']} on its own tokens, "
                f"{v['distance'] / v['rounding']:.0f}× the engine's rounding distance ({v['rounding']:.2g}): "
                f"rounding cannot explain it (a stale buffer, a wrong position). {dist}.")
    bad_pick = [k for k, v in paths.items() if not v["chose_top"]]
    if bad_pick:
        return f"{', '.join(bad_pick)}: the engine chose a token it did not rank first. {dist}."
    if parting_step is not None and margin is not None and margin > 2 * rounding:
        return (f"the paths part at step {parting_step} where the reference's top-2 margin is {margin:.3g} nats, "
                f"beyond 2× the rounding distance ({rounding:.2g}): rounding cannot flip it. {dist}.")
    return None


def engine_verdicts(prompts, lm, lm64, settings, engine, ids, completions, logps, memo: dict | None = None) -> None:
    """Every prompt's distinct paths against the float64 reference (engine_paths); a verdict and explanation where
    its paths part from kvviz's reference, or where a path is farther from float64 than rounding explains even
    though the tokens agree (a bug that has not flipped a token yet). memo: a dict kept across calls on the same
    models (a sweep's cells) - a token path scored once is not scored again."""
    ex64 = Executor(lm64, settings.with_(invariant=False))
    dtype = engine.info().get("dtype") or dtype_name(lm.dtype)
    u = rounding_scale(dtype)
    # the engine's float format, run by kvviz on the same weights: its gap from float64 measures the rounding
    ex_own = Executor(lm, settings.with_(invariant=False)) if float_format(dtype) == dtype_name(lm.dtype) else None
    for p in prompts:
        i, paths, seen = p.index, {}, set()
        refs = memo.setdefault(("float64 path", tuple(ids[i])), {}) if memo is not None else {}
        owns = memo.setdefault(("own-format path", tuple(ids[i])), {}) if memo is not None else {}
        for cond, runs in completions.items():
            for r, toks in enumerate(runs[i]):
                if (cond, tuple(toks)) in seen or not toks:
                    continue
                seen.add((cond, tuple(toks)))
                top, chosen = logps[cond][i][r]
                if not top:
                    continue
                ref = refs.get(tuple(toks))
                if ref is None:
                    ref = refs[tuple(toks)] = reference_logprobs(ex64, ids[i], toks)
                own = owns.get(tuple(toks))
                if own is None and ex_own is not None:  # one forward per token path, as for the reference
                    own = owns[tuple(toks)] = reference_logprobs(ex_own, ids[i], toks)
                paths[f"{cond} run {r + 1}"] = path_distance(ref, top, chosen, u, own)
        if not paths:
            if p.first_divergence is not None:
                p.verdict, p.explanation = None, "the engine returned no log-probs; no engine-vs-reference verdict"
            continue
        p.engine_paths = {k: dict(v) for k, v in paths.items()}  # path_distance's fields
        p.float64_gap = max(v["distance"] for v in paths.values())
        t = p.first_divergence
        if t is None:
            verdict, why = judge(paths, None, None, 0.0)
            if verdict == Verdict.LOGIC:  # the same tokens as the reference, but not the same numbers
                p.verdict, p.explanation = Verdict.LOGIC.value, "The tokens agree with kvviz's reference, but " + why
            continue
        parted = completions[p.condition][i][p.run]
        ref = refs.get(tuple(parted))
        # a parted path that ended at t (a server stopping on its end token) has no step t: the reference's margin
        # there on the shared prefix is the same quantity
        margin = margin_at(ref, t) if ref is not None and t < ref.shape[0] else p.margin
        rounding = paths.get(f"{p.condition} run {p.run + 1}", next(iter(paths.values())))["rounding"]
        p.verdict, why = judge(paths, t, margin, rounding)
        p.explanation = (f"At step {t} {p.condition} run {p.run + 1} chose {p.run_token!r} where kvviz's reference "
                         f"chose {p.reference_token!r}. Against the float64 reference on each path's own tokens: "
                         + why)
