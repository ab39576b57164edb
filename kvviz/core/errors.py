"""The one exception kvviz raises for anything a user can fix: its message is a single clear line."""

import gc
import traceback

import torch


class KvvizError(Exception):
    """A problem with the user's input or environment, with a one-line message meant for people."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def first_line(e: BaseException, limit: int = 300, fallback: str | None = None, typed: bool = False) -> str:
    """An exception's message as one line: its first non-empty line, at most `limit` characters ("…" marks a cut);
    an exception without a message gives `fallback` (its class name by default).
    typed: the line starts with the class name ("ValueError: bad shape"; the class name alone without a message),
    and `limit` counts the whole line."""
    name = type(e).__name__
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), None)
    if typed:
        line = name if text is None else f"{name}: {text}"
    elif text is None:
        return name if fallback is None else fallback
    else:
        line = text
    return line if len(line) <= limit else line[:limit - 1] + "…"


OUT_OF_MEMORY_HINT = ("out of memory; use a shorter prompt, fewer new tokens or prompts, a 16-bit dtype or a smaller "
                      "model")


def is_out_of_memory(e: BaseException) -> bool:
    """MemoryError, torch's OutOfMemoryError (a RuntimeError) on any device, the CPU allocator's "can't allocate
    memory", or an mmap/read refused for memory (ENOMEM, e.g. under RLIMIT_AS)."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or (isinstance(e, (RuntimeError, OSError)) and any(
        s in text for s in ("out of memory", "can't allocate memory", "cannot allocate memory",
                            "not enough memory")))


def free_memory(error: BaseException | None = None) -> None:
    """Give memory back after an out-of-memory error, so the next run can start clean. The error's traceback holds
    the failed run's frames (and their tensors): clear them first."""
    if error is not None and error.__traceback__ is not None:
        traceback.clear_frames(error.__traceback__)

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
