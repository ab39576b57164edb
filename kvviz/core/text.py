"""Text for display: tokens decoded so that multi-byte characters are whole, and numbers people can read.

Byte-level tokenizers split a character such as "Б" or "世" or "🤖" into several tokens; decoded one by one each
piece is "\ufffd". `display_tokens` decodes such runs together: the whole character goes on the first token of the
run and the following pieces show "·" (one entry per token, so positions stay aligned).
"""
from __future__ import annotations

import math

from ..models.compat import byte_level_table

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
        else:  # no clean run (a cut-off character, random bytes): show the bytes themselves, never "\ufffd"
            out.append(_bytes_piece(tokenizer, ids[i], piece))
            i += 1
    return out


def display_text(tokenizer, ids: list[int]) -> str:
    """A decoded text for display: as the tokenizer decodes it, except that bytes which are not valid UTF-8 (a
    random model's output, a cut-off character) show as their bytes ("⟨e4 b8⟩") instead of "\ufffd" mojibake."""
    text = tokenizer.decode(ids)
    if REPLACEMENT not in text:
        return text
    return "".join(t for t in display_tokens(tokenizer, ids) if t != CONTINUATION)


def _byte_table() -> dict[str, int]:
    return byte_level_table()


def _bytes_piece(tokenizer, token_id: int, piece: str) -> str:
    """A token that is not valid UTF-8 on its own or with its neighbours, shown as its bytes ("⟨e4 b8⟩"), with any
    valid characters around them kept. Falls back to "⟨?⟩" where the tokenizer's byte pieces are unknown."""
    try:
        raw = tokenizer.convert_ids_to_tokens(int(token_id))
    except Exception:  # noqa: BLE001 - display only
        raw = None
    data = None
    if isinstance(raw, str) and raw.startswith("<0x") and raw.endswith(">") and len(raw) == 6:  # byte fallback
        data = bytes([int(raw[3:5], 16)])
    elif isinstance(raw, str):
        table = _byte_table()
        if table and all(c in table for c in raw):  # byte-level BPE (GPT-2 style)
            data = bytes(table[c] for c in raw)
    if data is None:
        return piece.replace(REPLACEMENT, "⟨?⟩")
    out, k = [], 0
    while k < len(data):
        for n in (4, 3, 2, 1):
            try:
                ch = data[k:k + n].decode("utf-8")
            except UnicodeDecodeError:
                continue
            if len(ch) == 1 or n == 1:
                out.append(ch)
                k += n
                break
        else:
            j = k
            while j < len(data) and data[j] >= 0x80:
                j += 1
            j = max(j, k + 1)
            out.append("⟨" + " ".join(f"{b:02x}" for b in data[k:j]) + "⟩")
            k = j
    return "".join(out)


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
