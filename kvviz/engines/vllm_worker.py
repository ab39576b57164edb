"""kvviz's vLLM worker: runs in vLLM's own environment (engines/build.sh), never imports kvviz, speaks JSON lines.

Started by kvviz (kvviz/engines/worker.py) as `python vllm_worker.py`; one request a line on stdin, one reply a line
on stdout (the real stdout is kept for the protocol; everything printed by vLLM goes to stderr):
  {"op": "start", "model": folder, "dtype": "float32", "prefix_caching": bool, "max_num_seqs": k,
   "block_size": 32, "tensor_parallel_size": 1, "batch_invariant": bool}
      -> {"ok": true, "version": "...", "settings": {...}, "seconds": s}
  {"op": "generate", "groups": [{"requests": [{"key": k, "ids": [...], "max_new_tokens": n, "salt": s}],
                                  "reset": bool}],
   "logprobs": k}   each group is one llm.generate call (its requests in flight together), after the prefix
                    cache is emptied when "reset" (a cold start) - so one engine serves alone, batch and warm
      -> {"ok": true, "outputs": {key: {"tokens": [...], "top": [[[id, logprob], ...] per step],
          "chosen": [logprob per step], "cached_tokens": n, "seconds": s}}, "seconds": s}
  {"op": "stop"} -> {"ok": true} and the worker exits.
A failure answers {"ok": false, "error": "one line"}. Greedy: temperature 0, ignore_eos, raw logprobs.
"""
import os
import time

from worker_loop import serve  # beside this file (a worker runs without kvviz)






class Worker:
    def __init__(self):
        self.llm = None
        self.settings = None

    def start(self, msg):
        if msg.get("batch_invariant"):
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        else:
            os.environ["VLLM_BATCH_INVARIANT"] = "0"
        import vllm
        from vllm import LLM

        t0 = time.perf_counter()
        kw = dict(model=msg["model"], tokenizer=msg["model"], dtype=msg.get("dtype", "float32"),
                  enable_prefix_caching=bool(msg.get("prefix_caching")), max_num_seqs=int(msg.get("max_num_seqs", 1)),
                  tensor_parallel_size=int(msg.get("tensor_parallel_size", 1)), enforce_eager=True,
                  seed=int(msg.get("seed", 0)), max_model_len=int(msg.get("max_model_len", 2048)),
                  block_size=int(msg.get("block_size", 32)), max_logprobs=int(msg.get("max_logprobs", 20)))
        if msg.get("gpu_memory_utilization") is not None:
            kw["gpu_memory_utilization"] = float(msg["gpu_memory_utilization"])
        self.llm = LLM(**kw)
        self.settings = {k: v for k, v in kw.items() if k not in ("model", "tokenizer")}
        self.settings["VLLM_BATCH_INVARIANT"] = os.environ["VLLM_BATCH_INVARIANT"]
        return {"version": vllm.__version__, "settings": self.settings, "seconds": time.perf_counter() - t0}

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
            t0 = time.perf_counter()
            prompts = [{"prompt_token_ids": list(map(int, r["ids"]))} for r in reqs]
            for p, r in zip(prompts, reqs):
                if r.get("salt"):  # requests with different salts never share cached blocks (a batch stays cold)
                    p["cache_salt"] = str(r["salt"])
            res = self.llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            total += seconds
            for r, o in zip(reqs, res):
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
