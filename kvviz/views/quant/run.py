"""Quantized KV caches and quantized weights, measured against the unquantized run of the same model.

Quantization changes the numbers by design, so its gaps are neither precision nor logic: they are `lossy`, and the
question is how much. kvviz answers with three figures, all against the unquantized model with a dynamic cache:

  per-step KL        KL(unquantized || quantized) of the next-token distribution at every decoding step, teacher
                     forced along the unquantized run's tokens (so every step compares the same context);
  agreement length   how many greedy tokens the quantized run produces before its text parts from the unquantized
                     one (free running, each on its own tokens);
  max gap per layer  the largest |Δ| of each layer's hidden state over the teacher-forced steps (and relative to the
                     layer's own scale).

KV caches: transformers' QuantizedCache - `quanto:int4`, `quanto:int2` (optimum-quanto), `hqq:int4`, `hqq:int2`,
`hqq:int8` (hqq), `fp8` (no package) - with a residual length: the last `residual_length` tokens stay unquantized
and are folded into the quantized part when the residual fills. The prefill's own forward sees the keys unquantized,
so the first step always agrees; decode steps read the quantized past.

Weights: `int8` / `int4` weight-only quantization of every nn.Linear with optimum-quanto (CPU and CUDA), applied to
a private deep copy of the model: the shared model is never changed. Models whose projections are not nn.Linear
(GPT-2's Conv1D) keep those in full precision; kvviz says how many layers were quantized. bitsandbytes is CUDA
only: `bnb-int8` / `bnb-nf4` reload the model's own files with transformers' BitsAndBytesConfig on a CUDA GPU, and
say so in one line anywhere else.

Combinations that cannot run here (a package that is not installed, a bit width the backend lacks) raise KvvizError
with a one-line message naming the package or the choices.
"""
from __future__ import annotations

import copy
import math
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable

import numpy as np
import torch
import transformers
from transformers import BitsAndBytesConfig

from ...core.backends import kv_group_size, quantized_cache  # noqa: F401 - kv_group_size: part of this module's API
from ...core import optional
from ...core.errors import KvvizError, first_line
from ...core.execution import DEFAULT_SETTINGS, Executor, RunInfo, RunSettings, StepPolicy
from ...core.inputs import PromptInputs, Workload, build_inputs
from ...models.loading import LoadedModel
from ...core.protocol import DEFAULT_CONTEXT, no_progress, Progress, RunContext
from ...core.metrics import hidden_divergence, logits_divergence
from ...core.naming import layer_labels, model_type
from ...core.text import display_tokens
from ...core.estimate import Timed
from ...models.quanto_ext import prepare


KV_BACKENDS = {"quanto": (2, 4), "hqq": (2, 4, 8), "fp8": ()}
KV_CHOICES = ("none", "fp8", "quanto:int4", "quanto:int2", "hqq:int4", "hqq:int2", "hqq:int8")
WEIGHT_CHOICES = ("none", "int8", "int4", "bnb-int8", "bnb-nf4")
PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
DEFAULT_RESIDUAL = 8
MAX_NEW_TOKENS = 256


def package_available(backend: str) -> bool:
    """Whether the package behind a backend imports here (fp8 needs none)."""
    return backend not in PACKAGES or optional.importable(PACKAGES[backend][0])  # missing or broken: False


def _need(backend: str, what: str) -> None:
    if not package_available(backend):
        raise KvvizError(f"{what} needs the package {PACKAGES[backend][1]}, which is not installed here "
                         f"(pip install {PACKAGES[backend][1]})")


def parse_kv(kv: str) -> tuple[str, int | None]:
    """'quanto:int4' -> ('quanto', 4); 'fp8' -> ('fp8', None); 'none' -> ('none', None)."""
    kv = (kv or "none").strip().lower()
    if kv in ("none", "fp8"):
        return kv, None
    backend, _, bits = kv.partition(":")
    if backend not in KV_BACKENDS or not backend:
        raise KvvizError(f"unknown quantized KV cache '{kv}'; choose one of {', '.join(KV_CHOICES)}")
    if not bits.startswith("int") or not bits[3:].isdigit():
        raise KvvizError(f"a {backend} KV cache needs a bit width such as {backend}:int4; choose one of "
                         f"{', '.join(c for c in KV_CHOICES if c.startswith(backend))}")
    n = int(bits[3:])
    if n not in KV_BACKENDS[backend]:
        raise KvvizError(f"the {backend} KV cache has no {n}-bit mode here; choose "
                         f"{' or '.join(f'int{b}' for b in KV_BACKENDS[backend])}")
    return backend, n


def quantized_kv_cache(lm: LoadedModel, kv: str, residual_length: int = DEFAULT_RESIDUAL):
    """A fresh transformers QuantizedCache for `lm` as `kv` says ('quanto:int4', 'hqq:int2', 'fp8')."""
    backend, nbits = parse_kv(kv)
    if backend == "none":
        return None
    if backend != "fp8":
        _need(backend, f"the {backend} KV cache")
    return quantized_cache(lm, backend, nbits, residual_length if backend != "fp8" else None,
                           q_group_size=None if backend == "fp8" else kv_group_size(lm))


# ------------------------------------------------------------------------------------------------------------------
# Quantized weights: a private copy of the model, never the shared one

_WEIGHTS: "OrderedDict[tuple, LoadedModel]" = OrderedDict()
_WEIGHTS_LOCK = threading.Lock()


def quantize_weights(lm: LoadedModel, scheme: str, progress: Progress | None = None) -> LoadedModel:
    """`lm` with int8 / int4 weight-only quantized linear layers (optimum-quanto), as a new LoadedModel around a deep
    copy; the last two are kept, so a page rerun does not quantize again."""
    progress = progress or no_progress
    scheme = (scheme or "none").strip().lower()
    if scheme == "none":
        return lm
    if scheme not in WEIGHT_CHOICES:
        raise KvvizError(f"unknown weight quantization '{scheme}'; choose one of {', '.join(WEIGHT_CHOICES)}")
    _weights_feasible(lm, scheme)
    key = (lm.spec.key, str(lm.dtype), str(lm.device), lm.attn_implementation, id(lm.model), scheme)
    with _WEIGHTS_LOCK:
        if key in _WEIGHTS:
            _WEIGHTS.move_to_end(key)
            return _WEIGHTS[key]
    if scheme.startswith("bnb-"):
        return _keep(key, _bnb_weights(lm, scheme, progress))
    from optimum.quanto import freeze, qint4, qint8, quantize

    prepare(lm.device, progress)  # no silent wait on quanto's extension build (kvviz/models/quanto_ext.py)
    progress(0.05, f"Copying the model to quantize its weights to {scheme}…")
    with lm.lock:
        model = copy.deepcopy(lm.model)
    progress(0.5, f"Quantizing the linear layers to {scheme} (optimum-quanto, weight-only)…")
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if not linear:
        raise KvvizError(f"{lm.name} has no nn.Linear layers to quantize (its projections are another kind), so "
                         f"weight quantization would change nothing")
    try:
        quantize(model, weights={"int8": qint8, "int4": qint4}[scheme])
        freeze(model)
    except Exception as e:  # noqa: BLE001 - quanto's own limits (shapes, dtypes, devices)
        raise KvvizError(f"optimum-quanto could not quantize {lm.name} to {scheme}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}") from None
    model.eval()
    total = sum(1 for m in lm.model.modules() if isinstance(m, (torch.nn.Linear,)) or type(m).__name__ == "Conv1D")
    note = (f"{scheme} weights: {len(linear)} of {total} linear layers quantized weight-only with optimum-quanto "
            f"(activations stay {str(lm.dtype).replace('torch.', '')})")
    if len(linear) < total:
        note += f"; {total - len(linear)} are not nn.Linear (e.g. GPT-2's Conv1D) and stay unquantized"
    q = replace(lm, model=model, description=f"{lm.description}; {note}", warnings=list(lm.warnings) + [note],
                lock=threading.RLock(), inference_mode=False)  # quanto's packed int4 weights fail under it
    progress(1.0, "Quantized")
    return _keep(key, q)


def _keep(key: tuple, q: LoadedModel) -> LoadedModel:
    """`q` kept under `key` beside the last quantized copy (the oldest beyond two dropped)."""
    with _WEIGHTS_LOCK:
        _WEIGHTS[key] = q
        while len(_WEIGHTS) > 2:
            _WEIGHTS.popitem(last=False)
    return q


def check_feasible(lm: LoadedModel, kv: str = "none", weights: str = "none") -> None:
    """Everything about a quantization choice that can be known before any run: the names, the packages, bitsandbytes'
    CUDA, a float64 model's weights, a KV cache the model refuses (sliding-window layers). Raises KvvizError with one
    line; the card and the Quantized view call it before their first forward."""
    QuantConfig("x", kv=kv or "none", weights=weights or "none").validate()
    w = (weights or "none").strip().lower()
    if w != "none":
        _weights_feasible(lm, w)
    if (kv or "none").strip().lower() != "none":
        quantized_kv_cache(lm, kv)  # an empty cache object, built now: a missing package or a refusal says so here


def _weights_feasible(lm: LoadedModel, scheme: str) -> None:
    if lm.dtype == torch.float64:
        raise KvvizError("quantized weights need a float32, float16 or bfloat16 model, not float64 (kvviz's "
                         "reference); pick another dtype")
    if scheme.startswith("bnb-"):
        _need_bnb(lm, scheme)
    else:
        _need("quanto", f"{scheme} weights")


def _need_bnb(lm: LoadedModel, scheme: str) -> None:
    if lm.device.type != "cuda":
        raise KvvizError(f"{scheme} weights use bitsandbytes, which needs a CUDA GPU; this run is on "
                         f"{lm.device.type}: pick int8 or int4 (optimum-quanto) instead")
    if not optional.importable("bitsandbytes"):
        raise KvvizError(f"{scheme} weights need the package bitsandbytes, which is not installed here "
                         f"(pip install bitsandbytes)")


def _bnb_weights(lm: LoadedModel, scheme: str, progress: Progress) -> LoadedModel:
    """The model's own files loaded again with a BitsAndBytesConfig (CUDA only): 8-bit or 4-bit NF4 weights."""
    progress(0.1, f"Loading {lm.name} again with bitsandbytes {scheme[4:]} weights…")
    qc = (BitsAndBytesConfig(load_in_8bit=True) if scheme == "bnb-int8" else
          BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=lm.dtype))
    kw = dict(dtype=lm.dtype, quantization_config=qc, device_map={"": lm.device.index or 0},
              trust_remote_code=lm.trust_remote_code, local_files_only=lm.spec.kind != "hub")
    if lm.attn_requested != "auto":
        kw["attn_implementation"] = lm.attn_requested
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(lm.source, **kw).eval()
    except Exception as e:  # noqa: BLE001 - bitsandbytes' own limits
        raise KvvizError(f"bitsandbytes could not load {lm.name} as {scheme}: {first_line(e, 200)}") from None
    note = f"{scheme} weights: the model's files reloaded with bitsandbytes ({scheme[4:]}) on {lm.device}"
    progress(1.0, "Quantized")
    return replace(lm, model=model, description=f"{lm.description}; {note}", warnings=list(lm.warnings) + [note],
                   lock=threading.RLock())


# ------------------------------------------------------------------------------------------------------------------
# The comparison


@dataclass(frozen=True)
class QuantConfig:
    prompt: str
    kv: str = "quanto:int4"
    residual_length: int = DEFAULT_RESIDUAL
    weights: str = "none"
    max_new_tokens: int = 24

    def validate(self) -> None:
        parse_kv(self.kv)
        if self.weights not in WEIGHT_CHOICES:
            raise KvvizError(f"unknown weight quantization '{self.weights}'; choose one of "
                             f"{', '.join(WEIGHT_CHOICES)}")
        if self.kv == "none" and self.weights == "none":
            raise KvvizError("nothing is quantized: choose a quantized KV cache, quantized weights, or both")
        for name, v, lo, hi in (("new tokens", self.max_new_tokens, 2, MAX_NEW_TOKENS),
                                ("the residual length", self.residual_length, 1, 4096)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise KvvizError(f"{name} must be a whole number from {lo} to {hi}, not {v!r}")

    def workload(self) -> Workload:
        """What the run holds, for its memory plan: the prompt, the new tokens, a quantized copy of the weights."""
        # its time estimate: three decodes through a cache (the unquantized run, the quantized one teacher forced and
        # free running), and a quantized copy of the weights where they are quantized
        return Workload(texts=(self.prompt,), new_tokens=int(self.max_new_tokens), weights=str(self.weights),
                        forwards=3.0, decode_paths=3,
                        casts=(str(self.weights),) if str(self.weights or "none") != "none" else ())

    def check_feasible(self, lm: LoadedModel) -> None:
        """What can be known before any run (check_feasible): KvvizError with one line."""
        check_feasible(lm, self.kv, self.weights)

    @property
    def label(self) -> str:
        parts = []
        if self.kv != "none":
            parts.append(f"{self.kv} KV cache" + ("" if self.kv == "fp8" else f" (residual {self.residual_length})"))
        if self.weights != "none":
            parts.append(f"{self.weights} weights")
        return " + ".join(parts)


@dataclass(frozen=True)
class QuantSettings(RunSettings):
    prompt: str = ""
    kv: str = "none"
    residual_length: int = DEFAULT_RESIDUAL
    weights: str = "none"
    max_new_tokens: int = 0

    @classmethod
    def of(cls, cfg: QuantConfig, run: RunInfo) -> "QuantSettings":
        return cls.from_run(run, **{f.name: getattr(cfg, f.name) for f in fields(QuantConfig)})

    @property
    def config(self) -> QuantConfig:
        return QuantConfig(**{f.name: getattr(self, f.name) for f in fields(QuantConfig)})


@dataclass
class QuantResult(Timed):
    settings: QuantSettings
    label: str
    verdict: str  # lossy | identical
    explanation: str
    reference_tokens: list[str]
    quantized_tokens: list[str]
    reference_text: str
    quantized_text: str
    agreement: int  # greedy tokens before the texts part (= steps when they never do)
    steps: int
    kl: list[float]  # per teacher-forced step
    logits_max_abs: list[float]
    argmax_agree: list[bool]
    layers: list[str]
    layer_max_abs: list[float]  # per layer, over the steps
    layer_relative: list[float]
    bitwise_equal: bool
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def kl_max(self) -> float:
        return max(self.kl) if self.kl else 0.0

    @property
    def kl_mean(self) -> float:
        return float(np.mean(self.kl)) if self.kl else 0.0

    @property
    def worst_layer(self) -> str:
        if not self.layers or max(self.layer_relative) == 0:
            return "—"  # no hidden state moved: only the logits (a quantized head) differ
        return self.layers[int(np.argmax(self.layer_relative))]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["settings"] = self.settings.to_dict()
        d.update(kl_max=self.kl_max, kl_mean=self.kl_mean, worst_layer=self.worst_layer)
        return d


def _decode(ex: Executor, inp: PromptInputs, n: int, cache, forced: list[int] | None = None,
            on_step: Callable[[int], None] | None = None):
    """Prefill, then one token at a time through `cache` (None: a dynamic cache) with the full mask and positions.
    Returns the tokens, the last position's logits [n, V] and hidden states [n, L+1, H], all on the device."""
    d = ex.decode(inp.ids, inp.mask, n, policy=StepPolicy.CACHE, positions=inp.positions, cache=cache, fresh_cache=False,
                  forced=forced, on_step=None if on_step is None else (lambda t, lg, h, tok: on_step(t)),
                  no_cache_error=f"{ex.lm.name} returns no KV cache (its attention is bidirectional, like RoBERTa "
                                 f"without is_decoder), so there is no cache to quantize and no cached decoding "
                                 f"to compare")
    return d.tokens, d.stacked_logits(), torch.stack(d.hidden)


def run_quant(lm: LoadedModel, cfg: QuantConfig, progress: Progress | None = None) -> QuantResult:
    """Quantized (KV cache and/or weights) against the unquantized model with a dynamic cache, on `lm`'s dtype."""
    progress = progress or no_progress
    cfg.validate()
    backend, _ = parse_kv(cfg.kv)
    if backend == "quanto" or cfg.weights.strip().lower() in ("int8", "int4"):
        if package_available("quanto"):
            prepare(lm.device, lambda f, m: progress(0.0, m))  # a build's wait says so, bounded
    check_feasible(lm, cfg.kv, cfg.weights)
    t0 = time.perf_counter()
    n = cfg.max_new_tokens
    inp = build_inputs(lm, cfg.prompt, extra_tokens=n)
    qlm = quantize_weights(lm, cfg.weights, lambda f, m: progress(0.05 + 0.15 * f, m))
    notes = [w for w in qlm.warnings if w not in lm.warnings]

    def cache():
        return quantized_kv_cache(qlm, cfg.kv, cfg.residual_length) if backend != "none" else None

    def steps(lo: float, what: str):  # per-step progress: a Stop click lands within one token
        return lambda t: progress(lo + 0.25 * (t + 1) / n, f"{what}: token {t + 1} of {n}")

    progress(0.2, "The unquantized run (dynamic cache)…")
    ex_ref = Executor(lm, DEFAULT_SETTINGS)
    with ex_ref.session():
        ref_tokens, ref_logits, ref_hidden = _decode(ex_ref, inp, n, None, on_step=steps(0.2, "unquantized"))
    qinp = inp if qlm.device == lm.device else build_inputs(qlm, cfg.prompt, extra_tokens=n)
    ex_q = Executor(qlm, DEFAULT_SETTINGS)
    progress(0.45, f"The quantized run along the unquantized tokens ({cfg.label})…")
    with ex_q.session():
        _, tf_logits, tf_hidden = _decode(ex_q, qinp, n, cache(), forced=ref_tokens,
                                          on_step=steps(0.45, "quantized, teacher forced"))
        progress(0.7, f"The quantized run on its own tokens ({cfg.label})…")
        q_tokens, _, _ = _decode(ex_q, qinp, n, cache(), on_step=steps(0.7, "quantized, free running"))
    progress(0.95, "Measuring…")
    with torch.inference_mode():
        ld = logits_divergence(ref_logits, tf_logits)
        eps = torch.finfo(lm.dtype).eps
        hd = hidden_divergence(ref_hidden.transpose(0, 1), tf_hidden.transpose(0, 1), eps)  # [L+1, n]
        kl = ld["kl"].cpu().tolist()
        lmax = ld["max_abs"].cpu().tolist()
        agree = ld["argmax_agree"].cpu().tolist()
        layer_abs = hd["max_abs"].amax(-1).cpu().tolist()
        layer_rel = hd["relative"].amax(-1).cpu().tolist()
        bitwise = bool(torch.equal(ref_logits, tf_logits) and torch.equal(ref_hidden, tf_hidden))
    agreement = next((i for i, (a, b) in enumerate(zip(ref_tokens, q_tokens)) if a != b), n)
    tok = lm.tokenizer
    res = QuantResult(
        settings=QuantSettings.of(cfg, RunInfo.of(lm)), label=cfg.label, verdict="identical" if bitwise else "lossy",
        explanation="", reference_tokens=display_tokens(tok, ref_tokens), quantized_tokens=display_tokens(tok, q_tokens),
        reference_text=tok.decode(ref_tokens), quantized_text=tok.decode(q_tokens), agreement=agreement, steps=n,
        kl=kl, logits_max_abs=lmax, argmax_agree=agree,
        layers=layer_labels(ref_hidden.shape[1], model_type(lm)), layer_max_abs=layer_abs, layer_relative=layer_rel, bitwise_equal=bitwise, notes=notes,
        seconds=time.perf_counter() - t0)
    res.explanation = explain(res)
    progress(1.0, "Done")
    return res


def explain(res: QuantResult) -> str:
    if res.bitwise_equal:
        return (f"Identical, bit for bit: with {res.label} this run computes exactly what the unquantized one does "
                f"(nothing that was quantized was read, e.g. every token still in the residual).")
    bad = [i for i, v in enumerate(res.logits_max_abs) if not math.isfinite(v)]
    if bad:  # e.g. transformers' fp8 QuantizedCache on CUDA
        return (f"Lossy, and worse: with {res.label} the quantized run produced non-finite values (NaN or inf) from "
                f"step {bad[0]} on ({len(bad)} of {res.steps} steps): the quantized cache broke the computation, "
                f"beyond rounding. Try another quantized cache kind.")
    parted = (f"the greedy text agrees for all {res.steps} tokens" if res.agreement >= res.steps else
              f"the greedy text agrees for {res.agreement} of {res.steps} tokens, then parts")
    return (f"Lossy by design ({res.label}): {parted}; per-step KL(unquantized ‖ quantized) mean {res.kl_mean:.3g}, "
            f"max {res.kl_max:.3g}; "
            + (f"the largest hidden-state gap is at {res.worst_layer} ({max(res.layer_relative):.3g} of the layer's "
               f"scale)" if res.worst_layer != "—" else "no hidden state moves: only the output head's logits differ")
            + f"; next-token choice agrees on "
            f"{sum(res.argmax_agree)} of {res.steps} teacher-forced steps. This is neither precision nor logic: "
            f"quantization changes the numbers, and how much depends on the model.")


# what its run cannot honour (kvviz.core.protocol.RunContext.running; the CLI refuses the matching flag)
REFUSES = {'invariant': 'a quantized run is lossy by design; invariant mode cannot make it exact', 'prove': 'it runs no proof rerun'}


def run(lm: LoadedModel, config: QuantConfig, ctx: RunContext = DEFAULT_CONTEXT) -> QuantResult:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    with ctx.running(REFUSES) as progress:  # quantization decides its own cache and weights
        return run_quant(lm, config, progress)
