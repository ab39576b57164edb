"""Is my model cache-safe? A battery of checks, each judged in float64 (where rounding cannot hide or fake a gap),
with one line of evidence each, and an overall `safe`, `unsafe` or `lossy`.

Checks: cached vs full forward (one chunk, and token by token); left padding with position ids; alone vs in a
padded batch; a prompt cache reused through a deep copy; past the sliding window (if the model has one); whether
the model is causal at all (a bidirectional model returns no cache: unsafe); whether it ships its own code; whether
its weights are quantized (then the cache is at best `lossy` against an unquantized run).

A quantized model - the card run with `weights="int8"|"int4"` (optimum-quanto, weight-only) and/or a quantized KV
cache (`kv="quanto:int4"`, ...) - gets the float64 logic battery on its unquantized float64 twin (quantization does
not change the cache code) plus the quantized run against the unquantized one: per-step KL, the greedy agreement
length and the largest gap per layer, with `overall` `lossy` and those numbers. A checkpoint that arrives quantized
(its config carries a quantization_config) has no unquantized twin here: the card says so.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path


from ...core.errors import KvvizError
from ...core.inputs import Workload
from ...core.execution import Settings
from ...models.loading import LoadedModel
from ...core.protocol import DEFAULT_CONTEXT, no_progress, RunContext
from ... import views
from ...core.verdict import Verdict, classify
from ...core.estimate import Timed
from ...core.dtypes import dtype_name

PROMPT = ("The museum guard knew every painting in the building, but he had a favourite one hanging in the far "
          "corner of the east wing.")
REUSE_PREFIX = "Answer in one short sentence."  # the prompt-cache reuse check: a prefix and its continuations
REUSE_QUESTIONS = (" Q: What is the capital of France? A:", " Q: What colour is the sky? A:")


@dataclass
class Check:
    name: str
    status: str  # pass | fail | n/a | note
    evidence: str
    figure: float | None = None
    logits_max_abs: float | None = None  # split-based checks: the float64 run's largest |Δ logit| (repro figure)
    scenario: dict | None = None  # split-based checks: prompt, split, mode, left_pad (what a repro script rebuilds)


@dataclass(frozen=True)
class CheckSettings(Settings):
    model: str = ""
    dtype: str = ""
    device: str = ""
    weights: str = "none"
    kv: str = "none"
    float64_device: str = ""


@dataclass
class CheckCard(Timed):
    model: str
    overall: str
    checks: list[Check]
    summary: str
    settings: CheckSettings = field(default_factory=CheckSettings)

    def to_dict(self) -> dict:
        return {**asdict(self), "settings": self.settings.to_dict()}


def _compose(view: str, lm: LoadedModel, config, progress=None):
    """Another view's run, through the registry (kvviz.core.protocol): the card judges in float64, no invariant rerun."""
    return views.run(view, lm, config, RunContext(prove=False, progress=progress))


def _split_config(prompt: str, **kw):
    return views.get("split").config_type()(prompt, **kw)


def _gap_check(name: str, rel: "float | tuple | None", what: str) -> Check:
    rel, logits, scenario = rel if isinstance(rel, tuple) else (rel, None, None)
    if rel is None:
        return Check(name, "fail", f"no cache came back: {what} cannot be checked", None)
    ok = classify(False, rel) == Verdict.PRECISION
    return Check(name, "pass" if ok else "fail",
                 f"float64 {what}: largest relative gap {rel:.3g} "
                 + ("(float64 rounding: the logic is right)" if ok else "(a logic gap: the cached path computes "
                                                                        "something else)"), rel, logits, scenario)


def _split_gap(lm64: LoadedModel, prompt: str, **kw) -> tuple[float | None, float | None, dict]:
    """The split check in float64: its largest relative gap, its largest |Δ logit| and the scenario."""
    n = len(lm64.tokenizer(prompt)["input_ids"])
    cfg = _split_config(prompt, split=max(1, n // 2), **kw)
    res = _compose("split", lm64, cfg)
    scenario = {"prompt": prompt, "split": cfg.split, "mode": cfg.mode, "left_pad": cfg.left_pad}
    if not res.main.has_cache:
        return None, None, scenario
    return res.main.max_relative, float(res.main.logits["max_abs"].max()), scenario


def _remote_code(lm: LoadedModel) -> Check:
    folder = Path(lm.source)
    py = sorted(p.name for p in folder.glob("*.py")) if folder.is_dir() else []
    auto_map = getattr(lm.config, "auto_map", None)
    if py or auto_map:
        return Check("remote code", "note", f"the model ships its own code ({', '.join(py) or 'auto_map'}); its "
                     f"cache behaviour is whatever that code does - it ran only because trust_remote_code was on"
                     if lm.trust_remote_code else "the model ships its own code, which kvviz did not run")
    return Check("remote code", "pass", "no model code of its own: transformers' implementation is what was checked")


def _bidirectional(lm64: LoadedModel, prompt: str = PROMPT) -> Check | None:
    res = _compose("split", lm64, _split_config(prompt, split=5))
    if res.main.has_cache:
        return None
    change = res.main.bidirectional_change
    if change is not None and classify(False, change) == Verdict.PRECISION:
        # causal (the prefix moves by float64 rounding only) but no cache object comes back: OpenAI GPT has no
        # past_key_values, RecurrentGemma keeps its state inside its modules - not bidirectional, nothing to check
        return Check("cache", "n/a", f"no cache comes back, though the model is causal (appending tokens moves "
                     f"earlier tokens' outputs by only {change:.3g}, float64 rounding): {type(lm64.model).__name__} "
                     f"returns no past_key_values, so there is no cached path to check", change)
    return Check("causal attention", "fail", f"no cache comes back: the model is bidirectional, so appending tokens "
                 f"changes what earlier tokens compute (by up to {change:.3g}); past_key_values cannot be used", change)


def _window_check(lm64: LoadedModel, base: str = PROMPT) -> Check:
    window = getattr(lm64.config, "sliding_window", None)
    if not window:
        return Check("past the sliding window", "n/a", "the model has no sliding window")
    prompt = base
    while len(lm64.tokenizer(prompt)["input_ids"]) < 2 * window + 4:
        prompt += " " + base
    if lm64.max_positions is not None and len(lm64.tokenizer(prompt)["input_ids"]) > lm64.max_positions:
        return Check("past the sliding window", "n/a", f"a window of {window} does not fit the context")
    return _gap_check("past the sliding window", _split_gap(lm64, prompt, mode="step"),
                      f"token by token past the window of {window}")


def _quantized_check(lm: LoadedModel, kv: str, weights: str, progress) -> Check:
    cfg = views.get("quant").config_type()(PROMPT, kv=kv, weights=weights, max_new_tokens=16)
    res = _compose("quant", lm, cfg, progress)
    if res.bitwise_equal:
        return Check(f"quantized ({cfg.label})", "pass", res.explanation, 0.0)
    agree = (f"greedy agrees for all {res.steps} tokens" if res.agreement >= res.steps
             else f"greedy agrees for {res.agreement} of {res.steps} tokens")
    layer = (f"largest hidden gap at {res.worst_layer} ({max(res.layer_relative):.3g} of its scale)"
             if res.worst_layer != "—" else "no hidden state moves (only the head)")
    return Check(f"quantized ({cfg.label})", "note",
                 f"lossy against the unquantized {lm.name}: {agree}; per-step KL mean {res.kl_mean:.3g}, max "
                 f"{res.kl_max:.3g}; {layer}", res.kl_max)


def run_check(lm: LoadedModel, progress=None, weights: str = "none", kv: str = "none", prompt: str = PROMPT,
              reuse_prefix: str = REUSE_PREFIX, reuse_questions: tuple = REUSE_QUESTIONS) -> CheckCard:
    """The cache-safety card of `lm`'s model (its float64 twin runs the checks). weights / kv: check the model
    with quantized weights (int8, int4) and/or a quantized KV cache (see kvviz.views.quant.run): the card is then at best
    `lossy`, with the measured loss."""
    progress = progress or no_progress
    weights, kv = weights or "none", kv or "none"
    quantized = weights != "none" or kv != "none"
    if quantized:  # names, packages, devices, dtypes and a cache the model refuses: all fail before the battery
        views.get("quant").config_type()(prompt, kv=kv, weights=weights).check_feasible(lm)
    lm64 = lm.reference()
    checks: list[Check] = []
    progress(0.05, "Is the model causal?")
    bidir = _bidirectional(lm64, prompt)
    if bidir is not None:
        checks.append(bidir)
    else:
        checks.append(Check("causal attention", "pass", "the model returns a cache: attention is causal"))
        steps = [("cached vs full, one chunk", dict(mode="chunk"), "cached vs full forward, rest in one chunk"),
                 ("cached vs full, token by token", dict(mode="step"), "cached vs full forward, token by token"),
                 ("left padding with position ids", dict(left_pad=4), "left-padded with position ids from the mask")]
        for i, (name, kw, what) in enumerate(steps):
            progress(0.1 + 0.15 * i, name)
            checks.append(_gap_check(name, _split_gap(lm64, prompt, **kw), what))
        progress(0.55, "alone vs in a batch")
        # float64 decides here; no invariant rerun; only the cell the card reads (the whole grid is 5x slower, and
        # its new-only-mask cells crash models that build positions or alibi from the mask: OPT, BLOOM)
        pad = _compose("padding", lm64, views.get("padding").config_type()(prompt, left_pad=2,
                                                                           only=(("in a batch", "cache"),)))
        cell = next(c for c in pad.cells if c["placement"] == "in a batch" and c["scenario"] == "cache")
        checks.append(_gap_check("alone vs in a batch", max(cell["hidden_relative"], cell["logits_relative"]),
                                 "the prompt in a left-padded batch with longer prompts, through the cache"))
        progress(0.7, "prompt-cache reuse")
        reuse = _compose("reuse", lm64, views.get("reuse").config_type()(reuse_prefix, tuple(reuse_questions), 3,
                                                                         ways=("deepcopy",)))
        worst = max(r["float64_relative"] for r in reuse.runs if r["strategy"] == "deepcopy")
        checks.append(_gap_check("prompt-cache reuse (deep copy)", worst,
                                 "a cached prefix reused for two continuations through deep copies"))
        progress(0.85, "past the sliding window")
        checks.append(_window_check(lm64, prompt))
    checks.append(_remote_code(lm))
    quant = getattr(lm.config, "quantization_config", None)
    quant_checks: list[Check] = []  # what the card says about quantization: the evidence of a lossy verdict
    measured: Check | None = None  # the quantized run against the unquantized one
    if quant:
        quant_checks.append(Check("quantized weights", "note", f"the checkpoint arrives quantized "
                                  f"({getattr(quant, 'quant_method', None) or quant}): kvviz has no unquantized "
                                  f"twin of it to measure against - lossy; load the unquantized checkpoint and "
                                  f"check it with quantized weights to measure the loss"))
    if quantized:
        if any(c.status == "fail" and c.name == "causal attention" for c in checks):
            quant_checks.append(Check("quantized", "n/a", "not measured: the model returns no cache"))
        else:
            progress(0.9, "the quantized run against the unquantized one")
            measured = _quantized_check(lm, kv, weights, lambda f, m: progress(0.9 + 0.09 * f, m))
            quant_checks.append(measured)
    elif not quant:
        quant_checks.append(Check("quantized weights", "pass", "the weights are not quantized"))
    checks += quant_checks
    failed = [c for c in checks if c.status == "fail"]
    lossy = bool(quant) or (measured is not None and measured.status == "note")
    overall = "unsafe" if failed else ("lossy" if lossy else "safe")
    no_cache = any(c.name == "cache" and c.status == "n/a" for c in checks)
    summary = ({"safe": "No cache: the model is causal but returns none, so every generation recomputes the whole "
                        "sequence and there is no cached path to get wrong." if no_cache else
                        "Safe: with correct masks and position ids, every cached path computes what the full "
                        "forward computes (to float64 rounding).",
                "lossy": "Lossy: the cache logic is right, but quantization changes the numbers: "
                         + "; ".join(c.evidence for c in quant_checks) + ".",
                "unsafe": "Unsafe: " + "; ".join(f"{c.name} — {c.evidence}" for c in failed) + "."}[overall])
    progress(1.0, "Done")

    return CheckCard(model=lm.name, overall=overall, checks=checks, summary=summary,
                     settings=CheckSettings(model=lm.name, dtype=dtype_name(lm.dtype), device=str(lm.device),
                                            weights=weights, kv=kv, float64_device=str(lm64.device)))


@dataclass(frozen=True)
class CheckConfig:
    """The cache-safety card; weights / kv: check the model quantized (see run_check)."""
    weights: str = "none"
    kv: str = "none"
    prompt: str = PROMPT
    reuse_prefix: str = REUSE_PREFIX
    reuse_questions: tuple[str, ...] = REUSE_QUESTIONS

    def validate(self) -> "CheckConfig":
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise KvvizError("the prompt is empty")
        if not self.reuse_questions:
            raise KvvizError("give at least one question for the prompt-cache reuse check")
        if (self.weights or "none") != "none" or (self.kv or "none") != "none":
            views.get("quant").config_type()(self.prompt, kv=self.kv or "none", weights=self.weights or "none")\
                .validate()
        return self

    def workload(self) -> Workload:
        """What the run holds, for its memory plan: a quantized copy of the weights; its prompts, past the sliding
        window, are the memory profile's."""
        # its time estimate: the battery in float64 (its float64 twin): five splits (two forwards each; the token by
        # token one about one and a half and its steps), one padded batch of three rows, the reuse check's prefills
        # and decode steps - about twenty forwards - and the quantized run where it checks one
        quant = str(self.weights or "none") != "none" or str(self.kv or "none") != "none"
        return Workload(weights=str(self.weights or "none"), forwards=20.0 + (3.0 if quant else 0.0),
                        run_dtypes=("float64",), copies=("float64",),
                        casts=(str(self.weights),) if str(self.weights or "none") != "none" else ())


# what its run cannot honour (kvviz.core.protocol.RunContext.running; the CLI refuses the matching flag)
REFUSES = {'invariant': 'the card decides in float64, where invariant mode has nothing to prove', 'prove': 'the card never runs the proof rerun'}


def run(lm: LoadedModel, config: CheckConfig, ctx: RunContext = DEFAULT_CONTEXT) -> CheckCard:
    """The view's run (kvviz.core.protocol: one signature for every view). The card judges in float64 (no proof runs)
    and composes split, padding, reuse and quant through the registry."""
    config.validate()
    with ctx.running(REFUSES) as progress:
        return run_check(lm, progress, config.weights, config.kv, config.prompt, config.reuse_prefix,
                         tuple(config.reuse_questions))
