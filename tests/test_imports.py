"""Importing kvviz has no side effects (issue 40 item 6): it prints nothing, works where `resource` does not exist
(Windows), and no module fills a registry by being imported - kvviz/__init__.py registers explicitly."""
from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvviz
from kvviz.models import compat
from kvviz.core import execution, memory

ROOT = Path(__file__).resolve().parent.parent
KVVIZ = ROOT / "kvviz"


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, **env})


def test_import_kvviz_prints_nothing():
    r = _python("import kvviz")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == "" and r.stderr == "", (r.stdout[-2000:], r.stderr[-2000:])


def test_outside_the_tested_range_import_is_silent_and_the_model_says_it_in_one_line():
    code = ("import transformers; transformers.__version__ = '5.99.0'\n"
            "import kvviz; print('imported', flush=True)\n"
            "lm = kvviz.load_model('tiny:llama', 'float32', 'cpu')\n"
            "print('notes:', [w for w in lm.warnings if 'outside the tested range' in w], flush=True)\n"
            "from kvviz.cli import main\n"
            "main(['split', '--model', 'tiny:llama', '--prompt', 'The capital of France is', '--split', '3',"
            " '--plan'])\n")
    r = _python(code, PYTHONWARNINGS="ignore::FutureWarning")
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr[-2000:]
    before, after = r.stdout.split("imported", 1)
    assert before == "" and "outside the tested range" not in before
    notes = [ln for ln in r.stdout.splitlines() if ln.startswith("notes:")]
    assert len(notes) == 1 and "5.99.0" in notes[0] and compat.TESTED_MIN in notes[0], r.stdout[-2000:]
    # the CLI adds no line of its own before a run's answer (kvviz --version and a failed run's line say it:
    # tests/test_compat.py::test_the_untested_version_is_said_where_it_helps)
    assert "outside the tested range" not in r.stderr, r.stderr[-2000:]
    assert "memory plan: split on tiny:llama" in r.stdout


def test_kvviz_imports_and_plans_a_run_without_resource():
    code = ("import sys; sys.modules['resource'] = None\n"
            "import kvviz\n"
            "from kvviz.core import memory\n"
            "assert memory._address_space_left() is None\n"
            "from kvviz.cli import main\n"
            "rc = main(['split', '--model', 'tiny:llama', '--prompt', 'The capital of France is', '--split', '3',"
            " '--plan'])\n"
            "plan = memory.plan_run('tiny:llama', 'float32', 'cpu', 'split').with_peak()\n"
            "print('rc', rc, 'fits', plan.fits, 'peak', plan.measured_peak)\n")
    r = _python(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "memory plan: split on tiny:llama, float32 on cpu" in r.stdout and "  fits" in r.stdout, r.stdout
    last = r.stdout.strip().splitlines()[-1].split()
    assert last[:4] == ["rc", "0", "fits", "True"], r.stdout[-2000:]
    assert int(last[5]) > 0  # VmHWM from /proc: the peak needs no `resource` on Linux


def test_without_resource_or_proc_the_peak_is_unknown_not_zero(monkeypatch):
    monkeypatch.setitem(sys.modules, "resource", None)
    monkeypatch.setattr(memory, "_status_bytes", lambda field: None)
    assert memory._address_space_left() is None
    assert memory.measured_peak("cpu") is None
    plan = memory.plan_run("tiny:llama", "float32", "cpu", "split").with_peak()
    assert plan.measured_peak is None and plan.to_dict()["measured_peak_gib"] is None
    assert not any("measured peak" in line for line in plan.lines())


def _module_level_register_calls(path: Path) -> list[str]:
    """Calls of a `register…` function made by a module's top level (loops and ifs included), not inside a def."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name.lstrip("_").startswith("register"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}()")
        for child in ast.iter_child_nodes(node):
            visit(child)

    for stmt in tree.body:
        visit(stmt)
    return found


def test_no_module_fills_a_registry_by_being_imported():
    offenders = [hit for p in sorted(KVVIZ.rglob("*.py")) if p.name != "__init__.py" or p.parent != KVVIZ
                 for hit in _module_level_register_calls(p)]
    assert offenders == [], "registration belongs in kvviz/__init__.py, as an explicit call:\n" + "\n".join(offenders)
    # ... and kvviz/__init__.py does make those calls, so the seam knows every backend after `import kvviz`
    calls = _module_level_register_calls(KVVIZ / "__init__.py")
    assert any("_backends.register" in c or c.endswith(" register()") for c in calls), calls
    assert set(execution.CacheKind) <= set(execution._CACHE_KINDS)
    assert execution._COMPILER and execution._SETTINGS_CHECKS
    assert len(execution._RUN_CONTEXTS) == 2  # precision flags and invariant mode, each once


def test_registering_again_adds_nothing():
    from kvviz.core import backends, invariant

    before = (list(execution._CACHE_KINDS), list(execution._RUN_CONTEXTS), list(execution._COMPILER),
              list(execution._SETTINGS_CHECKS))
    backends.register()
    invariant.register()
    after = (list(execution._CACHE_KINDS), list(execution._RUN_CONTEXTS), list(execution._COMPILER),
             list(execution._SETTINGS_CHECKS))
    assert after == before


def test_a_run_uses_what_init_registered():
    """After `import kvviz` alone: the backends' settings check refuses a bad flag, a static cache (a backend's
    factory) runs, and the invariant run context makes the cached run equal the full forward bit for bit."""
    with pytest.raises(kvviz.KvvizError, match="unknown flag 'no-such-flag'"):
        kvviz.ExecSettings(flags=("no-such-flag",)).validate()
    assert kvviz.ExecSettings(cache="static").validate().cache is execution.CacheKind.STATIC
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    res = kvviz.run_split(lm, kvviz.SplitConfig(prompt="The capital of France is", split=3),
                          settings=kvviz.ExecSettings(invariant=True))
    assert res.verdict == "identical", res.explanation


@pytest.mark.skipif(importlib.util.find_spec("hqq") is None, reason="hqq is not installed")
def test_hqq_s_module_is_imported_only_by_a_run_that_uses_it():
    """transformers.cache_utils imports hqq's Quantizer as it loads, and hqq's module torch.compiles as it loads
    (~1 CPU-s in every process that loads a model). After `import kvviz` (compat.defer_hqq_import) a model loads and a
    split runs without it; an hqq-quantized cache then imports it and quantizes through the real Quantizer."""
    code = """
import sys
import kvviz
from kvviz.views.quant.run import QuantConfig, run_quant
import transformers.cache_utils as cu
lm = kvviz.load_model("tiny:llama", "float32", "cpu")
res = kvviz.run_split(lm, kvviz.SplitConfig(prompt="The capital of France is Paris", split=3))
print("after split", "hqq.core.quantize" in sys.modules, "torch._inductor.compile_fx" in sys.modules, repr(cu.HQQQuantizer))
q = run_quant(lm, QuantConfig("The capital of France is Paris", kv="hqq:int4", residual_length=2, max_new_tokens=4))
from hqq.core.quantize import Quantizer
same = all(getattr(cu.HQQQuantizer, a) == getattr(Quantizer, a) for a in ("quantize", "dequantize", "cuda"))
print("after hqq", "hqq.core.quantize" in sys.modules, same, max(q.kl) > 0, res.verdict)
"""
    r = _python(code)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-2] == "after split False False <hqq's Quantizer, imported at first use>", r.stdout[-2000:]
    assert lines[-1].startswith("after hqq True True True "), r.stdout[-2000:]


def test_deferring_hqq_does_nothing_once_cache_utils_is_imported():
    import transformers.cache_utils  # noqa: F401  (imported by the time this test runs; made sure of here)

    assert compat.defer_hqq_import() is False
