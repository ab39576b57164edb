"""Module import graph of kvviz/ (module-level and function-level imports, relative or `kvviz.`-absolute,
sub-packages included), its cycles and its upward arrows: `python bench/import_graph.py kvviz` prints one line per
module (dotted, relative to the package: e.g. `views.split.run: core.execution, models.loading, ...`), then
`cycles: none` or the cycles, then `upward: none` or the arrows that run up the layers (RANK).
tests/test_architecture.py uses the same functions and checks docs/architecture.md against them."""
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

        def resolve(dotted: str, names=()) -> set[str]:
            """`from <dotted> import names`: the sub-modules named, and the deepest existing module of `dotted`
            for any other name (or for `import <dotted>`)."""
            out = {f"{dotted}.{n}".strip(".") for n in names} & known
            if len(out) < len(names) or not names:
                while dotted and dotted not in known:  # `from .x.y import Name`: the module that exists
                    dotted = dotted.rpartition(".")[0]
                out.add(dotted or "__init__")
            return out

        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(root.name + "."):
                        deps |= resolve(a.name.split(".", 1)[1])
            elif isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names]
                if node.level == 0:
                    if node.module == root.name or (node.module or "").startswith(root.name + "."):
                        deps |= resolve(node.module.partition(".")[2], names)
                    continue
                base = package.split(".") if package and package != "__init__" else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                deps |= resolve(".".join(base + (node.module.split(".") if node.module else [])), names)
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


# The layers, bottom up: a module may import its own layer and those below, never one above. The entry modules
# (kvviz/__init__.py, __main__.py, cli.py) sit on top. views and io share a layer: a view's report, cli and repro
# modules use io's export, clirun and repro; io reopens and runs views through the registry.
RANK = {"core": 0, "models": 0, "engines": 1, "views": 2, "io": 2, "teach": 3}
TOP = len(set(RANK.values()))


def rank(module: str) -> int:
    return RANK.get(module.split(".")[0], TOP)


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for every import from a lower layer to a higher one."""
    return [f"{m} -> {d}" for m in sorted(graph) for d in sorted(graph[m]) if rank(d) > rank(m)]


if __name__ == "__main__":
    g = import_graph(pathlib.Path(sys.argv[1]))
    for m in sorted(g):
        print(f"{m}: {', '.join(sorted(g[m]))}")
    found = cycles(g)
    print("cycles: none" if not found else "cycles: " + "; ".join(" -> ".join(c) for c in found))
    up = upward_arrows(g)
    print("upward: none" if not up else "upward: " + "; ".join(up))
