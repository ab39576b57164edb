"""The engines kvviz can run, by name: the one place an engine's name is looked up (kvviz.engines.base says what an
engine is). A new engine is a class (an `Engine`) and one line here; the Serving view, its sweep, the Engine layers
view, the CLI's --engine and the pages offer it from this table and read its facts from its class.
"""
from __future__ import annotations

from ..core.errors import KvvizError
from .base import ANSWER_LIMIT_S, Engine
from .server import ServerEngine
from .serving import TransformersEngine
from .workers import LlamaCppEngine, VllmWorkerEngine

ENGINES: dict[str, type[Engine]] = {
    TransformersEngine.name: TransformersEngine,  # in kvviz's process: transformers' continuous batching
    VllmWorkerEngine.name: VllmWorkerEngine,  # vLLM: in this process where importable, else its worker
    LlamaCppEngine.name: LlamaCppEngine,  # llama.cpp's worker on the GGUF file
    ServerEngine.name: ServerEngine,  # the user's running server (--server URL)
}


def get(name: str) -> type[Engine]:
    """The engine class named `name`, or one line naming the choices."""
    cls = ENGINES.get(name)
    if cls is None:
        raise KvvizError(f"unknown engine '{name}'; choose one of {', '.join(names())}")
    return cls


def facts(name: str) -> type[Engine]:
    """The engine class, or the bare Engine for a name no longer registered (a reopened result's engine)."""
    return ENGINES.get(name, Engine)


def names() -> tuple[str, ...]:
    """The engines a user picks by name (--engine, the page's select): every one but a server, which is a URL."""
    return tuple(n for n, c in ENGINES.items() if not c.served)


def default() -> str:
    return next(n for n, c in ENGINES.items() if c.default)


def served() -> str:
    return next(n for n, c in ENGINES.items() if c.served)


def capturing() -> tuple[str, ...]:
    """The engines that capture layers (the Engine layers view's choices)."""
    return tuple(n for n in names() if ENGINES[n].capture_pairs)


def status(name: str) -> str | None:
    """None when the engine can run here, else one line saying why not (and how to get it)."""
    cls = ENGINES.get(name)
    return f"unknown engine '{name}'; choose one of {', '.join(names())}" if cls is None else cls.status()


def check(name: str) -> type[Engine]:
    """The engine class where it can run here, else one line."""
    cls = get(name)
    msg = cls.status()
    if msg is not None:
        raise KvvizError(msg)
    return cls


def open_engine(name: str, *, page_size: int | None = None, tensor_parallel_size: int = 1, max_in_flight: int = 1,
                timeout_s: float = ANSWER_LIMIT_S, url: str | None = None) -> Engine:
    """The engine object `name` for a study (checked first: one line where it cannot run here)."""
    return check(name).open(page_size=page_size, tensor_parallel_size=tensor_parallel_size,
                            max_in_flight=max_in_flight, timeout_s=timeout_s, url=url)
