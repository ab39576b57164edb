"""kvviz's llama.cpp worker: runs in llama-cpp-python's own environment (engines/build.sh) on the GGUF file itself,
never imports kvviz, speaks JSON lines (the same protocol as vllm_worker.py):
  {"op": "start", "model": gguf, "n_ctx": 2048, "n_batch": 512, "threads": 2, "seed": 0}
      -> {"ok": true, "version": "...", "settings": {...}, "seconds": s}
  {"op": "generate", "groups": [{"requests": [{"key", "ids", "max_new_tokens"}], "reset": bool}], "logprobs": k}
      a group of one request runs in the main context (one sequence): reset empties it first and the whole prompt is
      evaluated (cache_prompt=false); else the longest common prefix with what the context holds is kept and the
      rest evaluated, at least the prompt's last token again (llama-server's cache_prompt / slot reuse).
      A group of k > 1 requests (batch neighbours) runs in a second context with k sequences in one unified KV
      buffer, as llama-server's parallel slots do: the prompts are decoded together in llama_batch chunks of
      n_batch tokens (each token tagged with its sequence), then every step decodes one token per sequence in one
      batch. It always starts empty (a batch is cold).
      -> {"ok": true, "outputs": {key: {"tokens", "top", "chosen", "cached_tokens", "seconds"}}, "seconds": s}
  {"op": "stop"}
Layer capture ("capture": true in start) is refused: llama-cpp-python gives a callback an opaque ggml_tensor pointer
and binds nothing that reads it (docs/engines.md).
Greedy: the argmax of the logits llama.cpp computed for the last token; log-probs are log_softmax of those logits.
"""
import time

from worker_loop import serve  # beside this file (a worker runs without kvviz)


def compat_context(llm):
    """llama-cpp-python's low-level context of a Llama (its logits, KV cells): a private field, read only here."""
    return llm._ctx


def compat_model(llm):
    """llama-cpp-python's low-level model of a Llama (to open a second context on the same weights)."""
    return llm._model


class Worker:
    def __init__(self):
        self.llm = None
        self._bctx = None  # the batch context (k sequences), made on the first batch group
        self._bbatch = None
        self._bseqs = 0

    def start(self, msg):
        if msg.get("capture"):
            raise RuntimeError("layer capture is not reachable here: llama-cpp-python exposes ggml's eval callback "
                               "(llama_context_params.cb_eval) but binds no ggml tensor API to read a tensor's name "
                               "or data")
        import llama_cpp

        import llama_cpp.llama as module

        t0 = time.perf_counter()
        threads = int(msg.get("threads", 2))
        kw = dict(n_ctx=int(msg.get("n_ctx", 2048)), n_batch=int(msg.get("n_batch", 512)), n_threads=threads,
                  n_threads_batch=threads,
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

    def _logits(self, ctx=None, i=-1):
        import numpy as np

        ptr = (ctx or compat_context(self.llm)).get_logits_ith(i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64)

    def _step(self, x, k):
        import numpy as np

        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        tok = int(np.argmax(x))
        best = np.argsort(-lp, kind="stable")[:k]
        return tok, [[int(i), float(lp[i])] for i in best], float(lp[tok])

    def _batch_context(self, n_seq):
        """A context holding n_seq sequences in one unified KV buffer (llama-server's parallel slots), with the main
        context's settings otherwise."""
        import llama_cpp
        from llama_cpp import _internals as internals

        if self._bctx is not None and self._bseqs == n_seq:
            return
        self._close_batch()
        base = self.llm.context_params
        params = type(base).from_buffer_copy(base)
        params.n_seq_max = n_seq
        params.kv_unified = True
        self._bctx = internals.LlamaContext(model=compat_model(self.llm), params=params, verbose=False)
        self._bbatch = internals.LlamaBatch(n_tokens=self.llm.n_batch, embd=0, n_seq_max=1, verbose=False)
        self._bseqs = n_seq
        if llama_cpp.llama_n_seq_max(self._bctx.ctx) < n_seq:
            raise RuntimeError(f"llama.cpp gave {llama_cpp.llama_n_seq_max(self._bctx.ctx)} sequences, not {n_seq}")

    def _close_batch(self):
        for obj in (self._bbatch, self._bctx):
            if obj is not None:
                obj.close()
        self._bctx = self._bbatch = None
        self._bseqs = 0

    def _decode(self, items):
        """Decode items (seq, pos, token, wants_logits) in chunks of n_batch; the logits of each item that wants them,
        by sequence."""
        ctx, b, n_batch = self._bctx, self._bbatch.batch, self.llm.n_batch
        out = {}
        for at in range(0, len(items), n_batch):
            chunk = items[at:at + n_batch]
            b.n_tokens = len(chunk)
            for j, (seq, pos, tok, want) in enumerate(chunk):
                b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, pos, 1, want
                b.seq_id[j][0] = seq
            ctx.decode(self._bbatch)
            for j, (seq, _, _, want) in enumerate(chunk):
                if want:
                    out[seq] = self._logits(ctx, j)
        return out

    def _generate_batch(self, reqs, k):
        n = len(reqs)
        ids = [[int(t) for t in r["ids"]] for r in reqs]
        new = [int(r["max_new_tokens"]) for r in reqs]
        need = sum(len(i) + m for i, m in zip(ids, new))
        if need > self.llm.n_ctx():
            raise ValueError(f"the batch needs {need} KV cells, the context holds {self.llm.n_ctx()}")
        self._batch_context(n)
        self._bctx.kv_cache_clear()
        t0 = time.perf_counter()
        logits = self._decode([(s, p, t, p == len(ids[s]) - 1) for s in range(n) for p, t in enumerate(ids[s])])
        res = [{"tokens": [], "top": [], "chosen": [], "cached_tokens": 0} for _ in range(n)]
        for step in range(max(new)):
            items = []
            for s in range(n):
                if step >= new[s]:
                    continue
                tok, top, chosen = self._step(logits[s], k)
                res[s]["tokens"].append(tok)
                res[s]["top"].append(top)
                res[s]["chosen"].append(chosen)
                if step + 1 < new[s]:
                    items.append((s, len(ids[s]) + step, tok, True))
            if items:
                logits.update(self._decode(items))
        seconds = time.perf_counter() - t0
        for r in res:
            r["seconds"], r["in_flight"] = seconds, n
        return {r["key"]: o for r, o in zip(reqs, res)}, seconds

    def _feed(self, ids, reset):
        llm = self.llm
        keep = 0
        if not reset and llm.n_tokens > 0:
            held = list(llm.input_ids[: llm.n_tokens])
            for a, b in zip(held, ids[:-1]):
                if a != b:
                    break
                keep += 1
        if keep > 0 and compat_context(llm).kv_cache_seq_rm(-1, keep, -1):
            llm.n_tokens = keep
        else:
            keep = 0
            llm.reset()
            compat_context(llm).kv_cache_clear()
        llm.eval(ids[keep:])
        return keep

    def generate(self, msg):
        k = int(msg.get("logprobs", 5))
        outs, total = {}, 0.0
        for group in msg["groups"]:
            if len(group["requests"]) > 1:
                got, seconds = self._generate_batch(group["requests"], k)
                outs.update(got)
                total += seconds
                continue
            for r in group["requests"]:
                ids = [int(t) for t in r["ids"]]
                t0 = time.perf_counter()
                keep = self._feed(ids, bool(group.get("reset")))
                toks, top, chosen = [], [], []
                for step in range(int(r["max_new_tokens"])):
                    tok, best, c = self._step(self._logits(), k)
                    top.append(best)
                    chosen.append(c)
                    toks.append(tok)
                    if step + 1 < int(r["max_new_tokens"]):
                        self.llm.eval([tok])
                seconds = time.perf_counter() - t0
                total += seconds
                outs[r["key"]] = {"tokens": toks, "top": top, "chosen": chosen, "cached_tokens": keep,
                                  "seconds": seconds}
        return {"outputs": outs, "seconds": total}

    def stop(self):
        self._close_batch()
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.close() if hasattr(llm, "close") else None
        return {}


def main():
    serve(Worker())


if __name__ == "__main__":
    main()
