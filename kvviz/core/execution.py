"""The execution seam: the one place where kvviz builds forward and generate calls.

Every scenario (split, greedy, dtypes, padding, reuse, and the views that come after them) runs its model through
an `Executor`: the inputs, attention mask, position ids, cache object and model kwargs are assembled here, and the
settings that change *how* a model runs are applied here, for the duration of a run only:

* `ExecSettings.cache`     which cache object the cached paths start from ("dynamic": the model's own default);
* `ExecSettings.compile`   torch.compile of the forward ("off" by default);
* `ExecSettings.flags`     global precision flags (TF32, reduced-precision reductions, deterministic algorithms…);
* `ExecSettings.invariant` the invariant mode: ops whose result can depend on how many rows are computed together
                           are replaced by fixed-order ones.

Extensions plug in without touching the scenarios: `register_cache_kind(kind, factory)` gives a `CacheKind` its
factory, `register_run_context(factory)` adds something entered around every run (precision flags, op overrides) and
`register_compiler(factory)` supplies compiled forwards. Whatever a run context changes it must restore on exit,
also on error: `Executor.session()` enters them in an ExitStack.

A loaded model is shared (between pages, sessions and threads) and never mutated: `session()` holds the model's
lock, so runs on one model take turns, and nothing here writes to the model or its config.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import Callable, ContextManager, Iterator

import torch
from transformers import GenerationConfig

from . import cancel, loops
from ..models import compat
from .errors import KvvizError
from ..models.loading import LoadedModel
from .loops import StepPolicy
from .dtypes import dtype_name
from .float64 import released_between_layers
from .reference import streamed_float64
from .streaming import HeldRows, decoder_layers, reduced_call, reduced_generate


class CacheKind(StrEnum):
    """The cache kinds of `ExecSettings.cache` (kvviz.core.backends registers their factories). A str: it compares and
    exports as its word ("static"), so JSON results read the same whenever they were written."""
    DYNAMIC = "dynamic"
    STATIC = "static"
    OFFLOADED = "offloaded"
    OFFLOADED_STATIC = "offloaded_static"
    QUANTIZED = "quantized"  # transformers' fp8 backend
    QUANTIZED_FP8 = "quantized:fp8"
    QUANTIZED_QUANTO = "quantized:quanto"
    QUANTIZED_HQQ = "quantized:hqq"

    @property
    def lossy(self) -> bool:
        """A quantized cache changes the numbers by design: its gaps are "lossy", not precision or logic."""
        return self.value.startswith("quantized")


DEFAULT_CACHE = CacheKind.DYNAMIC
COMPILE_OFF = "off"

Sink = Callable[[int, torch.Tensor], None]  # kvviz.core.streaming: gets each hidden state as a forward produces it
# Hidden states reach their sinks layer by layer as the forward produces them; inside `hidden_all_at_once()` every
# sink gets them when the forward returns (tests compare both ways). Scoped to the caller's context, restored on exit.
_STREAM_HIDDEN: contextvars.ContextVar[bool] = contextvars.ContextVar("kvviz_stream_hidden", default=True)


@contextlib.contextmanager
def hidden_all_at_once() -> Iterator[None]:
    token = _STREAM_HIDDEN.set(False)
    try:
        yield
    finally:
        _STREAM_HIDDEN.reset(token)

CacheFactory = Callable[[LoadedModel, int, int], object]  # (lm, batch size, max length) -> a Cache object
RunContextFactory = Callable[["ExecSettings", LoadedModel], "ContextManager | None"]
CompilerFactory = Callable[[LoadedModel, str], Callable]  # (lm, mode) -> a callable with the model's signature

_CACHE_KINDS: dict[CacheKind, CacheFactory | None] = {DEFAULT_CACHE: None}
_RUN_CONTEXTS: list[RunContextFactory] = []
_COMPILER: list[CompilerFactory] = []
_SETTINGS_CHECKS: list[Callable[["ExecSettings"], None]] = []


def register_cache_kind(kind: CacheKind, factory: CacheFactory) -> None:
    """Give a cache kind its factory: `factory(lm, batch, max_len)` returns a fresh cache object for one run."""
    _CACHE_KINDS[CacheKind(kind)] = factory


def register_run_context(factory: RunContextFactory) -> None:
    """Add a context entered around every run: `factory(settings, lm)` returns a context manager or None."""
    if factory not in _RUN_CONTEXTS:
        _RUN_CONTEXTS.append(factory)


def unregister_run_context(factory: RunContextFactory) -> None:
    if factory in _RUN_CONTEXTS:
        _RUN_CONTEXTS.remove(factory)


def register_compiler(factory: CompilerFactory) -> None:
    _COMPILER[:] = [factory]


def register_settings_check(check: Callable[["ExecSettings"], None]) -> None:
    """Add a validation of ExecSettings (e.g. known flag names); it raises KvvizError with one line."""
    if check not in _SETTINGS_CHECKS:
        _SETTINGS_CHECKS.append(check)


@dataclass(frozen=True)
class ExecSettings:
    """How a model runs, beyond the model itself (which the LoadedModel fixes: weights, dtype, device, attention)."""

    cache: CacheKind = DEFAULT_CACHE
    compile: str = COMPILE_OFF
    flags: tuple[str, ...] = ()
    invariant: bool = False
    # invariant mode's SDPA takes eager attention's steps op for op, so an eager and an SDPA model agree bit for bit
    # (a run that compares attention implementations: the matrix); False: the fused kernel where its probe passes
    sdpa_as_eager: bool = False

    def __post_init__(self) -> None:
        if self.cache in {k.value for k in CacheKind}:  # a word from JSON or a flag becomes its kind
            object.__setattr__(self, "cache", CacheKind(self.cache))

    def validate(self) -> "ExecSettings":
        if self.cache not in _CACHE_KINDS:
            raise KvvizError(f"unknown cache kind '{self.cache}'; choose one of {', '.join(_CACHE_KINDS)}")
        if self.compile != COMPILE_OFF and not _COMPILER:
            raise KvvizError("torch.compile is not available in this kvviz build")
        for check in _SETTINGS_CHECKS:
            check(self)
        return self

    def with_(self, **changes) -> "ExecSettings":
        return replace(self, **changes)

    @property
    def lossy(self) -> bool:
        """A quantized cache changes the numbers by design: its gaps are "lossy", not precision or logic."""
        return isinstance(self.cache, CacheKind) and self.cache.lossy

    @property
    def is_default(self) -> bool:
        return self == ExecSettings()

    def label(self) -> str:
        parts = [f"cache {self.cache}"]
        if self.compile != COMPILE_OFF:
            parts.append(f"compile {self.compile}")
        if self.flags:
            parts.append("flags " + ",".join(self.flags))
        if self.invariant:
            parts.append("invariant" + (" (SDPA as eager)" if self.sdpa_as_eager else ""))
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return {"cache": str(self.cache), "compile": self.compile, "flags": list(self.flags),
                "invariant": self.invariant, "sdpa_as_eager": self.sdpa_as_eager}

    @classmethod
    def from_dict(cls, d: dict | None) -> "ExecSettings":
        """The settings a JSON export carries (an older export's missing fields take their defaults)."""
        d = d or {}
        return cls(cache=d.get("cache", DEFAULT_CACHE), compile=d.get("compile", COMPILE_OFF),
                   flags=tuple(d.get("flags", ())), invariant=bool(d.get("invariant", False)),
                   sdpa_as_eager=bool(d.get("sdpa_as_eager", False)))


DEFAULT_SETTINGS = ExecSettings()


def one_stream(h: torch.Tensor, b: int, t: int, width: int | None) -> torch.Tensor:
    """One [B, T, H] hidden state per layer, like every other model, for models with several parallel residual
    streams: hyper-connections (DeepSeek-V4, HY-V4: [B, T, S, H]) or Gemma 3n's AltUp ([S, B, T, H]), and streams
    flattened into the width (Qwen4-Exp: [B, T, S x H]) - compared as their mean (a gap in any stream moves the mean
    unless it cancels exactly across streams). Every other hidden state is returned as it is."""
    if h.dim() == 4:
        h = h.mean(0) if tuple(h.shape[1:3]) == (b, t) else h.mean(-2)
    if width and h.shape[-1] != width and h.shape[-1] % width == 0:
        h = h.unflatten(-1, (-1, width)).mean(-2)
    return h


@dataclass
class Executor:
    """Runs one loaded model under one ExecSettings. Build it per run; it is cheap.

    max_len: the longest sequence (padding included) any cached call of this run will reach; static caches are
    sized from it."""

    lm: LoadedModel
    settings: ExecSettings = DEFAULT_SETTINGS
    max_len: int | None = None
    forwards: int = 0
    _call: Callable | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.settings = (self.settings or DEFAULT_SETTINGS).validate()

    @property
    def model(self):
        return self.lm.model

    # -- the run --------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def session(self) -> Iterator["Executor"]:
        """The model's lock, inference mode, and every registered run context (restored on exit, also on error)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(cancel.acquire(self.lm.lock))  # a stopped run stops waiting for it (kvviz.core.cancel)
            stack.enter_context(torch.inference_mode() if self.lm.inference_mode else torch.no_grad())
            if self.settings.invariant or self.lm.dtype == torch.float64:  # their layers can take minutes on a
                stack.enter_context(cancel.op_checks())  # long prompt: a checkpoint at every op
            for factory in list(_RUN_CONTEXTS):
                cm = factory(self.settings, self.lm)
                if cm is not None:
                    stack.enter_context(cm)
            if self.lm.stream64 is not None:  # a streamed float64 reference: innermost, as the twin's own forward
                stack.enter_context(streamed_float64(self.lm))
            if self.settings.compile == COMPILE_OFF:  # a checkpoint at every layer while a run can be stopped
                stack.enter_context(cancel.layer_checks(decoder_layers(self.lm.model)))
                if self.lm.dtype == torch.float64 and self.lm.device.type == "cpu":  # a long float64 forward's freed
                    # blocks go back between its layers
                    stack.enter_context(released_between_layers(decoder_layers(self.lm.model)))
            yield self

    def _callable(self) -> Callable:
        if self._call is None:
            self._call = (self.lm.model if self.settings.compile == COMPILE_OFF
                          else _COMPILER[0](self.lm, self.settings.compile))
        return self._call

    # -- building calls -------------------------------------------------------------------------------------------

    def new_cache(self, batch: int = 1, max_len: int | None = None):
        """A fresh cache object of the settings' kind; None for "dynamic" (the model makes its own)."""
        factory = _CACHE_KINDS[self.settings.cache]
        if factory is None:
            return None
        n = max_len or self.max_len
        if n is None:
            raise KvvizError(f"a {self.settings.cache} cache needs the run's maximum length")
        return factory(self.lm, batch, n)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                cache=None, *, use_cache: bool = True, hidden: "bool | Sink" = True,
                logits_to_keep: int | None = None, fresh_cache: bool = True):
        """One model call. cache: the past (None: start a new one of the settings' kind when use_cache and
        fresh_cache). mask/positions None are left out (the model then infers them, as a user's loop would).
        hidden: True (every layer's hidden states in the output), False (none), or a sink `sink(index, tensor)`
        that gets each hidden state as the forward produces it (kvviz.core.streaming; the output then carries none)."""
        cancel.check()
        sink = hidden if callable(hidden) else None
        dev = getattr(self.lm, "device", None)  # inputs go where the model's embeddings are (a caller's may be on cpu)
        if dev is not None:
            ids, mask, positions = (None if t is None else t.to(dev) for t in (ids, mask, positions))
        kwargs: dict = dict(input_ids=ids, use_cache=use_cache, return_dict=True,
                            output_hidden_states=sink is not None or bool(hidden))
        if mask is not None:
            kwargs["attention_mask"] = mask
        if positions is not None:
            kwargs["position_ids"] = positions
        if cache is None and use_cache and fresh_cache:
            cache = self.new_cache(ids.shape[0])
        state_arg = state_argument(self.lm.model)
        if state_arg is not None:
            if positions is not None:
                kwargs.pop("position_ids")  # a recurrent model's order is its state: it takes no position ids
            if mask is not None and mask.shape[-1] > ids.shape[-1]:
                kwargs["attention_mask"] = mask[:, -ids.shape[-1]:]  # its mask covers the tokens fed, not the past
        if cache is not None:
            kwargs[compat.cache_argument(self.lm.model) or compat.cache_argument_name()] = cache
        if logits_to_keep is not None:
            kwargs["logits_to_keep"] = logits_to_keep
        self.forwards += 1
        b, t = ids.shape[0], ids.shape[-1]
        if sink is not None:
            width = getattr(self.lm.config, "hidden_size", None)
            # compiled forwards get no hooks of ours: their hidden states are reduced when the forward returns
            out = reduced_call(self.model, lambda: self._callable()(**kwargs),
                               lambda i, h: sink(i, one_stream(h, b, t, width)),
                               hooks=self.settings.compile == COMPILE_OFF and _STREAM_HIDDEN.get())
        else:
            out = self._callable()(**kwargs)
        if state_arg is not None and state_arg not in compat.CACHE_NAMES[:3]:  # RWKV's state, read back as a cache
            compat.set_output_cache(out, getattr(out, state_arg, None))
        hs = getattr(out, "hidden_states", None) if hidden is True else None
        if hs is not None and (any(h.dim() == 4 for h in hs) or len({h.shape[-1] for h in hs}) > 1):
            width = hs[-1].shape[-1]
            out.hidden_states = tuple(one_stream(h, b, t, width) for h in hs)
        return out

    def generate(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, pad_token_id: int,
                 hidden: bool = True, logits: bool = True, **extra):
        """model.generate(do_sample=False) for exactly max_new_tokens (EOS does not stop it), under the settings'
        cache kind; transformers' own compile of the decode step is left off unless compile is asked for.
        hidden: each step's hidden states, the last position of each layer only ([B, 1, H] per layer)."""
        gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=0,
                              eos_token_id=[], pad_token_id=pad_token_id, output_logits=logits,
                              output_hidden_states=hidden, return_dict_in_generate=True, use_cache=True)
        kwargs: dict = dict(input_ids=ids, attention_mask=mask, generation_config=gc)
        cache = self.new_cache(ids.shape[0], max_len=ids.shape[1] + max_new_tokens)
        if cache is not None:
            kwargs[compat.generate_cache_kwarg()] = cache
        if self.settings.compile == COMPILE_OFF:
            kwargs["disable_compile"] = True
        kwargs.update(extra)
        self.forwards += max_new_tokens
        if hidden:  # each step's hidden states: only their last positions are kept, as they are produced
            return reduced_generate(self.model, lambda: self.model.generate(**kwargs),
                                    hooks=self.settings.compile == COMPILE_OFF and _STREAM_HIDDEN.get())
        return self.model.generate(**kwargs)

    # -- loops: the only place a token is fed back or a known sequence is fed through a cache ----------------------
    # (kvviz.core.loops holds the loops as pure functions; repro scripts embed the same source)

    def _caller(self, fresh_cache: bool = True) -> Callable:
        def call(ids, mask, positions, past, use_cache=True, hidden=True):
            return self.forward(ids, mask, positions, past, use_cache=use_cache, hidden=hidden,
                                fresh_cache=fresh_cache)
        return call

    def _last_position_caller(self, fresh_cache: bool = True) -> Callable:
        """A caller for decoding, which reads only the last position of each hidden state: each layer's last
        position is kept as the forward produces it (kvviz.core.streaming) and the output's hidden_states are those
        rows [B, 1, H], so a no-cache step never holds every layer × every position."""
        plain = self._caller(fresh_cache)

        def call(ids, mask, positions, past, use_cache=True, hidden=True):
            if hidden is not True:
                return plain(ids, mask, positions, past, use_cache, hidden)
            rows = HeldRows(lambda h: h[:, -1:])
            out = plain(ids, mask, positions, past, use_cache, rows)
            out["hidden_states"] = tuple(rows.layers)
            return out
        return call

    def feed(self, ids: torch.Tensor, cache, *, one_by_one: bool = False,
             mask_of: Callable[[int, int], torch.Tensor | None] | None = None,
             positions_of: Callable[[int, int], torch.Tensor | None] | None = None,
             hidden: bool = True) -> Iterator[tuple[int, int, object]]:
        """Feed the known tokens `ids` [B, n] through `cache`, in one chunk or one token per forward (kvviz.core.loops.feed):
        yields (s, e, output) per forward, the grown cache carried from one forward to the next."""
        return loops.feed(self._caller(), ids, cache, one_by_one, mask_of, positions_of, hidden)

    def decode(self, ids: torch.Tensor, mask: torch.Tensor | None, n: int, *, policy: StepPolicy = StepPolicy.CACHE,
               positions: torch.Tensor | None = None, step_positions: str | None = None, cache=None,
               forced: list[int] | None = None, hidden: bool = True, fresh_cache: bool = True,
               on_step: Callable[[int, torch.Tensor, torch.Tensor | None, int], None] | None = None,
               no_cache_error: str | None = None) -> "Decoded":
        """Greedy decoding of n tokens under a step policy (kvviz.core.loops.decode: no_cache, cache, user_loop; forced
        tokens; a per-step hook). cache: the cache to start from (None: a fresh one of the settings' kind; with
        fresh_cache=False, the model's own). A cached policy on a model that returns no cache raises KvvizError
        (no_cache_error, or a generic line)."""
        if policy not in loops.STEP_POLICIES:
            raise KvvizError(f"unknown step policy '{policy}'; choose one of {', '.join(loops.STEP_POLICIES)}")
        policy = StepPolicy(policy)

        def prefilled(out) -> None:
            if policy != StepPolicy.NO_CACHE and not has_cache(out):
                raise KvvizError(no_cache_error or f"{self.lm.name} returns no cache (a bidirectional model): "
                                                   "past_key_values cannot be used")

        call = self._last_position_caller(fresh_cache)
        tokens, logits, hiddens, last = loops.decode(call, ids, mask, n, policy, positions, step_positions, cache,
                                                     forced, hidden, on_step, prefilled)
        return Decoded(tokens, logits, hiddens, compat.output_cache(last) if policy != StepPolicy.NO_CACHE else None,
                       last)


@dataclass
class Decoded:
    """What Executor.decode returns: row 0's tokens, logits [V] and hidden states [n_hidden, H] per step, the
    grown cache (None without cache) and the last model output."""

    tokens: list[int]
    logits: list[torch.Tensor]
    hidden: list[torch.Tensor]
    cache: object
    last: object

    def stacked_logits(self) -> torch.Tensor:
        return torch.stack(self.logits)


# ------------------------------------------------------------------------------------------------------------------
# Cache contents, whatever the cache class


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of every layer that holds any, for any transformers 5 cache object."""
    if cache is None:
        return []
    layers = getattr(cache, "layers", None)
    if layers is None:
        self_cache = getattr(cache, "self_attention_cache", None)
        layers = getattr(self_cache, "layers", [])
    # quantized layers keep their keys quantized elsewhere (an empty `keys`): nothing comparable is stored in the clear
    return [kv for kv in (compat.layer_kv(layer) for layer in layers) if kv is not None]


def state_argument(model) -> str | None:
    """The argument a recurrent / state-space causal LM takes its state by (kvviz.models.compat.state_argument: Mamba's
    `cache_params` - `cache` from transformers 5.24 -, RWKV's `state`); None for a key/value model. Executor.forward
    passes the cache under it, gives no position ids and a mask over the fed tokens only, and reads the state back
    as the output's cache, so every comparison runs on these models unchanged."""
    return compat.state_argument(model)


def _state_tensors(cache) -> list[torch.Tensor]:
    """The conv / recurrent state tensors a cache holds (linear-attention layers of a hybrid or state-space model,
    or RWKV's list of state tensors)."""
    if isinstance(cache, (list, tuple)):
        return [t for t in cache if isinstance(t, torch.Tensor)]
    out = []
    rnn = getattr(cache, "rnn_state", None)  # xLSTM's cache: {layer: (C, n, m)}
    if isinstance(rnn, dict):
        out += [t for states in rnn.values() for t in (states if isinstance(states, (list, tuple)) else [states])
                if isinstance(t, torch.Tensor)]
    for layer in getattr(cache, "layers", None) or []:
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            if isinstance(states, dict):
                out += [t for t in states.values() if isinstance(t, torch.Tensor)]
    return out


def has_cache(out) -> bool:
    """Did the model return a usable cache? (Bidirectional models, e.g. RoBERTa without is_decoder, return none.)
    A cache of linear-attention / recurrent layers only (Mamba, a hybrid whose attention layers hold nothing yet)
    has no sequence length: its state tensors count."""
    cache = compat.output_cache(out)
    if cache is None:
        return False
    try:
        if int(cache.get_seq_length()) > 0:
            return True
    except (AttributeError, TypeError, ValueError):  # ValueError: only linear-attention layers (transformers 5)
        pass
    return bool(cache_layers(cache)) or bool(_state_tensors(cache))


# ------------------------------------------------------------------------------------------------------------------
# What every result records about how it was run


@dataclass(frozen=True)
class Settings:
    """Typed settings of a result, read as attributes; `settings["dtype"]` (dict-style) works too. A result whose run
    is described by its own fields (matrix, loading trap, card, bisector) subclasses it directly, the others
    RunSettings. `to_dict()` writes them for JSON (tuples as lists, ExecSettings as its dict)."""

    def __getitem__(self, name: str):
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def get(self, name: str, default=None):
        return getattr(self, name, default)

    def to_dict(self) -> dict:
        def plain(v):
            if isinstance(v, ExecSettings):
                return v.to_dict()
            return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v

        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class RunSettings(Settings):
    """The typed settings every result carries: the run (which model as the user wrote it, dtype, device,
    attention, how it ran); each scenario's settings class adds its own fields after these."""

    model: str = ""
    spec_kind: str = ""
    dtype: str = ""
    device: str = ""
    attention: str = ""
    execution: ExecSettings = DEFAULT_SETTINGS

    @classmethod
    def from_run(cls, run: "RunSettings", **scenario):
        return cls(**{f.name: getattr(run, f.name) for f in fields(RunSettings)}, **scenario)


@dataclass(frozen=True)
class RunInfo(RunSettings):
    """The run side alone, read off a loaded model."""

    @classmethod
    def of(cls, lm: LoadedModel, settings: ExecSettings | None = None) -> "RunInfo":
        return cls(model=lm.name, spec_kind=lm.spec.kind, dtype=dtype_name(lm.dtype), device=str(lm.device),
                   attention=lm.attn_implementation, execution=settings or DEFAULT_SETTINGS)
