"""A device_map run on CUDA (called by `make gpu-check`; runs on the CPU too): the default model with its layers
spread by accelerate over GPU 0, CPU RAM and disk (a max_memory budget of ~1/3 of the weights on each of GPU 0
and the CPU), against the same model on one device: split (with the float64 evidence) and greedy with the float64
path must give bit for bit the same numbers in the run's own dtype, and float64 parts within 1e-12 (on an H100 they
differed in their last bits, 1e-16). Prints one JSON object.

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


def _split64(d, in64=False):
    """(the parts computed in the run's own dtype, the float64 parts: keys naming float64) of a result dict."""
    if isinstance(d, dict):
        parts = {k: _split64(v, in64 or "float64" in str(k)) for k, v in d.items()}
        return {k: v[0] for k, v in parts.items()}, {k: v[1] for k, v in parts.items()}
    if isinstance(d, list):
        parts = [_split64(v, in64) for v in d]
        return [p[0] for p in parts], [p[1] for p in parts]
    return (None, d) if in64 else (d, None)


def _gap(a, b) -> float:
    """Largest |a - b| over the numbers of two same-shaped structures (inf where their shapes or words differ)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return max((_gap(a[k], b.get(k)) for k in a), default=0.0) if a.keys() == b.keys() else float("inf")
    if isinstance(a, list) and isinstance(b, list):
        return max((_gap(x, y) for x, y in zip(a, b)), default=0.0) if len(a) == len(b) else float("inf")
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b)
    return 0.0 if a == b else float("inf")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import kvviz
    from kvviz.views.greedy.run import GreedyConfig
    from kvviz.models.placement import placement_summary

    plain = kvviz.load_model(args.model, args.dtype, args.device)
    weights = sum(p.numel() * p.element_size() for p in plain.model.parameters())
    budget = {"cpu": weights // 3}
    if plain.device.type == "cuda":
        budget["0"] = weights // 3
    spread = kvviz.load_model(args.model, args.dtype, args.device, placement="auto", max_memory=budget)
    out = {"model": args.model, "dtype": args.dtype, "device": str(plain.device), "weights_bytes": weights,
           "max_memory": budget, "placement": placement_summary(spread), "checks": {}}
    no_proof = kvviz.RunContext(prove=False)
    runs = {
        "split": lambda lm: kvviz.run("split", lm, kvviz.SplitConfig(PROMPT, 6), no_proof),
        "split_logic": lambda lm: kvviz.run("split", lm, kvviz.SplitConfig(PROMPT, 6, left_pad=2, position_ids="omit"),
                                            no_proof),
        "greedy_float64": lambda lm: kvviz.run("greedy", lm, GreedyConfig(PROMPT, 4, paths=("no_cache", "cache",
                                                                                           "float64")), no_proof),
    }
    ok = True
    for name, run in runs.items():
        t0 = time.perf_counter()
        a = run(plain)
        t1 = time.perf_counter()
        b = run(spread)
        t2 = time.perf_counter()
        da, db = (_numbers(json.loads(json.dumps(r.to_dict(), default=str))) for r in (a, b))
        same = da == db
        own = _split64(da)[0] == _split64(db)[0]  # the run's own dtype: bit for bit
        gap64 = _gap(_split64(da)[1], _split64(db)[1])  # the float64 parts: largest difference
        ok &= own and gap64 <= 1e-12
        out["checks"][name] = {"bit_for_bit": same, "own_dtype_bit_for_bit": own, "float64_max_diff": gap64,
                               "one_device_s": round(t1 - t0, 2), "spread_s": round(t2 - t1, 2)}
    out["ok"] = ok
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
