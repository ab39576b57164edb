"""Dtype names, their machine epsilon, and which devices can run them."""
from __future__ import annotations

import torch

from .errors import KvvizError

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES = tuple(DTYPES)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise KvvizError(f"dtype {name} is not supported; choose one of {', '.join(DTYPE_NAMES)}")
        return name
    key = str(name).strip().lower().removeprefix("torch.")
    key = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32",
           "fp16": "float16", "half": "float16", "bf16": "bfloat16"}.get(key, key)
    if key not in DTYPES:
        raise KvvizError(f"unknown dtype '{name}'; choose one of {', '.join(DTYPE_NAMES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def machine_eps(dtype: torch.dtype) -> float:
    """Distance from 1.0 to the next representable number: the unit the precision views use."""
    return float(torch.finfo(dtype).eps)


def resolve_device(device: str | None = "auto") -> torch.device:
    """`auto`: cuda, else mps, else cpu. Anything else must be a device this machine has."""
    name = (device or "auto").strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise KvvizError(f"unknown device '{device}'; use auto, cpu, cuda or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KvvizError(f"device '{device}' asked for, but no CUDA GPU is available here; use auto or cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise KvvizError(f"device '{device}' does not exist; this machine has {torch.cuda.device_count()} GPU(s)")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise KvvizError(f"device '{device}' asked for, but MPS is not available here; use auto or cpu")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise KvvizError(f"device '{device}' is not supported; use auto, cpu, cuda or mps")
    return dev


def supports_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """MPS has no float64; everything else here runs all four dtypes."""
    return not (device.type == "mps" and dtype == torch.float64)


def float64_device(device: torch.device) -> torch.device:
    """Where the float64 reference runs: the same device, or the CPU where the device has no float64."""
    return device if supports_dtype(device, torch.float64) else torch.device("cpu")


def exact_in(src: torch.dtype | None, dst: torch.dtype) -> bool:
    """Does casting src to dst keep every value? (bfloat16 and float16 do not hold each other.)"""
    if src is None or src == dst:
        return True
    wider = {torch.float32: (torch.float16, torch.bfloat16), torch.float64: (torch.float32, torch.float16,
                                                                              torch.bfloat16)}
    return src in wider.get(dst, ())


def check_attention_dtype(attn: str, dt: "torch.dtype", dev: "torch.device") -> None:
    """Refuse in one line an attention implementation that has no kernel for this dtype on this device (torch's
    FlexAttention compiles float32, float16 and bfloat16 only on the CPU)."""
    if attn == "flex_attention" and dt == torch.float64 and dev.type == "cpu":
        raise KvvizError("flex_attention has no float64 kernel on the CPU (torch's FlexAttention takes float32, "
                         "float16 and bfloat16 there), and a verdict's reference runs the model in float64: pick "
                         "sdpa or eager, or run on a GPU")
