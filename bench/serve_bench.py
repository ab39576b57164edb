"""Benchmark: the Serving study's engine runs against the same continuous-batching calls made plainly.

The study (the serving view's run: kvviz.run("serving", ...)) makes, per condition and run, one call of transformers' continuous-batching
engine, reading each step's scores at the engine's argmax (top-2 margins), with the caller's torch function modes
in the engine's thread, then counts distinct completions. The plain way makes the same calls itself:
`model.generate_batch(...)` for `alone` (one request in flight) and `batch` (k in flight, the study's shuffled
order), and the manager that generate_batch wraps for `warm` (a warmer, then the prompt, prefix sharing on).

Reported: the study's engine time + its analysis (distinct counts, first divergences) against the plain calls
(ratio; the goal is ≤ 1.2×), with plain measured as transformers runs it (its stop() does two full gc.collect()
per call) and with the same gc.freeze() kvviz uses; and, apart, what the study adds as evidence: the no-cache
reference and the float64 replays of the parting prompts' first divergences (the invariant proofs are left out
here: they are invariant-mode runs, measured by bench/invariant_bench.py).

    python bench/serve_bench.py [--model default] [--dtype bfloat16] [--prompts 20] [--runs 2] [--tokens 16]
                                [--write] [--json FILE]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvviz  # noqa: E402
from kvviz.core.inputs import encode  # noqa: E402
from kvviz.views.serving.run import ServeConfig, load_prompt_set, plan_batches  # noqa: E402


def _cb_config(per_batch: int, sharing: bool, longest: int, n_requests: int, page: int):
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(page_size=page, num_blocks=(-(-longest // page) + 1) * (n_requests + 2) + 8,
                                    max_batch_tokens=max(64, per_batch * longest), max_requests_per_batch=per_batch,
                                    allow_block_sharing=sharing, use_async_batching=False, use_cuda_graph=False,
                                    auto_switch_to_flash=False, scheduler_type="fifo", max_blocks_per_request=0)


def plain(lm, ids: list[list[int]], n: int, runs: int, k: int, seed: int, page: int, freeze: bool) -> dict:
    """The same engine calls, made plainly (no kvviz in the loop)."""
    from transformers import GenerationConfig

    model = lm.model
    gen = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=n, eos_token_id=-1, pad_token_id=0)
    longest = max(len(x) for x in ids) + n
    plan = plan_batches(len(ids), k, runs, seed)
    times = {"alone": 0.0, "batch": 0.0, "warm": 0.0}
    if freeze:
        gc.freeze()
    try:
        for r in range(runs):
            t = time.perf_counter()
            model.generate_batch(ids, generation_config=gen,
                                 continuous_batching_config=_cb_config(1, False, longest, len(ids), page))
            times["alone"] += time.perf_counter() - t
            order = [i for b in plan[r] for i in b]
            t = time.perf_counter()
            model.generate_batch([ids[i] for i in order], generation_config=gen,
                                 continuous_batching_config=_cb_config(k, False, longest, len(order), page))
            times["batch"] += time.perf_counter() - t
            t = time.perf_counter()
            manager = model.init_continuous_batching(
                generation_config=gen, continuous_batching_config=_cb_config(1, True, longest, 2 * len(ids), page))
            manager.start()
            try:
                for i, x in enumerate(ids):
                    for key, toks, m in ((f"w{i}", x, 2), (f"p{i}", x, n)):
                        manager.add_request(toks, request_id=key, max_new_tokens=m, eos_token_id=-1)
                        while True:
                            res = manager.get_result(timeout=1)
                            if res is not None and res.is_finished() and res.request_id == key:
                                break
            finally:
                manager.stop(block=True)
                manager.destroy()
            times["warm"] += time.perf_counter() - t
    finally:
        if freeze:
            gc.unfreeze()
    times["total"] = times["alone"] + times["batch"] + times["warm"]
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="append to docs/benchmarks.md")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lm = kvviz.load_model(args.model, args.dtype, args.device)
    prompts, _ = load_prompt_set("builtin", limit=args.prompts)
    ids = [encode(lm, p) for p in prompts]
    cfg = dict(runs=args.runs, max_new_tokens=args.tokens, batch_size=4, seed=0, page_size=8)
    plain(lm, ids[:2], 2, 1, 2, 0, 8, False)  # warm-up
    rows = []
    for rep in range(args.repeats):
        order = ("study", "plain", "plain_frozen") if rep % 2 == 0 else ("plain_frozen", "plain", "study")
        row = {}
        for what in order:
            if what == "study":
                t = time.perf_counter()
                res = kvviz.run("serving", lm, ServeConfig(prompts=list(prompts), **cfg),
                                kvviz.RunContext(prove=False))
                total = time.perf_counter() - t
                engine = sum(c.seconds for k, c in res.conditions.items() if k != "reference")
                row.update(study_engine_s=engine, study_analysis_s=res.analysis_s,
                           study_reference_s=res.conditions["reference"].seconds, study_total_s=total,
                           study_evidence_s=total - engine - res.analysis_s - res.conditions["reference"].seconds,
                           parting=len(res.first_divergences), histogram=res.histogram)
            else:
                row[what + "_s"] = plain(lm, ids, args.tokens, args.runs, 4, 0, 8, what == "plain_frozen")["total"]
        row["ratio"] = (row["study_engine_s"] + row["study_analysis_s"]) / row["plain_s"]
        row["ratio_frozen"] = (row["study_engine_s"] + row["study_analysis_s"]) / row["plain_frozen_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    from kvviz.core.environment import environment

    env = environment(lm.device)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], float)}
    print(f"study engine+analysis {med['study_engine_s'] + med['study_analysis_s']:.2f} s | plain "
          f"{med['plain_s']:.2f} s (ratio {med['ratio']:.2f}x) | plain with gc.freeze {med['plain_frozen_s']:.2f} s "
          f"(ratio {med['ratio_frozen']:.2f}x) | reference {med['study_reference_s']:.2f} s | float64 verdicts "
          f"{med['study_evidence_s']:.2f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "args": vars(args), "rows": rows, "median": med}))
    if args.write:
        with open(ROOT / "docs" / "benchmarks.md", "a", encoding="utf-8") as f:
            f.write(f"\n## Serving study — {time.strftime('%Y-%m-%d')} — {env['device_name']} ({env['cpu']})\n\n"
                    f"`bench/serve_bench.py`: `{args.model}` in {args.dtype} on {args.device}, {args.prompts} built-in "
                    f"prompts × {{alone, batch of 4, warm}} × {args.runs} runs × {args.tokens} tokens; median of "
                    f"{args.repeats} repeats, order alternating. Plain = the same transformers continuous-batching "
                    "calls without kvviz (`generate_batch` for alone and batch, its manager for warm).\n\n"
                    "| study engine + analysis | plain | ratio | plain with gc.freeze | ratio | reference (no cache) "
                    "| float64 verdicts |\n|---|---|---|---|---|---|---|\n"
                    f"| {med['study_engine_s'] + med['study_analysis_s']:.2f} s | {med['plain_s']:.2f} s | "
                    f"{med['ratio']:.2f}× | {med['plain_frozen_s']:.2f} s | {med['ratio_frozen']:.2f}× | "
                    f"{med['study_reference_s']:.2f} s | {med['study_evidence_s']:.2f} s |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
