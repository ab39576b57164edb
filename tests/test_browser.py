"""Real browser: `streamlit run app.py`, headless Chromium via playwright; screenshots in test-artifacts/."""
import pytest

from browser import browser, no_exception, open_page, streamlit_server, wait_idle

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server():
    with streamlit_server() as (url, log):
        yield url
    text = log.read_text()
    assert "Traceback" not in text, "the server logged an exception; see " + str(log)


def test_split_page_draws_heatmap_with_default_model(server, artifacts):
    with browser() as b:
        page = open_page(b, server + "/split_point")
        assert page.get_by_text("Verdict:").count() >= 1
        # the heatmap is really drawn with its full layer axis, whether this machine's result has a gap (a colour
        # bar for the gap) or is bitwise identical (the zero colour and the note)
        assert page.locator(".js-plotly-plot .heatmaplayer").count() >= 1 or \
            page.locator(".js-plotly-plot .hm").count() >= 1
        assert page.locator(".js-plotly-plot").first.get_by_text("layer 30 + final norm").count() >= 1
        identical = page.get_by_text("bitwise identical: 0 everywhere").count() >= 1
        assert identical or page.locator(".js-plotly-plot .colorbar").count() >= 1
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
        page = open_page(b, server + "/greedy_paths", height=2400)
        assert page.get_by_text("no cache (full forward each step)").count() >= 1
        assert page.locator(".js-plotly-plot").count() >= 2
        page.screenshot(path=str(artifacts / "greedy-default.png"), full_page=True)
        page.get_by_text("Fast preview (teacher-forced no-cache path)").click()
        wait_idle(page)
        page.get_by_text("no cache (full forward each step) — fast preview").first.wait_for(timeout=240_000)
        no_exception(page)
        page.screenshot(path=str(artifacts / "greedy-fast.png"), full_page=True)


CHANGES = {  # a control to change on each page, and what to see after it
    "dtypes": ("in units of each dtype's ε", ".js-plotly-plot"),
    "padding": ("logits", ".js-plotly-plot"),
    "reuse": (None, None),
}


@pytest.mark.parametrize("path, name", [
    ("dtypes_lab", "dtypes"),
    ("padding_lab", "padding"),
    ("cache_reuse", "reuse"),
])
def test_lab_pages_in_browser(server, artifacts, path, name):
    with browser() as b:
        page = open_page(b, server + "/" + path, height=2000, ready='[data-testid="stMainBlockContainer"]')
        if name != "reuse":
            page.wait_for_selector(".js-plotly-plot", timeout=240_000)
        else:
            page.get_by_text("All runs").first.wait_for(timeout=240_000)
        wait_idle(page)
        no_exception(page)
        page.screenshot(path=str(artifacts / f"{name}-default.png"), full_page=True)
        label, expect = CHANGES[name]
        if label:
            page.get_by_text(label, exact=True).first.click()
            wait_idle(page)
            page.wait_for_selector(expect, timeout=60_000)
        else:  # reuse: fewer new tokens, a new run
            box = page.get_by_label("New tokens per continuation")
            box.fill("5")
            box.press("Enter")
            wait_idle(page)
            page.get_by_text("All runs").first.wait_for(timeout=240_000)
        no_exception(page)
        page.screenshot(path=str(artifacts / f"{name}-changed.png"), full_page=True)


def test_home_page_and_navigation(server, artifacts):
    with browser() as b:
        page = b.new_page(viewport={"width": 1300, "height": 1000})
        page.goto(server)
        page.get_by_text("why does the KV cache change my numbers").first.wait_for(timeout=60_000)
        no_exception(page)
        for title in ("Split point", "Greedy paths", "Dtypes side by side", "Padding and batching",
                      "Prompt-cache reuse"):
            assert page.get_by_role("link", name=title).count() >= 1
        page.screenshot(path=str(artifacts / "home.png"))


def _metrics(page) -> dict:
    page.get_by_text("largest relative gap").first.wait_for(timeout=240_000)
    wait_idle(page)
    out = {}
    for box in page.locator('[data-testid="stMetric"]').all():
        label = box.locator('[data-testid="stMetricLabel"]').inner_text().strip()
        out[label] = box.locator('[data-testid="stMetricValue"]').inner_text().strip()
    return out


def test_four_sessions_at_once_see_the_numbers_of_one(server, artifacts):
    with browser() as b:
        pages = [b.new_context(viewport={"width": 1300, "height": 1400}).new_page() for _ in range(4)]
        for p in pages:  # all four sessions start before any has finished
            p.goto(server + "/split_point", wait_until="commit")
        together = [_metrics(p) for p in pages]
        for i, p in enumerate(pages):
            no_exception(p)
            p.screenshot(path=str(artifacts / f"concurrent-{i}.png"))
        alone_page = b.new_context(viewport={"width": 1300, "height": 1400}).new_page()
        alone_page.goto(server + "/split_point")
        alone = _metrics(alone_page)
    assert alone and "largest relative gap" in alone
    assert all(m == alone for m in together), (together, alone)
