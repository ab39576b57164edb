"""Real browser at 1280×720, presenter mode and normal mode: the text of every plotly figure on the chart pages
(titles, legend items, axis titles, colour-bar titles, annotations) lies inside its figure and no two of them
overlap, nor lie over tick labels — measured from the drawn elements' boxes, as a user sees them (issue 39 item 7).
Screenshots in test-artifacts/text-fit-*.png."""
import time

import pytest

from browser import app_server_fixture, browser, no_exception, wait_idle
from test_browser import link

pytestmark = pytest.mark.browser

server = app_server_fixture()

# every chart page with short settings (as test_first_screen_in_normal_mode runs them); the matrix runs on a button
PAGES = {"split": {}, "greedy": {"greedy_n": 8}, "dtypes": {}, "padding": {}, "loading_trap": {"loading_trap_n": 6},
         "quant": {"quant_n": 4}, "matrix": {}, "serving": {}}
LESSON_STEPS = ["1 · Floats", "2 · Sums", "3 · One row", "4 · One layer", "5 · All layers", "6 · A word flips",
                "7 · The referee", "8 · A bug"]

TEXT_JS = """() => {
  const named = 'text.gtitle, .legendtext, .xtitle, .ytitle, .cbtitle text, .annotation-text';
  const box = (el) => el.getBoundingClientRect();
  const hit = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > 2 &&
                        Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 2;
  const out = [];
  document.querySelectorAll('.js-plotly-plot').forEach((plot, i) => {
    const fb = box(plot);
    if (fb.width === 0 || fb.height === 0) return;  // a figure in a folded expander or another tab
    const texts = [...plot.querySelectorAll(named)].filter(t => t.textContent.trim() && box(t).width > 0);
    const ticks = [...plot.querySelectorAll('.xtick text, .ytick text, .colorbar .tick text, .cbaxis text')].filter(t => t.textContent.trim() && box(t).width > 0);
    const title = (plot.querySelector('text.gtitle') || {}).textContent || ('figure ' + i);
    for (const k of ticks) {  // a tick label cut at the figure's edge (the last x tick's right half)
      const r = box(k);
      if (r.left < fb.left - 1 || r.right > fb.right + 1 || r.top < fb.top - 1 || r.bottom > fb.bottom + 1)
        out.push({figure: title.slice(0, 60), problem: 'tick label clipped', text: k.textContent.slice(0, 60),
                  box: [r.left - fb.left, r.top - fb.top, r.width, r.height].map(Math.round),
                  figure_size: [Math.round(fb.width), Math.round(fb.height)]});
    }
    for (const t of texts) {
      const r = box(t);
      if (r.left < fb.left - 1 || r.right > fb.right + 1 || r.top < fb.top - 1 || r.bottom > fb.bottom + 1)
        out.push({figure: title.slice(0, 60), problem: 'clipped', text: t.textContent.slice(0, 60),
                  box: [r.left - fb.left, r.top - fb.top, r.width, r.height].map(Math.round),
                  figure_size: [Math.round(fb.width), Math.round(fb.height)]});
    }
    plot.querySelectorAll('.legend').forEach(lg => {  // a legend clips its entries to its background
      const bg = lg.querySelector('rect.bg');
      if (!bg) return;
      const lb = box(bg);
      lg.querySelectorAll('.legendtext').forEach(t => {
        const r = box(t);
        if (t.textContent.trim() && r.right > lb.right + 1)
          out.push({figure: title.slice(0, 60), problem: 'cut by its legend', text: t.textContent.slice(0, 60)});
      });
      const marks = [...lg.querySelectorAll('.legendpoints, .legendlines, .legendsymbols')];
      lg.querySelectorAll('.legendtext').forEach(t => marks.forEach(m => {
        if (!m.closest('.traces').contains(t) && hit(box(t), box(m)))
          out.push({figure: title.slice(0, 60), problem: 'legend text over another entry', text: t.textContent.slice(0, 60)});
      }));
    });
    for (let a = 0; a < texts.length; a++) {
      const ra = box(texts[a]);
      for (let b = a + 1; b < texts.length; b++)
        if (hit(ra, box(texts[b])))
          out.push({figure: title.slice(0, 60), problem: 'overlap', text: texts[a].textContent.slice(0, 40),
                    other: texts[b].textContent.slice(0, 40)});
      for (const k of ticks)
        if (hit(ra, box(k)))
          out.push({figure: title.slice(0, 60), problem: 'over a tick label', text: texts[a].textContent.slice(0, 40),
                    other: k.textContent.slice(0, 40)});
    }
  });
  return out; }"""


def _figures_drawn(page, timeout_s: float = 600) -> int:
    """The page's figures have drawn their text (plotly draws after Streamlit's script is idle)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        n = page.evaluate("() => document.querySelectorAll('.js-plotly-plot text.gtitle').length")
        if n:
            time.sleep(1.5)  # the last figures' legends and annotations
            return n
        time.sleep(0.5)
    raise TimeoutError("no plotly figure drew its title")


@pytest.mark.parametrize("presenter", [True, False], ids=["presenter", "normal"])
def test_figure_text_fits_and_does_not_overlap(server, artifacts, presenter):
    problems = {}
    with browser() as b:
        ctx = b.new_context(viewport={"width": 1280, "height": 720})
        for path, params in PAGES.items():
            page = ctx.new_page()
            page.goto(link(server, path, presenter=presenter, **params))
            if path == "matrix":
                page.get_by_role("button", name="Run the matrix").click(timeout=300_000)
            page.wait_for_selector(".js-plotly-plot", timeout=600_000)
            wait_idle(page, 600)
            no_exception(page)
            _figures_drawn(page)
            mode = "presenter" if presenter else "normal"
            page.screenshot(path=str(artifacts / f"text-fit-{mode}-{path}.png"), full_page=True)
            found = page.evaluate(TEXT_JS)
            if found:
                problems[path] = found
            page.close()
        ctx.close()
    import json

    (artifacts / f"text-fit-{'presenter' if presenter else 'normal'}.json").write_text(json.dumps(problems, indent=1))
    assert not problems, problems


@pytest.mark.parametrize("presenter", [True, False], ids=["presenter", "normal"])
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
            wait_idle(page, 300)
            reveal.click()
            page.get_by_text("Why.").first.wait_for(timeout=300_000)
            wait_idle(page, 300)
            no_exception(page)
            _figures_drawn(page)
            page.screenshot(path=str(artifacts / f"text-fit-{mode}-lesson-step{k}.png"), full_page=True)
            found = page.evaluate(TEXT_JS)
            if found:
                problems[label] = found
    import json

    (artifacts / f"text-fit-{mode}-lesson.json").write_text(json.dumps(problems, indent=1))
    assert not problems, problems


def test_titles_wrap_at_their_parts_and_settings_read_as_words():
    """No browser: the pieces the figures and reports use."""
    from kvviz.export import shown
    from kvviz.plotting import wrap_title
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
    from kvviz.export import html_report
    from kvviz.views.greedy import figures
    from kvviz.views.greedy.run import GreedyConfig, run_greedy

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    res = run_greedy(lm, GreedyConfig("Hello world", 4))
    page = html_report(res)
    assert "GreedyPath." not in page and "<td>None</td>" not in page
    fig = figures.greedy_margins(res)
    assert fig.data and not any("`" in (t.name or "") for t in fig.data)
    assert fig.layout.legend.yanchor == "bottom" and fig.layout.legend.y > 1  # above the plot, not over its axis
