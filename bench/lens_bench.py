"""Benchmark: the logit lens view's cost and memory at real sizes.

    python bench/lens_bench.py speed [--lengths 64,256,1024] [--repeats 2] [--dtype bfloat16]
        the lens against the split view on the same prompt, in the same process, on the default model (SmolLM2-135M,
        bfloat16): wall time of each run (both with the float64 reference rerun, the split without its invariant-mode
        proof, which the lens refuses), the median of `repeats` (interleaved), the ratio lens / split per prompt
        length, both verdicts and the 1-minute load average before and after each repeat. --dtype float32 likewise.
    python bench/lens_bench.py memory [--tokens 4096] [--root /tmp/lens_bench]
        `python -m kvviz lens` at ~`tokens` prompt tokens (the last `compared` through the cache) on the default model and on a Gemma-3-shaped
        random model with its 262144-token vocabulary (4 layers, built once as safetensors under --root), each a child
        process under `prlimit --as=20GiB`, peak RSS from `/usr/bin/time -f %M`, against the CLI's own --plan.

Not a test: timings and peaks belong here; results go to docs/benchmarks.md by hand (the machine and its load with
them).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SENTENCE = "The capital of France is Paris, and the capital of Italy is Rome. "



def gemma262k_config() -> dict:
    from memory_bench import GEMMA270M

    return dict(GEMMA270M, num_hidden_layers=4,
                layer_types=["sliding_attention"] * 3 + ["full_attention"])


def prompt_of(lm_or_tokenizer, tokens: int) -> str:
    """A prompt of about `tokens` tokens for this tokenizer (the sentence repeated)."""
    tok = getattr(lm_or_tokenizer, "tokenizer", lm_or_tokenizer)
    per = max(1, len(tok(SENTENCE, add_special_tokens=False)["input_ids"]))
    return SENTENCE * max(1, tokens // per)


def speed(lengths: list[int], repeats: int, dtype: str = "bfloat16") -> dict:
    import torch

    import kvviz
    from kvviz.models.loading import load_model
    from kvviz.views.lens.run import LensConfig
    from kvviz.views.split.run import SplitConfig

    lm = load_model("default", dtype, "cpu")
    ref = lm.reference()
    out = {"threads": torch.get_num_threads(), "model": lm.name, "dtype": dtype, "rows": []}
    for n in lengths:
        prompt = prompt_of(lm, n)
        ids = lm.tokenizer(prompt)["input_ids"]
        split = len(ids) // 2
        times = {"split": [], "lens": []}
        load = [os.getloadavg()[0]]
        for _ in range(repeats):  # interleaved: a load change on the shared machine hits both
            t = time.perf_counter()
            s_res = kvviz.run("split", lm, SplitConfig(prompt, split), kvviz.RunContext(prove=False, reference=ref))
            times["split"].append(time.perf_counter() - t)
            t = time.perf_counter()
            l_res = kvviz.run("lens", lm, LensConfig(prompt=prompt, split=split), kvviz.RunContext(reference=ref))
            times["lens"].append(time.perf_counter() - t)
            load.append(os.getloadavg()[0])
        row = {"tokens": len(ids), "split": split, "split_s": statistics.median(times["split"]),
               "lens_s": statistics.median(times["lens"]), "split_all": times["split"], "lens_all": times["lens"],
               "split_verdict": s_res.verdict, "lens_verdict": l_res.verdict, "lens_bitwise": l_res.main.bitwise,
               "load_1min": load}
        row["ratio"] = row["lens_s"] / row["split_s"]
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    return out


def plan_total(cmd: list[str]) -> float:
    """The CLI's --plan total for this command, bytes."""
    p = subprocess.run([sys.executable, "-m", "kvviz", *cmd, "--plan"], capture_output=True, text=True, cwd=ROOT)
    m = re.search(r"^\s*total\s+([\d.]+) (GiB|MiB)", p.stdout, re.M)
    if not m:
        raise SystemExit(f"no plan total in: {p.stdout[-500:]} {p.stderr[-500:]}")
    return float(m.group(1)) * (1024 ** 3 if m.group(2) == "GiB" else 1024 ** 2), p.stdout


def memory(tokens: int, root: Path, compared: int, models: list[str]) -> list[dict]:
    from memory_bench import build, measure

    from transformers import AutoTokenizer

    from kvviz.models.loading import load_model

    folder = build(root / "gemma262k", gemma262k_config())
    rows = []
    for model in [str(folder) if m == "gemma262k" else m for m in models]:
        tok = load_model(model, "bfloat16", "cpu").tokenizer if model == "default" else \
            AutoTokenizer.from_pretrained(folder)
        prompt = prompt_of(tok, tokens)
        n = len(tok(prompt)["input_ids"])
        cmd = ["lens", "--model", model, "--dtype", "bfloat16", "--prompt", prompt, "--split", str(n - compared)]
        plan, text = plan_total(cmd)
        got = measure(cmd + ["--quiet", "--json"])
        row = {"model": "default" if model == "default" else "gemma262k (4 layers)", "tokens": n, "compared": compared,
               "plan_bytes": plan, "peak_rss": got["peak_rss"], "rc": got["rc"], "wall_s": got["wall_s"],
               "within_plan": got["peak_rss"] is not None and got["peak_rss"] <= plan,
               "verdict": (got.get("json") or {}).get("verdict")}
        if got["rc"]:
            row["stderr"] = got["stderr_tail"]
        print(text, flush=True)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--lengths", default="64,256,1024")
    s.add_argument("--repeats", type=int, default=2)
    s.add_argument("--dtype", default="bfloat16")
    m = sub.add_parser("memory")
    m.add_argument("--tokens", type=int, default=4096)
    m.add_argument("--root", type=Path, default=Path("/tmp/lens_bench"))
    m.add_argument("--compared", type=int, default=512, help="positions after the split (compared)")
    m.add_argument("--models", default="default,gemma262k")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.what == "speed":
        print(json.dumps(speed([int(x) for x in a.lengths.split(",")], a.repeats, a.dtype), indent=1))
    else:
        print(json.dumps(memory(a.tokens, a.root, a.compared, a.models.split(",")), indent=1))


if __name__ == "__main__":
    main()
