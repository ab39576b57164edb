"""The library's shape: no import cycles, no Streamlit, registration explicit (drawn from the code itself)."""
import ast
import re

from conftest import ROOT


def import_graph() -> dict[str, set[str]]:
    lib = ROOT / "kvviz"
    graph = {}
    for p in lib.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
                deps.update(n for n in names if (lib / f"{n}.py").exists())
        deps.discard(p.stem)
        graph[p.stem] = deps - {"__init__"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(v, path):
        state[v] = "open"
        for w in sorted(graph.get(v, ())):
            if state.get(w) == "open":
                found.append(path[path.index(w):] + [w])
            elif w not in state:
                visit(w, path + [w])
        state[v] = "done"

    for v in sorted(graph):
        if v not in state:
            visit(v, [v])
    return found


def test_the_cycle_finder_finds_a_cycle():  # so that the next test can fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_no_import_cycles_in_the_library():
    graph = import_graph()
    assert {"execution", "split", "greedy", "loading"} <= set(graph) and "execution" in graph["split"]
    assert cycles(graph) == []
    assert not {"backends", "quant", "invariant"} & graph["execution"]  # extensions register themselves


def test_the_documented_graph_is_the_code_s():
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for module, deps in import_graph().items():
        line = re.search(rf"^{re.escape(module)}: (.*)$", doc, re.M)
        assert line is not None, module
        assert set(filter(None, line.group(1).split(", "))) == deps, module


def test_a_new_view_is_one_registry_line(tmp_path):
    """A toy view registered in one line is exported, reopened and reported by the same code as the others."""
    from dataclasses import asdict, dataclass

    from kvviz import views
    from kvviz.export import export_json, html_report, open_result

    @dataclass
    class TokenCountResult:  # a whole "view": a result with settings and to_dict
        settings: dict
        verdict: str
        explanation: str

        def to_dict(self):
            return asdict(self)

    views.register(views.View("token_count", "Token count", "TokenCountResult",
                              reopen=lambda d: TokenCountResult(**d)))
    try:
        res = TokenCountResult({"model": "tiny:llama", "device": "cpu"}, "identical", "3 tokens either way")
        opened = open_result(export_json(res))
        assert opened.view == "token_count" and opened.result == res
        assert "Verdict: identical." in html_report(res) and "3 tokens either way" in html_report(res)
        assert "token_count" in views.names()
    finally:
        views._VIEWS.pop("token_count", None)


def test_every_view_module_names_real_functions():
    from kvviz import views

    assert len(views.all_views()) >= 13
    for v in views.all_views():
        for ref in (v.reopen, v.figures, v.verdict):
            assert ref is None or views._resolve(ref) is not None, (v.name, ref)
