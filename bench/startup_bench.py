"""A kvviz process's start-up: hqq's module imported when transformers.cache_utils loads (transformers' own way) vs
at its first use (kvviz.models.compat.defer_hqq_import, what `import kvviz` does).

    python bench/startup_bench.py [repeats]

Each repeat runs, alternating, two fresh interpreters that import kvviz, load tiny:llama and run one split (the
work of a `kvviz split` on a tiny model): "hqq at cache_utils' import" imports transformers.cache_utils before kvviz
(so hqq's module loads with it, as it does in any process that imports transformers first), "hqq at first use" does
not. Prints the median wall and CPU seconds (user + system, the children included: hqq's module starts torch's
compile workers) of each and their ratio. Needs hqq installed.
"""
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORK = """
import sys, resource, time
t0 = time.perf_counter()
{first}
import kvviz
lm = kvviz.load_model("tiny:llama", "float32", "cpu")
kvviz.run("split", lm, kvviz.SplitConfig(prompt="The capital of France is Paris", split=3))
print("hqq imported:", "hqq.core.quantize" in sys.modules, file=sys.stderr)
"""
WAYS = {"hqq at cache_utils' import": "import transformers.cache_utils",
        "hqq at first use": ""}


def one(first: str) -> tuple[float, float, str]:
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", WORK.format(first=first)], cwd=ROOT, capture_output=True, text=True,
                       check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, r.stderr.strip().splitlines()[-1]


def main(repeats: int = 5) -> None:
    got: dict[str, dict[str, list]] = {w: {"wall": [], "cpu": [], "seen": []} for w in WAYS}
    for _ in range(repeats):
        for way, first in WAYS.items():
            wall, cpu, seen = one(first)
            got[way]["wall"].append(wall)
            got[way]["cpu"].append(cpu)
            got[way]["seen"].append(seen)
    out = {w: {"wall_s": round(statistics.median(v["wall"]), 2), "cpu_s": round(statistics.median(v["cpu"]), 2),
               "child says": sorted(set(v["seen"]))} for w, v in got.items()}
    a, b = out["hqq at cache_utils' import"], out["hqq at first use"]
    out["ratio (first use / at import)"] = {"wall": round(b["wall_s"] / a["wall_s"], 2),
                                           "cpu": round(b["cpu_s"] / a["cpu_s"], 2)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
