"""The generic page (pages/view.py) with the example view of docs/architecture.md (docs/example_view/next_token), added
to a server as a contributor adds it: its folder, its one registry line and its page file (the three lines of
docs/example_view/pages/next_token.py). In Chromium, a link to the view opened as a fresh server's very first request
draws the view (it answered "Page not found" and landed on Home: Streamlit looks a fresh server's first request up
among the pages/ file names before app.py runs); what the page says is written for users (the config's ABOUT and its
fields' help, not its developer docstring); its chart fits (test_text_fit.py's check, normal and presenter mode)."""
import contextlib
import json
import shutil
import sys

import pytest
from streamlit.testing.v1 import AppTest

from conftest import ROOT

EXAMPLE = ROOT / "docs" / "example_view"


def add_example(root, pages: bool = True) -> None:
    """Under `root`: the example view's folder as the package example_views.next_token and, with `pages`, a pages/
    folder holding the app's pages/ files (links) and the example's page file."""
    shutil.copytree(EXAMPLE / "next_token", root / "example_views" / "next_token")
    (root / "example_views" / "__init__.py").write_text("")
    if pages:
        (root / "pages").mkdir()
        for f in (ROOT / "pages").glob("*.py"):
            (root / "pages" / f.name).symlink_to(f)
        shutil.copy(EXAMPLE / "pages" / "next_token.py", root / "pages" / "next_token.py")


@contextlib.contextmanager
def example_server(tmp_path):
    """`streamlit run` of app.py with the example view's registry line, from `tmp_path` (whose pages/ is the app's
    plus the example's page file): (URL, log path)."""
    from browser import streamlit_server, view_launcher

    add_example(tmp_path)
    with streamlit_server(script=view_launcher(tmp_path, "example_views.next_token"),
                          log_path=tmp_path / "server.log") as (url, log_path):
        yield url, log_path


@pytest.fixture
def example_view(tmp_path, monkeypatch):
    """The example view registered in this process (its folder and one line), for AppTest; the registry and the page
    modules that read it at import restored afterwards."""
    from kvviz import views

    add_example(tmp_path, pages=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    views.all_views()
    monkeypatch.setattr(views, "_VIEWS", dict(views._VIEWS))
    monkeypatch.setattr(views, "_LOADED", list(views._LOADED))
    monkeypatch.setattr(views, "VIEW_FOLDERS", views.VIEW_FOLDERS + ["example_views.next_token"])
    for mod in [m for m in sys.modules if m == "pages" or m.startswith("pages.")]:
        monkeypatch.delitem(sys.modules, mod)  # pages read the registry when imported
    return views.get("next_token")


def test_the_example_page_speaks_to_users_and_its_chart_is_fitted(example_view):
    """Under the title, the config's ABOUT (what the view compares; the docstring, developer text, was shown there);
    the prompt's tooltip says what it does; the chart went through fit_text (its title wrapped and left-aligned)."""
    cls = example_view.config_type()
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    at.session_state["model_preset"] = "tiny:llama"
    at.run()
    at.switch_page("pages/view.py").run()
    assert not at.exception, at.exception
    assert at.title[0].value == "Next token"
    captions = [c.value for c in at.caption]
    assert cls.ABOUT in captions and not any(cls.__doc__.split(".")[0] in c for c in captions)
    assert "cache" in cls.ABOUT and "float64" in cls.ABOUT
    prompt = at.text_area(key="next_token_prompt")
    assert prompt.value == "The cat sat on the"
    assert prompt.help.startswith("The text the model reads. Its last token is the one fed through the cache")
    assert prompt.help.endswith("The CLI's `kvviz next-token --prompt`; default: `The cat sat on the`.")
    fig = json.loads(at.get("plotly_chart")[0].proto.spec)
    title = fig["layout"]["title"]
    assert title["xanchor"] == "left" and title["text"].startswith("Cached vs full forward: ")
    assert fig["layout"]["yaxis"]["title"]["text"] == "max |Δ logit|"
    verdict = [e.value for e in list(at.info) + list(at.success) if "Verdict:" in e.value]
    assert verdict and ("bit for bit" in verdict[0] or "no float64 reference" in verdict[0]), verdict


def test_every_page_of_the_app_has_its_file_for_a_fresh_servers_first_request():
    """Every view page the app serves has a file in pages/ named as its URL (its own page, or the generic page's
    three lines): without it, a link to the page opened as a fresh server's first request answered "Page not found"
    and landed on Home. (A view on the generic page without one still works from the app's second request on.)"""
    from kvviz import views

    pages = [v.page for v in views.all_views() if v.page is not None]
    assert len(pages) >= 12
    for p in pages:
        assert (ROOT / "pages" / f"{p.url_path}.py").is_file(), p.url_path


@pytest.mark.browser
def test_the_example_view_as_a_fresh_servers_first_request(tmp_path, artifacts):
    """The example view's link opened as the very first request of a fresh server draws the view - its title, its
    ABOUT, its verdict and its chart - at its own URL, with no "Page not found" (before its page file it landed on
    Home under that dialog); then its chart's text fits in normal and presenter mode (test_text_fit.py's check)."""
    from browser import browser, no_exception, text_fit_problems, wait_idle

    sys.path.insert(0, str(EXAMPLE))
    try:
        from next_token.run import NextTokenConfig
    finally:
        sys.path.remove(str(EXAMPLE))
    problems = {}
    with example_server(tmp_path) as (url, log), browser() as b:
        page = b.new_page(viewport={"width": 1280, "height": 720})
        page.goto(url + '/next_token?model_preset="tiny:llama"')  # the server's first request
        page.get_by_text("Verdict:").or_(page.get_by_text("Page not found")).first.wait_for(timeout=240_000)
        wait_idle(page)
        page.screenshot(path=str(artifacts / "view-page-first-request.png"))
        assert page.get_by_text("Page not found").count() == 0
        assert page.url.split("?")[0] == url + "/next_token"
        assert page.locator("h1", has_text="Next token").count() == 1
        assert page.get_by_text(NextTokenConfig.ABOUT[:60]).count() == 1
        assert page.get_by_text("About kvviz", exact=True).count() == 1  # the app's navigation, not Home's page
        assert page.get_by_text("why does the KV cache change my numbers").count() == 0  # not Home
        no_exception(page)
        found = text_fit_problems(page, artifacts / "text-fit-normal-next_token.png")
        if found:
            problems["normal"] = found
        page.goto(url + '/next_token?model_preset="tiny:llama"&presenter=true')
        page.get_by_text("Verdict:").first.wait_for(timeout=240_000)
        wait_idle(page)
        no_exception(page)
        found = text_fit_problems(page, artifacts / "text-fit-presenter-next_token.png")
        if found:
            problems["presenter"] = found
    assert not problems, problems
    assert "Traceback" not in log.read_text()
