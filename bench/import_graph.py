"""Module import graph of kvviz/ (module-level and function-level relative imports) and its cycles: `python bench/import_graph.py kvviz`."""
import ast, pathlib, sys, itertools
root = pathlib.Path(sys.argv[1])
g = {}
for p in sorted(root.glob("*.py")):
    m = p.stem
    deps = set()
    for node in ast.walk(ast.parse(p.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module: deps.add(node.module.split(".")[0])
            else: deps.update(a.name for a in node.names if (root / f"{a.name}.py").exists())
    deps.discard(m); deps.discard("__init__")
    g[m] = sorted(d for d in deps if (root / f"{d}.py").exists())
for m, d in g.items(): print(f"{m}: {', '.join(d)}")
# cycles (strongly connected components)
idx, low, st, on, sccs, c = {}, {}, [], set(), [], [0]
def sc(v):
    idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
    for w in g.get(v, []):
        if w not in idx: sc(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1: sccs.append(comp)
for v in g:
    if v not in idx: sc(v)
print("CYCLES:", sccs)
