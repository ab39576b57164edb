"""Benchmark: the invariant split comparison against the normal one, same process, same model.

Times the scenario itself (prefix, full forward, the rest through the cache: kvviz.views.split.run._run) in normal and in
invariant mode, alternating order, median of the per-repeat ratios; and, for reference, the whole run_split
(normal: with its float64 rerun and proof; invariant: which needs neither when the gap is 0).

    python bench/invariant_bench.py [--model default] [--device auto] [--repeats 5] [--write] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvviz  # noqa: E402
from kvviz.execution import ExecSettings  # noqa: E402
from kvviz.inputs import build_inputs  # noqa: E402
from kvviz.views.split.run import SplitConfig, _run, run_split  # noqa: E402

PROMPT = "The capital of France is Paris, and the capital of Italy is"
INV = ExecSettings(invariant=True)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def bench(lm, mode: str, repeats: int) -> dict:
    cfg = SplitConfig(PROMPT, split=6, mode=mode)
    inp = build_inputs(lm, PROMPT, 0)
    jobs = {"normal": lambda: _run(lm, cfg, inp, lambda f, m: None),
            "invariant": lambda: _run(lm, cfg, inp, lambda f, m: None, INV)}
    for job in jobs.values():
        job()  # warm-up
    times = {k: [] for k in jobs}
    for r in range(repeats):
        for name in (list(jobs) if r % 2 == 0 else list(jobs)[::-1]):
            times[name].append(timed(jobs[name]))
    whole_n = timed(lambda: run_split(lm, cfg))
    whole_i = timed(lambda: run_split(lm, cfg, settings=INV))
    return {"mode": mode, "normal_s": statistics.median(times["normal"]),
            "invariant_s": statistics.median(times["invariant"]),
            "ratio": statistics.median(i / n for i, n in zip(times["invariant"], times["normal"])),
            "whole_normal_s": whole_n, "whole_invariant_s": whole_i}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="append to docs/benchmarks.md")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lm = kvviz.load_model(args.model, args.dtype, args.device)
    lm.reference()
    rows = [bench(lm, mode, args.repeats) for mode in ("chunk", "step")]
    from kvviz.environment import environment

    env = environment(lm.device)
    for r in rows:
        print(f"{r['mode']:>5}: normal {r['normal_s']:.3f} s | invariant {r['invariant_s']:.3f} s | ratio "
              f"{r['ratio']:.2f}x | whole run_split normal {r['whole_normal_s']:.2f} s, invariant "
              f"{r['whole_invariant_s']:.2f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "model": args.model, "dtype": args.dtype, "rows": rows}))
    if args.write:
        with open(ROOT / "docs" / "benchmarks.md", "a", encoding="utf-8") as f:
            f.write(f"\n## Invariant mode — {time.strftime('%Y-%m-%d')} — {env['device_name']} ({env['cpu']})\n\n"
                    f"`bench/invariant_bench.py`: the split scenario (`kvviz.views.split.run._run`) on `{args.model}` in "
                    f"{args.dtype}, prompt \"{PROMPT}\", split 6, median of {args.repeats}, order alternating. "
                    "The whole run_split column includes the normal run's float64 rerun and invariant proof.\n\n"
                    "| feed the rest | normal | invariant | ratio | whole run_split normal / invariant |\n"
                    "|---|---|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['mode']} | {r['normal_s']:.3f} s | {r['invariant_s']:.3f} s | {r['ratio']:.2f}× | "
                        f"{r['whole_normal_s']:.2f} s / {r['whole_invariant_s']:.2f} s |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
