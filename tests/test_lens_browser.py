"""The Logit lens page (the generic page, pages/lens.py) in a real browser: its controls pressed, its figures drawn."""
import json
from urllib.parse import quote

import pytest

from browser import app_server_fixture, browser, click_until, figures_drawn, no_exception, open_page, wait_idle

pytestmark = pytest.mark.browser

server = app_server_fixture()

PROMPT = "The capital of France is Paris and the capital of Spain is"


def test_the_lens_page_names_the_decision_depth_after_its_controls_are_pressed(server, artifacts):
    """Opened on tiny:llama with the prompt and split in its link; then, in the browser, left pad 3 typed and
    position ids "omit" clicked (the left-padding bug): the KL heatmap's title names the decision depth (layer 1),
    its cells carry the two paths' tokens where the top-1 differ, the attention figure names the head that moved,
    the verdict says logic; "step" clicked reruns it token by token, with no exception shown."""
    from kvviz.views.lens.figures import DIFFERS

    q = "&".join(f"{k}={quote(json.dumps(v))}" for k, v in {"model_preset": "tiny:llama", "presenter": False,
                                                              "lens_prompt": PROMPT, "lens_split": 5}.items())
    with browser() as b:
        page = open_page(b, f"{server}/lens?{q}", height=2400)
        assert page.locator("h1", has_text="Logit lens").count() == 1
        assert page.get_by_text("Verdict:").count() >= 1
        page.get_by_text("Settings: prompt and controls").click()
        pad = page.get_by_role("spinbutton", name="Left pad")
        pad.fill("3")
        pad.press("Enter")
        wait_idle(page)
        plots = page.locator(".js-plotly-plot")
        click_until(page, page.get_by_text("omit", exact=True).first,
                    lambda: "decision depth layer 1" in plots.nth(1).inner_text())
        wait_idle(page, started=True)
        figures_drawn(page)
        no_exception(page)
        kl = plots.nth(1).inner_text()
        assert "Logit lens: KL" in kl and DIFFERS in kl  # the tokens written where the two top-1 differ
        assert any("max |Δp|" in plots.nth(i).inner_text() and "most: layer" in plots.nth(i).inner_text()
                   for i in range(plots.count()))
        assert page.get_by_text("Verdict: logic").count() >= 1
        assert page.get_by_text("decision depth").count() >= 1
        page.screenshot(path=str(artifacts / "lens-padding-bug.png"), full_page=True)
        click_until(page, page.get_by_text("step", exact=True).first,
                    lambda: page.get_by_label("step", exact=True).is_checked())
        wait_idle(page)
        figures_drawn(page)
        no_exception(page)
        assert page.get_by_text("Verdict: logic").count() >= 1
        assert "decision depth layer 1" in page.locator(".js-plotly-plot").nth(1).inner_text()
        page.screenshot(path=str(artifacts / "lens-padding-bug-step.png"), full_page=True)
