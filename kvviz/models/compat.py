"""The one place kvviz touches transformers internals or behaviour that depends on its version.

Every entry below names what kvviz relies on; tests/test_compat.py checks each one against the installed
transformers and fails with one line naming the version and what moved. No other module of kvviz, its pages or its
bench names these internals (tests/test_compat.py greps for them).

Entries:
- the cache keyword: `cache` (transformers >= 5.24) - `past_key_values` / `cache_params` before; outputs carry the
  cache as `.cache` (>= 5.24) or `.past_key_values` / `.cache_params`;
- output capturing: the running forward's collector of recorded hidden states
  (`transformers.utils.output_capturing._active_collector`) and its hooks, installed before kvviz's own
  (`_CAN_RECORD_REGISTRY`, `maybe_install_capturing_hooks`);
- GGUF/checkpoint conversion mapping (`transformers.conversion_mapping`, `transformers.core_model_loading`);
- the `gguf` package's `GGUFReader` and `get_tensor_name_map`, which transformers' GGUF loader imports at each call
  (gguf_read_once: one parse of a file, one name map, for a whole conversion);
- continuous batching: the manager's generation loop and its batch processor factory;
- cache layer state: the fields a cache layer holds its keys/values in (`keys`, `values`, `is_initialized`);
- the attention kernel a loaded model runs (`config._attn_implementation`);
- an op's qualified name (`_qualified_op_name`); torch's grouped matmul before it was public (`torch._grouped_mm`)
  is float64.py's own `compat_grouped_mm_functions` (float64.py is copied into repro scripts);
- the model modules transformers has imported (`sys.modules["transformers.models.*"]`), for invariant mode's scans,
  and the plain function under a kernel decorator (`plain_function`: `__wrapped__`, the `kernels` package's `Func`
  module), whose signature invariant mode binds to;
- optimum-quanto's compiled extension handle (`Extension._lib`);
- Streamlit's script-run requests (`ScriptRequests._state`, `_rerun_data`): has the page asked this run to stop;
- hqq's `Quantizer`, which `transformers.cache_utils` imports as it loads when hqq is installed (`HQQQuantizer`):
  imported at its first use instead (defer_hqq_import).

Outside this module a foreign object's private attribute is read only in a function named `compat_*` of code that
runs without kvviz (the engines' workers, standalone repro scripts); tests/test_compat.py walks the AST for it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import sys
import threading
import types
import warnings
from typing import Iterator

import torch
import transformers
from transformers.utils import logging as hf_logging

from ..core import cancel, optional
from ..core.errors import KvvizError

TRANSFORMERS_VERSION = transformers.__version__
# the range the suite passed on (requirements.lock and `make test-latest`); pyproject.toml declares the same
TESTED_MIN = "5.23.0"
TESTED_MAX = "5.25.0"


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


def transformers_at_least(*version: int) -> bool:
    """The installed transformers is this version or newer (e.g. transformers_at_least(5, 24))."""
    return _vtuple(TRANSFORMERS_VERSION)[:len(version)] >= tuple(version)


def in_tested_range(version: str | None = None) -> bool:
    v = _vtuple(version or TRANSFORMERS_VERSION)[:3]
    return _vtuple(TESTED_MIN) <= v <= _vtuple(TESTED_MAX)


def tested_range() -> str:
    return f"{TESTED_MIN} to {TESTED_MAX}"


def untested_note(version: str | None = None) -> str:
    """A clause for a line that is already being printed (a run that failed unexpectedly): empty in the tested range.
    The untested version is never a line of its own before a run's answer: one line per answer, on any version."""
    version = version or TRANSFORMERS_VERSION
    if in_tested_range(version):
        return ""
    return f" (transformers {version} is outside kvviz's tested range {tested_range()})"


def range_warning(version: str | None = None) -> str | None:
    """One line when the installed transformers is outside the tested range, else None."""
    version = version or TRANSFORMERS_VERSION
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


def takes_logits_to_keep(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (only the last rows' logits: the vocabulary is the costly
    part); older or custom models do not."""
    return "logits_to_keep" in _forward_params(model)


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
    before), read without a deprecation warning; None when it has none. (Self-contained: repro scripts copy it.)"""
    if out is None:
        return None
    for name in ("cache", "past_key_values", "cache_params"):
        if isinstance(out, dict) and out.get(name) is not None:
            return out[name]
        value = getattr(out, "__dict__", {}).get(name)
        if value is not None:
            return value
    return None


def script_source() -> str:
    """`output_cache`'s source, for a standalone repro script (torch and transformers only, no kvviz)."""
    return ("\n# the cache a model output carries, whatever this transformers calls it (a copy of kvviz.models.compat's)\n"
            + inspect.getsource(output_cache))


def cache_argument_name() -> str:
    """The keyword the installed transformers' key/value models take a cache by (for scripts, before any model)."""
    return "cache" if _vtuple(TRANSFORMERS_VERSION) >= (5, 24) else "past_key_values"


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
    try:
        return {f.name for f in dataclasses.fields(out)}
    except TypeError:
        return set()


def generate_cache_kwarg() -> str:
    """The keyword `model.generate` takes a cache object by."""
    return cache_argument_name()


# ------------------------------------------------------------------------------------------------------------------
# Output capturing: the running forward's record of hidden states (a ContextVar holding a list), which kvviz's
# per-layer hooks drain as layers finish (kvviz.core.streaming). None where this transformers has none: hidden states are
# then reduced after the forward returns (same numbers, more memory).

def _output_collector():
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector if hasattr(_active_collector, "get") else None


OUTPUT_COLLECTOR = _output_collector()


def install_output_recorder(model) -> None:
    """Install transformers' output-recording hooks on `model` now. transformers installs them lazily, in the first
    forward that records hidden states; a hook kvviz attached before that forward would then run before the
    recorder's on every layer (torch runs hooks in the order registered) and find the record one layer short (that
    first forward keeps one layer output more alive). Idempotent; nothing where this transformers has no recorder."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return
    install = getattr(output_capturing, "maybe_install_capturing_hooks", None)
    if install is None:
        return
    for module in model.modules():  # outermost first, as the forwards run: an outer record installs its inner ones
        if _records_outputs(module, os.path.basename(output_capturing.__file__)):
            install(module)


def _records_outputs(module, source: str) -> bool:
    """Whether the module's forward is wrapped by transformers' `capture_outputs` (the forwards that install the
    recorder: installing it from any other module, e.g. a ForCausalLM whose class also declares what it can record,
    would hook every layer a second time)."""
    f = getattr(type(module), "forward", None)
    while f is not None:
        code = getattr(f, "__code__", None)
        if code is not None and os.path.basename(code.co_filename) == source:
            return True
        f = getattr(f, "__wrapped__", None)
    return False


# ------------------------------------------------------------------------------------------------------------------
# Checkpoint conversion mapping: the names `from_pretrained` gives a checkpoint's tensors (a GGUF streamed into a
# folder is written under the names the model loads).

def checkpoint_renamer(model):
    """name -> the parameter name `from_pretrained` loads it as (suffixed "\\0converted" when a converter, not a
    plain renaming, handles it)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError as e:
        raise incompatible("streaming a GGUF file into a checkpoint", f"its conversion mapping moved ({e})") from None

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]

    def rename(name: str) -> str:
        new, pattern = rename_source_key(name, renamings, converters)
        return name if pattern is None and new == name else new + ("" if pattern is None else "\0converted")

    return rename


# ------------------------------------------------------------------------------------------------------------------
# Continuous batching (transformers' `ContinuousBatchingManager`): its public API is used for everything but three
# hooks kvviz needs on one manager (never the model): the generation loop runs in the engine's own thread, so the
# caller's torch function modes (invariant mode, float64 keep-mode) are entered around it there; the model runner's
# sampler shows the scores each step samples from (margins); the paged cache's prefix matcher says how many prompt
# tokens a request found cached (warm prefix).

CB_MANAGER_HOOKS = ("_run_generation_loop", "_create_batch_processor")


def cb_hook_manager(manager, around_loop, on_batch_processor) -> list:
    """Run this manager's generation loop inside `around_loop()` (a context manager, entered in the engine's thread)
    and pass every batch processor it creates to on_batch_processor. Returns the list the loop's exception (if any)
    is put in, for the caller's thread to raise."""
    missing = [h for h in CB_MANAGER_HOOKS if not callable(getattr(manager, h, None))]
    if missing:
        raise incompatible("the Serving study (continuous batching)",
                           f"ContinuousBatchingManager has no {missing[0]}")
    create = manager._create_batch_processor
    inner = manager._run_generation_loop
    failure: list[BaseException] = []

    def create_hooked(*args, **kwargs):
        bp = create(*args, **kwargs)
        on_batch_processor(bp)
        return bp

    def loop(*args, **kwargs) -> None:  # whatever the loop takes (5.24 added use_inference_mode)
        try:
            with around_loop():
                inner(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported in the caller's thread
            failure.append(e)

    manager._create_batch_processor = create_hooked
    manager._run_generation_loop = loop  # this manager only; the model is not touched
    return failure


def cb_hook_sampler(batch_processor, on_scores) -> bool:
    """Call on_scores(requests, scores) with the scores the engine samples from at each step, before it samples:
    requests are the request ids of the rows that get a new token, in row order. False where this engine has no
    sampler to hook (margins are then not recorded)."""
    runner = getattr(batch_processor, "model_runner", None)
    inner = getattr(runner, "_sample", None)
    if inner is None or getattr(inner, "_kvviz", False):
        return inner is not None
    io = getattr(runner, "inputs_and_outputs", None) or getattr(batch_processor, "inputs_and_outputs", None)

    def sample(scores, output_ids):
        states = getattr(io, "requests_in_batch", None) or []
        on_scores([fs.state.request_id for fs in states if fs.has_new_token], scores[0] if scores.dim() == 3 else scores)
        return inner(scores, output_ids)

    sample._kvviz = True
    runner._sample = sample
    return True


def cb_hook_prefix_match(batch_processor, on_match) -> bool:
    """Call on_match(request_id, n) with the number of prompt tokens each request found in the paged cache."""
    cache = getattr(batch_processor, "cache", None)
    search = getattr(cache, "search_prefix_match", None)
    if search is None or getattr(search, "_kvviz", False):
        return search is not None

    def search_hooked(request_id, prompt_ids, *args, **kwargs):
        n = search(request_id, prompt_ids, *args, **kwargs)
        on_match(request_id, int(n))
        return n

    search_hooked._kvviz = True
    cache.search_prefix_match = search_hooked
    return True


def cb_fatal_error(manager):
    """The error that stopped the engine's thread, or None."""
    status = getattr(manager, "background_thread_status", None)
    return getattr(status, "fatal_error", None)


class cb_quiet_end:
    """Around a manager's stop() and destroy(): transformers logs its shutdown (a thread still inside a step when
    stop() stops waiting: "did not exit after join timeout"; stop() clears the batch processor, so that thread's next
    step fails and its loop logs the error with a traceback) - after kvviz has said in one line why the run ended, or
    after a normal end where there is nothing to say. Its continuous-batching logger is muted meanwhile."""

    LOGGER = "ContinuousBatchingLogger"  # transformers/generation/continuous_batching/utils.py

    def filter(self, record) -> bool:
        return False

    def __enter__(self):
        logging.getLogger(self.LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(self.LOGGER).removeFilter(self)
        return False


def cb_stopped_and_drained(manager) -> bool:
    """The engine's thread has ended and no result is waiting."""
    router = getattr(manager, "output_router", None)
    queue = getattr(router, "output_queue", None)
    return not manager.is_running() and (queue is None or queue.empty())


# ------------------------------------------------------------------------------------------------------------------
# Cache layer state: a transformers 5 cache holds one layer object per decoder layer, its keys and values in the
# fields `keys` / `values` [B, heads, T, D] (initialised lazily from the first tensors it sees; a sliding layer also
# counts every token it has seen in `cumulative_length`).


def layer_kv(layer):
    """(keys, values) a cache layer holds in the clear, or None (nothing yet, or stored quantized elsewhere)."""
    keys = getattr(layer, "keys", None)
    if not isinstance(keys, torch.Tensor) or keys.dim() < 3:
        return None
    return keys, layer.values


def fill_cache_layer(layer, keys, values, n_tokens: int) -> None:
    """Put saved keys/values [B, heads, T, D] into an empty cache layer, as if it had seen n_tokens tokens."""
    init = getattr(layer, "lazy_initialization", None)
    if init is None:
        raise incompatible("loading a saved KV cache", f"{type(layer).__name__} has no lazy_initialization")
    init(keys, values)
    layer.keys, layer.values = keys, values
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = n_tokens


# ------------------------------------------------------------------------------------------------------------------
# Other submodules kvviz reads (not the package's top-level API)

def causal_lm_type_names() -> list[str]:
    """Every model type transformers maps to a causal-LM class (`models.auto.modeling_auto`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


_GGUF_ONCE = threading.Lock()


@contextlib.contextmanager
def gguf_read_once() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader(path)` parses each file once and `gguf.get_tensor_name_map(arch, n)` builds
    each map once; restored on exit. A conversion of the default model parsed the file five times (transformers'
    config and tokenizer each read it, its legacy loader once more, kvviz's stream and label once each: ~1.2 M numpy
    views of its 49k-token vocabulary every time) and built the name map 397 times (once per module in
    `get_gguf_hf_weights_map`). Both are read-only once built.
    One block at a time in a process (the patch is global): another conversion waits, and a stopped run stops
    waiting (kvviz.core.cancel)."""
    import gguf  # here, not at the top: 0.35-0.5 s of `import kvviz`'s ~4 s, and only GGUF files need it

    with cancel.acquire(_GGUF_ONCE):
        reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict = {}
        maps: dict = {}

        def reader(path, *args, **kwargs):
            if args or kwargs:  # another mode than read-only: its own
                return reader_cls(path, *args, **kwargs)
            key = os.path.realpath(path)
            if key not in readers:
                readers[key] = reader_cls(path)
            return readers[key]

        def tensor_name_map(arch, n_blocks):
            if (arch, n_blocks) not in maps:
                maps[arch, n_blocks] = name_map(arch, n_blocks)
            return maps[arch, n_blocks]

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, tensor_name_map
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


class _DeferredHQQQuantizer:
    """Stands for hqq's `Quantizer` in transformers.cache_utils: its attributes are the real class's, imported at the
    first one asked for (a QuantizedCache with the hqq backend quantizing its first keys)."""

    def __getattr__(self, name: str):
        from hqq.core.quantize import Quantizer

        return getattr(Quantizer, name)

    def __repr__(self) -> str:
        return "<hqq's Quantizer, imported at first use>"


def defer_hqq_import() -> bool:
    """Import transformers.cache_utils without importing hqq's quantize module, which it imports as it loads when hqq
    is installed. That module torch.compiles functions as it loads (torch's inductor and its compile workers start):
    about 1 CPU-second in every process that loads a model, though only an hqq-quantized cache uses it. cache_utils
    gets a stand-in for `Quantizer` (_DeferredHQQQuantizer); hqq's module stays unimported, so a later
    `import hqq.core.quantize` is the real one. Nothing is done when cache_utils or hqq's module is already imported
    or hqq is not installed. True when cache_utils holds the stand-in. Called once by kvviz/__init__.py."""
    name = "hqq.core.quantize"
    if "transformers.cache_utils" in sys.modules or name in sys.modules or not optional.available("hqq"):
        return False
    stand_in = types.ModuleType(name)
    stand_in.Quantizer = _DeferredHQQQuantizer()
    sys.modules[name] = stand_in
    try:
        import transformers.cache_utils as cache_utils
    finally:
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]
    return isinstance(getattr(cache_utils, "HQQQuantizer", None), _DeferredHQQQuantizer)


def gguf_utils():
    """transformers' GGUF loading helpers (`modeling_gguf_pytorch_utils`) and whether an architecture has a
    tensor processor (`integrations.gguf.utils.is_gguf_arch_supported`; False where this transformers lacks it)."""
    from transformers import modeling_gguf_pytorch_utils as mg

    try:
        from transformers.integrations.gguf.utils import is_gguf_arch_supported
    except ImportError:
        def is_gguf_arch_supported(arch: str) -> bool:
            return False
    return mg, is_gguf_arch_supported


def quiet_transformers(verbosity: bool = True) -> None:
    """No per-tensor progress bars from transformers (kvviz reports its own progress); errors only, if asked."""
    hf_logging.disable_progress_bar()
    if verbosity:
        hf_logging.set_verbosity_error()


def byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level BPE's character -> byte table (`convert_slow_tokenizer.bytes_to_unicode`); {} without it."""
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:
        return {}
    return {v: k for k, v in bytes_to_unicode().items()}


def continuous_batching_config_classes():
    """(ContinuousBatchingConfig, WorkloadHints): the continuous-batching engine's configuration types."""
    try:
        from transformers import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError as e:
        raise incompatible("the Serving study (continuous batching)", f"its configuration moved ({e})") from None
    return ContinuousBatchingConfig, WorkloadHints


def attention_implementation(model) -> str | None:
    """The attention kernel a loaded model runs ("sdpa", "eager", ...): transformers keeps it in its config."""
    return getattr(model.config, "_attn_implementation", None)


def op_qualified_name(func) -> str:
    """A torch op's qualified name ("aten::..." or a library's "ns::op"), "" for a plain function."""
    return str(getattr(func, "_qualified_op_name", ""))


def transformers_model_modules():
    """(name, module) of every transformers model module imported so far (the modeling code kvviz may wrap)."""
    return [(name, mod) for name, mod in list(sys.modules.items())
            if name.startswith("transformers.models.") and mod is not None]


def plain_function(f):
    """The Python function under transformers' kernel decorators, whose signature is the one a caller binds to:
    `functools.wraps` chains (`__wrapped__`) and, with the `kernels` package installed (transformers >= 5.25
    requires it), the `nn.Module` its `use_kernel_forward_from_hub` makes of a function (`Func`, whose
    `forward(*args, **kwargs)` calls the function it closes over as `func`). Anything else: returned as it is."""
    for _ in range(8):  # decorators nest a few deep at most
        f = inspect.unwrap(f)
        forward = getattr(type(f), "forward", None) if isinstance(f, torch.nn.Module) else None
        inner = inspect.getclosurevars(forward).nonlocals.get("func") if inspect.isfunction(forward) else None
        if not callable(inner):
            return f
        f = inner
    return f


def extension_lib(ext):
    """optimum-quanto's loaded extension library (None: not built/loaded yet)."""
    return ext._lib


def set_extension_lib(ext, lib) -> None:
    ext._lib = lib


def script_request_state(requests) -> tuple[str, object]:
    """Streamlit's pending request for a script run: ("CONTINUE" | "STOP" | "RERUN", the rerun's data or None)."""
    state = getattr(getattr(requests, "_state", None), "name", "CONTINUE")
    return state, getattr(requests, "_rerun_data", None)


def tensor_version(t: torch.Tensor) -> int | None:
    """A tensor's in-place version counter (`_version`), None for an inference tensor (it tracks none)."""
    try:
        return t._version
    except RuntimeError:
        return None
