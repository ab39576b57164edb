"""The memory plan on the pages: shown beside every run, and a run that cannot fit is refused before it starts."""
import pytest

pytest.importorskip("streamlit")  # the app tests need Streamlit (a GPU image may lack it)
from streamlit.testing.v1 import AppTest  # noqa: E402

from conftest import ROOT

pytestmark = pytest.mark.app


def start(page: str, **state) -> AppTest:
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=240)
    at.session_state["model_preset"] = "tiny:llama"
    for k, v in state.items():
        at.session_state[k] = v
    at.run()
    at.switch_page(page).run()
    return at


def test_the_plan_is_shown_beside_the_run():
    at = start("pages/split.py")
    assert not at.exception, at.exception
    assert any(c.value.startswith("Memory: about") for c in at.caption), [c.value for c in at.caption]
    boxes = [m.value for m in list(at.success) + list(at.info) + list(at.error)]
    assert any(b.startswith("**Verdict:") or "Verdict:" in b for b in boxes), boxes  # the run ran, after its plan


def test_a_run_that_cannot_fit_is_refused_before_it_starts(monkeypatch):
    import kvviz.core.memory as memory
    import kvviz.views.greedy.run as greedy

    calls = []
    real = greedy.run_greedy
    monkeypatch.setattr(greedy, "run_greedy", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(memory, "free_bytes", lambda device: (1024 ** 2, "a test limit"))
    at = start("pages/greedy.py")
    assert not at.exception, at.exception
    errors = [e.value for e in at.error]
    assert any(e.startswith("Cannot run") for e in errors), errors
    assert calls == [] and not at.get("plotly_chart")  # nothing ran


@pytest.mark.parametrize("peak_gib, said", ((0, False), (1024, True)))
def test_a_run_that_peaked_over_its_plan_says_so_on_the_page(monkeypatch, peak_gib, said):
    """The test hook: the run's measured peak is reported as peak_gib (its plan is a few GiB at most). Over the plan,
    the page says so in one line under the run; within it, nothing is said."""
    import kvviz.core.memory as memory

    monkeypatch.setattr(memory, "measured_peak", lambda device: peak_gib * memory.GB)
    at = start("pages/split.py")
    assert not at.exception, at.exception
    warnings = [w.value for w in at.warning if w.value.startswith("memory: this run peaked at")]
    assert len(warnings) == int(said), warnings
    if said:
        # worded for the user: what happened, that the result stands, what to do
        assert "1024.00 GiB of memory" in warnings[0] and "split run" in warnings[0]
        assert "result is not affected" in warnings[0] and "more free than the plan says" in warnings[0]
    boxes = [m.value for m in list(at.success) + list(at.info) + list(at.error)]
    assert any("Verdict:" in b for b in boxes), boxes  # the run ran and its result is shown
