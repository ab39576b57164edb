"""The process settings that change a CPU result's last bits, recorded with every export and set again by every repro
script (kvviz.io.repro), so a script reproduces its figure bit for bit whatever threads or CPU path its caller has.

  threads                   torch.get_num_threads(): how many parts a reduction is split into (1 thread and 2
                            threads sum a float32 matmul in other orders, e.g. ...641601562e-06 vs ...373046875e-07);
  deterministic_algorithms  torch.use_deterministic_algorithms (and its warn_only);
  float32_matmul_precision  torch.set_float32_matmul_precision ("highest" / "high" / "medium");
  cpu_capability            the vector kernels ATen dispatches to (torch.backends.cpu.get_cpu_capability(): AVX512,
                            AVX2, DEFAULT, ...). ATen reads it once, when torch is imported: only the environment
                            variable ATEN_CPU_CAPABILITY set before `import torch` changes it;
  env                       the instruction-set variables of MKL and oneDNN (and ATEN_CPU_CAPABILITY) and the thread
                            pools' variables (MKL_NUM_THREADS, OMP_NUM_THREADS, ...) that were set, also read once
                            when the libraries load.

They are recorded when the result is written (export_json, html_report, repro_script), in the process that computed
it: kvviz computes and writes in one process (the CLI, the app, the library), and torch's settings are process-wide.
"""
from __future__ import annotations

import os

import torch

# Environment variables read once, when torch / MKL / oneDNN / OpenMP load, that change the bits: the CPU instruction
# sets, and the thread pools' defaults (MKL_NUM_THREADS=1 in the environment changes float64 dgemm's bits on AVX2 even
# after torch.set_num_threads(2)). Each one a result did not have set is removed by its repro script, so the
# caller's environment cannot change the bits.
ENV_NAMES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "MKL_DEBUG_CPU_TYPE", "ONEDNN_MAX_CPU_ISA",
             "DNNL_MAX_CPU_ISA", "MKL_NUM_THREADS", "MKL_DYNAMIC", "OMP_NUM_THREADS", "OMP_DYNAMIC")
# torch.backends.cpu.get_cpu_capability() names that ATEN_CPU_CAPABILITY accepts (lower-cased there)
CAPABILITIES = ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256")


def numerics() -> dict:
    """This process's settings that change a result's bits, now."""
    return {
        "threads": torch.get_num_threads(),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "deterministic_warn_only": bool(torch.is_deterministic_algorithms_warn_only_enabled()),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {k: os.environ[k] for k in ENV_NAMES if os.environ.get(k)},
    }


def describe(n: dict | None) -> str:
    """One line: '1 thread, CPU capability AVX512, deterministic algorithms off, float32 matmul precision highest'."""
    if not n:
        return "not recorded"
    t = n.get("threads")
    parts = [f"{t} thread{'s' if t != 1 else ''}", f"CPU capability {n.get('cpu_capability')}",
             f"deterministic algorithms {'on' if n.get('deterministic_algorithms') else 'off'}",
             f"float32 matmul precision {n.get('float32_matmul_precision')}"]
    parts += [f"{k}={v}" for k, v in (n.get("env") or {}).items()]
    return ", ".join(parts)


def differences(saved: dict | None, current: dict | None = None) -> list[str]:
    """What differs between the numerics a result recorded and this process's (empty when none was recorded)."""
    if not saved:
        return []
    current = current or numerics()
    keys = ("threads", "cpu_capability", "deterministic_algorithms", "float32_matmul_precision")
    diffs = [f"numerics {k}: {saved.get(k)} there, {current.get(k)} here" for k in keys
             if saved.get(k) != current.get(k)]
    se, ce = saved.get("env") or {}, current.get("env") or {}
    diffs += [f"numerics {k}: {se.get(k)} there, {ce.get(k)} here" for k in sorted(set(se) | set(ce))
              if se.get(k) != ce.get(k)]
    return diffs


def script_prelude(n: dict) -> str:
    """A repro script's lines before `import torch`: the recorded settings, the environment variables set (or
    removed) before torch loads, then torch imported and its threads, deterministic flag and matmul precision set
    before any computation; it prints which it used, and says so when this machine cannot give the same CPU path."""
    env = dict(n.get("env") or {})
    cap = n.get("cpu_capability")
    if cap in CAPABILITIES:
        env.setdefault("ATEN_CPU_CAPABILITY", cap.lower())
    return f'''import copy
import os
import sys

# The settings kvviz computed this result with that change its last bits (kvviz/core/numerics.py): torch's threads (how
# a sum is split), ATen's CPU kernels, MKL's and oneDNN's instruction sets, deterministic algorithms, float32 matmul
# precision. The instruction sets are read once, when torch loads: they are set here, before `import torch`.
NUMERICS = {n!r}
CPU_ENV = {env!r}
for _name in {ENV_NAMES!r}:
    if _name in CPU_ENV:
        os.environ[_name] = CPU_ENV[_name]
    else:
        os.environ.pop(_name, None)  # not set when kvviz computed the result
if "torch" in sys.modules:
    print("note: torch was imported before this script set its CPU environment; run it as `python <script>`")

import torch

torch.set_num_threads(NUMERICS["threads"])
torch.use_deterministic_algorithms(NUMERICS["deterministic_algorithms"], warn_only=NUMERICS["deterministic_warn_only"])
torch.set_float32_matmul_precision(NUMERICS["float32_matmul_precision"])
print("numerics: " + ", ".join([f"{{torch.get_num_threads()}} thread(s)",
                                f"CPU capability {{torch.backends.cpu.get_cpu_capability()}}",
                                f"deterministic algorithms {{torch.are_deterministic_algorithms_enabled()}}",
                                f"float32 matmul precision {{torch.get_float32_matmul_precision()}}"]
                               + [f"{{k}}={{v}}" for k, v in CPU_ENV.items()]))
if torch.backends.cpu.get_cpu_capability() != NUMERICS["cpu_capability"]:
    print(f"note: kvviz computed this result with CPU capability {{NUMERICS['cpu_capability']}}; this machine gives "
          f"{{torch.backends.cpu.get_cpu_capability()}}: the last bits may differ")
'''
