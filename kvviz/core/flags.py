"""Global precision flags set for one run and restored after it, also on error (TF32, reduced-precision
reductions, deterministic algorithms, an SDPA backend). kvviz.core.backends registers them as a run context; the backends
matrix's repro script embeds this module's source (kvviz.io.repro), so the script sets the flags exactly as kvviz does.
Keep this module to torch and contextlib only."""
import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION"}


def flag_state() -> dict:
    m = torch.backends.cuda.matmul
    return {"allow_tf32": m.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "f32_precision": torch.get_float32_matmul_precision(),
            "bf16_rr": m.allow_bf16_reduced_precision_reduction, "fp16_rr": m.allow_fp16_reduced_precision_reduction,
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic}


def set_flag_state(s: dict) -> None:
    m = torch.backends.cuda.matmul
    m.allow_tf32 = s["allow_tf32"]
    torch.backends.cudnn.allow_tf32 = s["cudnn_tf32"]
    torch.set_float32_matmul_precision(s["f32_precision"])
    m.allow_bf16_reduced_precision_reduction = s["bf16_rr"]
    m.allow_fp16_reduced_precision_reduction = s["fp16_rr"]
    torch.use_deterministic_algorithms(s["deterministic"], warn_only=s["deterministic_warn"])
    torch.backends.cudnn.deterministic = s["cudnn_deterministic"]


@contextlib.contextmanager
def precision_flags(flags):
    """Apply `flags` for the duration of the block and restore every value afterwards, also on error."""
    saved = flag_state()
    stack = contextlib.ExitStack()
    try:
        m = torch.backends.cuda.matmul
        for flag in flags:
            if flag == "tf32":
                m.allow_tf32 = True
                torch.backends.cudnn.allow_tf32 = True
                torch.set_float32_matmul_precision("high")
            elif flag == "no-bf16-reduced-reduction":
                m.allow_bf16_reduced_precision_reduction = False
            elif flag == "no-fp16-reduced-reduction":
                m.allow_fp16_reduced_precision_reduction = False
            elif flag == "deterministic":
                torch.use_deterministic_algorithms(True, warn_only=True)
                torch.backends.cudnn.deterministic = True
            elif flag.startswith("sdpa="):
                stack.enter_context(sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[flag.split("=", 1)[1]])))
        yield
    finally:
        stack.close()
        set_flag_state(saved)
