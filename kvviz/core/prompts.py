"""Prompt sets: the built-in set shipped with kvviz, and users' .txt / .jsonl files."""
from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

from .errors import KvvizError

# a prompt whose continuation every small model knows (the pages' default prompt)
CAPITALS = "The capital of France is Paris, and the capital of Italy is"

BUILTIN = "builtin"


@functools.lru_cache(maxsize=1)
def _builtin_rows() -> tuple[tuple[str, str], ...]:
    text = resources.files("kvviz").joinpath("data/prompts.jsonl").read_text(encoding="utf-8")
    return tuple((r["category"], r["prompt"]) for r in map(json.loads, filter(str.strip, text.splitlines())))


def builtin_prompts(category: str | None = None) -> list[dict]:
    """The built-in set: [{"category": ..., "prompt": ...}], written for kvviz (prose, code, lists, dialogue,
    several languages, facts, instructions, odd inputs). Read once per process."""
    rows = [{"category": c, "prompt": p} for c, p in _builtin_rows()]
    if category:
        rows = [r for r in rows if r["category"] == category]
    return rows


def parse_prompts(data: bytes | str, name: str = "prompts") -> list[str]:
    """Prompts from a file's contents: .jsonl (objects with "prompt" or "text", or plain JSON strings) or text
    with one prompt a line (a literal \\n inside a line stands for a newline)."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise KvvizError(f"{name} is not UTF-8 text; save it as UTF-8") from None
    lines = [ln for ln in data.splitlines() if ln.strip()]
    if not lines:
        raise KvvizError(f"{name} holds no prompts")
    prompts: list[str] = []
    if name.lower().endswith(".jsonl"):
        for i, ln in enumerate(lines, 1):
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError:
                raise KvvizError(f"{name}, line {i}: not valid JSON") from None
            if isinstance(obj, dict):
                obj = obj.get("prompt", obj.get("text"))
            if not isinstance(obj, str) or not obj.strip():
                raise KvvizError(f'{name}, line {i}: expected a string or an object with "prompt" or "text"')
            prompts.append(obj)
    else:
        prompts = [ln.replace("\\n", "\n") for ln in lines]
    return prompts


def load_prompts(source: str | Path, limit: int | None = None) -> list[str]:
    """`builtin` (or builtin:<category>) or a file path; at most `limit` prompts."""
    src = str(source)
    if src == BUILTIN or src.startswith(BUILTIN + ":"):
        cat = src.split(":", 1)[1] if ":" in src else None
        prompts = [r["prompt"] for r in builtin_prompts(cat)]
        if not prompts:
            raise KvvizError(f"no built-in prompts in category '{cat}'")
    else:
        path = Path(src).expanduser()
        if not path.is_file():
            raise KvvizError(f"prompt file not found: {src}")
        prompts = parse_prompts(path.read_bytes(), path.name)
    if limit is not None:
        if limit < 1:
            raise KvvizError(f"--limit must be 1 or more, not {limit}")
        prompts = prompts[:limit]
    return prompts
