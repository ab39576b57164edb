"""Where a result was computed: versions, device, and every global precision flag that can change the numbers.

Every exported result carries `environment()`; `compare_environments(a, b)` says in one line what differs, so a
result opened on another machine says why its numbers may not be reproduced bit for bit."""
from __future__ import annotations

import platform

import torch
import transformers

from ..models import compat
from .. import __version__


def precision_flags() -> dict:
    """The current values of the global torch settings that change float results."""
    cuda_matmul = torch.backends.cuda.matmul
    flags = {
        "cuda_matmul_allow_tf32": bool(cuda_matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_fp16_reduced_precision_reduction":
            bool(cuda_matmul.allow_fp16_reduced_precision_reduction),
        "cuda_matmul_allow_bf16_reduced_precision_reduction":
            bool(cuda_matmul.allow_bf16_reduced_precision_reduction),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
    }
    for name in ("flash", "mem_efficient", "math", "cudnn"):
        fn = getattr(torch.backends.cuda, f"{name}_sdp_enabled", None)
        if fn is not None:
            flags[f"sdpa_{name}_enabled"] = bool(fn())
    return flags


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: str | torch.device | None = None) -> str:
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    if dev is not None and dev.type == "mps":
        return "Apple MPS"
    return cpu_name()


def environment(device: str | torch.device | None = None) -> dict:
    """kvviz, torch, transformers, CUDA/cuDNN versions, the device's name and the precision flags."""
    return {
        "kvviz": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "transformers_tested": compat.tested_range() + ("" if compat.in_tested_range() else
                                                 " (this transformers is outside it: views may fail or differ)"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": str(device) if device is not None else None,
        "device_name": device_name(device),
        "cpu": cpu_name(),
        "platform": platform.platform(terse=True),
        "flags": precision_flags(),
    }


# What must match for bitwise reproduction; the rest is informative.
_KEYS = ("torch", "transformers", "cuda", "device_name", "cpu")


def compare_environments(saved: dict | None, current: dict | None = None) -> list[str]:
    """What differs between a saved environment and this one (empty when nothing that matters differs)."""
    if not saved:
        return ["the result carries no environment"]
    current = current or environment(saved.get("device"))
    diffs = [f"{k}: {saved.get(k)} there, {current.get(k)} here" for k in _KEYS if saved.get(k) != current.get(k)]
    sf, cf = saved.get("flags") or {}, current.get("flags") or {}
    diffs += [f"flag {k}: {sf.get(k)} there, {cf.get(k)} here" for k in sorted(set(sf) | set(cf))
              if sf.get(k) != cf.get(k)]
    return diffs
