"""Real browser: `streamlit run app.py`, headless Chromium via playwright; screenshots in test-artifacts/."""
import pytest

from browser import browser, no_exception, streamlit_server, wait_idle

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server():
    with streamlit_server() as url:
        yield url


def test_split_page_draws_heatmap_with_default_model(server, artifacts):
    with browser() as b:
        page = b.new_page(viewport={"width": 1400, "height": 1800})
        page.goto(server + "/split_point")
        page.wait_for_selector(".js-plotly-plot", timeout=240_000)
        wait_idle(page)
        no_exception(page)
        assert page.get_by_text("Verdict:").count() >= 1
        # the heatmap is really drawn: a plotly heatmap trace with its colour bar
        assert page.locator(".js-plotly-plot .heatmaplayer").count() >= 1 or \
            page.locator(".js-plotly-plot .hm").count() >= 1
        assert page.locator(".js-plotly-plot .colorbar").count() >= 1
        page.screenshot(path=str(artifacts / "split-default-chunk.png"), full_page=True)
        # run another comparison: token by token
        page.get_by_text("token by token").click()
        wait_idle(page)
        page.wait_for_selector(".js-plotly-plot", timeout=120_000)
        no_exception(page)
        assert "step" in page.locator(".js-plotly-plot").first.inner_text()
        page.screenshot(path=str(artifacts / "split-default-step.png"), full_page=True)


def test_greedy_page_in_browser(server, artifacts):
    with browser() as b:
        page = b.new_page(viewport={"width": 1400, "height": 2400})
        page.goto(server + "/greedy_paths")
        page.wait_for_selector(".js-plotly-plot", timeout=240_000)
        wait_idle(page)
        no_exception(page)
        assert page.get_by_text("no cache (full forward each step)").count() >= 1
        assert page.locator(".js-plotly-plot").count() >= 2
        page.screenshot(path=str(artifacts / "greedy-default.png"), full_page=True)


@pytest.mark.parametrize("path, name", [
    ("dtypes_lab", "dtypes"),
    ("padding_lab", "padding"),
    ("cache_reuse", "reuse"),
])
def test_lab_pages_in_browser(server, artifacts, path, name):
    with browser() as b:
        page = b.new_page(viewport={"width": 1400, "height": 2000})
        page.goto(server + "/" + path)
        page.wait_for_selector('[data-testid="stMainBlockContainer"]', timeout=60_000)
        wait_idle(page)
        if name != "reuse":
            page.wait_for_selector(".js-plotly-plot", timeout=240_000)
        else:
            page.get_by_text("All runs").first.wait_for(timeout=240_000)
        wait_idle(page)
        no_exception(page)
        page.screenshot(path=str(artifacts / f"{name}-default.png"), full_page=True)
