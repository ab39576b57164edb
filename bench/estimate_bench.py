"""Estimate against actual (issue 53.1): every view's default run (the calls its page makes, bench/pages_bench.py) and
long variants (a split at ~1k and ~3.7k tokens, greedy with 1,024 new tokens on a 4-layer folder model), each run
through its view's protocol with the estimate kvviz.core.estimate makes for it from this machine's calibration,
timed. Prints one row per run (view, model, dtype, tokens, estimate s of the phases that ran, the estimate with every
"may happen" phase, actual s, ratio) and, with --write, the table
in docs/benchmarks.md. The pace is calibrated afresh (a store of the bench's own: no run refines the next one's
estimate, so each row is what a first run would be told).

    nice -n 10 .venv/bin/python bench/estimate_bench.py [--sets defaults,long] [--views split,greedy] [--write]

Goal: every row within 0.5x-2x on a quiet machine. The load average is printed with each row: on a loaded machine
calibration and run see different loads.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import kvviz  # noqa: E402
from kvviz import views  # noqa: E402
from kvviz.core import estimate  # noqa: E402
from kvviz.core.protocol import DEFAULT_CONTEXT  # noqa: E402
from kvviz.io.clirun import config_workload  # noqa: E402

FRESH = False  # --fresh-each: a fresh calibration before every row (else once, at the first row, for all)
RATIO = ("Ratio = actual / the estimate of the phases that ran (goal 0.5-2): its certain phases, and those that run "
         "only where the paths differ (the float64 rerun, the invariant proof: marked ? in the phases) where they "
         "ran; \"up to\" counts them all.")
WORDS = ("The old lighthouse keeper wrote every evening in a worn notebook about the ships, the weather and the "
         "gulls that circled the rocks below, and each page ended with the same careful line about the tide. ")


@contextlib.contextmanager
def estimated_runs(rows: list, model: str, dtype: str, note: str = ""):
    """Every view run through View.runner() inside: its estimate made first (from its config's workload), the run
    given it in its context, and one row of estimate against actual (the outermost run only: the check card's
    inner runs are part of its own)."""
    orig = views.View.runner
    depth = [0]

    def runner(self):
        run = orig(self)

        def go(lm, config, ctx=DEFAULT_CONTEXT):
            if depth[0]:
                return run(lm, config, ctx)
            w = config_workload(config)
            if ctx.prove is False:
                w = dataclasses.replace(w, prove=False)
            tokens = estimate.tokens_of(lm, w)
            if FRESH:  # calibrated just before this run (a loaded machine's share moves between rows)
                path = Path(tempfile.mkdtemp(prefix="kvviz-estimate-bench-")) / "estimates.json"
                estimate.store_path = lambda: path
            t_cal = time.perf_counter()
            est = estimate.for_model(lm, w, tokens, self.name, invariant=ctx.settings.invariant)
            cal_s = time.perf_counter() - t_cal
            clock = estimate.PhaseClock()
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                res = run(lm, config, dataclasses.replace(ctx, estimate=est, on_phase=clock))
            finally:
                depth[0] -= 1
            took = time.perf_counter() - t0
            measured = clock.measured()
            ran = est.ran_s(measured)  # the certain phases and the "may happen" ones that ran
            row = {"view": self.name, "model": model, "dtype": dtype, "tokens": tokens + int(w.new_tokens or 0),
                   "estimate_s": ran, "upper_s": est.total_s, "actual_s": took, "ratio": took / ran if ran else None,
                   "phases_estimate": {p.name + ("?" if p.maybe else ""): p.seconds for p in est.phases},
                   "phases_actual": measured, "calibration_s": cal_s, "note": note, "loadavg": os.getloadavg()[0]}
            rows.append(row)
            print(f"{row['view']:<14} {model:<22} {dtype:<9} {row['tokens']:>6} tok  estimate {ran:8.1f} s (up to "
                  f"{est.total_s:.1f})  actual {took:8.1f} s  ratio {row['ratio'] or 0:5.2f}  {note}  (load "
                  f"{row['loadavg']:.1f}; phases est {fmt(row['phases_estimate'])} / actual {fmt(measured)})",
                  flush=True)
            return res

        return go

    views.View.runner = runner
    try:
        yield
    finally:
        views.View.runner = orig


def fmt(d: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in d.items())


def text_of(lm, tokens: int) -> str:
    """A prompt of about `tokens` tokens for this model's tokenizer."""
    tok = lm.tokenizer
    text = WORDS
    while len(tok(text)["input_ids"]) < tokens:
        text += WORDS
    ids = tok(text)["input_ids"][:tokens]
    return tok.decode(ids, skip_special_tokens=True)


def folder_model(src: str, layers: int = 4) -> str:
    """A folder model: `src`'s architecture cut to `layers` layers (weights random; a run's time does not depend
    on them), saved once under the system's temp dir."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(tempfile.gettempdir()) / f"kvviz-bench-{layers}-layer-model"
    if (out / "config.json").is_file():
        return str(out)
    lm = kvviz.load_model(src, "float32", "cpu")
    cfg = lm.model.config.__class__.from_dict(lm.model.config.to_dict())
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    lm.tokenizer.save_pretrained(out)
    return str(out)


def defaults(rows: list, model: str, dtype: str, names: list[str]) -> None:
    from pages_bench import page_calls

    lm = kvviz.load_model(model, dtype, "cpu")
    calls = page_calls(lm, model)
    with estimated_runs(rows, model, dtype, "page default"):
        for name in names or list(calls):
            if name in calls:
                calls[name]()


def long_split(rows: list, model: str, dtype: str, tokens: int, prove: bool) -> None:
    from kvviz.core.protocol import RunContext

    lm = kvviz.load_model(model, dtype, "cpu")
    prompt = text_of(lm, tokens)
    v = views.get("split")
    with estimated_runs(rows, model, dtype, "long, one chunk" + ("" if prove else ", no proof")):
        v.runner()(lm, v.config_type()(prompt=prompt, split=tokens // 2),
                   RunContext(prove=None if prove else False))


def long_greedy(rows: list, model: str, dtype: str, new_tokens: int, label: str) -> None:
    from kvviz.core.protocol import RunContext

    lm = kvviz.load_model(model, dtype, "cpu")
    v = views.get("greedy")
    with estimated_runs(rows, label, dtype, f"long, {new_tokens} new tokens"):
        v.runner()(lm, v.config_type()(prompt=WORDS, max_new_tokens=new_tokens), RunContext())


def write_table(rows: list, header: str) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    text = path.read_text(encoding="utf-8")
    start = "<!-- estimate_bench -->"
    table = [start, "", header, "",
             "| view | model | dtype | tokens | estimate s (phases that ran) | up to s | actual s | ratio | "
             "phases: estimate (? may happen) / actual s | run |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        table.append(f"| {r['view']} | {r['model']} | {r['dtype']} | {r['tokens']} | {r['estimate_s']:.1f} | "
                     f"{r.get('upper_s', r['estimate_s']):.1f} | {r['actual_s']:.1f} | {r['ratio']:.2f} | "
                     f"{fmt(r['phases_estimate'])} / {fmt(r['phases_actual'])} | {r['note']} "
                     f"(load {r['loadavg']:.1f}) |")
    table += ["", "<!-- /estimate_bench -->"]
    block = "\n".join(table)
    if start in text:
        a, b = text.index(start), text.index("<!-- /estimate_bench -->") + len("<!-- /estimate_bench -->")
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip() + "\n\n## Estimates against actual (bench/estimate_bench.py)\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--sets", default="defaults,long", help="defaults (every view's page default), long")
    ap.add_argument("--views", default="", help="the defaults set's views (default: all)")
    ap.add_argument("--dtype", default="float32", help="the defaults set's dtype")
    ap.add_argument("--split-tokens", default="1024,3680", help="the long split's prompt lengths")
    ap.add_argument("--greedy-tokens", type=int, default=1024, help="the long greedy's new tokens")
    ap.add_argument("--long-dtype", default="bfloat16")
    ap.add_argument("--json", default="")
    ap.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    ap.add_argument("--fresh-each", action="store_true",
                    help="calibrate afresh before every row (on a loaded machine: the load the run meets)")
    ap.add_argument("--table-from", default="", help="comma-separated --json files: write their rows, run nothing")
    a = ap.parse_args(argv)
    import torch

    global FRESH
    FRESH = a.fresh_each

    if a.table_from:
        docs = [json.loads(Path(f).read_text()) for f in a.table_from.split(",") if f]
        write_table([r for d in docs for r in d["rows"]], "Machines: " + "; ".join(d["machine"] for d in docs)
                    + ". " + RATIO)
        return 0
    store = Path(tempfile.mkdtemp(prefix="kvviz-estimate-bench-")) / "estimates.json"
    estimate.store_path = lambda: store  # calibrated afresh; no run refines the next
    sets = [s for s in a.sets.split(",") if s]
    head = (f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, nice {os.nice(0)}, load average at "
            f"start {os.getloadavg()[0]:.1f}" + (", calibrated afresh before each row" if FRESH else ""))
    print(head, flush=True)
    rows: list = []
    t0 = time.perf_counter()
    if "defaults" in sets:
        defaults(rows, a.model, a.dtype, [n for n in a.views.split(",") if n])
    if "long" in sets:
        for i, n in enumerate(int(x) for x in a.split_tokens.split(",") if x):
            long_split(rows, a.model, a.long_dtype, n, prove=i == 0)  # the longest without its proof (issue 53)
        if a.greedy_tokens:
            long_greedy(rows, folder_model(a.model), a.long_dtype, a.greedy_tokens, "4-layer folder model")
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": head, "rows": rows}, indent=2))
    if a.write:
        write_table(rows, f"Machine: {head}. " + RATIO)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
