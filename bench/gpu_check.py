"""`make gpu-check`: the library tests with device auto on a CUDA machine, plus the greedy benchmark, written up
as a short report (device, versions, pass/fail, ratios) in docs/gpu.md.

    python bench/gpu_check.py [--out docs/gpu.md] [--tokens 64] [--repeats 3] [--no-bench]

The browser and Streamlit tests are left out (they test the app, not the numbers). On a machine without CUDA it
says so and runs nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
APP_TESTS = ("tests/test_app.py", "tests/test_browser.py", "tests/test_streamlit_internals.py",
             "tests/test_wheel.py")  # the app, and the package build (it installs into a venv of the image's own)


def run_tests(extra: list[str], workers: int = 0) -> dict:
    """pytest -m 'not browser' with KVVIZ_TEST_DEVICE=auto; counts and the failing tests from its JUnit XML.
    workers > 0: that many pytest-xdist processes sharing the GPU (the suite takes over 10 min serially there)."""
    from kvviz.core import optional

    xml = Path(tempfile.mkdtemp()) / "junit.xml"
    par = ["-n", str(workers)] if workers > 0 and optional.available("xdist") else []
    if workers > 0 and not par:
        print(f"gpu-check: --workers {workers} needs pytest-xdist, which is not installed here: one process",
              file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pytest", "-q", *par, "-m", "not browser and not app", "-p", "no:cacheprovider",
           f"--junitxml={xml}",
           *[f"--ignore={t}" for t in APP_TESTS], *extra]
    env = dict(os.environ, KVVIZ_TEST_DEVICE="auto", HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    if proc.stdout:
        (Path(tempfile.gettempdir()) / "kvviz-gpu-pytest.log").write_text(proc.stdout)
    if not xml.exists():
        return {"tests": 0, "failures": 0, "errors": 1, "skipped": 0, "failed": ["pytest did not run"], "seconds": took}
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {
        "failed": failed, "seconds": took}


def run_bench(tokens: int, repeats: int) -> dict | None:
    out = Path(tempfile.mkdtemp()) / "bench.json"
    cmd = [sys.executable, str(ROOT / "bench" / "greedy_bench.py"), "--device", "cuda", "--tokens", str(tokens),
           "--repeats", str(repeats), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", flush=True)
    return json.loads(out.read_text()) if out.exists() else None


def run_invariant(models: str, lengths: str) -> dict | None:
    """bench/invariant_bench.py on CUDA: invariant/normal per model and length (the 8B shape built on the device)."""
    out = Path(tempfile.mkdtemp()) / "invariant.json"
    cmd = [sys.executable, str(ROOT / "bench" / "invariant_bench.py"), "--device", "cuda", "--models", models,
           "--lengths", lengths, "--modes", "chunk", "--repeats", "3", "--root", tempfile.mkdtemp(), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else \
        {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"], "rows": []}


def invariant_report(inv: dict | None) -> str:
    if not inv:
        return ""
    if inv.get("error"):
        return f"\nInvariant benchmark (`bench/invariant_bench.py --device cuda`): did not finish: {inv['error'][0]}\n"
    lines = ["", f"Invariant benchmark (`bench/invariant_bench.py --device cuda`, {inv['dtype']}, split scenario, chunk):",
             "", "| model | tokens | normal | invariant | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['tokens']} | {r['normal_s']:.3f} s | {r['invariant_s']:.3f} s | {r['ratio']:.2f}× |"
              for r in inv["rows"]]
    return "\n".join(lines) + "\n"


def run_device_map() -> dict | None:
    """bench/device_map_check.py on CUDA: the default model spread over GPU 0, CPU RAM and disk vs one device."""
    out = Path(tempfile.mkdtemp()) / "device_map.json"
    cmd = [sys.executable, str(ROOT / "bench" / "device_map_check.py"), "--device", "cuda", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", flush=True)
    return json.loads(out.read_text()) if out.exists() else {"ok": False, "error": proc.stderr.strip()[-300:]}


def device_map_report(dm: dict | None) -> str:
    if dm is None:
        return ""
    if "checks" not in dm:
        return f"\ndevice_map run (`bench/device_map_check.py`): did not finish: {dm.get('error', '?')}\n"
    lines = [f"\ndevice_map run (`bench/device_map_check.py`, {dm['model']} {dm['dtype']}, max_memory "
             f"{dm['max_memory']}): placement {dm['placement']}.", "",
             "| check | bit for bit = one device | one device | spread |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['bit_for_bit']} | {v['one_device_s']} s | {v['spread_s']} s |" for k, v in dm["checks"].items()]
    return "\n".join(lines) + "\n"


def report(env: dict, tests: dict, bench: dict | None) -> str:
    passed = tests["tests"] - tests["failures"] - tests["errors"] - tests["skipped"]
    lines = [f"\n## {time.strftime('%Y-%m-%d')} — {env['device_name']}\n",
             f"torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}), transformers {env['transformers']}, "
             f"kvviz {env['kvviz']}, Python {env['python']}; CPU {env['cpu']}.\n",
             f"Library tests with `KVVIZ_TEST_DEVICE=auto` (browser/app tests left out): **{passed} passed**, "
             f"{tests['failures']} failed, {tests['errors']} errors, {tests['skipped']} skipped, "
             f"{tests['seconds']:.0f} s."]
    lines += [f"- failed: `{name}`" for name in tests["failed"]]
    flags = env["flags"]
    lines.append(f"\nPrecision flags during the run: TF32 matmul {flags['cuda_matmul_allow_tf32']}, "
                 f"float32 matmul precision {flags['float32_matmul_precision']}, deterministic "
                 f"{flags['deterministic_algorithms']}.")
    if bench:
        lines += ["", f"Greedy benchmark (`bench/greedy_bench.py --device cuda`, model `{bench['model']}`, "
                      f"{bench['tokens']} new tokens, median of {bench['repeats']}):", "",
                  "| dtype | naive script | kvviz exact | ratio | kvviz fast | ratio | exact tokens = naive |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['naive']:.2f} s | {r['exact']:.2f} s | {r['exact_ratio']:.2f}× | "
                  f"{r['fast']:.2f} s | {r['fast_ratio']:.2f}× | {r['same_tokens']} |" for r in bench["rows"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "gpu.md"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--invariant-models", default="default,llama1b,llama8b")
    ap.add_argument("--invariant-lengths", default="16,64,256,1024,4096,8192")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="pytest-xdist processes (0: one process; without pytest-xdist it says so and runs one)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -k split)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU here; nothing to check (the CPU suite is `make test`)", file=sys.stderr)
        return 1
    from kvviz.core.environment import environment

    env = environment("cuda")
    tests = run_tests(args.pytest_args, args.workers)
    bench = None if args.no_bench else run_bench(args.tokens, args.repeats)
    device_map = run_device_map()
    inv = None if args.no_bench else run_invariant(args.invariant_models, args.invariant_lengths)
    out = Path(args.out)
    head = "" if out.exists() else ("# kvviz on a GPU\n\nWritten by `make gpu-check` (bench/gpu_check.py): the library "
                                    "tests with device auto, and the greedy benchmark against the naive script.\n")
    with open(out, "a", encoding="utf-8") as f:
        f.write(head + report(env, tests, bench) + device_map_report(device_map) + invariant_report(inv))
    print(f"written to {out}")
    return 0 if not tests["failed"] and (device_map or {}).get("ok", False) else 1


if __name__ == "__main__":
    sys.exit(main())
