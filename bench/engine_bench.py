"""The engine study's overhead against the engine's own run: the same greedy requests with top-5
log-probs, (a) as the study sends them - kvviz's adapter, the JSON-lines worker, one request per submission
(alone) and the prefix cache emptied before each - timed in kvviz around each call, and (b) the engine's own time
for the same calls, measured inside the worker around `llm.generate` / llama.cpp's eval loop. Goal: a/b <= 1.2.
The float64 reference and kvviz's no-cache reference are the study's analysis, not engine overhead: reported apart.

    python bench/engine_bench.py [vllm] [llama.cpp]   (both where built; `make engines`)
    python bench/engine_bench.py capture               (vLLM's layer capture, below)
    python bench/engine_bench.py capture llama.cpp     (llama.cpp's layer capture, below)

`capture`: the cost of vLLM layer capture (kvviz/engines/vllm_worker.py, LayerCapture) against the engine's plain
run: two engines at once - one started as the Serving view starts it (no extension), one with the capture extension
- and the same requests sent round-robin to (a) the plain engine, (b) the extension with capture off (its hooks
removed), (c) capture on (every layer's rows copied and kept on the worker, the toggles' RPCs included), each
variant first, second and third in turn, so the machine's load drifts over all three alike. Goals: b/a <= 1.02, c/a <= 1.5. Times are the worker's own (around
llm.generate) and kvviz's wall clock around each call.

`capture llama.cpp`: the same three variants for llama.cpp's layer capture (kvviz/engines/llamacpp_worker.py: the
eval callback reads the embeddings, every l_out-<i> and result_norm; logits_all is on so the last layer keeps every
row) on the default GGUF, at two prompt lengths: (a) a worker started as the Serving view starts it (no callback),
(b) a worker started with capture (callback installed) running a group with no capture tag, (c) the
same worker capturing every row (the kept arrays overwrite one tag, so memory stays flat). Every request starts cold
(reset: the whole prompt evaluated), greedy, top-5 log-probs, as the view sends it. Same rotation of the variants.
One thread per worker: on a machine shared beyond its cores llama.cpp's threads wait on each other at every graph
barrier, and that wait, not the capture, would decide a ratio measured with two. Besides the worker's own time and
kvviz's wall clock, each worker's CPU time around each call (/proc): with one thread the least disturbed by load.
"""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvviz  # noqa: E402
from kvviz.engines import engine_python  # noqa: E402
from kvviz.core.inputs import encode  # noqa: E402
from kvviz.core.prompts import load_prompts  # noqa: E402
from kvviz.engines import registry  # noqa: E402
from kvviz.engines.base import Request  # noqa: E402


def bench(name: str, n_prompts: int = 8, new_tokens: int = 16) -> dict:
    lm = kvviz.load_model("default", "float32", "cpu")
    prompts = load_prompts("builtin", n_prompts)
    ids = [encode(lm, p) for p in prompts]
    engine = registry.open_engine(name)
    try:
        t0 = time.perf_counter()
        engine.generate(lm, [Request("warmup", ids[0], 2)], max_in_flight=1, prefix_sharing=False)
        start = time.perf_counter() - t0
        walls, inside = [], []
        for rep in range(2):
            for i, x in enumerate(ids):
                t0 = time.perf_counter()
                out = engine.generate(lm, [Request(f"p{i}", x, new_tokens)], max_in_flight=1, prefix_sharing=False)
                walls.append(time.perf_counter() - t0)
                inside.append(out.seconds)
        info = engine.info()
    finally:
        engine.close()
    a, b = sum(walls), sum(inside)
    return {"engine": name, "version": info.get("version"), "start_s": start, "study_s": a, "engine_s": b,
            "ratio": a / b, "requests": len(walls), "new_tokens": new_tokens}


def bench_capture(n_prompts: int = 8, new_tokens: int = 16, reps: int = 3, dtype: str = "float32") -> dict:
    from kvviz.engines import WorkerClient

    lm = kvviz.load_model("default", dtype, "cpu")
    ids = [encode(lm, p) for p in load_prompts("builtin", n_prompts)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_BATCH_INVARIANT": "0"}
    start = dict(model=lm.source, dtype=dtype, prefix_caching=True, max_num_seqs=8, block_size=32,
                 gpu_memory_utilization=0.3)
    engines = {}
    try:
        for name, capture in (("plain", False), ("capture", True)):
            engines[name] = WorkerClient("vllm", env=env, timeout_s=1800)
            engines[name].call("start", capture=capture, **start)
            engines[name].call("generate", groups=[{"requests": [{"key": "w", "ids": ids[0], "max_new_tokens": 2}],
                                                    "reset": True}], logprobs=5)
        inside = {"plain": 0.0, "off": 0.0, "on": 0.0}
        wall = dict(inside)
        order = ("plain", "off", "on")
        for rep in range(reps):
            for i, x in enumerate(ids):
                turn = rep * len(ids) + i  # each variant first, second and third in turn (a hot engine's threads
                for how in order[turn % 3:] + order[: turn % 3]:  # run faster right after a call of their own)
                    eng = engines["plain" if how == "plain" else "capture"]
                    group = {"requests": [{"key": f"p{i}", "ids": x, "max_new_tokens": new_tokens}], "reset": True}
                    if how == "on":
                        group["capture"] = f"r{rep}p{i}"
                    t0 = time.perf_counter()
                    out = eng.call("generate", groups=[group], logprobs=5)
                    wall[how] += time.perf_counter() - t0
                    inside[how] += float(out["seconds"])
                    if how == "on":
                        eng.call("drop", tags=[f"r{rep}p{i}"])
    finally:
        for e in engines.values():
            e.close()
    return {"inside": inside, "wall": wall, "requests": reps * len(ids), "new_tokens": new_tokens, "dtype": dtype}


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used (Linux /proc; 10 ms ticks): with one thread, what the work cost,
    whatever else the machine runs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def long_ids(lm, length: int, k: int) -> list[int]:
    """Prompt k of `length` tokens: the built-in prompts from the k-th on, joined, cut to length."""
    texts = load_prompts("builtin")
    ids: list[int] = []
    j = k
    while len(ids) < length:
        ids += encode(lm, texts[j % len(texts)] + " ")
        j += 1
    return ids[:length]


def bench_capture_llamacpp(lengths=(32, 256), n_prompts: int = 4, new_tokens: int = 16, reps: int = 2,
                           threads: int = 1, report=None) -> dict:
    from kvviz.engines import WorkerClient
    from kvviz.engines.workers import gguf_of

    lm = kvviz.load_model("default", "float32", "cpu")
    gguf = gguf_of(lm)[0]
    workers = {}
    out = {"lengths": {}, "requests": reps * n_prompts, "new_tokens": new_tokens, "threads": threads}
    try:
        for name, capture in (("plain", False), ("capture", True)):
            workers[name] = WorkerClient("llama.cpp", timeout_s=1800)
            workers[name].call("start", model=gguf, n_ctx=2048, seed=0, threads=threads, capture=capture)
        for length in lengths:
            ids = [long_ids(lm, length, k) for k in range(n_prompts)]
            for w in workers.values():  # warm-up: the first decode of a length allocates its buffers
                w.call("generate", groups=[{"requests": [{"key": "w", "ids": ids[0], "max_new_tokens": 2}],
                                            "reset": True}], logprobs=5)
            inside = {"plain": 0.0, "off": 0.0, "on": 0.0}
            wall, cpu = dict(inside), dict(inside)
            order = ("plain", "off", "on")
            for rep in range(reps):
                for i, x in enumerate(ids):
                    turn = rep * len(ids) + i
                    for how in order[turn % 3:] + order[: turn % 3]:
                        w = workers["plain" if how == "plain" else "capture"]
                        group = {"requests": [{"key": f"p{i}", "ids": x, "max_new_tokens": new_tokens}],
                                 "reset": True}
                        if how == "on":
                            group["capture"] = "bench"
                        c0, t0 = cpu_s(w.proc.pid), time.perf_counter()
                        got = w.call("generate", groups=[group], logprobs=5)
                        wall[how] += time.perf_counter() - t0
                        cpu[how] += cpu_s(w.proc.pid) - c0
                        inside[how] += float(got["seconds"])
                        if how == "on":  # every row of every layer kept: prompt + generated - 1 positions
                            rows = w.call("captured", tag="bench", key=f"p{i}")
                            assert len(rows["positions"]) == length + new_tokens - 1, rows
            out["lengths"][length] = {"inside": inside, "wall": wall, "cpu": cpu}
            if report is not None:
                report(out, length)
    finally:
        for w in workers.values():
            w.close()
    return out


def _capture_llamacpp() -> None:
    if engine_python("llama.cpp") is None:
        print("llama.cpp: not built (make engines)")
        return

    def show(r, length):
        for k in ("cpu", "inside", "wall"):
            t = r["lengths"][length][k]
            print(f"llama.cpp layer capture, {r['requests']} requests of {length} tokens + {r['new_tokens']} new, "
                  f"{r['threads']} thread(s), {k}: plain {t['plain']:.2f} s, callback off {t['off']:.2f} s "
                  f"({t['off'] / t['plain']:.3f}x), capture on {t['on']:.2f} s ({t['on'] / t['plain']:.3f}x)",
                  flush=True)

    bench_capture_llamacpp(report=show)


def _capture_vllm() -> None:
    r = bench_capture()
    for k in ("inside", "wall"):
        t = r[k]
        print(f"vLLM layer capture, {r['requests']} requests x {r['new_tokens']} tokens ({r['dtype']}), {k}: plain "
              f"{t['plain']:.2f} s, extension off {t['off']:.2f} s ({t['off'] / t['plain']:.3f}x), capture on "
              f"{t['on']:.2f} s ({t['on'] / t['plain']:.3f}x)")


CAPTURE = {"vllm": _capture_vllm, "llama.cpp": _capture_llamacpp}  # `capture [engine]` (vLLM by default)

if __name__ == "__main__":
    if sys.argv[1:2] == ["capture"] and len(sys.argv) <= 3:
        CAPTURE[sys.argv[2] if len(sys.argv) == 3 else "vllm"]()
        sys.exit(0)
    names = sys.argv[1:] or list(registry.capturing())
    for n in names:
        if engine_python(n) is None:
            print(f"{n}: not built (make engines)")
            continue
        r = bench(n)
        print(f"{r['engine']} {r['version']}: {r['requests']} requests × {r['new_tokens']} tokens: through kvviz "
              f"{r['study_s']:.2f} s, the engine's own {r['engine_s']:.2f} s -> {r['ratio']:.3f}× "
              f"(start-up {r['start_s']:.1f} s, not counted)")
