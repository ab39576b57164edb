"""How long each page's default run takes: the library calls each page makes with its default controls, on the
default model (or --model), timed after the model is loaded (the first load is excluded and reported apart).
Medians over --repeats runs; each run is a fresh call (the pages' session cache is not used).

    nice -n 10 .venv/bin/python bench/pages_bench.py [--model default] [--repeats 3] [--pages split,greedy] [--json F]

The budget: every page's default run <= 30 s on a quiet 2-core CPU. The machine this ran on, its load
and the niceness are printed with the numbers: compare runs only on the same machine and load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvviz  # noqa: E402


def page_calls(lm, spec: str):
    """view name -> a zero-argument function doing what the page does on its first run with its default controls.
    Keep in step with the defaults in pages/*.py (tests/test_pages_bench.py checks the names and a tiny run)."""
    from kvviz import views
    from kvviz.core.protocol import RunContext
    from kvviz.views.cache.run import save_cache_bytes
    from kvviz.views.quant.run import DEFAULT_RESIDUAL

    from pages.defaults import DEFAULTS as D  # the pages' default controls, in one place

    def run(name: str, *args, prove=None, **kw):
        """The view's run (kvviz.core.protocol) on its config class made from the page's defaults."""
        v = views.get(name)
        return v.runner()(lm, v.config_type()(*args, **kw), RunContext(prove=prove))

    def split():
        from kvviz.core.inputs import encode

        n = len(encode(lm, D["split"]["prompt"]))
        return run("split", prompt=D["split"]["prompt"], split=min(max(1, n // 2), n - 1))

    def greedy():
        from kvviz.views.greedy.run import DEFAULT_PATHS

        g = D["greedy"]
        return run("greedy", prompt=g["prompt"], max_new_tokens=g["n"], paths=tuple(DEFAULT_PATHS))

    def dtypes():
        d = D["dtypes"]
        return run("dtypes", (d["prompt"],), tuple(d["dtypes"]), split="last", mode="chunk")

    def padding():
        p = D["padding"]
        return run("padding", p["prompt"], None, p["left_pad"], prove=None if p["prove"] else False)

    def reuse():
        r = D["reuse"]
        return run("reuse", r["prefix"], tuple(r["continuations"]), r["n"], prove=None if r["prove"] else False)

    def trap():
        t = D["loading_trap"]
        return run("loading_trap", t["prompt"], t["n"], "bfloat16")

    def matrix():
        m = D["matrix"]
        return run("matrix", prompt=m["prompt"], max_new_tokens=m["n"], attentions=tuple(m["attn"]),
                   caches=tuple(m["cache"]), compiles=("off",), flag_sets=((),), repeats=m["repeats"])

    def kv_cache():
        save_cache_bytes(lm, D["cache"]["prompt"])  # the page's download button
        return run("kv_size", D["cache"]["tokens"], 1, measure=lm.max_positions is None
                   or D["cache"]["tokens"] <= lm.max_positions)

    def quant():
        q = D["quant"]
        return run("quant", q["prompt"], kv=q["kv"], residual_length=DEFAULT_RESIDUAL, weights="none",
                   max_new_tokens=q["n"])

    def check():
        return run("check")

    def lens():  # the generic page: its config's defaults (pages/view.py), the Page's default prompt
        return run("lens", prompt=D["lens"]["prompt"] if "lens" in D else views.get("lens").page.defaults["prompt"])

    def serving():
        from kvviz.core.prompts import builtin_prompts

        sv = D["serving"]
        prompts = [r["prompt"] for r in builtin_prompts() if r["category"] == sv["category"]][: sv["limit"]]
        return run("serving", prompts=prompts, runs=sv["runs"], max_new_tokens=sv["n"], batch_size=sv["batch"],
                   prompt_source="built-in set")

    # keyed by the view whose page makes the call (kvviz.views: View.page)
    return {"lens": lens, "split": split, "greedy": greedy, "dtypes": dtypes, "padding": padding, "reuse": reuse,
            "loading_trap": trap, "matrix": matrix, "kv_reload": kv_cache, "quant": quant,
            "check": check, "serving": serving}


def lesson_calls(spec: str):
    """name -> a zero-argument function running one Lesson step (pages/lesson.py) with its default options, on the
    lesson's models (loaded before timing: bench the steps, not the loads). Goal: each <= 10 s on 2 CPU
    cores."""
    from kvviz.teach import lesson

    models = lesson.model_loader(spec, "cpu")
    for dt in ("float32", "float16", "bfloat16", "float64"):
        t = time.perf_counter()
        models(dt)
        print(f"lesson model {dt}: loaded in {time.perf_counter() - t:.1f} s (a page pays this once, on the first "
              "step that needs it)", flush=True)
    def cold(k):  # each step on its own: nothing from the steps before (a lesson walk shares runs: steps 4, 5, 7)
        lesson.clear_memo()
        return lesson.run_step(k, models)
    return {f"lesson_{k}": (lambda k=k: cold(k)) for k in lesson.STEPS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pages", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--json", default="")
    ap.add_argument("--lesson", action="store_true", help="time the Lesson's eight steps (goal: each <= 10 s)")
    a = ap.parse_args(argv)
    import torch

    t0 = time.perf_counter()
    lm = kvviz.load_model(a.model, "float32", "cpu")
    load_s = time.perf_counter() - t0
    calls = lesson_calls(a.model) if a.lesson else page_calls(lm, a.model)
    names = [n for n in a.pages.split(",") if n] or list(calls)
    try:
        nice = os.nice(0)
    except OSError:
        nice = None
    print(f"model {a.model} ({lm.description}); load {load_s:.1f} s; torch threads {torch.get_num_threads()}; "
          f"cpus {os.cpu_count()}; nice {nice}; load average {os.getloadavg()}")
    out = {"model": a.model, "load_s": load_s, "threads": torch.get_num_threads(), "nice": nice, "pages": {}}
    for name in names:
        times, cpus = [], []
        for _ in range(a.repeats):
            t, c = time.perf_counter(), time.process_time()
            calls[name]()
            times.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
        med, cpu = statistics.median(times), statistics.median(cpus)
        # On a shared machine the wall time is inflated by the other processes; the process CPU time (all threads)
        # is what the run itself needed: on a quiet machine with T threads its wall time lies between cpu / T and cpu.
        est = cpu / max(1, torch.get_num_threads())
        out["pages"][name] = {"median_s": med, "first_s": times[0], "runs_s": times, "cpu_s": cpu, "quiet_estimate_s": [est, cpu],
                              "loadavg": os.getloadavg()[0]}
        print(f"{name:<14} wall median {med:7.1f} s  (runs {', '.join(f'{x:.1f}' for x in times)})  CPU {cpu:7.1f} s "
              f"-> quiet {est:5.1f}-{cpu:5.1f} s  first run {times[0]:.1f} s  "
              f"{'OK' if max(times[0], med) <= (10 if a.lesson else 30) else 'OVER BUDGET'}  "
              f"(load avg {os.getloadavg()[0]:.1f})", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
