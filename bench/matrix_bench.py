"""Benchmark: the matrix (models shared across cells, references computed once) against running each cell naively
(its own model load and its own reference), same process, same cells.

    python bench/matrix_bench.py [--model default] [--device auto] [--tokens 8] [--write] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvviz  # noqa: E402
from kvviz.views.matrix.run import MatrixConfig  # noqa: E402

PROMPT = "The capital of France is Paris, and the capital of Italy is"


def run_matrix(args, cfg: MatrixConfig):
    """The matrix view through the protocol, its loading timed with it: the eager model is the one its reference
    loads first (the others come from the same cache)."""
    return kvviz.run("matrix", kvviz.load_model(args.model, args.dtype, args.device, "eager"), cfg)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--caches", default="dynamic,static")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = MatrixConfig(PROMPT, args.tokens, attentions=("eager", "sdpa"), caches=tuple(args.caches.split(",")),
                       repeats=1)
    kvviz.load_model(args.model, args.dtype, args.device)  # converted once (GGUF) before anything is timed
    kvviz.clear_cache()
    t = time.perf_counter()
    shared = run_matrix(args, cfg)
    t_shared = time.perf_counter() - t
    t_naive = 0.0
    for a, c, comp, flags in cfg.cells():
        kvviz.clear_cache()  # every cell loads its own models and computes its own reference
        one = MatrixConfig(PROMPT, args.tokens, attentions=(a,), caches=(c,), compiles=(comp,), flag_sets=(flags,),
                           repeats=1)
        t = time.perf_counter()
        run_matrix(args, one)
        t_naive += time.perf_counter() - t
    ratio = t_shared / t_naive
    dev = shared.environment["device_name"]
    print(f"{len(cfg.cells())} cells, {args.tokens} tokens: matrix {t_shared:.2f} s, naive {t_naive:.2f} s, "
          f"ratio {ratio:.2f}x ({dev})")
    row = {"cells": len(cfg.cells()), "tokens": args.tokens, "matrix_s": t_shared, "naive_s": t_naive,
           "ratio": ratio, "device": dev, "model": args.model, "dtype": args.dtype}
    if args.json:
        Path(args.json).write_text(json.dumps(row))
    if args.write:
        with open(ROOT / "docs" / "benchmarks.md", "a", encoding="utf-8") as f:
            f.write(f"\n## Backends matrix — {time.strftime('%Y-%m-%d')} — {dev}\n\n`bench/matrix_bench.py`: "
                    f"`{args.model}` in {args.dtype}, {row['cells']} cells (eager/sdpa × {args.caches}), "
                    f"{args.tokens} tokens, 1 repeat. The matrix shares loaded models and the references across "
                    f"cells; the naive way loads its own models and computes its own reference per cell.\n\n"
                    f"| matrix | naive | ratio |\n|---|---|---|\n| {t_shared:.2f} s | {t_naive:.2f} s | "
                    f"{ratio:.2f}× |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
