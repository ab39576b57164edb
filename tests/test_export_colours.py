"""Exports keep their colours when written from the app (issue 39).

`import streamlit` makes "streamlit" plotly's default template for the whole process: its colours are placeholders
(#000001..#000040) that only Streamlit's frontend replaces. Every figure the app's process builds - the HTML report's,
the meeting bundle's, the lesson handout's - used to start with it, so a file exported from the app drew black lines
and solid black bars. kvviz writes figures with its own template (kvviz.io.export.standalone_figure)."""
import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import pytest
import streamlit  # noqa: F401  (what the app's process has imported: plotly's default template is Streamlit's)

import kvviz
from kvviz.core import theme
from kvviz.io.export import PLACEHOLDER_COLOUR, figure_html, html_report, main_figures, standalone_figure

from conftest import PROMPT, ROOT

# the first colours of kvviz's template (kvviz.core.theme): the worst line, and the float64 rerun's worst line
PLOTLY_BLUE, PLOTLY_RED = theme.COLORWAY[0], theme.COLORWAY[2]
VIRIDIS_LOW = "#440154"  # the heatmap's colour scale


def placeholders(text: str) -> list[str]:
    return sorted(set(PLACEHOLDER_COLOUR.findall(text)))


@pytest.fixture(scope="module")
def split_result():
    lm = kvviz.load_model("tiny:llama", "bfloat16", "cpu")
    return kvviz.run_split(lm, kvviz.SplitConfig(PROMPT, 8, left_pad=2, position_ids="omit"))


def test_the_app_process_default_template_is_streamlits_placeholders(split_result, monkeypatch):
    """The cause, as it was: after `import streamlit`, a figure built by the library carries placeholder colours (the
    app now makes kvviz's template the default, pages/common.py: theme.use(); a process that imports the pages has
    it already, so Streamlit's default is set here again)."""
    monkeypatch.setattr(pio.templates, "default", "streamlit")
    built = "".join(pio.to_json(f) for f in main_figures(split_result))
    assert "#000001" in placeholders(built) and "#000011" in placeholders(built)


def test_html_report_written_in_the_app_process_has_kvviz_colours(split_result, monkeypatch):
    monkeypatch.setattr(pio.templates, "default", "streamlit")  # a figure built with Streamlit's placeholders
    page = html_report(split_result)
    assert placeholders(page) == []
    assert PLOTLY_BLUE in page and VIRIDIS_LOW in page.lower()
    # the page's own figures are left as the app draws them (Streamlit's frontend fills in its theme there)
    fig = main_figures(split_result)[1]
    standalone_figure(fig)
    assert fig.layout.template.layout.colorway[0] == "#000001"


def test_a_written_figure_takes_kvviz_template_not_a_merge(monkeypatch):
    monkeypatch.setattr(pio.templates, "default", "streamlit")
    fig = go.Figure(go.Scatter(y=[1, 3, 2]))
    assert fig.layout.template.layout.colorway[0] == "#000001"
    out = standalone_figure(fig)
    assert out.layout.template == pio.templates["kvviz"] and placeholders(out.to_json()) == []
    assert "#000001" not in figure_html(fig, include_plotlyjs=False)


def test_a_colour_taken_from_the_apps_template_is_refused():
    """A colour copied from the app's template into a trace would still draw black: refused, not written."""
    fig = go.Figure(go.Scatter(y=[1, 2], line=dict(color=pio.templates["streamlit"].layout.colorway[0])))
    with pytest.raises(ValueError, match="#000001"):
        standalone_figure(fig)
    ok = go.Figure(go.Scatter(y=[1, 2], line=dict(color="#000000")))  # plain black, chosen: kept
    assert standalone_figure(ok).data[0].line.color == "#000000"


def test_the_meeting_bundle_and_the_lesson_handout_keep_their_colours(split_result):
    from kvviz.teach import lesson
    from kvviz.teach.lesson_figures import handout_html
    from kvviz.teach.meeting import bundle

    meeting = bundle([("split", html_report(split_result))])
    assert placeholders(meeting) == [] and PLOTLY_BLUE in meeting
    handout = handout_html([lesson.step_float(), lesson.step_sums(n=200)])
    assert placeholders(handout) == [] and PLOTLY_BLUE in handout


@pytest.mark.app
def test_the_report_downloaded_from_a_page_has_no_placeholder_colour(monkeypatch):
    """The split page rendered by AppTest (its charts drawn with Streamlit's theme), then its Report (HTML) download
    made by the page's own callable (pages/exporting.py)."""
    from streamlit.elements.widgets import button
    from test_app import start

    written = {}
    real = button.marshall_file

    def capture(coordinates, data, proto, mimetype, file_name=None, **kw):
        if callable(data) and file_name and file_name.endswith(".html"):
            written[file_name] = data()
        return real(coordinates, data, proto, mimetype, file_name, **kw)

    monkeypatch.setattr(button, "marshall_file", capture)
    at = start("pages/split.py", model="tiny:llama")
    assert len(at.get("plotly_chart")) == 2 and pio.templates.default == "kvviz"  # the app's charts: kvviz's theme
    page = written["kvviz-split.html"]
    assert "Verdict:" in page and page.count('class="plotly-graph-div"') == 2
    assert placeholders(page) == [] and PLOTLY_BLUE in page and VIRIDIS_LOW in page.lower()


def _colour_counts(png: bytes) -> dict:
    """Pixels of a screenshot: near-black ones, and ones near kvviz's first two line colours."""
    import io

    from PIL import Image

    px = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3).astype(int)

    def near(hex_colour: str, tol: int = 40) -> int:
        rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
        return int((np.abs(px - rgb).max(axis=1) <= tol).sum())

    return {"black": int((px.max(axis=1) <= 40).sum()), "blue": near(PLOTLY_BLUE, 30), "red": near(PLOTLY_RED, 30),
            "total": len(px)}


@pytest.mark.browser
def test_an_exported_report_draws_coloured_lines_offline(split_result, tmp_path, artifacts):
    """The report opened from a file in headless Chromium with the network blocked: the layer-lines chart is drawn
    in kvviz's colours, not black. The same chart written without kvviz's template (as before the fix) is black -
    the pixel check tells them apart."""
    from browser import browser

    fixed = tmp_path / "report.html"
    fixed.write_text(html_report(split_result), encoding="utf-8")
    before = tmp_path / "placeholders.html"  # the layer lines drawn black on plotly's plain template, as the report
    # drew them before it carried kvviz's colours: the control that the pixel count tells black lines from coloured
    control = go.Figure(main_figures(split_result)[1])
    control.update_layout(template="none")
    control.update_traces(line_color="#000000", marker_color="#000000")
    before.write_text(pio.to_html(control, include_plotlyjs=True, full_html=True), encoding="utf-8")
    blocked = []
    with browser() as b:
        ctx = b.new_context(viewport={"width": 1200, "height": 900})
        ctx.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                  else (blocked.append(route.request.url), route.abort()))
        counts = {}
        for name, path, index in (("fixed", fixed, 1), ("before", before, 0)):
            page = ctx.new_page()
            page.goto(path.as_uri())
            page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot .scatterlayer path.js-line')"
                                   f".length > 0", timeout=60_000)
            chart = page.locator(".js-plotly-plot").nth(index)
            png = chart.screenshot()
            (artifacts / f"export-colours-{name}.png").write_bytes(png)
            counts[name] = _colour_counts(png)
            page.close()
        ctx.close()
    assert blocked == []  # the report needs nothing from the network: plotly.js is inlined
    fixed_c, before_c = counts["fixed"], counts["before"]
    assert fixed_c["blue"] > 300 and fixed_c["red"] > 100, fixed_c  # the worst line blue, the float64 rerun orange
    assert fixed_c["black"] < 0.002 * fixed_c["total"], fixed_c  # text is plotly's slate, not black
    assert before_c["black"] > 300 and before_c["blue"] == 0, before_c  # black lines are counted as black
