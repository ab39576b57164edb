"""The one engine interface (issue 52.3): what every serving engine is to the Serving and Engine layers views.

An engine is an object made by its class's `open(...)` (kvviz.engines.registry names the classes; engine names
appear there and nowhere else as something compared):
  generate(lm, requests, *, max_in_flight, prefix_sharing, sequential_keys, invariant) -> EngineRun
      the requests through the engine (greedy), each with its tokens, top-2 margins, top-k log-probs, cached tokens;
  capture(lm, *, tensor_parallel_size, max_num_seqs, ...) -> LayerCapture
      the engine started with layer capture on: every decoder layer's hidden states (R = L + 1 rows per token, as
      transformers' output_hidden_states) of the groups submitted under a tag, kept where the engine runs;
  info() -> dict   name, version, dtype, settings, toggles (what the result's `engine` records);
  close()          free what it holds (a worker process, a GPU's memory).
Its facts are class attributes (which options it honours, how its outputs are judged), read instead of its name.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.dtypes import dtype_name
from ..core.errors import KvvizError
from .verdict import UNIT_ROUNDOFF

ANSWER_LIMIT_S = 900.0  # the most seconds a worker may take for one answer, unless its caller gives another


@dataclass
class Request:
    """One request: its token ids, how many new tokens, and whether kvviz keeps its full score rows."""

    key: str
    ids: list[int]
    max_new_tokens: int
    keep_scores: bool = False


@dataclass
class RequestOut:
    tokens: list[int]
    margins: list[float]  # top-2 margin of the engine's scores at each step (empty when not captured)
    scores: list[torch.Tensor] = field(default_factory=list, repr=False)  # full rows, float64 (keep_scores only)
    cached_tokens: int = 0  # prompt tokens taken from the cache (prefix sharing) instead of being computed
    logprobs: list = field(default_factory=list, repr=False)  # per step: [(token id, log-prob)] top-k, best first
    chosen: list = field(default_factory=list, repr=False)  # per step: the chosen token's log-prob (worker engines)


@dataclass
class EngineRun:
    outputs: dict[str, RequestOut]
    seconds: float
    new_tokens: int


class LayerCapture:
    """An engine started with layer capture on (Engine.capture). Groups: [{"requests": [{"key", "ids",
    "max_new_tokens", "salt"}], "reset": bool (the prefix cache emptied first), "capture": tag or None}]; a group's
    hidden states are kept under its tag. Sides are (tag, request key)."""

    info: dict  # name, version, settings, start_s

    def generate(self, groups: list[dict]) -> dict:
        """{key: {"tokens", "top", "chosen", "cached_tokens", "seconds"}} of every request of every group."""
        raise NotImplementedError

    def gaps(self, a: tuple[str, str], b: tuple[str, str] | None = None, file: str | None = None,
             upto: int | None = None, eps: float = 0.0) -> dict:
        """Side a's states against side b's (or against the reference [R, T, H] in `file`, positions both hold, up
        to `upto`): {"positions", "rows", "max_abs", "relative", "eps_units"} (metric -> [rows][positions])."""
        raise NotImplementedError

    def positions(self, tag: str, key: str) -> list[int]:
        """The positions captured for the side (a warm request's cached ones never pass through the model)."""
        raise NotImplementedError

    def save_states(self, tag: str, key: str, path: str) -> None:
        """The side's states as safetensors (.npz where the engine's reference_npz): "hidden" [R, T, H],
        "positions" [T] (kvviz applies what it likes to them: the logit lens's final norm and head, for one). An
        engine that cannot leaves this unimplemented: Engine layers then says in one line why its lens is absent."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the engine."""


class Engine:
    """A serving engine (module docstring). Subclasses set their facts and implement generate (and capture where
    the engine can capture layers)."""

    name = ""  # the registry's key: --engine's value, a result's settings.engine
    label = ""  # how a sentence names it ("vLLM")
    default = False  # the engine that runs when none is named
    served = False  # the user's running server (--server URL), not an engine kvviz starts
    pages_here = False  # its paged KV cache lives in kvviz's process: --page-size honoured, counted by the memory plan
    tensor_parallel = False  # honours tensor_parallel_size
    judged_by_logprobs = True  # judged against float64 by its log-probs on each path (else the parting step is
    #                            replayed in float64 on its full score rows and proved in invariant mode)
    repro = False  # a repro script (torch + transformers) remakes its calls plainly
    capture_pairs: tuple[str, ...] = ()  # the Engine layers pairs it captures layer by layer
    capture_refused = ""  # why it captures no other pair (one line)
    quantized = False  # computes in a format kvviz cannot run (llama.cpp's 8-bit activations): a fixed bound
    reference_npz = False  # its capture reads kvviz's float64 reference states as .npz (no safetensors there)
    cache_block: int | None = None  # its prefix cache reuses whole blocks of this many tokens
    toggles: tuple[str, ...] = ()
    timeout_s = ANSWER_LIMIT_S

    # -------------------------------------------------------------------------------- facts that need a check
    @classmethod
    def status(cls) -> str | None:
        """None when the engine can run here, else one line saying why not (and how to get it)."""
        return None

    @classmethod
    def check_settings(cls, settings) -> None:
        """Refuse, in one line and before anything runs, what the engine cannot honour here."""

    @classmethod
    def layer_dtype(cls, lm) -> str:
        """The format the engine computes the model's layers in (its rounding), or one line where it cannot."""
        dtype = dtype_name(lm.dtype)
        if dtype not in UNIT_ROUNDOFF:
            raise KvvizError(f"{cls.label or cls.name} runs float32, bfloat16 or float16, not {dtype}")
        return dtype

    @classmethod
    def engine_dtype(cls, lm) -> str | None:
        """What to name as the engine's dtype where it is not the model's (None: the model's)."""
        return None

    # ------------------------------------------------------------------------------------------- the object
    @classmethod
    def open(cls, *, page_size: int | None = None, tensor_parallel_size: int = 1, max_in_flight: int = 1,
             timeout_s: float = ANSWER_LIMIT_S, url: str | None = None) -> "Engine":
        """The engine object for a study (its options, each honoured only where the class says so)."""
        eng = cls()
        eng.timeout_s = timeout_s
        return eng

    def generate(self, lm, requests: list[Request], *, max_in_flight: int, prefix_sharing: bool,
                 sequential_keys: set[str] | None = None, invariant: bool = False) -> EngineRun:
        raise NotImplementedError

    def capture(self, lm, *, tensor_parallel_size: int = 1, max_num_seqs: int = 8, pipeline_parallel_size: int = 1,
                distributed_executor_backend: str | None = None) -> LayerCapture:
        raise KvvizError(f"{self.label or self.name} captures no layers")

    def info(self) -> dict:
        return {"name": self.name, "toggles": list(self.toggles)}

    def notes(self) -> list[str]:
        """What a study's result should say about the engine that ran."""
        return []

    def close(self) -> None:
        """Nothing to free."""
