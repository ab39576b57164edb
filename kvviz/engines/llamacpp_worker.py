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
Layer capture ("capture": true in start): llama.cpp's eval callback (llama_context_params.cb_eval, set through
llama-cpp-python's default context params) asks for the token-embedding lookup (each decode's first GET_ROWS node)
and the tensors the graph names "l_out-<i>" and "result_norm", and reads each (F32, [n_embd, rows]) with ggml's own
functions, bound here with ctypes from the libggml llama-cpp-python loads (it declares none itself). A group with "capture": tag keeps its one request's states, rows =
the embeddings, the residual after layers 0 … L-2 and the final norm (transformers' output_hidden_states), at the
positions it evaluated; logits_all is on while it runs so the last layer keeps every row (off for other requests). One-sequence groups only (a batch's
ubatches interleave sequences). Ops on them, as vllm_worker.py's: "layer_gaps" (a side against another or against an
.npz reference {"hidden": [R, T, H], "positions"}), "captured", and "save_states" {"tag", "key", "path"}: the side's
states written as that same .npz (float32 "hidden" [R, T, H], "positions" [T]; numpy's format, no pickle) for the
logit lens kvviz runs on them.
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


def compat_logits_all(llm, on: bool) -> None:
    """Whether Llama.eval keeps every evaluated token's logits (llama-cpp-python reads this private field at each
    eval; its scores buffer is sized for every token when the Llama was made with logits_all): on only while a
    request is captured, so that the last layer keeps every row; off, a prefill computes the output row alone."""
    llm._logits_all = on


class Worker:
    def __init__(self):
        self.llm = None
        self._bctx = None  # the batch context (k sequences), made on the first batch group
        self._bbatch = None
        self._bseqs = self._bcells = 0
        self._cap, self._cap_error, self.store = None, None, {}
        self.captures = False  # started with layer capture (the eval callback, the scores of every token)

    OPS = ("layer_gaps", "captured", "save_states")

    def _bind_ggml(self):
        import ctypes

        from llama_cpp import _ggml

        g = _ggml.libggml  # dlsym searches libggml's dependencies: libggml-base defines these
        for fn, res, args in (("ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p]),
                              ("ggml_nelements", ctypes.c_int64, [ctypes.c_void_p]),
                              ("ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
                              ("ggml_op_desc", ctypes.c_char_p, [ctypes.c_void_p]),
                              ("ggml_backend_tensor_get", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                                 ctypes.c_size_t])):
            f = getattr(g, fn)
            f.restype, f.argtypes = res, args
        return g

    def _eval_cb(self, t, ask, _user):
        """ggml's scheduler asks (ask) whether it wants node t, then hands over each wanted node computed; False in that
        second call would abort the graph, so it is always True. The embeddings have no name of their own (the graph's
        "inp_embd" is the unused input of vector prompts): they are the decode's first GET_ROWS node, the lookup of
        the token embeddings (the next GET_ROWS picks the output rows in the last layer)."""
        import numpy as np

        try:
            if self._cap is None:
                return not ask
            name = self._g.ggml_get_name(t).decode(errors="replace")
            named = name == "result_norm" or name.startswith("l_out-")
            if ask:
                return named or (self._emb_next and self._g.ggml_op_desc(t) == b"GET_ROWS")
            if not named:
                name, self._emb_next = "inp_embd", False
            elif name == "result_norm":
                self._emb_next = True  # the next decode's embeddings
            n, nb = int(self._g.ggml_nelements(t)), int(self._g.ggml_nbytes(t))
            if nb != 4 * n or n % self.n_embd:
                raise RuntimeError(f"{name}: {nb} bytes for {n} values, not F32 rows of {self.n_embd}")
            a = np.empty(n, dtype=np.float32)
            self._g.ggml_backend_tensor_get(t, a.ctypes.data, 0, nb)
            self._cap.setdefault(name, []).append(a.reshape(-1, self.n_embd))
        except Exception as e:  # noqa: BLE001 - raised after the decode, never through ggml
            self._cap_error = self._cap_error or e
        return True

    def _keep_capture(self, tag, key, positions):
        import numpy as np

        cap, self._cap = self._cap, None
        if self._cap_error is not None:
            e, self._cap_error = self._cap_error, None
            raise RuntimeError(f"layer capture failed: {e}")
        layers = sorted(int(n.split("-")[1]) for n in cap if n.startswith("l_out-"))
        names = ["inp_embd"] + [f"l_out-{i}" for i in layers[:-1]] + ["result_norm"]
        missing = [n for n in names if n not in cap]
        if missing or not layers:
            raise RuntimeError(f"llama.cpp's graph named no {', '.join(missing or ['l_out-*'])} tensor")
        rows = [np.concatenate(cap[n]) for n in names]
        if any(r.shape[0] != len(positions) for r in rows):
            raise RuntimeError(f"captured {[r.shape[0] for r in rows]} rows for {len(positions)} positions")
        self.store.setdefault(str(tag), {})[key] = (np.stack(rows), list(positions))

    def _states(self, tag, key):
        got = self.store.get(str(tag), {}).get(key)
        if got is None:
            raise RuntimeError(f"no hidden states captured for request {key!r} under {tag!r}")
        return got

    def captured(self, msg):
        rows, pos = self._states(msg["tag"], msg["key"])
        return {"positions": pos, "rows": int(rows.shape[0]), "hidden": int(rows.shape[2])}

    def save_states(self, msg):
        import numpy as np

        rows, pos = self._states(msg["tag"], msg["key"])
        with open(str(msg["path"]), "wb") as f:  # a file object: np.savez would add .npz to a path without it
            np.savez(f, hidden=np.ascontiguousarray(rows, dtype=np.float32), positions=np.asarray(pos, dtype=np.int64))
        return {}

    def layer_gaps(self, msg):
        """Side a against side b or an .npz reference, on the positions both hold (below upto); b is the reference
        side of the relative gap. Per row and token: max |a - b|, / max |b|, / eps (vllm_worker.py's _gaps)."""
        import numpy as np

        ra, pa = self._states(*msg["a"])
        if msg.get("file"):
            with np.load(msg["file"]) as f:
                rb, pb = f["hidden"], [int(p) for p in f["positions"]]
        else:
            rb, pb = self._states(*msg["b"])
        if rb.shape[0] != ra.shape[0]:
            raise RuntimeError(f"{ra.shape[0]} captured rows against {rb.shape[0]} reference rows")
        upto = msg.get("upto")
        ib = {p: j for j, p in enumerate(pb)}
        ia = {p: j for j, p in enumerate(pa)}
        common = [p for p in pa if p in ib and (upto is None or p < upto)]
        a = ra[:, [ia[p] for p in common]].astype(np.float64)
        b = rb[:, [ib[p] for p in common]].astype(np.float64)
        max_abs = np.abs(a - b).max(axis=-1) if common else np.zeros((ra.shape[0], 0))
        ref = np.abs(b).max(axis=-1) if common else np.zeros((ra.shape[0], 0))
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(ref > 0, max_abs / np.maximum(ref, 1e-300), np.where(max_abs > 0, np.inf, 0.0))
        eps = float(msg["eps"])
        return {"positions": common, "rows": int(ra.shape[0]), "max_abs": max_abs.tolist(),
                "relative": rel.tolist(), "eps_units": (rel / eps).tolist()}

    def start(self, msg):
        import llama_cpp

        import llama_cpp.llama as module

        t0 = time.perf_counter()
        threads = int(msg.get("threads", 2))
        capture = bool(msg.get("capture"))
        kw = dict(n_ctx=int(msg.get("n_ctx", 2048)), n_batch=int(msg.get("n_batch", 512)), n_threads=threads,
                  n_threads_batch=threads,
                  seed=int(msg.get("seed", 0)), logits_all=capture, verbose=False)
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
        ctx_default = llama_cpp.llama_context_default_params
        if capture:  # the eval callback, through the default context params Llama() starts from
            self._g = self._bind_ggml()
            self._cb = llama_cpp.ggml_backend_sched_eval_callback(self._eval_cb)

            def ctx_params():
                p = ctx_default()
                p.cb_eval, p.cb_eval_user_data = self._cb, None
                return p

            module.llama_cpp.llama_context_default_params = ctx_params
        try:
            self.llm = llama_cpp.Llama(model_path=msg["model"], **kw)
        finally:
            module.llama_cpp.llama_model_default_params = default
            module.llama_cpp.llama_context_default_params = ctx_default
        self.n_vocab, self.n_embd = self.llm.n_vocab(), self.llm.n_embd()
        self.captures = capture
        return {"version": llama_cpp.__version__,
                "settings": {**kw, "n_batch": self.llm.n_batch, "use_extra_bufts": extra, "capture": capture},
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

    def _batch_context(self, n_seq, cells):
        """A context holding n_seq sequences in one unified KV buffer (llama-server's parallel slots) of at least
        `cells` KV cells (the main context's n_ctx, else the batch's need in steps of 256), with the main context's
        settings otherwise."""
        import llama_cpp
        from llama_cpp import _internals as internals

        n_ctx = max(self.llm.n_ctx(), -(-cells // 256) * 256)
        if self._bctx is not None and self._bseqs == n_seq and self._bcells >= cells:
            return
        self._close_batch()
        base = self.llm.context_params
        params = type(base).from_buffer_copy(base)
        params.n_seq_max = n_seq
        params.kv_unified = True
        params.n_ctx = n_ctx
        self._bctx = internals.LlamaContext(model=compat_model(self.llm), params=params, verbose=False)
        self._bbatch = internals.LlamaBatch(n_tokens=self.llm.n_batch, embd=0, n_seq_max=1, verbose=False)
        self._bseqs, self._bcells = n_seq, llama_cpp.llama_n_ctx(self._bctx.ctx)
        if llama_cpp.llama_n_seq_max(self._bctx.ctx) < n_seq:
            raise RuntimeError(f"llama.cpp gave {llama_cpp.llama_n_seq_max(self._bctx.ctx)} sequences, not {n_seq}")

    def _close_batch(self):
        for obj in (self._bbatch, self._bctx):
            if obj is not None:
                obj.close()
        self._bctx = self._bbatch = None
        self._bseqs = self._bcells = 0

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
        self._batch_context(n, need)
        if need > self._bcells:
            raise ValueError(f"the batch needs {need} KV cells, llama.cpp gave a context of {self._bcells}")
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
                if group.get("capture"):
                    raise ValueError("llama.cpp layer capture takes one request a group (a batch's ubatches "
                                     "interleave its sequences)")
                got, seconds = self._generate_batch(group["requests"], k)
                outs.update(got)
                total += seconds
                continue
            for r in group["requests"]:
                ids = [int(t) for t in r["ids"]]
                tag = group.get("capture")
                self._cap, self._emb_next = ({} if tag else None), True
                if self.captures:  # every row's logits only while capturing (a plain request's cost otherwise)
                    compat_logits_all(self.llm, bool(tag))
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
                if tag:
                    n = len(toks)
                    self._keep_capture(tag, r["key"], list(range(keep, len(ids) + n - 1)))
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
