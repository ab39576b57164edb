"""The one place kvviz touches transformers internals or behaviour that depends on its version.

Every entry below names what kvviz relies on; tests/test_compat.py checks each one against the installed
transformers and fails with one line naming the version and what moved. No other module of kvviz, its pages or its
bench names these internals (tests/test_compat.py greps for them).

Entries:
- the cache keyword: `cache` (transformers >= 5.24) - `past_key_values` / `cache_params` before; outputs carry the
  cache as `.cache` (>= 5.24) or `.past_key_values` / `.cache_params`;
- output capturing: the running forward's collector of recorded hidden states
  (`transformers.utils.output_capturing._active_collector`);
- GGUF/checkpoint conversion mapping (`transformers.conversion_mapping`, `transformers.core_model_loading`);
- continuous batching: the manager's generation loop and its batch processor factory;
- cache layer state: the fields a cache layer holds its keys/values in (`keys`, `values`, `is_initialized`).
"""
from __future__ import annotations

import inspect
import warnings

import transformers

from .errors import KvvizError

TRANSFORMERS_VERSION = transformers.__version__
# the range the suite passed on (requirements.lock and `make test-latest`); pyproject.toml declares the same
TESTED_MIN = "5.23.0"
TESTED_MAX = "5.24.0"


def _vtuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if not part.isdigit():
            break
    return tuple(out)


def in_tested_range(version: str = TRANSFORMERS_VERSION) -> bool:
    v = _vtuple(version)[:3]
    return _vtuple(TESTED_MIN) <= v <= _vtuple(TESTED_MAX)


def range_warning(version: str = TRANSFORMERS_VERSION) -> str | None:
    """One line when the installed transformers is outside the tested range, else None."""
    if in_tested_range(version):
        return None
    return (f"kvviz: transformers {version} is outside the tested range {TESTED_MIN} to {TESTED_MAX}; "
            f"views may fail or differ (pip install -r requirements.lock for the tested versions)")


def incompatible(feature: str, what: str) -> KvvizError:
    """The one-line refusal of a feature that cannot work on the installed transformers."""
    return KvvizError(f"{feature} cannot run on transformers {TRANSFORMERS_VERSION}: {what} "
                      f"(kvviz is tested on {TESTED_MIN} to {TESTED_MAX})")


# ------------------------------------------------------------------------------------------------------------------
# The cache keyword

CACHE_NAMES = ("cache", "past_key_values", "cache_params", "state")  # newest first


def _forward_params(model) -> dict:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}


def cache_argument(model) -> str | None:
    """The keyword `model.forward` takes its cache by: `cache` where the installed transformers has it, else
    `past_key_values` (key/value models), `cache_params` (Mamba-like) or `state` (RWKV); None where it takes none.
    A forward with a deprecated `past_key_values` that also names `cache` gets `cache` (no FutureWarning)."""
    params = _forward_params(model)
    return next((a for a in CACHE_NAMES if a in params), None)


def state_argument(model) -> str | None:
    """The cache keyword of a recurrent / state-space model (its order is its state: no position ids, a mask over the
    fed tokens only): `cache_params` or `state` before transformers 5.24, `cache` on a model whose forward deprecates
    `cache_params` (5.24+); None for a key/value model."""
    arg = cache_argument(model)
    if arg in ("cache_params", "state"):
        return arg
    if arg == "cache" and "cache_params" in deprecated_names(type(model).forward):
        return arg
    return None


def deprecated_names(fn) -> set[str]:
    """The old keyword names a transformers forward still accepts through `deprecate_kwarg` (read from the
    decorator's closure, walking `__wrapped__`): {"past_key_values"} on a key/value model of 5.24, {"cache_params"}
    on a state-space one."""
    names: set[str] = set()
    seen = 0
    while fn is not None and seen < 16:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            if isinstance(v, str) and v in CACHE_NAMES[1:]:
                names.add(v)
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return names


def output_cache(out):
    """The cache a model output carries (`.cache` on transformers >= 5.24, `.past_key_values` / `.cache_params`
    before), read without a deprecation warning; None when it has none."""
    if out is None:
        return None
    if isinstance(out, dict):
        for name in CACHE_NAMES[:3]:
            if name in out and out[name] is not None:
                return out[name]
        # an output object whose cache field is set but None
    d = getattr(out, "__dict__", {})
    for name in CACHE_NAMES[:3]:
        if name in d and d[name] is not None:
            return d[name]
    return None


def set_output_cache(out, cache) -> None:
    """Put a cache on a model output under the name this transformers reads (a recurrent model's state is read
    back where every caller reads a cache)."""
    name = "cache" if "cache" in _output_fields(out) else "past_key_values"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            out[name] = cache
        except (KeyError, TypeError):
            object.__setattr__(out, name, cache)


def _output_fields(out) -> set[str]:
    import dataclasses

    try:
        return {f.name for f in dataclasses.fields(out)}
    except TypeError:
        return set()


def generate_cache_kwarg() -> str:
    """The keyword `model.generate` takes a cache object by."""
    return "cache" if _vtuple(TRANSFORMERS_VERSION) >= (5, 24) else "past_key_values"
