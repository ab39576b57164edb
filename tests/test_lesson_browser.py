"""The Lesson in a real browser at 1280x720 with the default model, in presenter mode and a dark colour scheme:
every step computes, reveals its answer and draws its figure, and the figure's text fits (tests/browser.py's
TEXT_JS: test_text_fit.py's check in presenter mode, made here on the way, where the Lesson is walked anyway; its
normal-mode walk is test_text_fit.py's); screenshots in test-artifacts/."""
import json
from urllib.parse import quote

import pytest

from browser import app_server_fixture, browser, figures_drawn, no_exception, text_fit_problems, wait_idle

pytestmark = [pytest.mark.browser, pytest.mark.slow]

STEPS = ["1 · Floats", "2 · Sums", "3 · One row", "4 · One layer", "5 · All layers", "6 · A word flips",
         "7 · The referee", "8 · A bug"]


server = app_server_fixture()


@pytest.mark.parametrize("scheme, presenter", [("dark", True)])
def test_the_lesson_walks_every_step_with_its_figure(server, artifacts, scheme, presenter):
    q = "&".join(f"{k}={quote(json.dumps(v))}" for k, v in {"model_preset": "default", "presenter": presenter}.items())
    with browser() as b:
        ctx = b.new_context(viewport={"width": 1280, "height": 720}, color_scheme=scheme)
        page = ctx.new_page()
        page.goto(f"{server}/lesson?{q}")
        page.get_by_text("Lesson: rounding or a bug?").first.wait_for(timeout=240_000)
        problems = {}
        nav = page.locator('[data-testid="stSidebarNav"]')
        assert nav.get_by_text("Lesson", exact=True).count() == 1  # its own section, at the top
        for k, label in enumerate(STEPS, start=1):
            page.get_by_text(label, exact=True).first.click()
            page.get_by_text(f"Step {k}:").first.wait_for(timeout=300_000)
            page.get_by_role("button", name="Reveal the answer").first.wait_for(timeout=300_000)
            wait_idle(page, 300, started=True)  # "Step k:" is the new run's
            no_exception(page)
            assert page.get_by_text("Predict.").count() >= 1
            page.get_by_role("button", name="Reveal the answer").first.click()
            page.get_by_text("Why.").first.wait_for(timeout=120_000)
            wait_idle(page, 120, started=True)  # "Why." is the new run's
            no_exception(page)
            page.wait_for_selector(".js-plotly-plot .main-svg", timeout=60_000)  # plotly draws after the script
            figures_drawn(page)
            plots = page.locator(".js-plotly-plot")
            assert plots.count() == 1, (label, plots.count())
            assert f"Step {k}" in plots.first.inner_text(), label
            assert page.locator(".js-plotly-plot .main-svg").count() >= 1
            found = text_fit_problems(page, artifacts / f"lesson-{scheme}-step{k}.png", drawn=True)
            if found:
                problems[label] = found
        ctx.close()
    (artifacts / f"text-fit-{'presenter' if presenter else 'normal'}-lesson.json").write_text(
        json.dumps(problems, indent=1))
    assert not problems, problems


def test_presenter_mode_enlarges_home_and_never_cuts_a_tile_label(server, artifacts):
    def link(path, **params):
        q = "&".join(f"{k}={quote(json.dumps(v))}" for k, v in params.items())
        return f"{server}/{path}?{q}"

    with browser() as b:
        ctx = b.new_context(viewport={"width": 1280, "height": 720})
        sizes = {}
        for presenter in (False, True):
            page = ctx.new_page()
            page.goto(link("", model_preset="tiny:llama", presenter=presenter))
            page.get_by_text("Start with a scenario").first.wait_for(timeout=120_000)
            wait_idle(page, started=True)
            sizes[presenter] = page.evaluate(
                "parseFloat(getComputedStyle(document.querySelector('[data-testid=\"stMainBlockContainer\"] p'))"
                ".fontSize)")
            page.close()
        assert sizes[True] > sizes[False], sizes
        page = ctx.new_page()
        page.goto(link("split", model_preset="tiny:llama", presenter=True, invariant=True))
        page.wait_for_selector('[data-testid="stMetricLabel"]', timeout=240_000)
        wait_idle(page, started=True)
        no_exception(page)
        cut = page.evaluate("""[...document.querySelectorAll('[data-testid="stMetricLabel"]')].filter(
            e => [e, ...e.querySelectorAll('*')].some(x => x.scrollWidth > x.clientWidth + 1)).map(e => e.innerText)""")
        page.screenshot(path=str(artifacts / "presenter-split-tiles.png"), full_page=True)
        assert not cut, cut
        ctx.close()
