"""A run's side notes (its memory peak over its plan) are drawn below its verdict, never above it: the first screen
is the verdict and the chart (issue 39 item 6; a fresh server's first split run put the note above the chart)."""
import pytest

from kvviz.core.memory import MemoryPlan

from test_app import app

pytestmark = pytest.mark.app

LINE = "memory: this run peaked over its plan (test)"


def _main_order(at) -> list[str]:
    """The main area's alerts in page order, as (kind, text) with kind in info/success/error/warning."""
    out = []

    def walk(node):
        kind = getattr(node, "type", None)
        if kind in ("info", "success", "warning", "error"):
            out.append((kind, str(node.value)))
        for child in getattr(node, "children", {}).values():
            walk(child)

    walk(at.main)
    return out


@pytest.mark.parametrize("page,verdict_box", [("pages/split.py", True), ("pages/check.py", False)])
def test_over_plan_note_is_below_the_verdict(monkeypatch, page, verdict_box):
    monkeypatch.setattr(MemoryPlan, "over_plan", lambda self: LINE)
    at = app()
    at.session_state["model_preset"] = "tiny:llama"
    at.run()
    at.switch_page(page)
    at.run()
    assert not at.exception, at.exception
    texts = [t for _, t in _main_order(at)]
    notes = [i for i, t in enumerate(texts) if LINE in t]
    assert len(notes) >= 1, texts
    verdicts = [i for i, t in enumerate(texts) if "Verdict" in t]
    if verdict_box:
        assert verdicts and max(verdicts) < min(notes), texts
    assert all(LINE not in w.value for w in at.sidebar.warning)
