"""Benchmark: kvviz's greedy comparison (no_cache, cache, generate) vs the naive script people write.

Same process, same run, the same model objects: the naive script's three loops (no-cache loop, cache loop,
generate) against kvviz exact and kvviz fast. Prints times and ratios; with --write, records them in
docs/benchmarks.md together with the machine they came from. Not a test: timings belong here.

    python bench/greedy_bench.py [--model default] [--tokens 64] [--repeats 2] [--write]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvviz  # noqa: E402
from kvviz.models.compat import cache_argument, output_cache  # noqa: E402
from kvviz.views.greedy.run import GreedyConfig  # noqa: E402

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning"


def naive_script(model, tokenizer, prompt: str, n: int) -> list[list[int]]:
    """What the naive script does: greedy without cache, greedy with cache, and generate."""
    dev = next(model.parameters()).device
    outs = []
    tokens = tokenizer(prompt, return_tensors="pt").input_ids.to(dev)
    for _ in range(n):
        with torch.no_grad():
            mout = model(tokens)
        tokens = torch.hstack((tokens, torch.argmax(mout.logits[0, -1]).unsqueeze(0).unsqueeze(0)))
    outs.append(tokens[0].tolist())
    tokens = tokenizer(prompt, return_tensors="pt").input_ids.to(dev)
    cached = None
    for _ in range(n):
        with torch.no_grad():
            if cached is None:
                mout = model(tokens, output_hidden_states=True, use_cache=True)
            else:
                mout = model(tokens[:, -1:], **{cache_argument(model): cached}, use_cache=True, output_hidden_states=True)
            cached = output_cache(mout)
        tokens = torch.hstack((tokens, torch.argmax(mout.logits[0, -1]).unsqueeze(0).unsqueeze(0)))
    outs.append(tokens[0].tolist())
    tokens = tokenizer(prompt, return_tensors="pt").input_ids.to(dev)
    with torch.no_grad():
        # EOS must not stop it early, or it would do less work than the loops (kvviz's generate path does the same)
        outs.append(model.generate(tokens, do_sample=False, max_new_tokens=n, eos_token_id=[],
                                   pad_token_id=tokenizer.eos_token_id)[0].tolist())
    return outs


def timed(fn):
    t = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU only ({os.cpu_count()} cores)"
    return f"{cpu}; {dev}; torch {torch.__version__}, threads {torch.get_num_threads()}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--write", action="store_true", help="append the figures to docs/benchmarks.md")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = ap.parse_args()
    rows = []
    for dtype in args.dtypes.split(","):
        lm = kvviz.load_model(args.model, dtype, args.device)
        kvviz.load_model(args.model, "float64", kvviz.core.dtypes.float64_device(lm.device))  # verdict model, loaded once
        paths = ("no_cache", "cache", "generate")
        exact_cfg = GreedyConfig(PROMPT, args.tokens, paths=paths)
        fast_cfg = GreedyConfig(PROMPT, args.tokens, paths=paths, fast=True)
        naive_s, exact_s, fast_s = [], [], []
        kvviz.run("greedy", lm, GreedyConfig(PROMPT, 2, paths=paths))  # warm-up
        for r in range(args.repeats):
            # interleaved, and in alternating order, so drifts in machine speed hit all three alike
            jobs = [("naive", lambda: naive_script(lm.model, lm.tokenizer, PROMPT, args.tokens)),
                    ("exact", lambda: kvviz.run("greedy", lm, exact_cfg)),
                    ("fast", lambda: kvviz.run("greedy", lm, fast_cfg))]
            for name, job in (jobs if r % 2 == 0 else jobs[::-1]):
                t, out = timed(job)
                {"naive": naive_s, "exact": exact_s, "fast": fast_s}[name].append(t)
                if name == "naive":
                    naive = out
                elif name == "exact":
                    exact = out
                else:
                    fast = out
        n_prompt = len(lm.tokenizer(PROMPT)["input_ids"])
        same = naive[0][n_prompt:] == exact.paths["no_cache"].token_ids and \
            naive[1][n_prompt:] == exact.paths["cache"].token_ids
        row = dict(dtype=dtype, naive=statistics.median(naive_s), exact=statistics.median(exact_s),
                   fast=statistics.median(fast_s), same_tokens=same,
                   parting=exact.pair("no_cache", "cache").first_divergence,
                   forwards_exact=sum(p.forwards for p in exact.paths.values()),
                   forwards_fast=sum(p.forwards for p in fast.paths.values()),
                   unsettled=fast.paths["no_cache"].settled.count(False))
        # the ratio of each repeat (measured back to back), then the median: robust to a machine that drifts
        row["exact_ratio"] = statistics.median(e / n for e, n in zip(exact_s, naive_s))
        row["fast_ratio"] = statistics.median(f / n for f, n in zip(fast_s, naive_s))
        row["spread"] = f"{min(naive_s):.1f}–{max(naive_s):.1f} s"
        rows.append(row)
        print(f"{dtype:>9}: naive {row['naive']:.2f} s | kvviz exact {row['exact']:.2f} s "
              f"({row['exact_ratio']:.2f}x) | kvviz fast {row['fast']:.2f} s ({row['fast_ratio']:.2f}x) | "
              f"forwards exact/fast {row['forwards_exact']}/{row['forwards_fast']} | no_cache vs cache part at "
              f"{row['parting']} | exact tokens = naive tokens: {same}", flush=True)
    if args.json:
        import json

        Path(args.json).write_text(json.dumps({"machine": machine(), "model": args.model, "tokens": args.tokens,
                                               "repeats": args.repeats, "rows": rows}, indent=1))
    if args.write:
        out = ROOT / "docs" / "benchmarks.md"
        new = not out.exists()
        with open(out, "a") as f:
            if new:
                f.write("# Benchmarks\n\nGreedy comparison (`bench/greedy_bench.py`): kvviz's no_cache, cache and "
                        "generate paths vs the naive script doing the same three loops, same process, "
                        "medians over the repeats (each repeat's ratio measured back to back, order alternating). Ratios below 1 mean "
                        "kvviz is faster.\n")
            f.write(f"\n## {time.strftime('%Y-%m-%d')} — {machine()}\n\n"
                    f"model `{args.model}`, {args.tokens} new tokens, prompt \"{PROMPT}\", median of {args.repeats}\n\n"
                    "| dtype | naive script (range) | kvviz exact | ratio | kvviz fast | ratio | forwards exact / fast | "
                    "no_cache vs cache part at | fast steps not settled | exact tokens = naive |\n"
                    "|---|---|---|---|---|---|---|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['dtype']} | {r['naive']:.2f} s ({r['spread']}) | {r['exact']:.2f} s | {r['exact_ratio']:.2f}× | "
                        f"{r['fast']:.2f} s | {r['fast_ratio']:.2f}× | {r['forwards_exact']} / {r['forwards_fast']} | "
                        f"{r['parting']} | {r['unsettled']} | {r['same_tokens']} |\n")
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
