"""Issue 52 item 5: one definition of a run's progress callback, settings validated once (where the run's context is
made), optional packages probed in one place (kvviz.core.optional)."""
from __future__ import annotations

import ast
import re

import pytest

from kvviz.core import optional
from kvviz.core.errors import KvvizError
from kvviz.core.execution import ExecSettings
from kvviz.core.protocol import RunContext

from conftest import ROOT


def _sources():
    for path in sorted((ROOT / "kvviz").rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def test_progress_is_defined_once():
    defined = []
    for rel, src in _sources():
        for node in ast.parse(src).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "Progress" for t in targets):
                    defined.append(rel)
            elif isinstance(node, ast.ClassDef) and node.name == "Progress":
                defined.append(rel)
    assert defined == ["kvviz/core/cancel.py"]
    from kvviz.core import cancel, protocol
    from kvviz.models import loading
    from kvviz.views.split import run as split_run

    assert protocol.Progress is cancel.Progress is loading.Progress is split_run.Progress


def test_settings_are_validated_where_the_context_is_made():
    with pytest.raises(KvvizError, match="^unknown cache kind 'nope'; choose one of"):
        RunContext(settings=ExecSettings(cache="nope"))
    with pytest.raises(KvvizError, match="unknown flag 'no-such-flag'"):
        RunContext(settings=ExecSettings(flags=("no-such-flag",)))
    ok = ExecSettings(cache="static", invariant=True)
    assert RunContext(settings=ok).settings is ok and RunContext(settings=None).settings == ExecSettings()
    # no view's run validates its settings again (the 10 copies of `(settings or DEFAULT_SETTINGS).validate()`)
    again = [rel for rel, src in _sources() if rel.startswith("kvviz/views/")
             and re.search(r"\(settings or [\w.()]+\)\.validate\(\)", src)]
    assert again == []


def test_optional_packages_are_probed_in_one_place():
    users = [rel for rel, src in _sources() if "find_spec(" in src]
    assert users == ["kvviz/core/optional.py"]
    optional.forget()
    assert optional.available("json") and optional.importable("json")
    assert not optional.available("kvviz_no_such_package") and not optional.importable("kvviz_no_such_package")
    assert not optional.available("kvviz_no_such_package.sub")  # a missing parent: False, not an error
    assert optional.location("kvviz") == ROOT / "kvviz" and optional.location("kvviz_no_such_package") is None
    hits = optional.available.cache_info().hits
    optional.available("json")
    assert optional.available.cache_info().hits == hits + 1  # asked again: the cached answer
