"""Serving engines (the Serving and Engine layers views run them): small, explicit adapters, each saying what
it can toggle.

* `transformers` (default, CPU and GPU): transformers' own continuous batching - a paged KV cache and a FIFO
  scheduler (`generation/continuous_batching/`, the engine behind `model.generate_batch`). kvviz drives the
  `ContinuousBatchingManager` that `generate_batch` drives, with these toggles:
    - `max_requests_per_batch`  how many requests are in flight together (1: each request alone; k: batches of k);
    - `allow_block_sharing`     prefix sharing: completed cache pages are hashed and reused by a later request
                                whose prompt starts with the same tokens (a warm prefix); off: every prefill is cold;
    - `page_size`               tokens per cache page (prefix sharing works in whole pages; at least 4);
    - attention                 the model's own: `sdpa` stays `sdpa` (paged), `eager` runs as `paged|eager`
                                (the only two CB implementations besides flash; kvviz never switches to flash);
    - CUDA graphs, compile and async double-buffering are off, so the batches are exactly those the scheduler
      makes (nothing padded), the same on every machine.
  The engine runs its loop in a background thread. kvviz runs that thread under the caller's torch function modes
  (invariant mode, the float64 keep-mode), so invariant mode covers the engine as it covers every other path, and
  it reads each step's scores where the engine samples from them (top-2 margin per request; the full row where asked).
  While a run holds the model's lock the engine may switch the model's attention to `paged|eager`; it is switched
  back when the run ends, also on error.
* `vllm` where it is importable here (a GPU machine): offline `vllm.LLM(...)` in this process (VllmEngine) with
  `enable_prefix_caching` on/off, `VLLM_BATCH_INVARIANT` on/off and `tensor_parallel_size`; elsewhere vLLM (and
  llama.cpp) run in their workers (kvviz/engines/workers.py), which also capture their layers.
"""
from __future__ import annotations

import contextlib
import gc as _gc
import os
import time

import torch
from torch.overrides import _get_current_function_mode_stack
import transformers
from transformers import GenerationConfig

from ..core import cancel, optional
from ..models import compat
from ..core.errors import KvvizError, first_line
from ..core.float64 import KeepFloat64
from ..core.memory import PAGE_SIZE, paged_batch_tokens, paged_blocks
from .base import Engine, EngineRun, Request, RequestOut
from . import engine_python, how_to_get
from ..core.dtypes import dtype_name

MIN_PAGE = 4
_TIMEOUT_S = 600.0
_STOP_WAIT_S = 60.0  # how long stop() waits for the engine's thread before destroy() joins it


def vllm_available() -> bool:
    return optional.available("vllm")


class _Capture:
    """Reads the scores the engine samples from (its greedy argmax): which request each row belongs to, the top-2
    margin, maybe the whole row. Hooked on this manager's model runner only (no per-op cost)."""

    def __init__(self, keep: set[str], margins: dict, scores: dict):
        self.keep, self.margins, self.scores = keep, margins, scores
        self.cached: dict[str, int] = {}
        self.last_step = time.perf_counter()  # when the engine last sampled: its progress, for the caller's wait

    def hook(self, batch_processor) -> None:
        compat.cb_hook_sampler(batch_processor, self.record)
        compat.cb_hook_prefix_match(batch_processor, self.matched)

    def matched(self, request_id: str, n: int) -> None:
        self.cached[request_id] = self.cached.get(request_id, 0) + n

    def record(self, rows: list[str], probs: torch.Tensor) -> None:
        self.last_step = time.perf_counter()
        if not rows or len(rows) > probs.shape[0]:
            return
        top = probs[: len(rows)].double().topk(2, dim=-1).values
        gaps = (top[:, 0] - top[:, 1]).cpu().tolist()
        for i, rid in enumerate(rows):
            self.margins.setdefault(rid, []).append(gaps[i])
            if rid in self.keep:
                self.scores.setdefault(rid, []).append(probs[i].detach().double().cpu())


def _thread_modes() -> list:
    """The torch function modes active in the calling thread (invariant mode, float64 keep-mode, test kernels)."""
    try:
        return list(_get_current_function_mode_stack())
    except Exception:  # noqa: BLE001 - private torch API: without it the engine runs without them
        return []


class TransformersEngine(Engine):
    """transformers' continuous batching, one manager per call (see the module docstring)."""

    name = label = "transformers"
    default = True
    pages_here = True
    judged_by_logprobs = False
    repro = True
    toggles = ("max_requests_per_batch (1 = alone, k = batches of k)", "allow_block_sharing (prefix sharing: "
               "warm vs cold)", "page_size (prefix sharing works in whole pages)",
               "attention: the model's sdpa, or eager as paged|eager", "CUDA graphs / compile / async: off")

    def __init__(self, page_size: int = PAGE_SIZE):
        if not isinstance(page_size, int) or page_size < MIN_PAGE:
            raise KvvizError(f"the page size must be a whole number, {MIN_PAGE} or more, not {page_size!r}")
        self.page_size = page_size

    @classmethod
    def open(cls, *, page_size=None, tensor_parallel_size=1, **_) -> "TransformersEngine":
        if tensor_parallel_size != 1:
            raise KvvizError("tensor_parallel_size applies to the vLLM engine only (transformers' continuous "
                             "batching runs the model on one device)")
        return cls(PAGE_SIZE if page_size is None else page_size)

    def info(self) -> dict:
        return {**super().info(), "version": transformers.__version__}

    def notes(self) -> list[str]:
        if vllm_available() or engine_python("vllm") is not None:
            return []
        return ["vLLM is not installed here; the transformers engine ran (`make engines` builds vLLM)"]

    def close(self) -> None:
        """Nothing to free: each run makes and destroys its own manager."""

    def generate(self, lm, requests: list[Request], *, max_in_flight: int, prefix_sharing: bool,
            sequential_keys: set[str] | None = None, invariant: bool = False) -> EngineRun:
        """Run `requests` through one engine instance (call inside the Executor's session: the model's lock and
        run contexts). max_in_flight: requests per batch. sequential_keys: requests that are submitted only after
        every earlier request has finished (a warmer and its target), so their batches are exactly planned. invariant:
        nothing to set here - invariant mode reaches the engine's thread as the caller's torch function modes."""
        ContinuousBatchingConfig, WorkloadHints = compat.continuous_batching_config_classes()

        if not requests:
            return EngineRun({}, 0.0, 0)
        model = lm.model
        longest = max(len(r.ids) + r.max_new_tokens for r in requests)
        num_blocks = paged_blocks(longest, len(requests), self.page_size)  # the memory plan counts these sizes
        gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max(r.max_new_tokens for r in requests),
                              eos_token_id=-1, pad_token_id=0)
        cb = ContinuousBatchingConfig(page_size=self.page_size, num_blocks=num_blocks,
                                      max_batch_tokens=paged_batch_tokens(longest, max_in_flight),
                                      max_requests_per_batch=max_in_flight, allow_block_sharing=prefix_sharing,
                                      use_async_batching=False, use_cuda_graph=False, auto_switch_to_flash=False,
                                      scheduler_type="fifo", max_blocks_per_request=0)
        hints = WorkloadHints(max_prompt_length=max(len(r.ids) for r in requests),
                              max_generated_length=gc.max_new_tokens, num_requests=len(requests))
        original_attn = compat.attention_implementation(model)
        modes = _thread_modes()
        if lm.dtype == torch.float64:  # the engine casts its logits with .float(): keep float64 a float64 run

            modes.append(KeepFloat64())
        margins: dict[str, list[float]] = {}
        scores: dict[str, list[torch.Tensor]] = {}
        keep = {r.key for r in requests if r.keep_scores}
        results: dict[str, object] = {}
        t0 = time.perf_counter()
        manager = None
        # transformers' stop() runs gc.collect() (twice per manager): freeze what exists before the run so that those
        # collections only scan the run's own objects (unfrozen after, also on error; only gc speed changes)
        _gc.freeze()
        try:
            try:
                manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cb,
                                                         workload_hints=hints)
            except (ValueError, RuntimeError) as e:
                raise KvvizError(f"transformers' continuous batching cannot run this model: "
                                 f"{str(e).splitlines()[0]}") from None
            capture = _Capture(keep, margins, scores)
            failure = compat.cb_hook_manager(manager, lambda: _entered(modes), capture.hook)
            seq = sequential_keys or set()
            batch_now = [r for r in requests if r.key not in seq]
            for r in batch_now:
                manager.add_request(r.ids, request_id=r.key, max_new_tokens=r.max_new_tokens, eos_token_id=-1)
            manager.start()
            _collect(manager, {r.key for r in batch_now}, results, failure, capture)
            for r in requests:
                if r.key in seq:
                    manager.add_request(r.ids, request_id=r.key, max_new_tokens=r.max_new_tokens, eos_token_id=-1)
                    _collect(manager, {r.key}, results, failure, capture)
        finally:
            try:
                if manager is not None:
                    with compat.cb_quiet_end():  # its shutdown's log: a step still running, no second error
                        manager.stop(block=True, timeout=_STOP_WAIT_S)
                        manager.destroy()
            finally:
                if compat.attention_implementation(model) != original_attn:
                    model.set_attn_implementation(original_attn)
                _gc.unfreeze()
        seconds = time.perf_counter() - t0
        outs: dict[str, RequestOut] = {}
        for r in requests:
            toks = [int(t) for t in results[r.key].generated_tokens]
            # the margins of its last len(toks) samples (all of them where fewer were read)
            outs[r.key] = RequestOut(toks, margins.get(r.key, [])[-len(toks):], scores.get(r.key, []),
                                     capture.cached.get(r.key, 0))
        return EngineRun(outs, seconds, sum(len(o.tokens) for o in outs.values()))


@contextlib.contextmanager
def _entered(modes: list):
    """Enter a list of torch function modes (outermost first) and leave them in reverse order."""
    with contextlib.ExitStack() as stack:
        for m in modes:
            stack.enter_context(m)
        yield


def _engine_failure(e: BaseException) -> BaseException:
    """The engine thread's exception as the caller's one line (a KvvizError passes through as it is)."""
    if isinstance(e, KvvizError):
        return e
    return KvvizError(f"the continuous-batching engine failed on transformers {compat.TRANSFORMERS_VERSION}: "
                      + first_line(e, typed=True))


def _collect(manager, keys: set[str], results: dict, failure: list, capture: _Capture) -> None:
    """Wait for `keys`' results. The wait ends in one line when the engine has neither returned a result nor sampled
    a step for _TIMEOUT_S (a hung engine); a long run that keeps stepping (a float64 replay's many decode steps) is
    waited on."""
    started = time.perf_counter()
    waiting = set(keys)
    while waiting:
        if failure:
            raise _engine_failure(failure[0])
        cancel.check()  # a stopped run: the engine is stopped by the caller's finally (kvviz.core.cancel)
        res = manager.get_result(timeout=0.2)
        if res is None:
            fatal = compat.cb_fatal_error(manager)
            if fatal is not None:
                raise KvvizError(f"the continuous-batching engine failed: {str(fatal).splitlines()[0]}")
            if compat.cb_stopped_and_drained(manager):
                if failure:
                    raise _engine_failure(failure[0])
                raise KvvizError("the continuous-batching engine stopped before every request finished")
            if time.perf_counter() > max(started, capture.last_step) + _TIMEOUT_S:
                raise KvvizError(f"the continuous-batching engine gave no result and took no step for "
                                 f"{_TIMEOUT_S:.0f} s")
            continue
        if res.is_finished() and res.request_id in waiting:
            if res.error is not None:
                raise KvvizError(f"request {res.request_id} failed in the engine: {str(res.error).splitlines()[0]}")
            results[res.request_id] = res
            waiting.discard(res.request_id)


class VllmFacts(Engine):
    """What vLLM is, in this process or in its worker."""

    name, label = "vllm", "vLLM"
    tensor_parallel = True
    capture_pairs = ("warm", "batch", "tp")
    cache_block = 32  # the CPU backend's smallest block (kvviz.engines.workers.VLLM_BLOCK)
    toggles = ("enable_prefix_caching on/off", "VLLM_BATCH_INVARIANT on/off", "tensor_parallel_size (Ray for several "
               "nodes, as vLLM documents)")

    @classmethod
    def status(cls) -> str | None:
        return None if vllm_available() or engine_python(cls.name) is not None else how_to_get(cls.name)


class VllmEngine(VllmFacts):
    """Offline vllm.LLM over the model's folder. Toggles: prefix caching on/off (`prefix_sharing`), batch-invariant
    kernels (VLLM_BATCH_INVARIANT, on in kvviz's invariant mode; set for the run and restored after it),
    tensor_parallel_size, max_num_seqs (requests in flight). One LLM at a time: a run with other toggles shuts the
    previous one down first (each takes most of the GPU's memory), and `close()` frees the last. Margins are read
    from the top-2 logprobs (a logprob gap is the logit gap). Tested with a stand-in `vllm` module
    (tests/test_serving.py); run on a GPU machine for real figures."""

    def __init__(self, tensor_parallel_size: int = 1):
        self.tp = tensor_parallel_size
        self._llm = None
        self._key = None

    def _engine(self, lm, key):
        if self._key != key:
            self.close()
            from vllm import LLM

            prefix_sharing, max_in_flight, _ = key
            self._llm = LLM(model=lm.source, dtype=dtype_name(lm.dtype), enable_prefix_caching=prefix_sharing,
                            tensor_parallel_size=self.tp, max_num_seqs=max_in_flight, enforce_eager=True)
            self._key = key
        return self._llm

    def close(self) -> None:
        llm, self._llm, self._key = self._llm, None, None
        if llm is None:
            return
        for path in ("llm_engine.engine_core.shutdown", "llm_engine.shutdown"):
            obj = llm
            try:
                for part in path.split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            obj()
            break
        del llm
        _gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def generate(self, lm, requests: list[Request], *, max_in_flight: int, prefix_sharing: bool,
                 sequential_keys: set[str] | None = None, invariant: bool = False) -> EngineRun:
        if lm.dtype == torch.float64:
            raise KvvizError("vLLM has no float64 mode")
        saved = os.environ.get("VLLM_BATCH_INVARIANT")
        os.environ["VLLM_BATCH_INVARIANT"] = "1" if invariant else "0"
        try:
            from vllm import SamplingParams

            llm = self._engine(lm, (prefix_sharing, max_in_flight, invariant))
            seq = sequential_keys or set()
            outs: dict[str, RequestOut] = {}
            t0 = time.perf_counter()
            groups = [[r for r in requests if r.key not in seq]] + [[r] for r in requests if r.key in seq]
            for group in groups:
                if not group:
                    continue
                res = llm.generate([{"prompt_token_ids": r.ids} for r in group],
                                   [SamplingParams(temperature=0.0, max_tokens=r.max_new_tokens, ignore_eos=True,
                                                   logprobs=5) for r in group])
                for r, o in zip(group, res):
                    c = o.outputs[0]
                    toks = [int(t) for t in c.token_ids]
                    top = [sorted(((int(i), float(getattr(v, "logprob", v))) for i, v in step.items()),
                                  key=lambda x: -x[1]) for step in (c.logprobs or [])]
                    chosen = [dict(s).get(t) for t, s in zip(toks, top)]
                    outs[r.key] = RequestOut(toks, _logprob_margins(c.logprobs),
                                             cached_tokens=int(getattr(o, "num_cached_tokens", 0) or 0),
                                             logprobs=top, chosen=chosen)
            return EngineRun(outs, time.perf_counter() - t0, sum(len(o.tokens) for o in outs.values()))
        finally:
            if saved is None:
                os.environ.pop("VLLM_BATCH_INVARIANT", None)
            else:
                os.environ["VLLM_BATCH_INVARIANT"] = saved


def _logprob_margins(steps) -> list[float]:
    """Top-2 gap of each step's logprobs ({token id: Logprob(logprob=…)} per step); [] when vLLM gave none."""
    out = []
    for step in steps or []:
        vals = sorted((float(getattr(v, "logprob", v)) for v in step.values()), reverse=True)
        if len(vals) < 2:
            return []
        out.append(vals[0] - vals[1])
    return out
