"""Is my model cache-safe? A battery of checks, each judged in float64 (where rounding cannot hide or fake a gap),
with one line of evidence each, and an overall `safe`, `unsafe` or `lossy`.

Checks: cached vs full forward (one chunk, and token by token); left padding with position ids; alone vs in a
padded batch; a prompt cache reused through a deep copy; past the sliding window (if the model has one); whether
the model is causal at all (a bidirectional model returns no cache: unsafe); whether it ships its own code; whether
its weights are quantized (then the cache is at best `lossy` against an unquantized run).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path


from .loading import LoadedModel
from .padding import run_padding
from .reuse import run_reuse
from .split import FLOAT64_CLOSED_REL, SplitConfig, run_split

PROMPT = ("The museum guard knew every painting in the building, but he had a favourite one hanging in the far "
          "corner of the east wing.")
OVERALL = ("safe", "unsafe", "lossy")


@dataclass
class Check:
    name: str
    status: str  # pass | fail | n/a | note
    evidence: str
    figure: float | None = None


@dataclass
class CheckCard:
    model: str
    overall: str
    checks: list[Check]
    summary: str

    def to_dict(self) -> dict:
        return asdict(self)


def _gap_check(name: str, rel: float | None, what: str) -> Check:
    if rel is None:
        return Check(name, "fail", f"no cache came back: {what} cannot be checked", None)
    ok = rel <= FLOAT64_CLOSED_REL
    return Check(name, "pass" if ok else "fail",
                 f"float64 {what}: largest relative gap {rel:.3g} "
                 + ("(float64 rounding: the logic is right)" if ok else "(a logic gap: the cached path computes "
                                                                        "something else)"), rel)


def _split_gap(lm64: LoadedModel, prompt: str, **kw) -> float | None:
    n = len(lm64.tokenizer(prompt)["input_ids"])
    res = run_split(lm64, SplitConfig(prompt, split=max(1, n // 2), **kw), prove=False)
    return res.main.max_relative if res.main.has_cache else None


def _remote_code(lm: LoadedModel) -> Check:
    folder = Path(lm.source)
    py = sorted(p.name for p in folder.glob("*.py")) if folder.is_dir() else []
    auto_map = getattr(lm.config, "auto_map", None)
    if py or auto_map:
        return Check("remote code", "note", f"the model ships its own code ({', '.join(py) or 'auto_map'}); its "
                     f"cache behaviour is whatever that code does - it ran only because trust_remote_code was on"
                     if lm.trust_remote_code else "the model ships its own code, which kvviz did not run")
    return Check("remote code", "pass", "no model code of its own: transformers' implementation is what was checked")


def _bidirectional(lm64: LoadedModel) -> Check | None:
    res = run_split(lm64, SplitConfig(PROMPT, split=5), prove=False)
    if res.main.has_cache:
        return None
    return Check("causal attention", "fail", f"no cache comes back: the model is bidirectional, so appending tokens "
                 f"changes what earlier tokens compute (by up to {res.main.bidirectional_change:.3g}); "
                 f"past_key_values cannot be used", res.main.bidirectional_change)


def _window_check(lm64: LoadedModel) -> Check:
    window = getattr(lm64.config, "sliding_window", None)
    if not window:
        return Check("past the sliding window", "n/a", "the model has no sliding window")
    prompt = PROMPT
    while len(lm64.tokenizer(prompt)["input_ids"]) < 2 * window + 4:
        prompt += " " + PROMPT
    if lm64.max_positions is not None and len(lm64.tokenizer(prompt)["input_ids"]) > lm64.max_positions:
        return Check("past the sliding window", "n/a", f"a window of {window} does not fit the context")
    return _gap_check("past the sliding window", _split_gap(lm64, prompt, mode="step"),
                      f"token by token past the window of {window}")


def run_check(lm: LoadedModel, progress=None) -> CheckCard:
    """The cache-safety card of `lm`'s model (its float64 twin runs the checks)."""
    progress = progress or (lambda f, m: None)
    lm64 = lm.reference()
    checks: list[Check] = []
    progress(0.05, "Is the model causal?")
    bidir = _bidirectional(lm64)
    if bidir is not None:
        checks.append(bidir)
    else:
        checks.append(Check("causal attention", "pass", "the model returns a cache: attention is causal"))
        steps = [("cached vs full, one chunk", dict(mode="chunk"), "cached vs full forward, rest in one chunk"),
                 ("cached vs full, token by token", dict(mode="step"), "cached vs full forward, token by token"),
                 ("left padding with position ids", dict(left_pad=4), "left-padded with position ids from the mask")]
        for i, (name, kw, what) in enumerate(steps):
            progress(0.1 + 0.15 * i, name)
            checks.append(_gap_check(name, _split_gap(lm64, PROMPT, **kw), what))
        progress(0.55, "alone vs in a batch")
        pad = run_padding(lm64, PROMPT, left_pad=2)
        cell = next(c for c in pad.cells if c["placement"] == "in a batch" and c["scenario"] == "cache")
        checks.append(_gap_check("alone vs in a batch", max(cell["hidden_relative"], cell["logits_relative"]),
                                 "the prompt in a left-padded batch with longer prompts, through the cache"))
        progress(0.7, "prompt-cache reuse")
        reuse = run_reuse(lm64, "Answer in one short sentence.", [" Q: What is the capital of France? A:",
                                                                   " Q: What colour is the sky? A:"], 4)
        worst = max(r["float64_relative"] for r in reuse.runs if r["strategy"] == "deepcopy")
        checks.append(_gap_check("prompt-cache reuse (deep copy)", worst,
                                 "a cached prefix reused for two continuations through deep copies"))
        progress(0.85, "past the sliding window")
        checks.append(_window_check(lm64))
    checks.append(_remote_code(lm))
    quant = getattr(lm.config, "quantization_config", None)
    checks.append(Check("quantized weights", "note" if quant else "pass",
                        f"the weights are quantized ({quant}): compare with an unquantized run - lossy"
                        if quant else "the weights are not quantized"))
    failed = [c for c in checks if c.status == "fail"]
    overall = "unsafe" if failed else ("lossy" if quant else "safe")
    summary = ({"safe": "Safe: with correct masks and position ids, every cached path computes what the full "
                        "forward computes (to float64 rounding).",
                "lossy": "Lossy: the cache logic is right, but the quantized weights change the numbers.",
                "unsafe": "Unsafe: " + "; ".join(f"{c.name} — {c.evidence}" for c in failed) + "."}[overall])
    progress(1.0, "Done")
    return CheckCard(model=lm.name, overall=overall, checks=checks, summary=summary)



