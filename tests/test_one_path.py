"""One path (issue 52 items 1 and 2): outside a view's own folder, kvviz/, bench/ and scripts/ run a view only through
the protocol (kvviz.views.run / the entry's run(lm, config, ctx)), never through its folder's `run_<x>` function; and
the registry names its pieces by the objects themselves, never by "module:function" strings."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kvviz
from kvviz import views
from kvviz.core.errors import KvvizError
from kvviz.core.protocol import RunContext

ROOT = Path(__file__).resolve().parent.parent
VIEWS_DIR = ROOT / "kvviz" / "views"


def _run_functions() -> dict[str, set[str]]:
    """`kvviz.views.<folder>.<module>` -> the `run_<x>` functions it defines at top level (a view's own runs)."""
    out: dict[str, set[str]] = {}
    for path in sorted(VIEWS_DIR.glob("*/*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("run_")}
        if names:
            out[f"kvviz.views.{path.parent.name}.{path.stem}"] = names
    return out


def _dotted(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative ones resolved from the file's package)."""
    if not node.level:
        return node.module or ""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    base = parts[:-1] if path.name != "__init__.py" else parts[:-1]
    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _violations(path: Path, runs: dict[str, set[str]]) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    own = re.match(r"kvviz/views/([a-z_]+)/", rel)
    own_pkg = f"kvviz.views.{own.group(1)}" if own else None
    # a view package re-exports some of its runs (kvviz.views.serving.run_serving): those count as its own
    by_package: dict[str, set[str]] = {}
    for mod, names in runs.items():
        by_package.setdefault(mod.rsplit(".", 1)[0], set()).update(names)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases: dict[str, str] = {}  # a local name -> the view module it is
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _dotted(path, node)
            for a in node.names:
                target = f"{mod}.{a.name}"
                if mod in runs and a.name in runs[mod] and not mod.startswith(f"{own_pkg}."):
                    found.append(f"{rel}:{node.lineno} imports {target}")
                elif mod in by_package and a.name in by_package[mod] and mod != own_pkg:
                    found.append(f"{rel}:{node.lineno} imports {target}")
                elif target in runs:
                    aliases[a.asname or a.name] = target
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in runs and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.Attribute) and node.attr.startswith("run_"):
            chain = ast.unparse(node.value)
            mod = aliases.get(chain, chain)
            pkg = mod if mod in by_package else mod.rsplit(".", 1)[0]
            if (node.attr in runs.get(mod, ()) or node.attr in by_package.get(mod, ())) and pkg != own_pkg:
                found.append(f"{rel}:{node.lineno} uses {mod}.{node.attr}")
    return found


def _sources():
    for folder in ("kvviz", "bench", "scripts"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_the_check_sees_a_direct_call(tmp_path):
    """The AST check itself: each way of reaching a view's run function from outside its folder is caught."""
    runs = _run_functions()
    assert "run_split" in runs["kvviz.views.split.run"] and "run_sweep" in runs["kvviz.views.serving.sweep"]
    probe = ROOT / "bench" / "_one_path_probe.py"
    probe.write_text("from kvviz.views.split.run import SplitConfig, run_split\n"
                     "from kvviz.views.check import run as check_mod\n"
                     "import kvviz.views.greedy.run as g\n"
                     "from kvviz.views.serving import run_serving\n"
                     "check_mod.run_check(None)\n"
                     "g.run_greedy(None, None)\n"
                     "kvviz.views.padding.run.run_padding(None)\n", encoding="utf-8")
    try:
        found = _violations(probe, runs)
    finally:
        probe.unlink()
    assert len(found) == 5, found
    assert any("kvviz.views.split.run.run_split" in f for f in found)
    assert any("kvviz.views.check.run.run_check" in f for f in found)
    assert any("kvviz.views.greedy.run.run_greedy" in f for f in found)
    assert any("kvviz.views.serving.run_serving" in f for f in found)
    assert any("kvviz.views.padding.run.run_padding" in f for f in found)


def test_nothing_outside_a_view_s_folder_calls_its_run_function():
    runs = _run_functions()
    found = [v for path in _sources() for v in _violations(path, runs)]
    assert found == [], "\n".join(found)


def _string_refs(path: Path) -> list[str]:
    """String "module:function" (or a bare module name for repro=/cli=) given to a View(...) entry."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "View"):
            continue
        named = {k.arg: k.value for k in node.keywords}
        refs = list(node.args[3:6]) + [named[k] for k in ("reopen", "figures", "verdict", "tables", "repro", "cli",
                                                           "scenario", "config", "refuses", "run") if k in named]
        out += [f"{path.relative_to(ROOT)}:{r.lineno} {r.value!r}" for r in refs
                if isinstance(r, ast.Constant) and isinstance(r.value, str)]
    return out


def test_the_registry_names_objects_not_strings():
    entries = sorted(VIEWS_DIR.glob("*/__init__.py")) + sorted((ROOT / "docs" / "example_view").glob("*/__init__.py"))
    assert len(entries) >= 14
    found = [r for path in entries for r in _string_refs(path)]
    assert found == [], found
    for v in views.all_views():
        assert callable(v.reopen) and callable(v.run) and isinstance(v.config, type), v.name
        assert getattr(v.runner(), "__wrapped__", v.runner()) is v.run and v.config_type() is v.config
    assert not hasattr(views.View, "resolve")  # nothing is looked up by name any more
    assert views.get("split").run.__module__ == "kvviz.views.split.run"
    assert views.get("serving_sweep").config.__name__ == "SweepConfig"


def test_an_entry_naming_a_string_is_refused_in_one_line():
    split = views.get("split")
    from dataclasses import replace

    with pytest.raises(KvvizError, match="names its reopen by a string .'report:reopen'.: an entry names the "):
        views.register(replace(split, name="split_by_name", reopen="report:reopen", cli=None, page=None))
    with pytest.raises(KvvizError, match="names its run by a string"):
        views.register(replace(split, name="split_by_name", run="run:run", cli=None, page=None))
    assert "split_by_name" not in views.names()


PROMPT = "The capital of France is Paris"


def test_views_run_is_the_entry_s_run_with_its_context():
    """kvviz.run / kvviz.views.run (one helper) run the entry's run; the README's kvviz.run_split is the same call."""
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    cfg = kvviz.SplitConfig(prompt=PROMPT, split=3, left_pad=2, position_ids="omit")
    seen = []
    a = views.run("split", lm, cfg, RunContext(prove=False, progress=lambda f, t: seen.append(f)))
    b = kvviz.run(views.get("split"), lm, cfg, RunContext(prove=False))
    c = kvviz.run_split(lm, cfg, prove=False)
    assert kvviz.run is views.run
    assert a.verdict == b.verdict == c.verdict == "logic"  # the classic padding bug: the gap stays in float64
    assert a.main.max_abs == b.main.max_abs == c.main.max_abs > 0
    assert seen and seen[-1] == 1.0 and seen == sorted(seen)  # the context's progress, to the end


def test_the_context_s_reference_is_the_one_the_run_uses(monkeypatch):
    """A float64 reference already loaded (the Lesson's, a bench's) travels in the context: the run never asks the
    model for its own."""
    lm = kvviz.load_model("tiny:llama", "bfloat16", "cpu")
    lm64 = kvviz.load_model("tiny:llama", "float64", "cpu")
    cfg = kvviz.SplitConfig(prompt=PROMPT, split=3, left_pad=2, position_ids="omit")
    own = views.run("split", lm, cfg, RunContext(prove=False))
    monkeypatch.setattr(type(lm), "reference", lambda self, strategy=None: pytest.fail("asked for its own reference"))
    given = views.run("split", lm, cfg, RunContext(prove=False, reference=lm64))
    assert given.verdict == own.verdict == "logic"
    assert given.float64 is not None and given.float64.max_abs == own.float64.max_abs > 0


def test_dtypes_runs_split_through_the_protocol_with_float64_once_a_prompt(monkeypatch):
    """dtypes composes split through the protocol; the float64 run travels in the context (float64_run), so float64
    runs once per prompt however many dtypes."""
    import torch

    from kvviz.views.dtypes.run import DtypesConfig
    from kvviz.views.split import run as split_run

    calls = []
    real = split_run.run_split
    monkeypatch.setattr(split_run, "run_split", lambda lm, cfg, *a, **k: calls.append(
        (lm.dtype, k.get("float64_comparison") is not None)) or real(lm, cfg, *a, **k))
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    res = views.run("dtypes", lm, DtypesConfig((PROMPT, "Once upon a time there"), ("float32", "bfloat16")),
                    RunContext(prove=False))
    assert res.dtypes == ["float64", "float32", "bfloat16"] and len(res.prompts) == 2
    f64 = [c for c in calls if c[0] == torch.float64]
    assert len(f64) == 2 and not any(given for _, given in f64)  # once a prompt, judged by itself
    others = [c for c in calls if c[0] != torch.float64]
    assert len(others) == 4 and all(given for _, given in others)  # each dtype given that prompt's float64 run
