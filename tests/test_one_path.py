"""Issue 52, "done when": one path for each thing kvviz does, checked on the code itself (AST)."""
from __future__ import annotations

import ast
import importlib.util
import re
import sys
import textwrap
from pathlib import Path

import pytest

import kvviz
from kvviz import views
from kvviz.core.errors import KvvizError
from kvviz.core.protocol import RunContext
from kvviz.engines import registry

from conftest import ROOT

KVVIZ = ROOT / "kvviz"

# ---- item 4: one capture mechanism --------------------------------------------------------------------------------

HOOK_REGISTRATION = {"register_forward_hook", "register_forward_pre_hook"}
# the capture module; the engine workers load this same file by its path (kvviz/engines/vllm_worker.py), no copy
CAPTURE_MODULES = {"core/capture.py"}


def hook_registrations(source: str) -> list[int]:
    """Lines naming a module-hook registration (a call, or the method taken as a value)."""
    return [n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Attribute) and n.attr in HOOK_REGISTRATION]


def test_the_hook_finder_finds_every_spelling():  # so that the test below can fail
    assert hook_registrations("h = layer.register_forward_hook(f)") == [1]
    assert hook_registrations("x = 1\nadd = m.register_forward_pre_hook\nadd(f, with_kwargs=True)") == [2]
    assert hook_registrations("m.register_full_backward_hook(f)\ncapture(m, names, on_output=f)") == []


def test_module_hooks_are_registered_only_by_the_capture_module():
    """`register_forward_hook` / `register_forward_pre_hook` appear in kvviz/core/capture.py only: the bisector,
    streaming, float64, the streamed reference, the cancellation checkpoints and the vLLM worker all capture
    through it (and remove every hook on exit)."""
    offenders = []
    for path in sorted(KVVIZ.rglob("*.py")):
        rel = path.relative_to(KVVIZ).as_posix()
        if rel in CAPTURE_MODULES:
            continue
        offenders += [f"{rel}:{line}" for line in hook_registrations(path.read_text(encoding="utf-8"))]
    assert offenders == [], f"module hooks registered outside kvviz/core/capture.py: {offenders}"
    assert hook_registrations((KVVIZ / "core" / "capture.py").read_text(encoding="utf-8"))  # it does register them

# ---- item 1: every page runs a view through pages.runner.run_view (the protocol's one entry): no page calls a view's
# run_* function or the kvviz.run_* exports, builds a memory Workload or hands run_cached a cache key of its own; and
# pages/ stays small (a page is its controls, run_view and how it draws the Result) -------------------------------

PAGES = sorted((ROOT / "pages").glob("*.py"))
PAGES_MAX_LINES = 2000  # issue 52's target
PAGES_LINES_NOW = 2983  # the pages slice (3,322, 3,176, 3,179 before): pages/ may not grow back past this


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _called_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _from_views(node) -> bool:
    return isinstance(node, ast.ImportFrom) and bool(node.module) and (
        node.module in ("kvviz", "kvviz.views") or node.module.startswith("kvviz.views."))


def _run_functions_imported(tree: ast.Module) -> set[str]:
    """Names a page imported from kvviz or a view's package that are run functions or a view's run module (run,
    run_*, sweep)."""
    return {a.asname or a.name for node in ast.walk(tree) if _from_views(node) for a in node.names
            if a.name in ("run", "sweep") or a.name.startswith("run_")}


def _view_modules(tree: ast.Module) -> set[str]:
    """The names a page binds to kvviz or to a module of a view's package (`import kvviz`, `from kvviz.views.split
    import figures as split_figures`)."""
    names = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
             if a.name == "kvviz"}
    return names | {a.asname or a.name for node in ast.walk(tree) if _from_views(node) for a in node.names
                    if a.name[:1].islower()}


def test_no_page_calls_a_views_run_function():
    """A page runs a view through pages.runner.run_view only: it imports no run function from a view's module or from
    kvviz, and calls none by attribute (kvviz.run_split, serving.run_serving, sweep.run_sweep)."""
    bad = []
    for path in PAGES:
        if path.name == "runner.py":
            continue
        tree = _tree(path)
        bad += [f"{path.name}: imports {n}" for n in sorted(_run_functions_imported(tree))]
        modules = _view_modules(tree)
        for node in ast.walk(tree):
            f = node.func if isinstance(node, ast.Call) else None
            if not isinstance(f, ast.Attribute):
                continue
            if isinstance(f.value, ast.Name) and f.value.id in modules and (f.attr == "run" or f.attr.startswith("run_")):
                bad.append(f"{path.name}:{node.lineno}: calls {f.value.id}.{f.attr}")
            if f.attr == "runner":
                bad.append(f"{path.name}:{node.lineno}: calls a view's runner() itself")
    assert not bad, bad


def test_no_page_builds_a_workload_or_a_cache_key():
    """The memory plan comes from the config (kvviz.io.clirun.config_workload, in run_view) and the cache key from
    the config's value: no page constructs a Workload, calls .workload(), or calls run_cached (private to
    pages/runner.py)."""
    bad = []
    for path in PAGES:
        if path.name == "runner.py":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and _called_name(node) in ("Workload", "workload", "run_cached",
                                                                     "config_workload"):
                bad.append(f"{path.name}:{node.lineno}: {_called_name(node)}(...)")
            if isinstance(node, ast.ImportFrom) and any(a.name == "run_cached" for a in node.names):
                bad.append(f"{path.name}:{node.lineno}: imports {', '.join(a.name for a in node.names)}")
    assert not bad, bad


def test_the_rules_above_see_what_they_forbid(tmp_path):
    """The checks find each forbidden shape in a page written the old way (so a passing run means something)."""
    old = ast.parse("from kvviz.views.padding.run import PaddingConfig, run_padding\nimport kvviz\n"
                    "res = run_cached('padding', {'model': 1}, lambda: run_padding(lm, 'x'), PaddingConfig('x')"
                    ".workload())\nkvviz.run_split(lm, cfg)\n")
    assert _run_functions_imported(old) == {"run_padding"} and "kvviz" in _view_modules(old)
    called = {_called_name(n) for n in ast.walk(old) if isinstance(n, ast.Call)}
    assert {"run_cached", "workload", "run_padding", "run_split"} <= called


def _pages_lines() -> tuple[int, str]:
    lines = {p.name: len(p.read_text().splitlines()) for p in PAGES}
    return sum(lines.values()), ", ".join(f"{k} {v}" for k, v in sorted(lines.items(), key=lambda kv: -kv[1])[:6])


def test_pages_do_not_grow_back():
    total, longest = _pages_lines()
    assert total <= PAGES_LINES_NOW, f"pages/ is {total} lines, more than {PAGES_LINES_NOW}; the longest: {longest}"


@pytest.mark.xfail(strict=True, reason="issue 52: pages/ is not yet down to 2,000 lines (PAGES_LINES_NOW); strict: "
                                       "once it is, this passes, the run fails and the marker goes")
def test_pages_are_at_most_2000_lines():
    total, longest = _pages_lines()
    assert total <= PAGES_MAX_LINES, f"pages/ is {total} lines (at most {PAGES_MAX_LINES}); the longest: {longest}"


# ---- the import picture: function-local imports ------------------------------------------------------------------
# Issue 52: at most 60 function-local imports in kvviz/ and pages/, each of an allowed kind. Everything else is
# imported at the top of its module (kvviz's own modules: the import graph has no cycle, tests/test_architecture.py).

LOCAL_IMPORTS_MAX = 60
# optional packages (not in pyproject's dependencies): imported where used, after kvviz.core.optional said they are
# there (the one probe; importing vLLM or hqq costs seconds, and a broken one must not break `import kvviz`)
OPTIONAL_PACKAGES = {"vllm", "llama_cpp", "optimum", "hqq"}
# files run by an engine's own interpreter (its venv, without kvviz: loaded by path, never imported by kvviz)
ENGINE_VENV_FILES = {"kvviz/engines/vllm_worker.py", "kvviz/engines/llamacpp_worker.py", "kvviz/engines/worker_loop.py",
                     "kvviz/core/capture.py"}
# the rest, each with its reason: (file, the imported module's first part) -> why it stays inside a function
LOCAL_IMPORT_EXCEPTIONS = {
    ("kvviz/models/compat.py", "transformers"): "transformers internals whose place changes between versions "
    "(each behind ImportError, the compat seam's job), and transformers.cache_utils, which must load after "
    "defer_hqq_import",
    ("kvviz/core/memory.py", "resource"): "POSIX only: absent on Windows, and tests hide it after kvviz is imported",
    **{(f, "gguf"): "the gguf package: 0.35-0.5 s of `import kvviz`'s ~4 s (-X importtime), needed only for GGUF files"
       for f in ("kvviz/models/compat.py", "kvviz/models/loading.py", "kvviz/models/gguf_stream.py",
                 "kvviz/core/memory.py")},
}


def local_imports(tree: ast.Module) -> list[ast.stmt]:
    """Every import statement inside a function body (nested functions, if/try/with blocks included)."""
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in fn.body:
                found += [n for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return list({id(n): n for n in found}.values())  # a nested function's imports counted once


def _first_part(node) -> str:
    if isinstance(node, ast.ImportFrom):
        return "." if node.level else node.module.split(".")[0]
    return node.names[0].name.split(".")[0]


def _local_import_kinds() -> tuple[int, list[str]]:
    count, wrong = 0, []
    for path in sorted(KVVIZ.rglob("*.py")) + PAGES:  # PAGES: pages/*.py, its __init__ included
        rel = path.relative_to(ROOT).as_posix()
        for node in local_imports(_tree(path)):
            count += 1
            part = _first_part(node)
            if not (part in OPTIONAL_PACKAGES or rel in ENGINE_VENV_FILES or (rel, part) in LOCAL_IMPORT_EXCEPTIONS):
                wrong.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return count, wrong


def test_the_local_import_finder_sees_every_spelling():
    tree = ast.parse(textwrap.dedent("""
        import os
        def f():
            import json
            if True:
                from . import views
            try:
                from pathlib import Path
            except ImportError:
                pass
            def g():
                import torch as t
            return g
        class C:
            def m(self):
                from x.y import z
        """))
    assert sorted(ast.unparse(n) for n in local_imports(tree)) == [
        "from . import views", "from pathlib import Path", "from x.y import z", "import json", "import torch as t"]


def test_function_local_imports_are_few_and_each_of_an_allowed_kind():
    count, wrong = _local_import_kinds()
    assert not wrong, "import these at the top of their module (or say why not in LOCAL_IMPORT_EXCEPTIONS):\n" + \
        "\n".join(wrong)
    assert count <= LOCAL_IMPORTS_MAX, f"{count} function-local imports in kvviz/ and pages/ (at most {LOCAL_IMPORTS_MAX})"


def test_each_optional_package_is_probed_by_kvviz_core_optional():
    """The optional packages imported inside functions are the ones kvviz.core.optional is asked about."""
    probed = set()
    for path in KVVIZ.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if "optional." in text:
            probed |= {m.split(".")[0] for m in re.findall(r'"([a-z_][a-z0-9_.]*)"', text)}
    assert OPTIONAL_PACKAGES - {"llama_cpp"} <= probed  # llama_cpp: imported only in its worker, in its own venv
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    required = re.search(r"^dependencies = \[(.*?)\]", pyproject, re.S | re.M).group(1)
    assert not any(f'"{p}' in required for p in OPTIONAL_PACKAGES)


# ---- item 3: one engine interface ----------------------------------------------------------------------------------

REGISTRY = ROOT / "kvviz" / "engines" / "registry.py"


def _engine_names() -> set[str]:
    return set(registry.ENGINES) | {"llamacpp"}  # (llama.cpp's folder and worker spell it so)


def _strings(node) -> list[str]:
    """The string constants a comparison operand is, or holds (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def _engine_comparisons(path: Path, names: set[str]) -> list[str]:
    """Every ==, !=, in, not in with an engine's name as a string in `path`."""
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        if not any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            continue
        hit = sorted({s for operand in (node.left, *node.comparators) for s in _strings(operand) if s in names})
        if hit:
            found.append(f"{rel}:{node.lineno} compares with {', '.join(hit)}")
    return found


def test_the_engine_name_check_sees_every_kind_of_comparison(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('if engine == "vllm": pass\n'
                     'ok = name != "transformers"\n'
                     'x = e in ("vllm", "llama.cpp")\n'
                     'y = "server" not in {kind}\n'
                     'z = cfg.engine == ENGINE  # a name held elsewhere: not a literal\n'
                     'w = {"vllm": 1}.get(engine)  # a table, not a comparison\n', encoding="utf-8")
    found = _engine_comparisons(probe, _engine_names())
    assert [f.split(":", 1)[1] for f in found] == ["1 compares with vllm", "2 compares with transformers",
                                                    "3 compares with llama.cpp, vllm", "4 compares with server"]


def test_no_engine_name_is_compared_outside_the_registry():
    """kvviz/, pages/ and bench/ read an engine's facts from its class (kvviz.engines.registry), never `if engine ==
    "transformers"`; the worker scripts (their own environments, never importing kvviz) are kvviz's engines' insides."""
    names = _engine_names()
    files = [p for folder in ("kvviz", "pages", "bench") for p in sorted((ROOT / folder).rglob("*.py"))
             if p != REGISTRY and not p.name.endswith("_worker.py")]
    assert len(files) > 100
    found = [f for p in files for f in _engine_comparisons(p, names)]
    assert found == [], "\n".join(found)


# --------------------------------------------------------------------------------------------------------------
# A toy engine: one class and one registry line, in a module of its own

TOY_MODULE = textwrap.dedent('''
    """A toy engine: greedy decoding by full forwards of the model in kvviz's process (no cache at all), its top-5
    log-probs per step, and layer capture as the full forward's hidden states. `shift` adds that many nats to its
    log-probs' second-best token (a broken engine)."""
    import time

    import torch

    from kvviz.core.metrics import hidden_divergence
    from kvviz.engines import registry
    from kvviz.engines.base import Engine, EngineRun, LayerCapture, RequestOut


    def decode(lm, ids, n, shift):
        toks, top, chosen = [], [], []
        with torch.no_grad():
            for _ in range(n):
                x = torch.tensor([list(ids) + toks], device=lm.device)
                lp = torch.log_softmax(lm.model(input_ids=x, use_cache=False).logits[0, -1].double(), -1)
                v, i = lp.topk(5)
                step = [(int(a), float(b)) for a, b in zip(i, v)]
                step[1] = (step[1][0], step[1][1] + shift)
                toks.append(step[0][0])
                top.append(step)
                chosen.append(step[0][1])
        return toks, top, chosen


    def states(lm, ids):
        with torch.no_grad():
            out = lm.model(input_ids=torch.tensor([list(ids)], device=lm.device), use_cache=False,
                           output_hidden_states=True)
        return torch.stack([h[0].double().cpu() for h in out.hidden_states])


    class ToyCapture(LayerCapture):
        def __init__(self, lm, shift):
            self.lm, self.shift, self.kept = lm, shift, {}
            self.info = {"name": "toy", "version": "0.1", "settings": {"shift": shift}, "start_s": 0.0}

        def generate(self, groups):
            outs = {}
            for g in groups:
                for r in g["requests"]:
                    toks, top, chosen = decode(self.lm, r["ids"], r["max_new_tokens"], self.shift)
                    outs[r["key"]] = {"tokens": toks, "top": top, "chosen": chosen, "cached_tokens": 0,
                                      "seconds": 0.0}
                    if g.get("capture"):
                        self.kept[(g["capture"], r["key"])] = states(self.lm, list(r["ids"]) + toks[:-1])
            return outs

        def gaps(self, a, b=None, file=None, upto=None, eps=0.0):
            ra = self.kept[tuple(a)]
            if file is not None:
                from safetensors.torch import load_file

                rb = load_file(file)["hidden"]
            else:
                rb = self.kept[tuple(b)]
            t = min(ra.shape[1], rb.shape[1], upto or ra.shape[1])
            d = hidden_divergence(rb[:, :t], ra[:, :t], eps)
            return {"positions": list(range(t)), "rows": int(ra.shape[0]),
                    **{k: d[k].tolist() for k in ("max_abs", "relative", "eps_units")}}

        def positions(self, tag, key):
            return list(range(self.kept[(tag, key)].shape[1]))


    class ToyEngine(Engine):
        name = label = "toy"
        capture_pairs = ("warm", "batch")
        capture_refused = "the toy engine compares warm with cold and batch with alone only"
        shift = 0.0

        def generate(self, lm, requests, *, max_in_flight, prefix_sharing, sequential_keys=None, invariant=False):
            t0, outs = time.perf_counter(), {}
            for r in requests:
                toks, top, chosen = decode(lm, r.ids, r.max_new_tokens, self.shift)
                outs[r.key] = RequestOut(toks, [s[0][1] - s[1][1] for s in top], logprobs=top, chosen=chosen)
            return EngineRun(outs, time.perf_counter() - t0, sum(len(o.tokens) for o in outs.values()))

        def capture(self, lm, **options):
            return ToyCapture(lm, self.shift)

        def info(self):
            return {**super().info(), "version": "0.1", "dtype": None}


    registry.ENGINES[ToyEngine.name] = ToyEngine  # the one registry line
''')


@pytest.fixture
def toy(monkeypatch, tmp_path):
    """The toy engine's module imported (its registry line run) on a copy of the registry, both undone after."""
    monkeypatch.setattr(registry, "ENGINES", dict(registry.ENGINES))
    path = tmp_path / "kvviz_toy_engine.py"
    path.write_text(TOY_MODULE, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("kvviz_toy_engine", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kvviz_toy_engine", mod)
    spec.loader.exec_module(mod)
    return mod.ToyEngine


PROMPTS = ["The capital of France is", "Water boils at"]


def test_a_toy_engine_runs_the_serving_study_with_its_verdicts(toy, monkeypatch):
    from kvviz.views.serving.run import ServeConfig

    assert "toy" in registry.names() and "toy" in registry.capturing()
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    cfg = ServeConfig(prompts=PROMPTS, runs=2, max_new_tokens=3, engine="toy")
    assert cfg.page_size is None and cfg.workload().page_size == 0  # the toy keeps no pages in kvviz's process
    res = views.get("serving").runner()(lm, cfg, RunContext())
    assert res.engine["name"] == "toy" and res.settings.engine == "toy"
    for p in res.prompts:  # full forwards in float32: the no-cache reference's own tokens, every run
        assert p.distinct_all == 1 and all(x == p.reference for c in cfg.conditions for x in p.completions[c])
        # judged by its log-probs against the float64 reference on each path: within its rounding distance
        assert set(p.engine_paths) == {f"{c} run 1" for c in cfg.conditions}
        assert all(0 <= v["distance"] < v["rounding"] for v in p.engine_paths.values())
        assert p.verdict is None
    assert res.verdict_counts() == {"identical": 2}
    monkeypatch.setattr(toy, "shift", 3.0)  # a broken toy: its second-best log-prob 3 nats off
    broken = views.get("serving").runner()(lm, cfg, RunContext())
    assert broken.verdict_counts() == {"logic": 2}
    assert all(p.verdict == "logic" and "rounding cannot explain it" in p.explanation for p in broken.prompts)


def test_a_toy_engine_runs_the_engine_layers_pair_with_its_verdict(toy):
    from kvviz.core.errors import KvvizError
    from kvviz.views.engine_layers.run import EngineLayersConfig

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    with pytest.raises(KvvizError, match="^the toy engine compares warm with cold and batch with alone only$"):
        EngineLayersConfig(prompt="The capital of France is", pair="tp", engine="toy").validate()
    res = views.get("engine_layers").runner()(lm, EngineLayersConfig(prompt="The capital of France is", max_new_tokens=3,
                                                                 engine="toy"), RunContext())
    assert res.engine["name"] == "toy" and res.labels == ("cold", "warm")
    n_rows = lm.model.config.num_hidden_layers + 1
    assert len(res.layer_labels) == n_rows and res.gaps["max_abs"].shape[0] == n_rows
    # both sides are the same full forward: bit for bit equal at every layer, and each as far from float64 as
    # kvviz's own float32 run (the bound is 16x that)
    assert res.first_differing is None and res.first_beyond is None and res.first_divergence is None
    assert float(res.gaps["max_abs"].max()) == 0.0
    assert res.a.first_logic is None and res.b.first_logic is None
    assert res.layers_verdict == "identical" and res.verdict == "identical"
    assert res.prompts[0]["verdict"] == "identical"
    # the toy's capture saves no states: the logit lens is absent, and the result says why in one line
    assert res.lens is None and res.lens_absent == "toy's layer capture cannot save its hidden states"
    assert f"No logit lens: {res.lens_absent}." in res.explanation


# --- Callers (issue 52 items 1 and 2): outside a view's own folder, kvviz/, bench/ and scripts/ run a view only
# through the protocol (kvviz.views.run / the entry's run(lm, config, ctx)), never through its folder's `run_<x>`
# function; and the registry names its pieces by the objects themselves, never by "module:function" strings.

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


def test_no_source_file_is_cut_at_its_docstring_quotes():
    """Issue 52.2: no generated text parsed back; a repro script copies kvviz's modules by their parsed tree
    (kvviz.io.repro.source_body), never by splitting the source at its triple quotes."""
    from kvviz.core import capture, float64
    from kvviz.io.repro import float64_mode, source_body

    hits = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "kvviz").rglob("*.py")
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if ".split('\"\"\"'" in line or '.split("\\"\\"\\""' in line]
    assert hits == []
    body, relative = source_body(float64)
    assert relative == [".capture"] and '"""KeepFloat64' not in body and "from __future__" not in body
    assert ast.parse(body) and source_body(capture)[1] == []
    script = float64_mode()
    compile(script, "float64_mode", "exec")
    assert "class KeepFloat64" in script and "def capture(" in script and "from ." not in script
