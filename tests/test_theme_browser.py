"""One look everywhere, in a real browser (issue 53): the exported HTML report, the lesson handout and the meeting
bundle opened offline (file://, the network blocked) draw the app's background and verdict colours (logic red), read
from screenshots' pixels and compared with the app's own logic verdict box; presenter mode at 1280×720 shows the split
heatmap's last layer and its token axis in the first screen, for a 32-layer model."""
import io
import json
from urllib.parse import quote

import numpy as np
import pytest

import kvviz
from kvviz.core import theme
from kvviz.io.export import html_report

from browser import app_server_fixture, browser, figures_drawn, no_exception, wait_idle
from conftest import DEVICE, PROMPT

pytestmark = pytest.mark.browser

server = app_server_fixture()


def rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])


def centre_colour(png: bytes) -> np.ndarray:
    """The most common colour of a screenshot (a verdict box: its background behind its text)."""
    from PIL import Image

    px = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3)
    colours, counts = np.unique(px, axis=0, return_counts=True)
    return colours[counts.argmax()].astype(int)


def link(path: str, **params) -> str:
    q = "&".join(f"{k}={quote(json.dumps(v))}" for k, v in {"presenter": True, **params}.items())
    return f"{path}?{q}"


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """A tiny llama with 32 decoder layers, written as a model folder (loaded through the real folder path)."""
    from kvviz.models.tiny import byte_tokenizer, random_model, tiny_config

    folder = tmp_path_factory.mktemp("deep") / "llama32"
    config = tiny_config("llama")
    config.num_hidden_layers = 32
    random_model(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_exports_offline_draw_the_apps_background_and_verdict_colours(server, tmp_path, artifacts, deep_model):
    from kvviz.teach import lesson
    from kvviz.teach.lesson_figures import handout_html
    from kvviz.teach.meeting import bundle

    lm = kvviz.load_model("tiny:llama", "bfloat16", DEVICE)
    res = kvviz.run_split(lm, kvviz.SplitConfig(PROMPT, 8, left_pad=2, position_ids="omit"))
    assert res.verdict == "logic"
    files = {"report": html_report(res), "meeting": bundle([("logic", html_report(res))]),
             "handout": handout_html([lesson.step_float()])}
    blocked = []
    with browser() as b:
        # the app's own logic verdict box (st.error): the colour the files must match
        ctx = b.new_context(viewport={"width": 1280, "height": 720})
        page = ctx.new_page()
        page.goto(link(server + "/split", model_preset="tiny:llama", dtype="bfloat16", split_pad=2, split_pos="omit",
                       presenter=False))
        page.wait_for_selector('[data-testid="stAlert"]:has-text("Verdict: logic")', timeout=240_000)
        wait_idle(page, started=True)
        app_box = page.locator('[data-testid="stAlert"]:has-text("Verdict: logic")').first.screenshot()
        (artifacts / "theme-app-logic-box.png").write_bytes(app_box)
        app_red = centre_colour(app_box)
        ctx.close()
        ctx = b.new_context(viewport={"width": 1200, "height": 900}, color_scheme="light")
        ctx.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                  else (blocked.append(route.request.url), route.abort()))
        for name, text in files.items():
            path = tmp_path / f"{name}.html"
            path.write_text(text, encoding="utf-8")
            page = ctx.new_page()
            page.goto(path.as_uri())
            if name == "handout":  # the exercises' answers and a step's figure behind their reveals: open them
                page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
            page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length > 0",
                                   timeout=60_000)
            page.screenshot(path=str(artifacts / f"theme-{name}.png"), full_page=True)
            bg = centre_colour(page.locator(".js-plotly-plot").first.screenshot())
            assert np.abs(bg - rgb(theme.BACKGROUND)).max() <= 2, (name, bg)  # the chart's white, as in the app
            body = page.evaluate("getComputedStyle(document.body).backgroundColor")
            assert body == "rgb(255, 255, 255)", (name, body)
            if name != "handout":
                box = centre_colour(page.locator(".verdict.logic").first.screenshot())
                assert np.abs(box - rgb(theme.VERDICT_BOXES["logic"][0])).max() <= 2, (name, box)
                assert np.abs(box - app_red).max() <= 6, (name, box, app_red)  # the app's logic red
            else:
                assert page.locator("#exercises").count() == 1 and page.locator("section.exercise").count() == 4
                q = centre_colour(page.locator(".q").first.screenshot())  # the app's information blue
                assert np.abs(q - rgb(theme.VERDICT_BOXES["precision"][0])).max() <= 2, q
            page.close()
        ctx.close()
    assert blocked == []


def test_presenter_split_heatmap_last_layer_and_token_axis_in_the_first_screen(server, artifacts, deep_model):
    with browser() as b:
        ctx = b.new_context(viewport={"width": 1280, "height": 720})
        page = ctx.new_page()
        page.goto(link(server + "/split", model_preset="other…", model_other=str(deep_model), dtype="float32"))
        page.wait_for_selector(".js-plotly-plot", timeout=240_000)
        wait_idle(page, started=True)
        figures_drawn(page, titled=False)
        no_exception(page)
        page.screenshot(path=str(artifacts / "theme-presenter-split-1280x720.png"))
        chart = page.locator(".js-plotly-plot").first
        box = chart.bounding_box()
        assert box["y"] >= 0 and box["y"] + box["height"] <= 720, box  # the whole map in the first screen
        last = chart.locator(".ytick text", has_text="layer 32 + final norm")
        assert last.count() == 1
        lb = last.bounding_box()
        assert 0 <= lb["y"] and lb["y"] + lb["height"] <= 720, lb
        ticks = chart.locator(".xtick text")
        assert ticks.count() >= 2
        for i in range(ticks.count()):
            tb = ticks.nth(i).bounding_box()
            assert tb["y"] + tb["height"] <= 720 and tb["x"] + tb["width"] <= 1280, tb
        ctx.close()
