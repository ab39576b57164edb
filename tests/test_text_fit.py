"""Real browser at 1280×720, presenter mode and normal mode: the text of every plotly figure on the chart pages
(titles, legend items, axis titles, colour-bar titles, annotations) lies inside its figure and no two of them
overlap, nor lie over tick labels — measured from the drawn elements' boxes, as a user sees them (issue 39 item 7).
Screenshots in test-artifacts/text-fit-*.png.

The check (tests/browser.py's TEXT_JS, text_fit_problems) runs inside the walks that open the same pages anyway, so
no page is opened twice for it: the chart pages in normal mode in test_browser.py::test_first_screen_in_normal_mode
[light], in presenter mode in test_browser.py::test_presenter_mode_fits_verdict_and_chart_and_custom_html_is_readable
[light] and (dtypes, padding) test_every_page_in_presenter_mode; the Lesson's figures in presenter mode in
test_lesson_browser.py's walk (the default model, dark: only colours differ); in normal mode here; the example view's
chart on the generic page (docs/example_view, which the app does not register) in both modes in
test_view_page_browser.py::test_the_example_view_as_a_fresh_servers_first_request, on the server of its own it needs."""
import pytest

from browser import app_server_fixture, browser, no_exception, text_fit_problems, wait_idle
from test_browser import link

pytestmark = pytest.mark.browser

server = app_server_fixture()

LESSON_STEPS = ["1 · Floats", "2 · Sums", "3 · One row", "4 · One layer", "5 · All layers", "6 · A word flips",
                "7 · The referee", "8 · A bug"]


@pytest.mark.parametrize("presenter", [False], ids=["normal"])  # presenter: test_lesson_browser.py's walk
def test_the_lessons_figures_fit(server, artifacts, presenter):
    """Every Lesson step's figure, its answer revealed, at 1280×720: the same checks as the chart pages'."""
    problems = {}
    mode = "presenter" if presenter else "normal"
    with browser() as b:
        page = b.new_context(viewport={"width": 1280, "height": 720}).new_page()
        page.goto(link(server, "lesson", presenter=presenter))
        page.get_by_text("Lesson: rounding or a bug?").first.wait_for(timeout=240_000)
        for k, label in enumerate(LESSON_STEPS, start=1):
            page.get_by_text(label, exact=True).first.click()
            page.get_by_text(f"Step {k}:").first.wait_for(timeout=300_000)
            reveal = page.get_by_role("button", name="Reveal the answer").first
            reveal.wait_for(timeout=300_000)
            wait_idle(page, 300, started=True)  # "Step k:" is the new run's
            reveal.click()
            page.get_by_text("Why.").first.wait_for(timeout=300_000)
            wait_idle(page, 300, started=True)  # "Why." is the new run's
            no_exception(page)
            found = text_fit_problems(page, artifacts / f"text-fit-{mode}-lesson-step{k}.png")
            if found:
                problems[label] = found
    import json

    (artifacts / f"text-fit-{mode}-lesson.json").write_text(json.dumps(problems, indent=1))
    assert not problems, problems


def test_titles_wrap_at_their_parts_and_settings_read_as_words():
    """No browser: the pieces the figures and reports use."""
    from kvviz.io.export import shown
    from kvviz.core.plotting import wrap_title
    from kvviz.views.greedy.run import GreedyPath

    t = wrap_title("relative gap: cached vs full forward — bfloat16 on cpu, split 8 (chunk) — bitwise identical: "
                   "0 everywhere")
    assert t.split("<br>") == ["relative gap: cached vs full forward —", "bfloat16 on cpu, split 8 (chunk) —",
                               "bitwise identical: 0 everywhere"]
    assert wrap_title("Top-2 margin per step — float32 on cpu") == "Top-2 margin per step — float32 on cpu"
    assert all(len(line) <= 44 for line in wrap_title("Distance from the float64 reference: is the cache path "
                                                      "further from the truth?").split("<br>"))
    assert shown((GreedyPath.NO_CACHE, GreedyPath.CACHE)) == "no_cache, cache"
    assert shown(None) == "not set" and shown(GreedyPath.FLOAT64) == "float64" and shown(3) == "3"


def test_greedy_report_writes_paths_as_words_and_legends_without_backticks():
    import kvviz
    from kvviz.io.export import html_report
    from kvviz.views.greedy import figures
    from kvviz.views.greedy.run import GreedyConfig, run_greedy

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    res = run_greedy(lm, GreedyConfig("Hello world", 4))
    page = html_report(res)
    assert "GreedyPath." not in page and "<td>None</td>" not in page
    fig = figures.greedy_margins(res)
    assert fig.data and not any("`" in (t.name or "") for t in fig.data)
    assert fig.layout.legend.yanchor == "bottom" and fig.layout.legend.y > 1  # above the plot, not over its axis
