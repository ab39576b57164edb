"""The engine study's overhead against the engine's own run: the same greedy requests with top-5
log-probs, (a) as the study sends them - kvviz's adapter, the JSON-lines worker, one request per submission
(alone) and the prefix cache emptied before each - timed in kvviz around each call, and (b) the engine's own time
for the same calls, measured inside the worker around `llm.generate` / llama.cpp's eval loop. Goal: a/b <= 1.2.
The float64 reference and kvviz's no-cache reference are the study's analysis, not engine overhead: reported apart.

    python bench/engine_bench.py [vllm] [llama.cpp]   (both where built; `make engines`)
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvviz  # noqa: E402
from kvviz.engines import engine_python  # noqa: E402
from kvviz.inputs import encode  # noqa: E402
from kvviz.prompts import load_prompts  # noqa: E402
from kvviz.views.serving.engine_workers import make_worker_engine  # noqa: E402
from kvviz.views.serving.engines import Request  # noqa: E402


def bench(name: str, n_prompts: int = 8, new_tokens: int = 16) -> dict:
    lm = kvviz.load_model("default", "float32", "cpu")
    prompts = load_prompts("builtin", n_prompts)
    ids = [encode(lm, p) for p in prompts]
    engine = make_worker_engine(name)
    try:
        t0 = time.perf_counter()
        engine.run(lm, [Request("warmup", ids[0], 2)], max_in_flight=1, prefix_sharing=False)
        start = time.perf_counter() - t0
        walls, inside = [], []
        for rep in range(2):
            for i, x in enumerate(ids):
                t0 = time.perf_counter()
                out = engine.run(lm, [Request(f"p{i}", x, new_tokens)], max_in_flight=1, prefix_sharing=False)
                walls.append(time.perf_counter() - t0)
                inside.append(out.seconds)
        info = engine.info()
    finally:
        engine.close()
    a, b = sum(walls), sum(inside)
    return {"engine": name, "version": info.get("version"), "start_s": start, "study_s": a, "engine_s": b,
            "ratio": a / b, "requests": len(walls), "new_tokens": new_tokens}


if __name__ == "__main__":
    names = sys.argv[1:] or ["vllm", "llama.cpp"]
    for n in names:
        if engine_python(n) is None:
            print(f"{n}: not built (make engines)")
            continue
        r = bench(n)
        print(f"{r['engine']} {r['version']}: {r['requests']} requests × {r['new_tokens']} tokens: through kvviz "
              f"{r['study_s']:.2f} s, the engine's own {r['engine_s']:.2f} s -> {r['ratio']:.3f}× "
              f"(start-up {r['start_s']:.1f} s, not counted)")
