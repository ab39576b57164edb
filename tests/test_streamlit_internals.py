"""The one place kvviz touches Streamlit internals (pages/__init__.py: ensure_navigation) must notice when
Streamlit changes them: this test fails then, instead of the deep-link fix silently doing nothing."""


def test_pages_manager_still_has_the_switch_kvviz_turns_off():
    from streamlit.runtime.pages_manager import PagesManager

    assert hasattr(PagesManager, "uses_pages_directory")
    # a class-level switch: kvviz sets it to False once so deep links run inside app.py
    assert "uses_pages_directory" in vars(PagesManager) or any(
        "uses_pages_directory" in vars(c) for c in PagesManager.__mro__)


def test_ensure_navigation_is_the_only_place_that_uses_it():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    users = [p.relative_to(root).as_posix() for p in [*root.glob("pages/*.py"), root / "app.py",
                                                      *root.glob("kvviz/**/*.py")]
             if "PagesManager" in p.read_text(encoding="utf-8")]
    assert users == ["pages/__init__.py"]
    import ast

    tree = ast.parse((root / "pages/__init__.py").read_text(encoding="utf-8"))
    funcs = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and "PagesManager" in ast.unparse(n)]
    assert funcs == ["ensure_navigation", "_in_a_plain_pages_run"]
