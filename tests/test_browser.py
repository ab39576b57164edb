"""Real browser: `streamlit run app.py`, headless Chromium via playwright; screenshots in test-artifacts/."""
import pytest

from browser import (app_server_fixture, browser, click_until, figures_drawn, no_exception, open_page,
                     set_checked, wait_idle)

pytestmark = pytest.mark.browser


server = app_server_fixture()


def test_split_page_draws_heatmap_with_default_model(server, artifacts):
    with browser() as b:
        page = open_page(b, server + "/split")
        assert page.get_by_text("Verdict:").count() >= 1
        # the heatmap is really drawn with its full layer axis, whether the run's result has a gap (a colour
        # bar for the gap) or is bitwise identical (the zero colour and the note)
        assert page.locator(".js-plotly-plot .heatmaplayer").count() >= 1 or \
            page.locator(".js-plotly-plot .hm").count() >= 1
        assert page.locator(".js-plotly-plot").first.get_by_text("layer 30 + final norm").count() >= 1
        identical = page.get_by_text("bitwise identical: 0 everywhere").count() >= 1
        assert identical or page.locator(".js-plotly-plot .colorbar").count() >= 1
        page.screenshot(path=str(artifacts / "split-default-chunk.png"), full_page=True)
        # run another comparison: token by token (the controls are in the Settings expander)
        page.get_by_text("Settings: prompt and controls").click()
        plot = page.locator(".js-plotly-plot").first
        click_until(page, page.get_by_text("token by token", exact=True),
                    lambda: plot.count() and "(step)" in plot.inner_text())
        wait_idle(page, started=True)
        figures_drawn(page)
        no_exception(page)
        assert "step" in page.locator(".js-plotly-plot").first.inner_text()
        page.screenshot(path=str(artifacts / "split-default-step.png"), full_page=True)


def test_greedy_page_in_browser(server, artifacts):
    with browser() as b:
        page = open_page(b, server + "/greedy", height=2400)
        assert page.get_by_text("no cache (full forward each step)").count() >= 1
        assert page.locator(".js-plotly-plot").count() >= 2
        page.screenshot(path=str(artifacts / "greedy-default.png"), full_page=True)
        page.get_by_text("Settings: prompt and controls").click()  # the controls are folded on every page
        set_checked(page, "Fast preview (teacher-forced no-cache path)")
        page.get_by_text("no cache (full forward each step) — fast preview").first.wait_for(timeout=240_000)
        wait_idle(page, started=True)  # the text only the new run draws
        figures_drawn(page)
        no_exception(page)
        page.screenshot(path=str(artifacts / "greedy-fast.png"), full_page=True)


CHANGES = {  # a control to change on each page, and what to see after it
    "dtypes": ("in units of each dtype's ε", ".js-plotly-plot"),
    "padding": ("logits", ".js-plotly-plot"),
    "reuse": (None, None),
}


@pytest.mark.parametrize("path, name", [
    ("dtypes", "dtypes"),
    ("padding", "padding"),
    ("reuse", "reuse"),
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
        wait_idle(page, started=True)
        no_exception(page)
        page.screenshot(path=str(artifacts / f"{name}-default.png"), full_page=True)
        label, expect = CHANGES[name]
        if label:
            page.get_by_text(label, exact=True).first.click()
            wait_idle(page)
            page.wait_for_selector(expect, timeout=60_000)
        else:  # reuse: fewer new tokens, a new run
            page.get_by_text("Settings: prompt and controls").click()
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



def test_home_prepares_the_meeting_in_browser(server, artifacts, kvviz_cache):
    """Home's "Prepare the meeting" button with its default scenarios (tiny models): the results land where Open
    a result finds them."""
    out = kvviz_cache / "meeting"
    for f in out.glob("*.json"):
        f.unlink()
    with browser() as b:
        page = b.new_page(viewport={"width": 1300, "height": 1400})
        page.goto(server)
        page.get_by_text("why does the KV cache change my numbers").first.wait_for(timeout=60_000)
        page.get_by_text("Prepare the meeting: run scenarios ahead").click()
        ready = page.get_by_text("result(s) ready")
        click_until(page, page.get_by_role("button", name="Prepare", exact=True), lambda: ready.count() >= 1)
        no_exception(page)
        page.screenshot(path=str(artifacts / "home-meeting.png"))
    assert sorted(f.name for f in out.glob("*.json")) == ["padding.json", "proof.json", "tie.json"]


def _metrics(page) -> dict:
    page.get_by_text("largest relative gap").first.wait_for(timeout=240_000)
    wait_idle(page, started=True)
    figures_drawn(page, titled=False)  # plotly draws after the script
    out = {}
    for box in page.locator('[data-testid="stMetric"]').all():
        label = box.locator('[data-testid="stMetricLabel"]').inner_text().strip()
        out[label] = box.locator('[data-testid="stMetricValue"]').inner_text().strip()
    return out


def test_four_sessions_at_once_see_the_numbers_of_one(server, artifacts):
    with browser() as b:
        pages = [b.new_context(viewport={"width": 1300, "height": 1400}).new_page() for _ in range(4)]
        for p in pages:  # all four sessions start before any has finished
            p.goto(server + "/split", wait_until="commit")
        together = [_metrics(p) for p in pages]
        for i, p in enumerate(pages):
            no_exception(p)
            p.screenshot(path=str(artifacts / f"concurrent-{i}.png"))
        alone_page = b.new_context(viewport={"width": 1300, "height": 1400}).new_page()
        alone_page.goto(server + "/split")
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


def _text_fit(page, artifacts, mode: str, path: str, problems: dict, drawn: bool = True) -> None:
    """test_text_fit.py's check on a page a walk has open anyway: its figures' text inside them, no overlaps.
    drawn: the walk has just waited for the page's figures (figures_drawn)."""
    from browser import text_fit_problems

    page.wait_for_selector(".js-plotly-plot", timeout=600_000)
    found = text_fit_problems(page, artifacts / f"text-fit-{mode}-{path}.png", drawn=drawn)
    if found:
        problems[path] = found


def _open_for_text_fit(ctx, server, artifacts, path: str, params: dict, presenter: bool, problems: dict) -> None:
    """A chart page the walk opened with other settings (or not at all), opened with text fit's own."""
    page = ctx.new_page()
    page.goto(link(server, path, presenter=presenter, **params))
    if path == "matrix":  # the matrix runs on its button
        page.get_by_role("button", name="Run the matrix").click(timeout=300_000)
    page.wait_for_selector(".js-plotly-plot", timeout=600_000)
    wait_idle(page, 600, started=True)
    no_exception(page)
    _text_fit(page, artifacts, "presenter" if presenter else "normal", path, problems, drawn=False)
    page.close()


def _no_text_fit_problems(artifacts, name: str, problems: dict) -> None:
    import json

    (artifacts / f"{name}.json").write_text(json.dumps(problems, indent=1))
    assert not problems, problems


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_presenter_mode_fits_verdict_and_chart_and_custom_html_is_readable(server, artifacts, scheme):
    """Presenter mode at 1280×720: the verdict and the main chart start in the first screen, custom HTML is
    readable; in light, every chart page's figure text fits (test_text_fit.py's check in presenter mode: on the pages
    opened here with its settings, then on the others, opened with theirs; dtypes and padding are checked in
    test_every_page_in_presenter_mode, which opens them with the same settings)."""
    from browser import TEXT_FIT_PAGES

    pages = {"split": {"split_prompt": "Hello world, caching is fun! " * 3},  # custom HTML: token chips
             "greedy": {"greedy_n": 8},  # custom HTML: the texts panel
             "quant": {"quant_n": 4}, "loading_trap": {"loading_trap_n": 6}}  # quant, loading_trap: text fit's
    fit = {} if scheme != "light" else {k: v for k, v in TEXT_FIT_PAGES.items() if k not in EVERY_PAGE_FITS}
    problems = {}
    with browser() as b:
        ctx = b.new_context(viewport={"width": 1280, "height": 720}, color_scheme=scheme)
        for path, params in pages.items():
            page = ctx.new_page()
            page.goto(link(server, path, **params))
            page.wait_for_selector(".js-plotly-plot", timeout=240_000)
            wait_idle(page, started=True)
            figures_drawn(page, titled=False)  # plotly draws after the script
            no_exception(page)
            page.screenshot(path=str(artifacts / f"presenter-{scheme}-{path}.png"))
            # whatever the verdict (identical, precision or logic), it and the main chart start in the first screen
            verdict = _first_screen(page, '[data-testid="stAlert"]:has-text("Verdict:"), '
                                          '[data-testid="stAlert"]:has-text("paths chose the same")')
            chart = _first_screen(page, ".js-plotly-plot")
            assert verdict["y"] + verdict["height"] <= 720, (path, verdict)
            assert chart["y"] < 720 - 200, (path, chart)  # at least its upper part (title and first rows) is seen
            if path in fit and fit[path] == params:
                del fit[path]
                _text_fit(page, artifacts, "presenter", path, problems)
            if path == "split":  # the token chips live with the controls, collapsed in presenter mode
                page.get_by_text("Settings: prompt and controls").click()
                page.locator('span[title^="token "]').first.wait_for(timeout=30_000)
                page.screenshot(path=str(artifacts / f"presenter-{scheme}-{path}-controls.png"))
            if path not in ("split", "greedy"):
                continue  # no custom HTML on these pages: Streamlit's own theme colours
            ratios = page.evaluate(CONTRAST_JS)
            assert ratios, f"no chips or text panels on {path}"
            low = [r for r in ratios if r["ratio"] < 4.5]
            assert not low, (scheme, path, low[:5])
        for path, params in fit.items():
            _open_for_text_fit(ctx, server, artifacts, path, params, True, problems)
        ctx.close()
    if scheme == "light":
        _no_text_fit_problems(artifacts, "text-fit-presenter", problems)


EVERY_PAGE_FITS = ("dtypes", "padding")  # opened below with text fit's settings: checked there


def test_every_page_in_presenter_mode(server, artifacts):
    """Every page opens in presenter mode; on the chart pages it opens with test_text_fit.py's settings (dtypes,
    padding), their figures' text fits (its check; dark: only colours differ from light)."""
    from browser import TEXT_FIT_PAGES

    assert all(TEXT_FIT_PAGES[p] == {} for p in EVERY_PAGE_FITS)
    problems = {}
    with browser() as b:
        ctx = b.new_context(viewport={"width": 1280, "height": 720}, color_scheme="dark")
        for path in ("", "dtypes", "padding", "reuse", "loading_trap", "matrix", "cache", "quant",
                     "check", "open_result", "guide", "glossary"):
            page = ctx.new_page()
            page.goto(link(server, path))
            page.wait_for_selector('[data-testid="stMainBlockContainer"] h1', timeout=240_000)
            wait_idle(page, 300, started=True)
            figures_drawn(page, titled=False)
            no_exception(page)
            toggle = page.locator('[data-testid="stSidebar"]').get_by_text("Presenter mode")
            toggle.first.wait_for(timeout=60_000)  # the sidebar can still be drawing when the main part is idle
            assert toggle.count() == 1
            page.screenshot(path=str(artifacts / f"presenter-page-{path or 'home'}.png"))
            if path in EVERY_PAGE_FITS:  # the sidebar drew after the figures' wait: wait for them again
                _text_fit(page, artifacts, "presenter", path, problems, drawn=False)
            page.close()
        ctx.close()
    _no_text_fit_problems(artifacts, "text-fit-presenter-every-page", problems)


def test_a_copied_link_reopens_the_same_view_and_numbers(server, artifacts):
    with browser() as b:
        page = b.new_context(viewport={"width": 1400, "height": 1400}).new_page()
        page.goto(link(server, "split", presenter=False))
        page.wait_for_selector(".js-plotly-plot", timeout=240_000)
        wait_idle(page, started=True)
        page.get_by_text("Settings: prompt and controls").click()
        plot = page.locator(".js-plotly-plot").first
        click_until(page, page.get_by_text("token by token", exact=True),
                    lambda: plot.count() and "(step)" in plot.inner_text())
        wait_idle(page, started=True)
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
    from kvviz.io.export import export_json

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


# ---------------------------------------------------------------------------------------------------------------
# Settings you can trust, one naming, the first screen in normal mode, navigation (tiny models)

FIRST_SCREEN = {  # page: (its verdict line, the start of its main chart or table)
    "split": ('[data-testid="stAlert"]:has-text("Verdict:")', ".js-plotly-plot"),
    "greedy": ('[data-testid="stAlert"]:has-text("Verdict:"), [data-testid="stAlert"]:has-text("chose the same")',
                     ".js-plotly-plot"),
    "dtypes": ('text=Verdicts per dtype', '[data-testid="stDataFrame"]'),
    "padding": ('.js-plotly-plot', '.js-plotly-plot'),
    "reuse": ('[data-testid="stAlert"]:has-text("Verdict:")', 'text=Continuation 1'),
    "loading_trap": ('[data-testid="stAlert"]:has-text("Verdict:")', ".js-plotly-plot"),
    "quant": ('[data-testid="stAlert"]:has-text("Verdict:")', ".js-plotly-plot"),
    "check": ('[data-testid="stAlert"]:has-text("SAFE")', '[data-testid="stTable"]'),
    "matrix": ('[data-testid="stAlert"]:has-text("Verdict:")', ".js-plotly-plot"),
    "serving": ('[data-testid="stAlert"]:has-text("Verdict:")', ".js-plotly-plot"),
}
# (KV cache has no verdict until a saved cache is uploaded; its first screen is the download of the prompt's cache.)


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_first_screen_in_normal_mode(server, artifacts, scheme):
    """At 1280×720 without presenter mode: each page's verdict line is wholly in the first screen and its main chart
    (or table) starts there. Dark mode on the three busiest pages. In light mode the walk also checks that every
    chart page's figure text fits (test_text_fit.py's check in normal mode, on the same pages with the same
    settings, so each page is opened and run once: serving at its defaults, as text fit checks it)."""
    from browser import TEXT_FIT_PAGES

    names = list(FIRST_SCREEN) if scheme == "light" else ["split", "greedy", "check"]
    short = {"greedy": {"greedy_n": 8}, "quant": {"quant_n": 4}, "loading_trap": {"loading_trap_n": 6}}
    fit = {} if scheme != "light" else dict(TEXT_FIT_PAGES)  # text-fit pages not yet checked: their settings
    problems = {}
    with browser() as b:
        ctx = b.new_context(viewport={"width": 1280, "height": 720}, color_scheme=scheme)
        for path in names:
            verdict_sel, chart_sel = FIRST_SCREEN[path]
            page = ctx.new_page()
            page.goto(link(server, path, presenter=False, **short.get(path, {})))
            if path == "matrix":  # the matrix runs on its button
                page.get_by_role("button", name="Run the matrix").click(timeout=120_000)
            limit_s = 600 if path == "serving" else 300  # serving runs at its defaults (as text fit opened it)
            page.wait_for_selector(chart_sel, timeout=limit_s * 1000)
            wait_idle(page, limit_s, started=True)
            figures_drawn(page, titled=False)
            no_exception(page)
            page.screenshot(path=str(artifacts / f"normal-{scheme}-{path}.png"))
            verdict = _first_screen(page, verdict_sel)
            chart = _first_screen(page, chart_sel)
            assert verdict["y"] >= 0 and verdict["y"] + min(verdict["height"], 200) <= 720, (path, verdict)
            assert chart["y"] < 720 - 60, (path, chart)
            if path in fit and fit[path] == short.get(path, {}):
                del fit[path]
                _text_fit(page, artifacts, "normal", path, problems)
            page.close()
        for path, params in fit.items():  # opened above with other settings
            _open_for_text_fit(ctx, server, artifacts, path, params, False, problems)
        ctx.close()
    if scheme == "light":
        _no_text_fit_problems(artifacts, "text-fit-normal", problems)


def test_navigation_shows_every_page_in_sections(server, artifacts):
    with browser() as b:
        page = b.new_page(viewport={"width": 1280, "height": 720})
        page.goto(server)
        page.get_by_text("why does the KV cache change my numbers").first.wait_for(timeout=60_000)
        page.get_by_text("Start with a scenario").first.wait_for(timeout=60_000)
        wait_idle(page, started=True)
        nav = page.locator('[data-testid="stSidebarNav"]')
        for section in ("Start", "Investigate", "Classic traps", "Engine", "Reference"):
            assert nav.get_by_text(section, exact=True).count() == 1, section
        for title in ("Guide", "Glossary", "Is my model cache-safe?", "Open a result", "Quantized cache & weights"):
            assert nav.get_by_role("link", name=title).count() == 1, title
        assert page.locator('[data-testid="stSidebarNavViewButton"]').count() == 0  # no "View more"
        # Home's scenario buttons name the page they open
        assert page.get_by_role("button", name="Open in Split point").count() >= 1
        main = page.locator('[data-testid="stMain"]')
        assert main.get_by_role("button", name="Open", exact=True).count() == 0
        page.screenshot(path=str(artifacts / "home-nav.png"))


def test_after_a_scenario_another_model_gives_the_defaults_verdict(server, artifacts):
    with browser() as b:
        page = b.new_context(viewport={"width": 1280, "height": 720}).new_page()
        page.goto(server)
        page.get_by_text("Start with a scenario").first.wait_for(timeout=60_000)
        wait_idle(page)
        page.locator(".st-key-preset_padding button").first.click()  # "Left padding without position ids"
        page.get_by_text("Verdict: logic").first.wait_for(timeout=240_000)
        wait_idle(page)
        assert page.get_by_text("Scenario: Left padding without position ids").count() == 1
        page.screenshot(path=str(artifacts / "scenario-padding.png"))
        sidebar = page.locator('[data-testid="stSidebar"]')
        sidebar.get_by_role("combobox", name="Model").click()
        page.keyboard.type("tiny:gpt2")  # the list is longer than the dropdown shows: filter it as a user would
        page.get_by_role("option", name="tiny:gpt2").click()
        from playwright.sync_api import expect

        expect(page.get_by_text("Scenario:")).to_have_count(0, timeout=60_000)
        expect(page.get_by_text("Verdict: logic")).to_have_count(0, timeout=240_000)  # the stale one goes
        page.get_by_text("Verdict:").first.wait_for(timeout=240_000)
        wait_idle(page)
        no_exception(page)
        assert page.get_by_text("Verdict: logic").count() == 0
        assert page.get_by_text("Scenario:").count() == 0
        assert "split_pad" not in page.url and "split_pos" not in page.url
        page.screenshot(path=str(artifacts / "scenario-left.png"))


def test_slider_and_box_agree_after_a_failed_load(server, artifacts):
    import time

    with browser() as b:
        page = b.new_context(viewport={"width": 1280, "height": 900}).new_page()
        page.goto(link(server, "split", presenter=False, model_preset="tiny:gpt2", split_k=6))
        page.wait_for_selector(".js-plotly-plot", timeout=240_000)
        wait_idle(page)
        sidebar = page.locator('[data-testid="stSidebar"]')
        sidebar.get_by_role("combobox", name="Model").click()
        page.keyboard.type("other")  # the list is longer than the dropdown shows: filter it as a user would
        page.get_by_role("option", name="other…").click()
        wait_idle(page)
        box = sidebar.get_by_label("Hub id, folder or .gguf path")
        box.fill("/no/such/model.gguf")
        box.press("Enter")
        page.get_by_text("not found").first.wait_for(timeout=60_000)
        wait_idle(page)
        sidebar.get_by_role("combobox", name="Model").click()
        page.keyboard.type("tiny:gpt2")
        page.get_by_role("option", name="tiny:gpt2").click()
        page.wait_for_selector(".js-plotly-plot", timeout=240_000)
        wait_idle(page)
        no_exception(page)
        assert page.get_by_text("not found").count() == 0  # the old message went with the failed load
        page.get_by_text("Settings: prompt and controls").click()
        time.sleep(1)
        page.screenshot(path=str(artifacts / "slider-box-after-failed-load.png"))
        slider = page.locator('[data-testid="stSliderThumbValue"]').first
        typed = page.locator('[data-testid="stNumberInput"] input').first
        assert slider.inner_text().strip() == "6" and typed.input_value() == "6"
        assert page.get_by_text("6 cached (blue)").count() == 1  # and the run used k = 6
        page.screenshot(path=str(artifacts / "slider-box-after-failed-load.png"))


def test_bisector_and_heatmap_use_one_layer_name(server, artifacts):
    import re

    with browser() as b:
        page = b.new_context(viewport={"width": 1280, "height": 900}).new_page()
        # A mask that leaves the 2 pad tokens visible to the rest (a logic fault): the paths part in layer 1's
        # attention on every CPU. The default prompt's bfloat16 split differs on some CPUs only (AVX2: layer 4;
        # AVX-512: bit for bit, and the bisector then says nothing differs).
        page.goto(link(server, "split", presenter=False, model_preset="tiny:llama", dtype="bfloat16", split_pad=2,
                       split_mask="new-only"))
        page.wait_for_selector(".js-plotly-plot", timeout=240_000)
        wait_idle(page)
        assert page.locator(".js-plotly-plot").first.get_by_text("layer 2", exact=True).count() >= 1
        page.get_by_text("Where does it start? (bisector)").click()
        shown = page.locator("text=The first difference is in >> visible=true")  # a folded copy may sit above it
        click_until(page, page.get_by_role("button", name="Find the first differing module"),
                    lambda: shown.count() >= 1)
        wait_idle(page)
        text = shown.first.inner_text()
        m = re.search(r"layer (\d+) \((\S+?)\.(\d+)\b", text)
        assert m and int(m.group(1)) == int(m.group(3)) + 1, text  # "layer k (model.layers.{k-1}…)"
        page.screenshot(path=str(artifacts / "bisector-naming.png"), full_page=True)


def test_a_typed_k_past_the_prompt_comes_back_as_the_k_the_run_uses(server, artifacts):
    with browser() as b:
        page = b.new_context(viewport={"width": 1280, "height": 900}).new_page()
        page.goto(link(server, "split", presenter=False, model_preset="tiny:gpt2", split_k=4))
        page.wait_for_selector(".js-plotly-plot", timeout=240_000)
        wait_idle(page)
        page.get_by_text("Settings: prompt and controls").click()
        typed = page.locator('[data-testid="stNumberInput"] input').first
        typed.fill("999")
        typed.press("Enter")
        page.get_by_text("k = 999 is outside").first.wait_for(timeout=120_000)
        wait_idle(page)
        no_exception(page)
        k = typed.input_value()
        page.screenshot(path=str(artifacts / "split-k-typed-past-the-prompt.png"))
        assert k not in ("999", "4") and page.get_by_text(f"{k} cached (blue)").count() == 1
        assert page.locator('[data-testid="stSliderThumbValue"]').first.inner_text().strip() == k


@pytest.mark.parametrize("first", [True, False], ids=["fresh-server", "later"])
def test_an_older_page_url_lands_on_the_pages_own_url_with_its_settings(artifacts, first, request):
    """A link saved to /split_point (the page's URL before it was at its view's name) opens the Split point page at
    /split with the link's settings, as the very first request of a fresh server and as a later one."""
    import contextlib
    from urllib.parse import parse_qs, urlparse

    from browser import streamlit_server

    with contextlib.ExitStack() as stack:
        server = stack.enter_context(streamlit_server())[0] if first else request.getfixturevalue("server")
        b = stack.enter_context(browser())
        page = b.new_context(viewport={"width": 1280, "height": 900}).new_page()
        if not first:
            page.goto(server + "/guide")
            page.wait_for_selector('[data-testid="stMainBlockContainer"] h1', timeout=120_000)
        page.goto(link(server, "split_point", presenter=False, model_preset="tiny:gpt2", split_k=4))
        page.wait_for_selector(".js-plotly-plot", timeout=240_000)
        wait_idle(page)
        no_exception(page)
        url = urlparse(page.url)
        assert url.path == "/split" and parse_qs(url.query).get("split_k") == ["4"], page.url
        assert page.get_by_text("4 cached (blue)").count() == 1  # the run used the link's k
        page.screenshot(path=str(artifacts / f"older-url-{request.node.callspec.id}.png"))


def test_a_fresh_servers_deep_link_never_shows_the_raw_file_list(artifacts):
    """A fresh server's first request, a copied link to /glossary: Streamlit starts it as a plain pages/ app, whose
    navigation would be the flat list of pages/*.py file names ('app', 'ab', 'common', ...) until app.py's sectioned
    one arrives (kvviz's imports). .streamlit/config.toml turns the sidebar navigation off and app.py turns it on for
    its own: the flat list is never drawn — not for one frame (a DOM observer from the page's first script watches
    every change; it was on screen for ~0.2 s under load when only CSS hid it, ~5 s before that); the sectioned
    navigation comes."""
    import time

    from browser import streamlit_server

    watch = """(() => { window.__rawNav = []; const t0 = performance.now();
      const look = () => { const n = document.querySelector('[data-testid=stSidebarNav]');
        if (n && !n.querySelector('[data-testid=stNavSectionHeader]') && n.textContent.includes('common'))
          window.__rawNav.push(Math.round(performance.now() - t0)); };
      new MutationObserver(look).observe(document, {childList: true, subtree: true, characterData: true}); })();"""
    with streamlit_server() as (server, _log), browser() as b:
        page = b.new_page(viewport={"width": 1280, "height": 720})
        page.add_init_script(watch)
        page.goto(link(server, "glossary", presenter=False), wait_until="commit")
        t0 = time.time()
        while time.time() - t0 < 180:
            if page.locator('[data-testid="stNavSectionHeader"]').count():
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the sectioned navigation never came")
        page.screenshot(path=str(artifacts / "fresh-deep-link.png"))
        raw = page.evaluate("window.__rawNav")
        assert raw == [], f"the raw pages/ file list was drawn at {raw[:5]} ms"
        assert page.locator('[data-testid="stSidebarNav"]').get_by_text("Reference", exact=True).count() == 1
        page.get_by_role("heading", name="Glossary").wait_for(timeout=60_000)  # the link's page, inside app.py

def test_every_symbol_the_pages_print_has_a_glyph_in_chromium():
    """Debian's chromium has no colour-emoji font: a symbol without a glyph there draws as a box (🔒 did, before the
    verdicts' proof line took :material/lock:). Each non-letter symbol in the pages' text is drawn on a canvas and
    compared with a code point that no font has (its box)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = "".join(p.read_text(encoding="utf-8") for p in [root / "app.py", *sorted((root / "pages").glob("*.py"))])
    symbols = sorted({c for c in text if ord(c) > 0x2000 and not c.isalpha() and not 0xFE00 <= ord(c) <= 0xFE0F})
    assert "→" in symbols and "—" in symbols  # the scan sees the pages' symbols
    with browser() as b:
        page = b.new_page()
        page.set_content("<canvas id=c width=60 height=60></canvas>")
        missing = page.evaluate("""(chars) => { const cv = document.getElementById('c'), g = cv.getContext('2d');
          const draw = (ch) => { g.clearRect(0, 0, 60, 60); g.font = '40px sans-serif'; g.fillText(ch, 5, 45);
                                 return g.getImageData(0, 0, 60, 60).data.join(','); };
          const box = draw(String.fromCodePoint(0x10FFFD));
          return chars.filter(ch => draw(ch) === box); }""", symbols)
    assert not missing, [f"U+{ord(c):04X} {c}" for c in missing]
    assert not re.search("[\U0001F300-\U0001FAFF]", text)  # no pictographic emoji at all: none has a glyph here
