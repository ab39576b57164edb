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
    """The lab pages in a real browser on a tiny model (the default model's pages are walked by the tests above and
    the presenter tests): they draw, react to a control, and never show a traceback."""
    with browser() as b:
        page = open_page(b, link(server, path, presenter=False), height=2000,
                         ready='[data-testid="stMainBlockContainer"]')
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
    assert alone and any(k.startswith("largest relative gap") for k in alone)
    assert all(m == alone for m in together), (together, alone)


# ---------------------------------------------------------------------------------------------------------------
# Presenter mode at 1280×720 in light and dark, links, and opening a result (tiny models: quick on any machine)

from urllib.parse import quote  # noqa: E402

CONTRAST_JS = """() => {
  const lum = (c) => { const m = c.match(/[\\d.]+/g).map(Number);
    const ch = m.slice(0, 3).map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
    return 0.2126 * ch[0] + 0.7152 * ch[1] + 0.0722 * ch[2]; };
  const out = [];
  for (const el of document.querySelectorAll('[data-testid="stMarkdownContainer"] [style*="background"]')) {
    const s = getComputedStyle(el);
    if (!el.innerText.trim()) continue;
    const a = lum(s.color), b = lum(s.backgroundColor);
    out.push({text: el.innerText.slice(0, 20), ratio: (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)});
  }
  return out; }"""


def link(server: str, path: str, **params) -> str:
    import json

    q = "&".join(f"{k}={quote(json.dumps(v))}" for k, v in {"model_preset": "tiny:llama", "presenter": True,
                                                              **params}.items())
    return f"{server}/{path}?{q}"


def _first_screen(page, selector: str) -> dict:
    box = page.locator(selector).first.bounding_box()
    assert box is not None, selector
    return box


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_presenter_mode_fits_verdict_and_chart_and_custom_html_is_readable(server, artifacts, scheme):
    pages = {"split_point": {"split_prompt": "Hello world, caching is fun! " * 3},  # custom HTML: token chips
             "greedy_paths": {"greedy_n": 8},  # custom HTML: the texts panel
             "quantized": {"quant_n": 8}, "loading_trap": {"trap_n": 6}}
    with browser() as b:
        ctx = b.new_context(viewport={"width": 1280, "height": 720}, color_scheme=scheme)
        for path, params in pages.items():
            page = ctx.new_page()
            page.goto(link(server, path, **params))
            page.wait_for_selector(".js-plotly-plot", timeout=240_000)
            wait_idle(page)
            no_exception(page)
            page.screenshot(path=str(artifacts / f"presenter-{scheme}-{path}.png"))
            # whatever the verdict (identical, precision or logic), it and the main chart start in the first screen
            verdict = _first_screen(page, '[data-testid="stAlert"]:has-text("Verdict:"), '
                                          '[data-testid="stAlert"]:has-text("paths chose the same")')
            chart = _first_screen(page, ".js-plotly-plot")
            assert verdict["y"] + verdict["height"] <= 720, (path, verdict)
            assert chart["y"] < 720 - 200, (path, chart)  # at least its upper part (title and first rows) is seen
            if path == "split_point":  # the token chips live with the controls, collapsed in presenter mode
                page.get_by_text("Settings: prompt and controls").click()
                page.locator('span[title^="token "]').first.wait_for(timeout=30_000)
                page.screenshot(path=str(artifacts / f"presenter-{scheme}-{path}-controls.png"))
            if path not in ("split_point", "greedy_paths"):
                continue  # no custom HTML on these pages: Streamlit's own theme colours
            ratios = page.evaluate(CONTRAST_JS)
            assert ratios, f"no chips or text panels on {path}"
            low = [r for r in ratios if r["ratio"] < 4.5]
            assert not low, (scheme, path, low[:5])
        ctx.close()


def test_every_page_in_presenter_mode(server, artifacts):
    with browser() as b:
        ctx = b.new_context(viewport={"width": 1280, "height": 720}, color_scheme="dark")
        for path in ("", "dtypes_lab", "padding_lab", "cache_reuse", "loading_trap", "backends", "kv_cache", "quantized",
                     "cache_safety", "open_result", "guide", "glossary"):
            page = ctx.new_page()
            page.goto(link(server, path))
            page.wait_for_selector('[data-testid="stMainBlockContainer"] h1', timeout=240_000)
            wait_idle(page, 300)
            no_exception(page)
            assert page.locator('[data-testid="stSidebar"]').get_by_text("Presenter mode").count() == 1
            page.screenshot(path=str(artifacts / f"presenter-page-{path or 'home'}.png"))
            page.close()
        ctx.close()


def test_a_copied_link_reopens_the_same_view_and_numbers(server, artifacts):
    with browser() as b:
        page = b.new_context(viewport={"width": 1400, "height": 1400}).new_page()
        page.goto(link(server, "split_point", presenter=False))
        page.wait_for_selector(".js-plotly-plot", timeout=240_000)
        wait_idle(page)
        page.get_by_text("token by token").click()
        wait_idle(page)
        page.get_by_role("button", name="Copy link").click()
        copied = page.locator('[data-testid="stPopover"] code, [data-testid="stPopoverBody"] code').first
        copied.wait_for(timeout=30_000)
        url = copied.inner_text().strip()
        assert "split_mode" in url and "step" in url
        before = _metrics(page)
        other = b.new_context(viewport={"width": 1400, "height": 1400}).new_page()
        other.goto(url)
        after = _metrics(other)
        no_exception(other)
        assert other.get_by_label("token by token").is_checked()
        assert "step" in other.locator(".js-plotly-plot").first.inner_text()
        assert after == before
        other.screenshot(path=str(artifacts / "link-reopened.png"))


def test_open_a_result_shows_the_page_without_a_model(server, artifacts, tmp_path):
    import kvviz
    from kvviz.export import export_json

    lm = kvviz.load_model("tiny:gpt2", "float32", "cpu")
    res = kvviz.run_split(lm, kvviz.SplitConfig("Hello world, caching is fun!", 4))
    f = tmp_path / "result.json"
    f.write_text(export_json(res))
    with browser() as b:
        page = b.new_context(viewport={"width": 1280, "height": 900}).new_page()
        # the sidebar model is a path that does not exist: any attempt to load or run a model would fail loudly
        page.goto(f"{server}/open_result?model_preset=%22other%E2%80%A6%22&model_other=%22/nonexistent/model%22")
        page.get_by_text("Upload a result file").wait_for(timeout=60_000)
        page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(str(f))
        page.get_by_text("Verdict:").first.wait_for(timeout=60_000)
        wait_idle(page)
        no_exception(page)
        assert page.get_by_text(f"Verdict: {res.verdict}.").count() >= 1
        page.wait_for_selector(".js-plotly-plot", timeout=60_000)  # charts render after the verdict; wait for them
        assert page.locator(".js-plotly-plot").count() >= 1
        assert page.locator('[data-testid="stSidebar"]').get_by_text("Loaded:").count() == 0
        assert page.locator('[data-testid="stAlert"]:has-text("nonexistent")').count() == 0
        page.screenshot(path=str(artifacts / "open-result.png"))
