"""Backends on the execution seam: cache kinds, precision flags and torch.compile, each applied for one run only.

Cache kinds (`ExecSettings.cache`):
  dynamic           the model's own DynamicCache (the default);
  static            StaticCache sized to the run (sliding layers get static sliding-window layers, as transformers
                    builds them for the model's config);
  offloaded         DynamicCache(offloading=True): layers parked on the CPU between uses;
  offloaded_static  StaticCache(offloading=True);
  quantized         QuantizedCache - transformers' fp8 backend by default (no extra package); `quantized:quanto` /
                    `quantized:hqq` when those packages are installed. Lossy by design.

Precision flags (`ExecSettings.flags`), set when a run starts and restored exactly when it ends, also on error:
  tf32                           TF32 for float32 matmuls and convolutions (CUDA);
  no-bf16-reduced-reduction      full-precision reductions inside bfloat16 matmuls (CUDA);
  no-fp16-reduced-reduction      the same for float16;
  deterministic                  torch.use_deterministic_algorithms(True, warn_only=True), cuDNN deterministic;
  sdpa=math|flash|efficient|cudnn   the only scaled_dot_product_attention backend allowed.
Flags are process-wide in torch, so a run that changes them has the process to itself: runs take a shared lock,
runs with flags take it exclusively. Nothing leaks to another run, page or session.

Compile (`ExecSettings.compile`): default, reduce-overhead, max-autotune - `torch.compile` of a wrapper around the
model's forward (the shared model is not changed); `compile_stats()` counts what dynamo really compiled.
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Callable
import os
import shutil
import sys

import torch
from transformers import DynamicCache, QuantizedCache, StaticCache

from .errors import KvvizError
from .execution import (CacheKind, ExecSettings, register_cache_kind, register_compiler, register_run_context,
                        register_settings_check)
from .flags import SDPA_BACKENDS, precision_flags
from ..models.loading import LoadedModel
from ..models.quanto_ext import prepare

CACHE_KINDS = (CacheKind.DYNAMIC, CacheKind.STATIC, CacheKind.OFFLOADED, CacheKind.OFFLOADED_STATIC,
               CacheKind.QUANTIZED)  # what the backends page offers
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
FLAGS = ("tf32", "no-bf16-reduced-reduction", "no-fp16-reduced-reduction", "deterministic")
QUANT_BACKENDS = ("fp8", "quanto", "hqq")


# ------------------------------------------------------------------------------------------------------------------
# Cache kinds


def _needs_gpu(lm: LoadedModel) -> None:
    if lm.device.type != "cuda":
        raise KvvizError("an offloaded cache parks its layers on the CPU between uses on a CUDA GPU; transformers "
                         f"needs CUDA for it, and this run is on {lm.device.type}")


def _static(lm: LoadedModel, batch: int, max_len: int, offloading: bool = False):
    if offloading:
        _needs_gpu(lm)
    return StaticCache(config=lm.config, max_cache_len=max_len, offloading=offloading)


def _offloaded(lm: LoadedModel, batch: int, max_len: int):
    _needs_gpu(lm)
    return DynamicCache(config=lm.config, offloading=True)


def quantized_cache(lm: LoadedModel, backend: str = "fp8", nbits: int | None = None,
                    residual_length: int | None = None, q_group_size: int | None = None):
    """transformers' QuantizedCache with `backend` (fp8 needs no package; quanto and hqq need theirs)."""
    if backend not in QUANT_BACKENDS:
        raise KvvizError(f"unknown quantized-cache backend '{backend}'; choose one of {', '.join(QUANT_BACKENDS)}")
    kwargs = {} if backend == "fp8" else {k: v for k, v in (("nbits", nbits), ("residual_length", residual_length),
                                                            ("q_group_size", q_group_size)) if v is not None}
    if backend == "quanto":
        prepare(lm.device)  # quanto's compiled unpack: never a silent wait on its build lock (kvviz/models/quanto_ext.py)
    try:
        return QuantizedCache(backend=backend, config=lm.config, **kwargs)
    except ImportError as e:
        pkg = {"quanto": "optimum-quanto", "hqq": "hqq"}.get(backend, backend)
        raise KvvizError(f"the {backend} quantized cache needs the package {pkg}, which is not installed here "
                         f"({str(e).splitlines()[0][:120]})") from None
    except ValueError as e:
        raise KvvizError(f"a quantized cache cannot be used with this model: {str(e).splitlines()[0][:200]}") from None


def kv_group_size(lm: LoadedModel) -> int:
    """transformers' default group of 64 values must divide kv_heads x head_dim (the values quantized together at
    every length along axis 0): tiny models with 2 x 16 = 32 need 32. The largest divisor of that up to 64."""
    cfg = lm.config
    heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", None) \
        or getattr(cfg, "n_head", 1)
    head_dim = getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", None) or cfg.n_embd) // \
        (getattr(cfg, "num_attention_heads", None) or cfg.n_head)
    return math.gcd(64, int(heads) * int(head_dim))


def _quantized_factory(backend: str):
    def make(lm: LoadedModel, batch: int, max_len: int):
        return quantized_cache(lm, backend, q_group_size=None if backend == "fp8" else kv_group_size(lm))
    return make


# ------------------------------------------------------------------------------------------------------------------
# Precision flags


def check_flags(settings: ExecSettings) -> None:
    for flag in settings.flags:
        if flag.startswith("sdpa="):
            if flag.split("=", 1)[1] not in SDPA_BACKENDS:
                raise KvvizError(f"unknown sdpa backend in '{flag}'; choose sdpa={'|'.join(SDPA_BACKENDS)}")
        elif flag not in FLAGS:
            raise KvvizError(f"unknown flag '{flag}'; choose from {', '.join(FLAGS)}, sdpa=<backend>")
    if settings.compile not in COMPILE_MODES:
        raise KvvizError(f"unknown compile mode '{settings.compile}'; choose one of {', '.join(COMPILE_MODES)}")


def _run_wait_limit() -> float:
    """KVVIZ_RUN_WAIT_TIMEOUT: how long a run waits for the runs ahead of it to release the precision flags."""
    try:
        value = float(os.environ.get("KVVIZ_RUN_WAIT_TIMEOUT", "600"))
    except ValueError:
        value = 600.0
    return value if value > 0 else 600.0


class _SharedExclusive:
    """Many runs at once, or one run that changes process-wide flags alone. A run waits for the others at most
    KVVIZ_RUN_WAIT_TIMEOUT seconds (600 by default), then is refused in one line: never a silent wait."""

    def __init__(self):
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._owner: int | None = None
        self._depth = 0

    @contextlib.contextmanager
    def hold(self, exclusive: bool):
        me = threading.get_ident()
        with self._cond:
            if self._exclusive and self._owner == me:  # nested run in the same thread
                self._depth += 1
                reentrant = True
            else:
                reentrant = False
                limit = _run_wait_limit()
                if not self._cond.wait_for(lambda: not (self._exclusive or (exclusive and self._shared)), limit):
                    what = ("a run with precision flags" if self._exclusive else
                            f"{self._shared} run{'s' if self._shared != 1 else ''} in progress")
                    raise KvvizError(f"this run waited {limit:.0f} s for {what} to finish (precision flags are "
                                     f"process-wide, so a run that sets them runs alone): stop it or wait, then "
                                     f"retry (KVVIZ_RUN_WAIT_TIMEOUT sets the limit)")
                if exclusive:
                    self._exclusive, self._owner, self._depth = True, me, 1
                else:
                    self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                if reentrant or (exclusive and self._depth > 1):
                    self._depth -= 1
                elif exclusive:
                    self._exclusive, self._owner, self._depth = False, None, 0
                else:
                    self._shared -= 1
                self._cond.notify_all()


_FLAGS_LOCK = _SharedExclusive()


@contextlib.contextmanager
def _flags_context(settings: ExecSettings, lm: LoadedModel):
    exclusive = bool(settings.flags)
    with _FLAGS_LOCK.hold(exclusive), (precision_flags(settings.flags) if exclusive else contextlib.nullcontext()):
        yield


# ------------------------------------------------------------------------------------------------------------------
# torch.compile

_COMPILED: dict[tuple[int, str], Callable] = {}
_COMPILE_LOCK = threading.Lock()


def compile_stats() -> dict:
    """What dynamo has compiled so far in this process (frames, graphs, recompiles): take differences."""
    utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing compiled yet (its import takes seconds)
    if utils is None:
        return {"frames": 0, "graphs": 0, "recompiles": 0}
    counters = utils.counters
    stats = counters.get("stats", {})
    return {"frames": int(stats.get("unique_graphs", 0)), "graphs": int(stats.get("calls_captured", 0)),
            "recompiles": int(sum(counters.get("recompiles", {}).values()))}


def _compiler(lm: LoadedModel, mode: str) -> Callable:
    ok, why = compiler_works()
    if not ok:
        raise KvvizError(f"torch.compile cannot run here: {why}")
    key = (id(lm.model), mode)
    with _COMPILE_LOCK:
        if key not in _COMPILED:
            model = lm.model

            def forward(**kwargs):
                return model(**kwargs)

            _COMPILED[key] = torch.compile(forward, mode=None if mode == "default" else mode, dynamic=None)
        return _COMPILED[key]


def compiler_works() -> tuple[bool, str]:
    """Can torch.compile build kernels here (a C++ compiler on CPU)? (ok, one-line reason)."""
    if torch.cuda.is_available():
        return True, "CUDA"
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    return (True, cxx) if cxx else (False, "no C++ compiler found for torch.compile on the CPU (install g++)")


# ------------------------------------------------------------------------------------------------------------------
# Registration: explicit, called once by kvviz/__init__.py (idempotent); importing this module registers nothing


def register() -> None:
    """Add the cache kinds, the precision-flag checks and run context, and torch.compile to the execution seam."""
    register_cache_kind(CacheKind.STATIC, _static)
    register_cache_kind(CacheKind.OFFLOADED, _offloaded)
    register_cache_kind(CacheKind.OFFLOADED_STATIC, functools.partial(_static, offloading=True))
    for kind, backend in ((CacheKind.QUANTIZED, "fp8"), (CacheKind.QUANTIZED_FP8, "fp8"),
                          (CacheKind.QUANTIZED_QUANTO, "quanto"), (CacheKind.QUANTIZED_HQQ, "hqq")):
        register_cache_kind(kind, _quantized_factory(backend))
    register_settings_check(check_flags)
    register_run_context(_flags_context)
    register_compiler(_compiler)
