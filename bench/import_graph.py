"""Module import graph of kvviz/ (module-level and function-level relative imports, sub-packages included) and its
cycles: `python bench/import_graph.py kvviz` prints one line per module (dotted, relative to the package: e.g.
`views.split.run: execution, loading, ...`) and then `cycles: none` or the cycles. tests/test_architecture.py uses
the same functions and checks docs/architecture.md against them."""
import ast
import pathlib
import sys


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    root = pathlib.Path(root)
    files = sorted(root.rglob("*.py"))
    known = {module_name(root, p) for p in files}
    graph = {}
    for p in files:
        name = module_name(root, p)
        is_pkg = p.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            base = package.split(".") if package and package != "__init__" else []
            base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            if node.module:
                target = ".".join(base + node.module.split("."))
                while target and target not in known:  # `from .x.y import Name`: the module that exists
                    target = target.rpartition(".")[0]
                deps.add(target or "__init__")
            else:  # `from . import a, b`: the sub-modules named, else the package itself
                for a in node.names:
                    sub = ".".join(base + [a.name])
                    deps.add(sub if sub in known else (".".join(base) or "__init__"))
        deps.discard(name)
        graph[name] = deps - {"__init__"}
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


if __name__ == "__main__":
    g = import_graph(pathlib.Path(sys.argv[1]))
    for m in sorted(g):
        print(f"{m}: {', '.join(sorted(g[m]))}")
    found = cycles(g)
    print("cycles: none" if not found else "cycles: " + "; ".join(" -> ".join(c) for c in found))
