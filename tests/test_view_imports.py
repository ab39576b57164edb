"""Views never import another view's internals (issue 40): a module in kvviz/views/<a>/ imports core modules
(kvviz/*.py, kvviz/engines/) and the registry (kvviz.views), never kvviz.views.<b> for another folder b. A view that
composes another (the cache-safety card: split, padding, reuse, quant) does it through the registry and the one run
signature (kvviz.core.protocol). Function-local imports count."""
from __future__ import annotations

import ast
from pathlib import Path

import kvviz

VIEWS = Path(kvviz.__file__).parent / "views"


def _imports(path: Path, package: str):
    """(line, absolute module name) of every import in the file, function-local ones too."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield node.lineno, mod
            for a in node.names:  # `from .. import split` names a module too
                yield node.lineno, f"{mod}.{a.name}"


def cross_view_imports(root: Path = VIEWS) -> list[str]:
    folders = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    found = {}  # (file, line) -> the first module of another view that line imports
    for folder in sorted(folders):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root.parent.parent).with_suffix("")
            package = ".".join(rel.parts[:-1])  # the module's package (an __init__'s is its own folder)
            for line, mod in _imports(path, package):
                parts = mod.split(".")
                if parts[:2] == ["kvviz", "views"] and len(parts) > 2 and parts[2] in folders and parts[2] != folder:
                    found.setdefault((str(path.relative_to(root.parent.parent)), line), mod)
    return [f"{p}:{line} imports {mod}" for (p, line), mod in sorted(found.items())]


def test_no_view_imports_another_view():
    assert cross_view_imports() == []


def test_the_check_catches_a_cross_view_import(tmp_path):
    """The walk sees relative, absolute and function-local imports of another view (and not a view's own)."""
    root = tmp_path / "kvviz" / "views"
    for folder in ("a", "b"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "a" / "run.py").write_text("from .figures import x\nfrom ... import views\n"
                                       "def f():\n    from ..b.run import g\n    import kvviz.views.b.cli\n"
                                       "    from .. import b\n")
    found = cross_view_imports(root)
    assert found == ["kvviz/views/a/run.py:4 imports kvviz.views.b.run", "kvviz/views/a/run.py:5 imports kvviz.views.b.cli",
                     "kvviz/views/a/run.py:6 imports kvviz.views.b"], found
