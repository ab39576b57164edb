"""kvviz's llama.cpp worker: runs in llama-cpp-python's own environment (engines/build.sh) on the GGUF file itself,
never imports kvviz, speaks JSON lines (the same protocol as vllm_worker.py):
  {"op": "start", "model": gguf, "n_ctx": 2048, "threads": 2, "seed": 0}
      -> {"ok": true, "version": "...", "settings": {...}, "seconds": s}
  {"op": "generate", "groups": [{"requests": [{"key", "ids", "max_new_tokens"}], "reset": bool}], "logprobs": k}
      one sequence per context, so every group holds one request. reset: the context is emptied first and the whole
      prompt evaluated (cache_prompt=false); else the longest common prefix with what the context holds is kept and
      the rest evaluated, at least the prompt's last token again (llama-server's cache_prompt / slot reuse).
      -> {"ok": true, "outputs": {key: {"tokens", "top", "chosen", "cached_tokens", "seconds"}}, "seconds": s}
  {"op": "stop"}
Greedy: the argmax of the logits llama.cpp computed for the last token; log-probs are log_softmax of those logits.
"""
import time

from worker_loop import serve  # beside this file (a worker runs without kvviz)






class Worker:
    def __init__(self):
        self.llm = None

    def start(self, msg):
        import llama_cpp

        import llama_cpp.llama as module

        t0 = time.perf_counter()
        threads = int(msg.get("threads", 2))
        kw = dict(n_ctx=int(msg.get("n_ctx", 2048)), n_threads=threads, n_threads_batch=threads,
                  seed=int(msg.get("seed", 0)), logits_all=False, verbose=False)
        extra = bool(msg.get("use_extra_bufts", False))
        # llama_model_params.use_extra_bufts (weight repacking, AMX on CPUs that report it): Llama() exposes no
        # argument for it, so its default params are wrapped. Off by default: on the CPU this was built on, the AMX
        # repacked Q4_1 matmul segfaults in decode (ggml_backend_amx_mul_mat).
        default = llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = extra
            return p

        module.llama_cpp.llama_model_default_params = params
        try:
            self.llm = llama_cpp.Llama(model_path=msg["model"], **kw)
        finally:
            module.llama_cpp.llama_model_default_params = default
        self.n_vocab = self.llm.n_vocab()
        return {"version": llama_cpp.__version__,
                "settings": {**kw, "n_batch": self.llm.n_batch, "use_extra_bufts": extra},
                "seconds": time.perf_counter() - t0}

    def _logits(self):
        import numpy as np

        ptr = self.llm._ctx.get_logits_ith(-1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64)

    def _feed(self, ids, reset):
        llm = self.llm
        keep = 0
        if not reset and llm.n_tokens > 0:
            held = list(llm.input_ids[: llm.n_tokens])
            for a, b in zip(held, ids[:-1]):
                if a != b:
                    break
                keep += 1
        if keep > 0 and llm._ctx.kv_cache_seq_rm(-1, keep, -1):
            llm.n_tokens = keep
        else:
            keep = 0
            llm.reset()
            llm._ctx.kv_cache_clear()
        llm.eval(ids[keep:])
        return keep

    def generate(self, msg):
        import numpy as np

        k = int(msg.get("logprobs", 5))
        outs, total = {}, 0.0
        for group in msg["groups"]:
            for r in group["requests"]:
                ids = [int(t) for t in r["ids"]]
                t0 = time.perf_counter()
                keep = self._feed(ids, bool(group.get("reset")))
                toks, top, chosen = [], [], []
                for step in range(int(r["max_new_tokens"])):
                    x = self._logits()
                    lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
                    tok = int(np.argmax(x))
                    best = np.argsort(-lp, kind="stable")[:k]
                    top.append([[int(i), float(lp[i])] for i in best])
                    chosen.append(float(lp[tok]))
                    toks.append(tok)
                    if step + 1 < int(r["max_new_tokens"]):
                        self.llm.eval([tok])
                seconds = time.perf_counter() - t0
                total += seconds
                outs[r["key"]] = {"tokens": toks, "top": top, "chosen": chosen, "cached_tokens": keep,
                                  "seconds": seconds}
        return {"outputs": outs, "seconds": total}

    def stop(self):
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.close() if hasattr(llm, "close") else None
        return {}


def main():
    serve(Worker())


if __name__ == "__main__":
    main()
