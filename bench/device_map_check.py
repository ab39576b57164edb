"""A device_map run on CUDA (called by `make gpu-check`; runs on the CPU too): the default model with its layers
spread by accelerate over GPU 0, CPU RAM and disk (a max_memory budget of ~1/3 of the weights on each of GPU 0
and the CPU), against the same model on one device: split (with the float64 evidence) and greedy with the float64
path must give bit for bit the same numbers. Prints one JSON object.

    python bench/device_map_check.py [--device cuda] [--model default] [--dtype float32] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "The capital of France is Paris, and the capital of Italy is"
_HOW = {"settings", "model", "elapsed_s", "notes", "warnings", "seconds", "seconds_per_token", "device",
        "float64_device", "placement", "environment"}


def _numbers(d):
    if isinstance(d, dict):
        return {k: _numbers(v) for k, v in d.items() if k not in _HOW}
    if isinstance(d, (list, tuple)):
        return [_numbers(v) for v in d]
    return "nan" if isinstance(d, float) and d != d else d


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import kvviz
    from kvviz.views.greedy.run import GreedyConfig, run_greedy
    from kvviz.placement import placement_summary

    plain = kvviz.load_model(args.model, args.dtype, args.device)
    weights = sum(p.numel() * p.element_size() for p in plain.model.parameters())
    budget = {"cpu": weights // 3}
    if plain.device.type == "cuda":
        budget["0"] = weights // 3
    spread = kvviz.load_model(args.model, args.dtype, args.device, placement="auto", max_memory=budget)
    out = {"model": args.model, "dtype": args.dtype, "device": str(plain.device), "weights_bytes": weights,
           "max_memory": budget, "placement": placement_summary(spread), "checks": {}}
    runs = {
        "split": lambda lm: kvviz.run_split(lm, kvviz.SplitConfig(PROMPT, 6), prove=False),
        "split_logic": lambda lm: kvviz.run_split(lm, kvviz.SplitConfig(PROMPT, 6, left_pad=2, position_ids="omit"),
                                                  prove=False),
        "greedy_float64": lambda lm: run_greedy(lm, GreedyConfig(PROMPT, 4, paths=("no_cache", "cache", "float64")),
                                                prove=False),
    }
    ok = True
    for name, run in runs.items():
        t0 = time.perf_counter()
        a = run(plain)
        t1 = time.perf_counter()
        b = run(spread)
        t2 = time.perf_counter()
        same = _numbers(json.loads(json.dumps(a.to_dict(), default=str))) == \
            _numbers(json.loads(json.dumps(b.to_dict(), default=str)))
        ok &= same
        out["checks"][name] = {"bit_for_bit": same, "one_device_s": round(t1 - t0, 2), "spread_s": round(t2 - t1, 2)}
    out["ok"] = ok
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
