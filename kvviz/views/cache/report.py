"""The cache view's report: its result rebuilt from a JSON export (no model runs) and its verdict line."""
from __future__ import annotations

from .run import ContinueResult
from .size import SizeReport

def reopen_reload(d: dict):
    return ContinueResult(**d)


def reopen_size(d: dict):
    return SizeReport(**d)


def verdict_reload(result) -> tuple[str, str]:
    return ("bitwise equal" if result.bitwise_equal else "differs",
            f"Reloaded {result.n_cached} cached tokens and fed {len(result.continuation_tokens)} more: largest "
            f"gap to a fresh cache — logits {result.max_abs_logits:.3g}, hidden states {result.max_abs_hidden:.3g}, "
            f"keys/values {result.max_abs_kv:.3g}.")


def verdict_size(result) -> tuple[str, str]:
    measured = "—" if result.measured_bytes is None else f"{result.measured_bytes:,}"
    return ("size", f"{result.model} in {result.dtype}: {result.per_token_bytes:,} bytes per token; "
                    f"{result.tokens} tokens × batch {result.batch}: formula {result.formula_bytes:,} bytes, "
                    f"measured {measured} bytes.")
