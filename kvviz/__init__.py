"""kvviz: see where a KV cache (`cache`, called `past_key_values` before transformers 5.24) makes a model's numbers differ from a full forward, and why.

Usable from a notebook:

    import kvviz
    lm = kvviz.load_model("default", dtype="bfloat16")
    res = kvviz.run("split", lm, kvviz.SplitConfig(prompt="The capital of France is", split=3))
    res.verdict, res.explanation
    from kvviz.views.split import figures
    figures.split_heatmap(res, metric="relative")

Every view is a folder under kvviz/views/ (run, figures, report, repro, cli), run through one protocol:
`kvviz.run(view, lm, config, ctx=None)` (kvviz.views.run; ctx a kvviz.RunContext: settings, prove, progress...); see
docs/architecture.md.
"""
__version__ = "0.1.0"  # first: kvviz.core.environment reads it while this module is still importing

from .models.compat import defer_hqq_import as _defer_hqq_import

_defer_hqq_import()  # first: before anything imports transformers.cache_utils (see compat)
from .core import backends as _backends, invariant as _invariant, memory as _memory, reference as _reference
from .core.dtypes import DTYPE_NAMES, machine_eps, parse_dtype, resolve_device
from .core.errors import KvvizError
from .core.execution import ExecSettings, Executor
from .models.loading import (ATTN_CHOICES, DEFAULT_SPEC, LoadedModel, ModelSpec, cache_dir, clear_cache, load_model,
                             parse_spec)
from .models.loading import register_reference as _register_reference
from .models.tiny import TINY_ARCHS, TINY_MODELS
from .core.protocol import RunContext
from .views import memory_profile as _memory_profile
from .views import run
from .views.split.run import MODES, SplitConfig, SplitResult

# Registration, explicit and in one place (no module registers anything by being imported): the cache kinds,
# precision flags and torch.compile (backends) and invariant mode's run context on the execution seam, the float64
# reference behind LoadedModel.reference() (loading never imports kvviz.core.reference), the views' memory profiles
# behind the memory plan (kvviz.core never imports the views). (The bisector that names where an unproved precision
# verdict starts is reached through the view registry: kvviz.views.get("bisect").)
_backends.register()
_invariant.register()
_register_reference(_reference.reference_model)
_memory.register_profiles(_memory_profile)


def run_split(lm: LoadedModel, cfg: SplitConfig, progress=None, reference: LoadedModel | None = None,
              settings: ExecSettings | None = None, prove=None) -> SplitResult:
    """Split point through the protocol (kvviz.run("split", lm, cfg, RunContext(...))), kept for notebooks that call
    it by this name: the same arguments as the context's fields."""
    return run("split", lm, cfg, RunContext(settings=settings or ExecSettings(), prove=prove, progress=progress,
                                            reference=reference))


__all__ = [
    "ATTN_CHOICES", "DEFAULT_SPEC", "DTYPE_NAMES", "ExecSettings", "Executor", "KvvizError", "LoadedModel", "MODES",
    "ModelSpec", "RunContext", "SplitConfig", "SplitResult", "TINY_ARCHS", "TINY_MODELS", "cache_dir", "clear_cache", "load_model",
    "machine_eps", "parse_dtype", "parse_spec", "resolve_device", "run", "run_split",
]
