"""Text for display: tokens decoded so that multi-byte characters are whole, and numbers people can read.

Byte-level tokenizers split a character such as "Б" or "世" or "🤖" into several tokens; decoded one by one each
piece is "\ufffd". `display_tokens` decodes such runs together: the whole character goes on the first token of the
run and the following pieces show "·" (one entry per token, so positions stay aligned).
"""
from __future__ import annotations

import math

REPLACEMENT = "\ufffd"
CONTINUATION = "·"
_MAX_RUN = 8  # a UTF-8 character is at most 4 bytes; allow a little slack for merged pieces


def display_tokens(tokenizer, ids: list[int]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(ids):
        piece = tokenizer.decode([ids[i]])
        if REPLACEMENT not in piece:
            out.append(piece)
            i += 1
            continue
        for j in range(i + 2, min(len(ids), i + _MAX_RUN) + 1):
            run = tokenizer.decode(ids[i:j])
            if REPLACEMENT not in run:
                out.append(run)
                out.extend([CONTINUATION] * (j - i - 1))
                i = j
                break
        else:  # no clean run (a cut-off character, or a real U+FFFD): keep the piece as it is
            out.append(piece)
            i += 1
    return out


def fmt_number(v, digits: int = 3) -> str:
    """3 significant digits; scientific when small or large; "—" for missing or not finite."""
    if v is None:
        return "—"
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(x):
        return "—"
    if math.isinf(x):
        return "∞" if x > 0 else "−∞"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e5:
        return f"{x:.{digits}g}"
    return f"{x:.{digits - 1}e}"
