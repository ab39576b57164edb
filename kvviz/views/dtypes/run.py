"""Dtypes side by side: the split comparison in float64, float32, float16 and bfloat16 over one prompt or a set.

float64 runs once per prompt: it is the reference (its own verdict is "reference") and every other dtype's
verdict evidence, by the rule of kvviz.views.split.run.classify.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ...core.dtypes import DTYPE_NAMES, dtype_name, parse_dtype, supports_dtype
from ...core.errors import KvvizError
from ...core.execution import DEFAULT_SETTINGS, ExecSettings, RunSettings
from ...core.inputs import MODES, SplitConfig, Workload, check_mode, encode, split_point, validate_prompt
from ...models import loading
from ...models.loading import LoadedModel, ModelSpec
from ...core.protocol import DEFAULT_CONTEXT, no_progress, Progress, RunContext
from ...core.verdict import Prove
from ...core.estimate import Timed
from ... import views

VERDICTS = ("identical", "precision", "logic")
REFERENCE = "reference"  # the float64 column's verdict: it is the yardstick, not a result


def eta(t0: float, done: int, total: int) -> str:
    """", about 12 s left" from the time per item so far."""
    if done == 0:
        return ""
    left = (time.perf_counter() - t0) / done * (total - done)
    return f", about {left:.0f} s left" if left >= 1 else ", almost done"


@dataclass(frozen=True)
class DtypesSettings(RunSettings):
    """The run's fields (dtype: the dtypes compared; attention: per dtype) and the sweep's."""

    attention: dict = field(default_factory=dict)
    float64_device: str = ""
    split: int | str = "last"
    mode: str = "chunk"
    skipped_dtypes: tuple[str, ...] = ()


@dataclass
class DtypesResult(Timed):
    settings: DtypesSettings
    model: dict
    dtypes: list[str]
    prompts: list[str]
    layer_labels: list[str]
    # metric -> dtype -> [n_prompts, n_hidden]: per prompt, the worst compared token of each hidden state
    per_prompt: dict[str, dict[str, np.ndarray]]
    logits_max_abs: dict[str, list[float]]
    verdicts: dict[str, list[str]]
    elapsed_s: float
    single: dict[str, object] = field(default_factory=dict)  # full split results when the set is one prompt
    proved: dict[str, list] = field(default_factory=dict)  # per dtype and prompt: proved in invariant mode (or None)

    METRICS = ("max_abs", "relative", "eps_units")

    def stat(self, metric: str = "max_abs", how: str = "mean") -> pd.DataFrame:
        """Layers × dtypes: the mean (as people average over prompts) or max over the prompts."""
        f = np.mean if how == "mean" else np.max
        return pd.DataFrame({d: f(self.per_prompt[metric][d], axis=0) for d in self.dtypes}, index=self.layer_labels)

    def verdict_counts(self) -> pd.DataFrame:
        """Verdict counts per compared dtype; float64 is the reference and has no column."""
        compared = [d for d in self.dtypes if d != "float64"]
        return pd.DataFrame({d: [self.verdicts[d].count(v) for v in VERDICTS] for d in compared}, index=VERDICTS)

    def to_dict(self) -> dict:
        counts = self.verdict_counts()
        return {
            "settings": self.settings.to_dict(), "model": self.model, "dtypes": self.dtypes,
            "n_prompts": len(self.prompts), "prompts": self.prompts, "layer_labels": self.layer_labels,
            "per_layer": {m: {how: {d: self.stat(m, how)[d].tolist() for d in self.dtypes}
                              for how in ("mean", "max")} for m in self.METRICS},
            "per_prompt": {m: {d: v.tolist() for d, v in by.items()} for m, by in self.per_prompt.items()},
            "logits_max_abs": self.logits_max_abs, "verdicts": self.verdicts, "proved": self.proved,
            "verdict_counts": {d: dict(zip(VERDICTS, counts[d].tolist())) for d in counts.columns},
            "elapsed_s": self.elapsed_s,
        }


def _models(source, names: list[str], device, attn, trust_remote_code) -> dict[str, LoadedModel]:
    """One loaded model per dtype, float64 first. `source` is a LoadedModel (its twins are used) or a spec."""
    if isinstance(source, LoadedModel):
        base = source
    else:
        first = next((d for d in names if d != "float64"), "float64")
        base = loading.load_model(source, first, device, attn, trust_remote_code=trust_remote_code)
    return {"float64": base.reference()} | {d: base.twin(d) for d in names if d != "float64"}


class _Collector:
    """Per dtype and metric, one row per prompt; verdicts and logits gaps alongside."""

    def __init__(self, names: list[str]):
        self.per_prompt = {m: {d: [] for d in names} for m in DtypesResult.METRICS}
        self.logits_max = {d: [] for d in names}
        self.verdicts = {d: [] for d in names}
        self.proved = {d: [] for d in names}

    def add(self, d: str, res, reference: bool) -> None:
        self.proved[d].append(None if reference else res.proved)
        for m in DtypesResult.METRICS:
            self.per_prompt[m][d].append(res.main.hidden[m].max(axis=1))
        self.logits_max[d].append(float(res.main.logits["max_abs"].max()))
        self.verdicts[d].append(REFERENCE if reference else res.verdict)


def run_dtypes(model: "LoadedModel | ModelSpec | str", prompts: list[str], dtypes=DTYPE_NAMES, device="auto",
               attn: str | None = None, split: int | str = "last", mode: str = "chunk",
               trust_remote_code: bool = False, progress: Progress | None = None,
               settings: ExecSettings | None = None, prove: Prove = None, on_phase=None) -> DtypesResult:
    """The split comparison for several dtypes over a set of prompts; float64 runs once per prompt and serves as
    every dtype's verdict evidence. `model`: a loaded model (any dtype: its twins are used; device, attn and
    trust_remote_code are then taken from it) or a spec. prove: each precision verdict also runs in invariant mode
    (default: for a single prompt)."""
    progress = progress or no_progress
    settings = settings or DEFAULT_SETTINGS  # validated once, by its RunContext
    t0 = time.perf_counter()
    if not prompts:
        raise KvvizError("no prompts to run")
    names = list(dict.fromkeys(["float64"] + [dtype_name(parse_dtype(d)) for d in dtypes]))
    progress(0.0, "Loading the models…")
    models = _models(model, names, device, attn, trust_remote_code)
    lm64 = models["float64"]
    skipped = [d for d in names if not supports_dtype(models[d].device, parse_dtype(d))]
    out = _Collector(names)
    single: dict = {}
    # the split view composed through the protocol; the float64 run already made travels in its context
    # (float64_run), so float64 runs once per prompt for every dtype
    kept_prompts: list[str] = []
    labels: list[str] = []
    prove_each = None if prove or (prove is None and len(prompts) == 1) else False  # None: each precision verdict
    for i, prompt in enumerate(prompts):
        progress(i / len(prompts), f"Prompt {i + 1}/{len(prompts)}{eta(t0, i, len(prompts))}")
        validate_prompt(prompt)
        n = len(encode(lm64, prompt))
        if n < 2:
            continue  # a one-token prompt has nothing to split
        cfg = SplitConfig(prompt=prompt, split=split_point(n, split), mode=mode)
        f64_res = views.run("split", lm64, cfg, RunContext(settings=settings, prove=False))
        if not f64_res.main.has_cache:
            raise KvvizError(f"{lm64.name} returns no cache (a bidirectional model): nothing to compare per dtype")
        kept_prompts.append(prompt)
        labels = f64_res.layer_labels
        for d in names:
            res = f64_res if d == "float64" else views.run(
                "split", models[d], cfg, RunContext(settings=settings, prove=prove_each, float64_run=f64_res,
                                                    on_phase=on_phase))  # its proofs: the run's proof phase
            out.add(d, res, reference=d == "float64")
            if len(prompts) == 1:
                single[d] = res
    if not kept_prompts:
        raise KvvizError("every prompt is a single token; nothing to split")
    progress(1.0, "Done")
    others = [m for d, m in models.items() if d != "float64"]
    dev = others[0].device if others else lm64.device
    info = DtypesSettings(model=lm64.name, spec_kind=lm64.spec.kind, dtype=",".join(names), device=str(dev),
                          float64_device=str(lm64.device), split=split, mode=mode,
                          attention={d: m.attn_implementation for d, m in models.items()},
                          skipped_dtypes=tuple(skipped), execution=settings)
    return DtypesResult(
        settings=info, model=lm64.summary(), dtypes=names, prompts=kept_prompts, layer_labels=labels,
        per_prompt={m: {d: np.array(v) for d, v in by.items()} for m, by in out.per_prompt.items()},
        logits_max_abs=out.logits_max, verdicts=out.verdicts, elapsed_s=time.perf_counter() - t0, single=single,
        proved=out.proved)


@dataclass(frozen=True)
class DtypesConfig:
    """The split comparison over a set of prompts in several dtypes (float64, the yardstick, always runs)."""
    prompts: tuple[str, ...]
    dtypes: tuple[str, ...] = tuple(DTYPE_NAMES)
    split: int | str = "last"  # 'last', 'half' or a number of cached tokens
    mode: str = "chunk"

    def validate(self) -> "DtypesConfig":
        if not self.prompts:
            raise KvvizError("no prompts to run")
        for p in self.prompts:
            validate_prompt(p)
        for d in self.dtypes:
            parse_dtype(d)
        check_mode(self.mode, MODES, "mode")
        if self.split not in ("last", "half") and (isinstance(self.split, bool) or not isinstance(self.split, int)
                                                   or self.split < 1):
            raise KvvizError(f"the split is 'last', 'half' or a whole number of 1 or more, not {self.split!r}")
        return self

    def workload(self) -> Workload:
        """What the run holds, for its memory plan: each prompt (the longest counts) in each dtype beside float64."""
        # its time estimate: per prompt the split (two forwards in chunk mode, about one and a half in step mode) in
        # float64 and in each dtype, each a copy of the model; a single prompt's precision verdicts proved
        names = tuple(dict.fromkeys(["float64"] + [str(d) for d in self.dtypes]))
        return Workload(texts=tuple(self.prompts), dtypes=tuple(self.dtypes),
                        split=self.split if isinstance(self.split, int) and not isinstance(self.split, bool) else None,
                        forwards=(1.5 if self.mode == "step" else 2.0) * len(self.prompts), run_dtypes=names,
                        copies=names, proves=len(self.prompts) == 1)


def run(lm: LoadedModel, config: DtypesConfig, ctx: RunContext = DEFAULT_CONTEXT) -> DtypesResult:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    config.validate()
    with ctx.running() as progress:
        return run_dtypes(lm, list(config.prompts), config.dtypes, split=config.split, mode=config.mode,
                          progress=progress, settings=ctx.settings, prove=ctx.prove, on_phase=ctx.on_phase)
