"""Starting the app under Streamlit's AppTest on one page, with the sidebar's model and the page's controls set (one
helper: tests/test_app.py and tests/test_workloads.py both start pages this way)."""
from streamlit.testing.v1 import AppTest

from conftest import ROOT

# How long one AppTest run (one page drawn once) may take before it counts as hung, for every AppTest here. Measured
# on a 2-core machine shared with four other test runs (load average 8-10, issue 37): the slowest single run 61 s (the
# Home "layers" preset opening the dtype sweep), the others under 35 s; on CI (2 cores, `make test`'s two workers) a
# run in test_every_page_offers_its_exports went past the old 120 s. 600 s is over 3x every run measured, and still
# ends a hung page within the CI budget.
APP_TIMEOUT = 600


def app() -> AppTest:
    """The app, each of its runs allowed APP_TIMEOUT."""
    return AppTest.from_file(str(ROOT / "app.py"), default_timeout=APP_TIMEOUT)


def start(page: str, model: str = "tiny:gpt2", **state) -> AppTest:
    """The app opened on `page` (pages/<name>.py) with `model` chosen and the session state `state` (a page's
    controls by key) set before its first run; no exception raised."""
    at = app()
    at.session_state["model_preset"] = model
    for k, v in state.items():
        at.session_state[k] = v
    at.run()
    at.switch_page(page)
    at.run()
    assert not at.exception, at.exception
    return at
