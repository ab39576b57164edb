"""Benchmark: the invariant split comparison against the normal one, as the work grows - prompt length and model size.

Times the scenario itself (prefix, full forward, the rest through the cache: kvviz.views.split.run._run) in normal and
in invariant mode, same process, same model, order alternating, and prints the ratio per model x length x feed mode
(median of the per-repeat ratios; wall clock, and CPU time of the process beside it, which a machine busy with other
work disturbs less). The invariant kernels must keep the ratio flat as the length grows (kvviz/core/invariant.py).

Models: `default` (SmolLM2-135M), and random-weight Llama-shaped folders built on first use (safetensors, shard by
shard; bench/memory_bench.py's builder): `llama1b` (Llama-3.2-1B's shape) and `llama8b` (Llama-3.1-8B's: 16 GB in
bfloat16 - a GPU's, or a CPU with the memory and the patience). A length is skipped where its normal run alone
would take longer than --max-seconds (extrapolated from the previous length) or memory runs out.

    python bench/invariant_bench.py [--models default,llama1b] [--lengths 16,64,256,1024,4096,8192]
        [--modes chunk,step] [--device auto] [--dtype bfloat16] [--repeats 3] [--root /work/bigmodels] [--write]
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
from kvviz.core.execution import ExecSettings  # noqa: E402
from kvviz.core.inputs import build_inputs  # noqa: E402
from kvviz.models.loading import clear_cache  # noqa: E402
from kvviz.views.split.run import SplitConfig, _run  # noqa: E402

TEXT = ("The capital of France is Paris, and the capital of Italy is Rome. Rivers run to the sea; the sea gives "
        "back rain. ") * 2000
INV = ExecSettings(invariant=True)
_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], max_position_embeddings=131072,
              rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", bos_token_id=1, eos_token_id=2,
              pad_token_id=0, dtype="bfloat16", vocab_size=128256)
SHAPES = {
    "llama1b": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> tuple[float, float]:
    _sync()
    w, c = time.perf_counter(), time.process_time()
    fn()
    _sync()
    return time.perf_counter() - w, time.process_time() - c


def prompt_of(lm, n: int) -> str:
    ids = lm.tokenizer(TEXT, add_special_tokens=False).input_ids[:n]
    return lm.tokenizer.decode(ids)


def bench(lm, n: int, mode: str, repeats: int) -> dict:
    prompt = prompt_of(lm, n)
    inp = build_inputs(lm, prompt, 0)
    cfg = SplitConfig(prompt, split=inp.n_tokens // 2, mode=mode)
    jobs = {"normal": lambda: _run(lm, cfg, inp, lambda f, m: None),
            "invariant": lambda: _run(lm, cfg, inp, lambda f, m: None, INV)}
    for job in jobs.values():
        job()  # warm-up (and the invariant kernels' one-time shape probes)
    times = {k: [] for k in jobs}
    for r in range(repeats):
        for name in (list(jobs) if r % 2 == 0 else list(jobs)[::-1]):
            times[name].append(timed(jobs[name]))
    wall = {k: [t[0] for t in v] for k, v in times.items()}
    cpu = {k: [t[1] for t in v] for k, v in times.items()}
    return {"tokens": inp.n_tokens, "mode": mode, "normal_s": statistics.median(wall["normal"]),
            "invariant_s": statistics.median(wall["invariant"]),
            "ratio": statistics.median(i / m for i, m in zip(wall["invariant"], wall["normal"])),
            "cpu_ratio": statistics.median(i / m for i, m in zip(cpu["invariant"], cpu["normal"]))}


def model_spec(name: str, root: Path) -> str:
    if name in SHAPES:
        from bench.memory_bench import build

        return str(build(root / name, SHAPES[name]))
    return name


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="default,llama1b")
    ap.add_argument("--model", default=None, help="one model (as --models)")
    ap.add_argument("--lengths", default="16,64,256,1024,4096")
    ap.add_argument("--modes", default="chunk,step")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=120.0, help="skip a length whose normal run would be longer")
    ap.add_argument("--root", default="/work/bigmodels", help="where the random-weight folders are built")
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from kvviz.core.environment import environment

    rows, env = [], None
    for name in (args.model or args.models).split(","):
        lm = kvviz.load_model(model_spec(name, Path(args.root)), args.dtype, args.device)
        env = env or environment(lm.device)
        for mode in args.modes.split(","):
            last = None
            for n in (int(x) for x in args.lengths.split(",")):
                if last is not None and last["normal_s"] * (n / last["tokens"]) ** 1.2 > args.max_seconds:
                    print(f"{name} {mode} {n}: skipped (the normal run would pass {args.max_seconds:.0f} s)", flush=True)
                    continue
                try:
                    r = bench(lm, n, mode, args.repeats)
                except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
                    print(f"{name} {mode} {n}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:120]})", flush=True)
                    continue
                r["model"] = name
                rows.append(r)
                last = r
                print(f"{name:>8} {mode:>5} {r['tokens']:>5} tokens: normal {r['normal_s']:.3f} s | invariant "
                      f"{r['invariant_s']:.3f} s | ratio {r['ratio']:.2f}x (CPU time {r['cpu_ratio']:.2f}x)", flush=True)
        del lm
        clear_cache()  # one model in memory at a time
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "dtype": args.dtype, "rows": rows}, indent=1))
    if args.write and rows:
        with open(ROOT / "docs" / "benchmarks.md", "a", encoding="utf-8") as f:
            f.write(f"\n## Invariant mode as the work grows — {time.strftime('%Y-%m-%d')} — {env['device_name']} "
                    f"({env['cpu']}, {torch.get_num_threads()} threads)\n\n"
                    f"`python bench/invariant_bench.py --models {args.model or args.models} --lengths {args.lengths} "
                    f"--modes {args.modes} --dtype {args.dtype} --repeats {args.repeats}`: the split scenario, split "
                    "at half the prompt, median of the repeats, order alternating.\n\n"
                    "| model | feed | tokens | normal | invariant | ratio (wall) | ratio (CPU time) |\n"
                    "|---|---|---|---|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['model']} | {r['mode']} | {r['tokens']} | {r['normal_s']:.3f} s | "
                        f"{r['invariant_s']:.3f} s | {r['ratio']:.2f}× | {r['cpu_ratio']:.2f}× |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
