"""kvviz: see where a KV cache (`cache`, called `past_key_values` before transformers 5.24) makes a model's numbers differ from a full forward, and why.

Usable from a notebook:

    import kvviz
    lm = kvviz.load_model("default", dtype="bfloat16")
    res = kvviz.run_split(lm, kvviz.SplitConfig(prompt="The capital of France is", split=3))
    res.verdict, res.explanation
    from kvviz.views.split import figures
    figures.split_heatmap(res, metric="relative")

Every view is a folder under kvviz/views/ (run, figures, report, repro, cli); see docs/architecture.md.
"""
import sys as _sys

from . import compat as _compat

if _compat.range_warning() is not None:  # one line, once per process
    print(_compat.range_warning(), file=_sys.stderr)
from .dtypes import DTYPE_NAMES, machine_eps, parse_dtype, resolve_device
from .errors import KvvizError
from .execution import ExecSettings, Executor
from . import backends as _backends, invariant as _invariant, reference as _reference  # noqa: F401,E402 - register cache kinds, flags, compile, invariant mode
from .loading import ATTN_CHOICES, DEFAULT_SPEC, LoadedModel, ModelSpec, cache_dir, clear_cache, load_model, parse_spec
from .views.split.run import MODES, SplitConfig, SplitResult, run_split
from .views.bisect import run as _bisect  # noqa: F401,E402 - registers the bisector that explains an unproved verdict
from .tiny import TINY_ARCHS, TINY_MODELS

__all__ = [
    "ATTN_CHOICES", "DEFAULT_SPEC", "DTYPE_NAMES", "ExecSettings", "Executor", "KvvizError", "LoadedModel", "MODES",
    "ModelSpec", "SplitConfig",
    "SplitResult", "TINY_ARCHS", "TINY_MODELS", "cache_dir", "clear_cache", "load_model", "machine_eps", "parse_dtype",
    "parse_spec", "resolve_device", "run_split",
]
__version__ = "0.1.0"
