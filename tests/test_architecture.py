"""The library's shape: no import cycles, no Streamlit, registration explicit (drawn from the code itself)."""
import ast
import re

import importlib.util

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "bench" / "import_graph.py")
_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_graph)


def import_graph() -> dict[str, set[str]]:
    return _graph.import_graph(ROOT / "kvviz")


cycles = _graph.cycles


def test_the_cycle_finder_finds_a_cycle():  # so that the next test can fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_no_import_cycles_in_the_library():
    graph = import_graph()
    assert {"core.execution", "views.split.run", "views.greedy.run", "models.loading"} <= set(graph)
    assert "core.execution" in graph["views.split.run"] and "views" in graph["views.check.run"]  # the card composes through the registry
    assert cycles(graph) == []
    assert not {"core.backends", "views.quant", "core.invariant"} & graph["core.execution"]  # extensions register themselves


def test_no_import_cycles_among_the_pages():
    """Issue 52: no circle anywhere, pages included (pages/common <-> pages/runner was one: runner now reads the
    page's title from the session, which app.py sets)."""
    assert _graph.cycles(_graph.import_graph(ROOT / "pages")) == []


def test_the_graph_counts_every_kind_of_import(tmp_path):
    """Function-local, relative and absolute imports are all arrows (a hidden `from .. import views` inside a core
    function is an upward arrow like any other), and the layer check finds one."""
    pkg = tmp_path / "kvviz"
    for d in ("core", "views", "teach"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from .. import views\n    from ..teach import lesson\n")
    (pkg / "core" / "b.py").write_text("import kvviz.teach.lesson\nfrom kvviz.core import a\n")
    (pkg / "teach" / "lesson.py").write_text("from ..core import a, b\n")
    graph = _graph.import_graph(pkg)
    assert graph["core.a"] == {"views", "teach.lesson"} and graph["core.b"] == {"teach.lesson", "core.a"}
    assert graph["teach.lesson"] == {"core.a", "core.b"}
    assert _graph.upward_arrows(graph) == ["core.a -> teach.lesson", "core.a -> views", "core.b -> teach.lesson"]


def test_the_layers_only_look_down():
    """kvviz/core and kvviz/models import nothing above them, engines no view, views and io nothing from teach
    (bench/import_graph.py RANK), counting function-local imports; the top level holds only packages and the entry
    modules."""
    assert _graph.upward_arrows(import_graph()) == []
    assert sorted(p.name for p in (ROOT / "kvviz").glob("*.py")) == ["__init__.py", "__main__.py", "cli.py"]
    packages = sorted(p.name for p in (ROOT / "kvviz").iterdir() if (p / "__init__.py").is_file())
    assert packages == sorted(_graph.RANK)


def test_the_documented_graph_is_the_code_s():
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for module, deps in import_graph().items():
        line = re.search(rf"^{re.escape(module)}: (.*)$", doc, re.M)
        assert line is not None, module
        assert set(filter(None, line.group(1).split(", "))) == deps, module


@pytest.fixture
def example_view(tmp_path, monkeypatch):
    """docs/example_view/next_token copied as a package, and the ONE registry line that adds it."""
    import shutil

    from kvviz import views

    shutil.copytree(ROOT / "docs" / "example_view" / "next_token", tmp_path / "example_views" / "next_token")
    (tmp_path / "example_views" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(views, "VIEW_FOLDERS", views.VIEW_FOLDERS + ["example_views.next_token"])  # the one line
    yield
    views._VIEWS.pop("next_token", None)
    if "example_views.next_token" in views._LOADED:
        views._LOADED.remove("example_views.next_token")


def test_a_new_view_is_one_folder_and_one_registry_line(example_view, tmp_path, capsys):
    """The example view of docs/architecture.md, added by its folder and one line: the CLI runs it (with the common
    flags honoured or refused), exports and reopens it, reports it in HTML, and `open` shows it - with no other
    file touched."""
    import json

    from kvviz import views
    from kvviz.cli import main
    from kvviz.io.export import open_result

    assert "next_token" in views.names() and views.get("next_token").command == "next-token"
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    assert main(["next-token", "--model", "tiny:llama", "--prompt", "The cat sat on the", "--json",
                 "--json-out", str(out), "--html", str(page), "--quiet"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["verdict"] in ("identical", "gap") and printed["tokens"] >= 5
    assert printed["settings"]["execution"]["invariant"] is False
    assert "memory_plan" in json.loads(out.read_text())  # the run block attached the plan, as for every view
    opened = open_result(out.read_bytes())
    assert opened.view == "next_token" and opened.result.max_abs == printed["max_abs"]
    assert "Verdict: " + printed["verdict"] in page.read_text() and "plotly" in page.read_text()
    assert main(["open", str(out)]) == 0 and "a Next token result" in capsys.readouterr().out
    # --invariant is honoured (the seam's run context), --no-proof is refused in one line
    assert main(["next-token", "--model", "tiny:llama", "--prompt", "The cat sat on the", "--json", "--invariant",
                 "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["execution"]["invariant"] is True
    assert main(["next-token", "--model", "tiny:llama", "--prompt", "x", "--no-proof"]) == 2
    assert "--no-proof does nothing for `next-token`" in capsys.readouterr().err


def test_the_example_view_is_the_one_the_docs_show():
    """docs/architecture.md shows the example's registry entry, report and subcommand verbatim (and links the rest)."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    folder = ROOT / "docs" / "example_view" / "next_token"
    for name in ("__init__.py", "report.py"):
        assert (folder / name).read_text(encoding="utf-8").strip() in doc, name
    run = (folder / "run.py").read_text(encoding="utf-8")
    for start, end in (("@dataclass(frozen=True)\nclass NextTokenConfig", "@dataclass\nclass NextTokenResult"),
                       ("REFUSES = ", None)):  # its config and its run, verbatim
        part = run[run.index(start):run.index(end) if end else None].strip()
        assert part in doc, start
    for name in ("run.py", "figures.py"):
        assert f"example_view/next_token/{name}" in doc, name
    assert not (folder / "cli.py").exists()  # its subcommand is made from its config


def test_every_view_names_real_pieces():
    from kvviz import views

    assert len(views.all_views()) >= 13
    for v in views.all_views():
        for ref in (v.reopen, v.figures, v.verdict):
            assert ref is None or callable(ref), (v.name, ref)
        if v.repro:
            assert all(callable(getattr(v.repro_module(), f)) for f in ("check", "script", "key_figure")), v.name
        if v.cli:
            mod = v.cli_module()
            assert isinstance(mod.HELP, str) and callable(mod.add_arguments) and callable(mod.command), v.name
        assert v.package.startswith("kvviz.views.") and v.package.count(".") == 2, v.name  # one folder each


def test_the_library_never_imports_streamlit():
    """The library (kvviz/) has no Streamlit import, at module level or inside a function; the pages do."""
    def streamlit_imports(path):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            yield from (f"{path.name}:{node.lineno}" for n in names if n.split(".")[0] == "streamlit")

    assert list(streamlit_imports(ROOT / "pages" / "common.py"))  # the check sees a real one
    found = [hit for path in sorted((ROOT / "kvviz").rglob("*.py")) for hit in streamlit_imports(path)]
    assert found == []
