"""The user's own running server as a Serving engine: an OpenAI-compatible `/v1/completions` client (urllib only).

`kvviz serving --server URL --model <local weights>` runs the same conditions against a server someone else started
(`vllm serve`, `llama-server`, SGLang) and judges every distinct completion against kvviz's float64 reference on the
local weights (kvviz/engines/verdict.py, the path the worker engines take). Each request: the prompt as token ids (a
server that refuses them - HTTP 400/422, or llama-cpp-python's 500 naming `prompt` - gets their text instead, only
where the local tokenizer gives the same ids back from it and the server counts as many prompt tokens), greedy
(temperature 0, `repeat_penalty` 1: llama-cpp-python's server defaults to 1.1), `max_tokens`, `logprobs` = TOP_K,
`ignore_eos`, and `return_tokens_as_token_ids` (vLLM: the returned tokens are "token_id:N", read exactly). A server
that ignores that option returns token strings: each is mapped through the local tokenizer (its exact vocabulary piece,
else its encoding when that is one token) and the result says so (`info()['token_ids']`). The rounding a path is judged
with is the local weights' dtype's (start the server with that --dtype), but a server whose /v1/models names a .gguf
file runs llama.cpp's kernels, and is judged with their 8-bit-activation rounding (GGUF_DTYPE).

Conditions, mapped onto what a server offers:
  alone   one request at a time, cold: a fresh `cache_salt` per request (vLLM: no prefix-cache hit) and
          `cache_prompt: false` (llama.cpp server: the slot's cache not reused);
  batch   k requests in flight together (k threads), each with its own salt (no sharing inside the batch);
  warm    the warmer, then the prompt, with the same salt and `cache_prompt: true`: the prompt's prefix from the cache.
A server that ignores both options runs every condition with its own cache policy; the numbers are still judged.

Refused in one line: a server that cannot be reached (every wait has a timeout, KVVIZ_SERVER_TIMEOUT seconds, 300 by
default; the URL named); a server whose model is not the local weights - on a probe prompt its greedy completion's
log-probs differ from the local model's, on the same tokens, by more than PROBE_NATS (a bound far above rounding:
a float format's rounding moves these by hundredths of a nat, another model by whole nats).
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from ..core.errors import KvvizError
from .base import Engine, EngineRun, Request, RequestOut
from .verdict import reference_logprobs
from ..core.dtypes import dtype_name
from ..core.execution import Executor
from ..core.inputs import encode

TOP_K = 5
PROBE_TEXT = "The capital of France is"
PROBE_TOKENS = 4
PROBE_NATS = 1.0
# a server whose model is a .gguf file runs llama.cpp's kernels (8-bit activations): judged with their rounding
GGUF_DTYPE = "q8 activations x GGUF weights (a .gguf served: llama.cpp's kernels)"
TOGGLES = ("cache_salt per request (vLLM: cold prefix cache) / shared for warm", "cache_prompt false/true "
           "(llama.cpp server)", "requests in flight (threads)")


def _timeout() -> float:
    try:
        return float(os.environ.get("KVVIZ_SERVER_TIMEOUT", 300))
    except ValueError:
        return 300.0


def normalize_url(url: str) -> str:
    """The server's base URL (no trailing '/v1'), or one line."""
    u = (url or "").strip().rstrip("/")
    if not u.startswith(("http://", "https://")):
        raise KvvizError(f"--server needs an http:// or https:// URL (an OpenAI-compatible server), not {url!r}")
    return u[:-3] if u.endswith("/v1") else u


class _Refused(Exception):
    """An HTTP status the caller handles itself (a server that refuses token-id prompts)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


INVARIANT_REFUSED = ("invariant mode is a setting of the server, which kvviz does not start: rerun without "
                     "--invariant (start vLLM with VLLM_BATCH_INVARIANT=1 for its deterministic mode)")


class ServerEngine(Engine):
    """An OpenAI-compatible completions server behind the engine interface's `generate(lm, requests, …)`."""

    name, label = "server", "the server"
    served = True
    toggles = TOGGLES

    @classmethod
    def open(cls, *, url=None, **_) -> "ServerEngine":
        return cls(url)

    @classmethod
    def check_settings(cls, settings) -> None:
        if settings.invariant:
            raise KvvizError(INVARIANT_REFUSED)

    def __init__(self, url: str):
        self.url = normalize_url(url)
        self.model_id: str | None = None
        self.dtype = "float32"
        self.token_ids = "returned by the server (return_tokens_as_token_ids)"
        self.version = None
        self.probe_gap: float | None = None
        self.text_prompts: bool | None = None  # None until the first completion: the server takes token ids or not
        self.stopped_early = 0  # completions the server ended before max_tokens (it ignores ignore_eos)
        self.timeout_s: float | None = None  # one request's wait; None: KVVIZ_SERVER_TIMEOUT

    # ------------------------------------------------------------------------------------------------ HTTP
    def _call(self, path: str, body: dict | None = None, refused: tuple = ()) -> dict:
        req = urllib.request.Request(self.url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s or _timeout()) as r:
                return json.loads(r.read().decode())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:200].replace("\n", " ")
            if e.code in refused and (e.code != 500 or "prompt" in detail):  # llama-cpp-python: 500 for a 422
                raise _Refused(e.code) from None
            raise KvvizError(f"the server at {self.url} answered {path} with HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            why = getattr(e, "reason", e)
            raise KvvizError(f"the server at {self.url} cannot be reached ({why}; waited at most "
                             f"{self.timeout_s or _timeout():.0f} s)") from None
        except ValueError:
            raise KvvizError(f"the server at {self.url} did not answer {path} with JSON: is it an OpenAI-compatible "
                             f"server?") from None

    def _model(self) -> str:
        if self.model_id is None:
            data = self._call("/v1/models").get("data") or []
            if not data or not data[0].get("id"):
                raise KvvizError(f"the server at {self.url} lists no model at /v1/models")
            self.model_id = str(data[0]["id"])
        return self.model_id

    def _text_prompt(self, tok, ids: list[int]) -> str:
        """The prompt as text, for a server that takes no token ids: only where the local tokenizer gives the same ids
        back from it (else the server could run other tokens than those judged)."""
        ids = list(map(int, ids))
        lead = 1 if ids[0] in set(tok.all_special_ids) else 0  # a BOS the tokenizer adds back itself
        for text in dict.fromkeys([tok.decode(ids[lead:]), tok.decode(ids)]):
            if [int(i) for i in tok(text, add_special_tokens=True)["input_ids"]] == ids:
                return text
        raise KvvizError(f"the server at {self.url} takes text prompts only (no token ids), and a prompt's "
                         f"{len(ids)} tokens do not come back from its text through the local tokenizer: "
                         f"kvviz cannot be sure the server ran the tokens it judges")

    def _complete(self, tok, ids: list[int], n: int, salt: str | None, cache_prompt: bool) -> RequestOut:
        # greedy with no repetition penalty (llama-cpp-python's server applies 1.1 by default, vLLM's field is another)
        body = {"model": self._model(), "prompt": list(map(int, ids)), "max_tokens": int(n), "temperature": 0.0,
                "logprobs": TOP_K, "ignore_eos": True, "return_tokens_as_token_ids": True,
                "cache_prompt": cache_prompt, "repeat_penalty": 1.0}
        if salt is not None:
            body["cache_salt"] = salt
        if self.text_prompts:
            body["prompt"] = self._text_prompt(tok, ids)
        try:
            refused = () if self.text_prompts is not None else (400, 422, 500)
            reply = self._call("/v1/completions", body, refused=refused)
        except _Refused:  # token ids refused (llama-cpp-python's server: `prompt` is a string): text from now on
            self.text_prompts = True
            body["prompt"] = self._text_prompt(tok, ids)
            reply = self._call("/v1/completions", body)
        self.text_prompts = bool(self.text_prompts)
        used = (reply.get("usage") or {}).get("prompt_tokens")
        if self.text_prompts and used is not None and int(used) != len(ids):
            raise KvvizError(f"the server at {self.url} made {used} tokens of a prompt's text, the local tokenizer "
                             f"{len(ids)}: its model ({self.model_id}) is not the local weights' (or it adds tokens "
                             f"of its own)")
        try:
            choice = reply["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise KvvizError(f"the server at {self.url} answered /v1/completions without choices") from None
        cached = ((reply.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out = self._parse(tok, choice.get("logprobs"), int(cached), choice.get("finish_reason") == "stop")
        self.stopped_early += len(out.tokens) < n
        return out

    def _token_id(self, tok, s: str, strict: bool = True) -> int | None:
        """The local id of a token the server names (strict: one line where it maps to no single token, else None)."""
        if s.startswith("token_id:"):
            return int(s.split(":", 1)[1])
        self.token_ids = "mapped from the server's token strings through the local tokenizer"
        i = tok.convert_tokens_to_ids(s)
        if isinstance(i, int) and i != tok.unk_token_id:
            return i
        enc = tok.encode(s, add_special_tokens=False) if s else []
        if len(enc) != 1:
            if not strict:
                return None
            raise KvvizError(f"the server's token {s!r} is not one token of the local tokenizer: the server's model is "
                             f"not the local weights (or the server returns no token ids)")
        return int(enc[0])

    def _entry_id(self, tok, e: dict) -> int:
        return int(e["id"]) if e.get("id") is not None else self._token_id(tok, e["token"])

    def _parse(self, tok, lp, cached: int, stopped: bool = False) -> RequestOut:
        if lp and lp.get("content"):  # llama-server's newer form: per step {id, token, logprob, top_logprobs: [..]}
            toks = [self._entry_id(tok, e) for e in lp["content"]]
            chosen = [float(e["logprob"]) for e in lp["content"]]
            top = [sorted(((self._entry_id(tok, x), float(x["logprob"])) for x in e.get("top_logprobs") or []),
                          key=lambda x: -x[1]) for e in lp["content"]]
        elif lp and lp.get("tokens"):  # the OpenAI completions form (vLLM, SGLang, llama-cpp-python)
            strs = list(lp["tokens"])
            n = len(strs)
            if n and stopped and self._token_id(tok, strs[-1], strict=False) is None:
                n -= 1  # a stop token named by no text (llama-cpp-python's server has no ignore_eos): the path ends
            toks = [self._token_id(tok, s) for s in strs[:n]]
            chosen = [None if v is None else float(v) for v in (lp.get("token_logprobs") or [])[:n]]
            # token strings: an alternative that maps to no single local token (a partial UTF-8 piece, which
            # llama-cpp-python names '') is left out of its step
            top = [sorted(((i, float(v)) for i, v in ((self._token_id(tok, s, strict=False), v)
                                                       for s, v in (step or {}).items()) if i is not None),
                          key=lambda x: -x[1]) for step in (lp.get("top_logprobs") or [])[:n]]
        else:
            raise KvvizError(f"the server at {self.url} returned no log-probs (it must honour `logprobs` on "
                             f"/v1/completions)")
        for t, c, step in zip(toks, chosen, top):  # the chosen token belongs to its step's top-k
            if c is not None and t not in dict(step):
                step.append((t, c))
                step.sort(key=lambda x: -x[1])
        margins = [s[0][1] - s[1][1] if len(s) > 1 else 0.0 for s in top]
        return RequestOut(toks, margins, cached_tokens=cached, logprobs=top, chosen=chosen)

    # ------------------------------------------------------------------------------------------ the engine API
    def close(self) -> None:
        """Nothing to free: the server is the user's."""

    def info(self) -> dict:
        return {"name": self.name, "url": self.url, "served_model": self.model_id, "version": self.version,
                "dtype": self.dtype, "token_ids": self.token_ids,
                "prompts": "text (the server takes no token ids; each checked to give the same tokens)"
                if self.text_prompts else "token ids", "stopped_early": self.stopped_early, "top_k": TOP_K, "probe_gap": self.probe_gap,
                "toggles": list(TOGGLES)}

    def probe(self, lm, settings) -> None:
        """Refuse in one line when the server cannot be reached or does not serve the local weights: a short greedy
        completion of PROBE_TEXT, its log-probs against the local model's on the same tokens."""
        self.dtype = dtype_name(lm.dtype)  # the local weights' dtype: name the one the server runs with --dtype
        try:
            self.version = self._call("/version").get("version")
        except KvvizError:
            pass  # not every server has /version; reachability is decided by the calls below
        ids = encode(lm, PROBE_TEXT)
        out = self._complete(lm.tokenizer, ids, PROBE_TOKENS, f"kvviz-probe-{time.time_ns()}", False)
        if str(self.model_id).lower().endswith(".gguf"):  # llama-server / llama-cpp-python name the file they serve
            self.dtype = GGUF_DTYPE
        if not out.tokens:
            raise KvvizError(f"the server at {self.url} returned no tokens for the probe prompt")
        vocab = lm.model.get_output_embeddings().weight.shape[0]
        if max(t for s in out.logprobs for t, _ in s) >= vocab or max(out.tokens) >= vocab:
            raise KvvizError(f"the server at {self.url} returns token ids beyond the local model's vocabulary "
                             f"({vocab}): its model ({self.model_id}) is not the local weights")
        ref = reference_logprobs(Executor(lm, settings.with_(invariant=False)), ids, out.tokens)
        gap = max(abs(v - float(ref[t, i])) for t, step in enumerate(out.logprobs[: ref.shape[0]]) for i, v in step)
        self.probe_gap = gap
        if gap > PROBE_NATS:
            raise KvvizError(f"the server at {self.url} serves {self.model_id!r}, not the local weights: on the probe "
                             f"prompt {PROBE_TEXT!r} its log-probs differ from the local model's by {gap:.3g} nats "
                             f"(more than {PROBE_NATS} - far beyond rounding)")

    def generate(self, lm, requests: list[Request], *, max_in_flight: int, prefix_sharing: bool,
                 sequential_keys: set[str] | None = None, invariant: bool = False) -> EngineRun:
        if invariant:
            raise KvvizError(INVARIANT_REFUSED)
        if not requests:
            return EngineRun({}, 0.0, 0)
        tok, seq, stamp = lm.tokenizer, sequential_keys or set(), time.time_ns()
        free = [r for r in requests if r.key not in seq]
        outs: dict[str, RequestOut] = {}
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, max_in_flight)) as pool:
            for g in range(0, len(free), max(1, max_in_flight)):
                group = free[g:g + max_in_flight]
                futs = {r.key: pool.submit(self._complete, tok, r.ids, r.max_new_tokens, f"kvviz-{stamp}-{r.key}",
                                           False) for r in group}
                outs.update((k, f.result()) for k, f in futs.items())
        pending = [r for r in requests if r.key in seq]
        for j in range(0, len(pending), 2):  # warmer then target: one salt, the target reuses the warmer's cache
            pair = pending[j:j + 2]
            salt = f"kvviz-{stamp}-warm-{pair[0].key}"
            for m, r in enumerate(pair):
                outs[r.key] = self._complete(tok, r.ids, r.max_new_tokens, salt if prefix_sharing else
                                             f"{salt}-{m}", prefix_sharing)
        return EngineRun(outs, time.perf_counter() - t0, sum(len(o.tokens) for o in outs.values()))
