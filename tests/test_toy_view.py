"""A new view is one folder implementing the protocol plus one registry line (issue 40): a toy view, written here
into a temporary package, gets its CLI subcommand (one option per config field), its page (the generic pages/view.py:
the config's fields as controls), JSON export and reopen (`kvviz open`), HTML report, memory plan and a meeting
scenario — with no other edit to kvviz, pages/ or app.py."""
import json
import sys
import textwrap

import pytest
from streamlit.testing.v1 import AppTest

from kvviz import views

from conftest import ROOT

TOY = {
    "__init__.py": '''
        """Toy: the last position's logits, one full forward against the prefix cached and the rest fed through
        the cache."""
        from kvviz.teach.presets import Preset
        from kvviz.views import MemoryProfile, Page, View

        from . import report, run

        VIEW = View("toy", "Toy gap", "ToyResult", report.reopen, report.figures, report.verdict,
                    tables=report.tables, config=run.ToyConfig, run=run.run,
                    page=Page("toy", "Investigate", ":material/toys:", defaults={"split": 3}),
                    memory=MemoryProfile(reference=False),
                    scenarios=(Preset("toy_demo", "The toy's gap", "A toy scenario.", "pages/toy.py", "tiny:llama",
                                      "bfloat16", {"toy_prompt": "Once upon a time there", "toy_split": 2,
                                                   "toy_mode": "step"}),))
    ''',
    "run.py": '''
        from __future__ import annotations

        from dataclasses import asdict, dataclass
        from typing import Literal

        import torch

        from kvviz.models.compat import output_cache
        from kvviz.core.errors import KvvizError
        from kvviz.core.execution import Executor
        from kvviz.core.inputs import encode
        from kvviz.core.protocol import DEFAULT_CONTEXT


        @dataclass(frozen=True)
        class ToyConfig:
            """Each position after the split: max |logits| gap, cached against full."""
            prompt: str = "The capital of France is"
            split: int = 2
            mode: Literal["chunk", "step"] = "chunk"
            scale: float = 1.0
            absolute: bool = True

            def validate(self) -> "ToyConfig":
                if not 1 <= self.split:
                    raise KvvizError(f"the split must be 1 or more, not {self.split}")
                return self


        @dataclass
        class ToyResult:
            split: int
            mode: str
            gaps: list
            verdict: str
            explanation: str

            def to_dict(self) -> dict:
                return asdict(self)


        def run(lm, config: ToyConfig, ctx=DEFAULT_CONTEXT) -> ToyResult:
            ids = torch.tensor([encode(lm, config.prompt)])
            if config.split >= ids.shape[1]:
                raise KvvizError(f"the split must be below the prompt's {ids.shape[1]} tokens")
            with ctx.running() as report:
                ex = Executor(lm, ctx.settings)
                with ex.session():
                    full = ex.forward(ids, hidden=False).logits[0, config.split:].double()
                    report(0.4, "full forward done")
                    cache = output_cache(ex.forward(ids[:, :config.split], hidden=False))
                    rest = ids[:, config.split:]
                    steps = [rest] if config.mode == "chunk" else list(rest.split(1, dim=1))
                    rows = []
                    for part in steps:
                        out = ex.forward(part, cache=cache, hidden=False)
                        cache = output_cache(out)
                        rows.append(out.logits[0].double())
                    cached = torch.cat(rows)
            gaps = ((cached - full).abs().amax(-1) * config.scale).tolist()
            verdict = "identical" if max(gaps) == 0 else "precision"
            return ToyResult(config.split, config.mode, gaps, verdict,
                             f"largest gap {max(gaps):.3g} over {len(gaps)} positions")
    ''',
    "report.py": '''
        import pandas as pd
        import plotly.graph_objects as go

        from .run import ToyResult


        def reopen(d: dict) -> ToyResult:
            return ToyResult(**d)


        def verdict(res):
            return res.verdict, res.explanation


        def figures(res):
            return [go.Figure(go.Bar(y=res.gaps, name="toy-gap-bars"))]


        def tables(res):
            return [pd.DataFrame({"position": range(res.split, res.split + len(res.gaps)), "gap": res.gaps})]
    ''',
}


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy view's folder in a temporary package, and its one registry line; the registry, and the page modules
    that read it at import, restored afterwards."""
    pkg = tmp_path / "kvviz_toy_pkg" / "toy"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    for name, text in TOY.items():
        (pkg / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    views.all_views()  # the real views first, then the toy's registry line
    monkeypatch.setattr(views, "_VIEWS", dict(views._VIEWS))
    monkeypatch.setattr(views, "_LOADED", list(views._LOADED))
    monkeypatch.setattr(views, "VIEW_FOLDERS", views.VIEW_FOLDERS + ["kvviz_toy_pkg.toy"])  # the one line
    for mod in [m for m in sys.modules if m == "pages" or m.startswith("pages.")]:
        monkeypatch.delitem(sys.modules, mod)  # pages read the registry when imported
    return views.get("toy")


def tokens(text: str) -> int:
    from kvviz.core.inputs import encode
    from kvviz.models.loading import load_model

    return len(encode(load_model("tiny:llama", "float32", "cpu"), text))


def cli(capsys, *argv):
    from kvviz.cli import main

    try:
        rc = main(list(argv))
    except SystemExit as e:  # an argument error: argparse exits
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_toy_view_gets_a_subcommand_export_reopen_html_and_plan(toy, tmp_path, capsys):
    from kvviz.io.export import open_result

    assert toy.command == "toy"
    j, h = tmp_path / "toy.json", tmp_path / "toy.html"
    rc, out, err = cli(capsys, "toy", "--model", "tiny:llama", "--dtype", "bfloat16", "--prompt",
                       "Once upon a time there was a", "--split", "3", "--mode", "step", "--scale", "2",
                       "--no-absolute", "--json-out", str(j), "--html", str(h), "--quiet")
    assert rc == 0, err
    assert out.startswith("verdict: ") and "positions" in out
    doc = json.loads(j.read_text())
    assert doc["kvviz_result"]["view"] == "toy" and doc["split"] == 3 and doc["mode"] == "step"
    assert "memory_plan" in doc  # the plan rides on the export
    opened = open_result(j.read_bytes())
    assert type(opened.result).__name__ == "ToyResult" and opened.result.gaps == doc["gaps"]
    assert "toy-gap-bars" in h.read_text() and "plotly" in h.read_text()
    rc, out, _ = cli(capsys, "open", str(j))
    assert rc == 0 and out.startswith("a Toy gap result — verdict: ")
    # the memory plan, before anything loads
    rc, out, _ = cli(capsys, "toy", "--model", "tiny:llama", "--plan")
    assert rc == 0 and ("GiB" in out or "MiB" in out), out
    # a bad value: one line, before anything runs
    rc, _, err = cli(capsys, "toy", "--model", "tiny:llama", "--mode", "sideways")
    assert rc == 2 and "invalid choice: 'sideways'" in err and len(err.strip().splitlines()) == 1
    rc, _, err = cli(capsys, "toy", "--model", "tiny:llama", "--split", "0", "--quiet")
    assert rc == 1 and err.strip() == "kvviz: error: the split must be 1 or more, not 0"
    # the docs' flag list comes from the parsers: the toy's options are in it
    from kvviz.cli import build_parser

    toy_parser = build_parser()._subparsers._group_actions[0].choices["toy"]
    flags = {s for a in toy_parser._actions for s in a.option_strings}
    assert {"--prompt", "--split", "--mode", "--scale", "--absolute", "--no-absolute", "--json-out", "--plan"} <= flags


def test_the_toy_view_gets_a_meeting_scenario(toy, tmp_path):
    from kvviz.teach.meeting import prepare, prepared

    paths = prepare(["toy_demo"], tmp_path / "meeting")
    doc = json.loads(paths[0].read_text())
    assert doc["kvviz_result"]["view"] == "toy" and doc["scenario"]["key"] == "toy_demo"
    assert doc["split"] == 2 and doc["mode"] == "step"  # the preset's controls
    assert len(doc["gaps"]) == tokens("Once upon a time there") - 2
    assert "toy-gap-bars" in (tmp_path / "meeting" / "meeting.html").read_text()
    assert [t for t, _ in prepared(tmp_path / "meeting")] == ["The toy's gap"]


def test_the_toy_view_gets_a_page_whose_controls_run_it(toy):
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    at.session_state["model_preset"] = "tiny:llama"
    at.run()
    assert not at.exception, at.exception
    at.switch_page("pages/view.py").run()  # the toy's page: the generic one, at the toy's URL
    assert not at.exception, at.exception
    assert at.title[0].value == "Toy gap"
    assert at.text_area(key="toy_prompt").value == "The capital of France is"
    assert at.number_input(key="toy_split").value == 3  # the Page's defaults over the config's
    verdict = [e.value for e in list(at.info) + list(at.success) if "Verdict:" in e.value]
    assert verdict and "over " in verdict[0], [e.value for e in at.info]
    first = at.dataframe[0].value
    assert list(first["position"])[0] == 3
    # every control, pressed: the run follows each
    at.number_input(key="toy_split").set_value(2).run()
    at.radio(key="toy_mode").set_value("step").run()
    at.number_input(key="toy_scale").set_value(0.5).run()
    at.checkbox(key="toy_absolute").uncheck().run()
    at.text_area(key="toy_prompt").input("Once upon a time there was").run()
    assert not at.exception, at.exception
    table = at.dataframe[0].value
    assert list(table["position"])[0] == 2 and len(table) == tokens("Once upon a time there was") - 2
    assert [b.label for b in at.get("download_button")][:2] == ["Result (JSON)", "Report (HTML)"]
    # a bad value: one line on the page, no traceback
    at.number_input(key="toy_split").set_value(0).run()
    assert not at.exception and any("the split must be 1 or more" in e.value for e in at.error)


def test_the_generic_page_for_a_newcomer(toy):
    """What a browser showed on the generic page (H3): its controls collapsed as on every page that runs when it
    opens (five fields pushed the verdict and the chart below the first screen), each with help naming its CLI option
    and default; in presenter mode the verdict's headline is the view's own sentence (the library's headline claimed
    "the gap closes in float64", a check this page never runs) and a figure keeps room for its y ticks (presenter
    mode's 15 px text clipped "400n" to "00n")."""
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    at.session_state["model_preset"] = "tiny:llama"
    at.session_state["presenter"] = True
    at.run()
    at.switch_page("pages/view.py").run()
    assert not at.exception, at.exception
    assert [e.proto.expanded for e in at.expander if e.label.startswith("Settings")] == [False]
    split = at.number_input(key="toy_split")
    assert split.label == "Split" and split.help == "The CLI's `kvviz toy --split`; default: `2`."
    assert at.radio(key="toy_mode").help == "The CLI's `kvviz toy --mode`; default: `chunk`."
    boxes = [e.value for e in list(at.info) + list(at.success) + list(at.error) if "Verdict:" in e.value]
    n = tokens("The capital of France is") - 3
    assert len(boxes) == 1 and boxes[0].startswith("**Verdict: precision.** largest gap "), boxes
    assert boxes[0].endswith(f" over {n} positions.") and "float64" not in boxes[0]
    fig = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert fig["layout"]["margin"]["l"] >= 56 and fig["layout"]["yaxis"]["automargin"] is True
    # normal mode: the whole explanation, the figure's own margins
    at.session_state["presenter"] = False
    at.run()
    assert not at.exception, at.exception
    assert any(e.value.startswith("**Verdict: precision.** largest gap ") for e in at.info)
    assert "l" not in json.loads(at.get("plotly_chart")[0].proto.spec)["layout"].get("margin", {})


def test_reset_to_defaults_on_the_generic_page(toy):
    """Reset to defaults brings the controls back to the page's defaults, as shown and as run (in a browser, the
    controls kept the values they had while the run took the defaults: the widgets were drawn with `value=`)."""
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    at.session_state["model_preset"] = "tiny:llama"
    at.run()
    at.switch_page("pages/view.py").run()
    at.number_input(key="toy_split").set_value(2).run()
    at.radio(key="toy_mode").set_value("step").run()
    assert list(at.dataframe[0].value["position"])[0] == 2
    at.button(key="_reset_toy").click().run()
    assert not at.exception, at.exception
    assert at.number_input(key="toy_split").value == 3 and at.radio(key="toy_mode").value == "chunk"
    assert list(at.dataframe[0].value["position"])[0] == 3


@pytest.mark.browser
def test_reset_to_defaults_on_the_generic_page_in_a_browser(tmp_path):
    """The toy's page in Chromium (a server of its own: the toy's registry line in its process): after two controls
    are changed, Reset to defaults shows the defaults again - in the browser the controls had kept their old values
    (AppTest, without a frontend, never showed it)."""
    from browser import browser, click_until, streamlit_server, view_launcher, wait_idle

    pkg = tmp_path / "kvviz_toy_pkg" / "toy"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    for name, text in TOY.items():
        (pkg / name).write_text(textwrap.dedent(text))
    (tmp_path / "pages").symlink_to(ROOT / "pages")  # the app's pages, beside the launcher (st.Page paths)
    with streamlit_server(script=view_launcher(tmp_path, "kvviz_toy_pkg.toy"), log_path=tmp_path / "server.log") \
            as (url, _):
        with browser() as b:
            page = b.new_page(viewport={"width": 1280, "height": 720})
            page.goto(url)  # a fresh server's first visit runs Streamlit's plain pages/ app: the toy's URL waits
            page.get_by_text("About kvviz").first.wait_for(timeout=60_000)
            page.goto(url + '/toy?model_preset="tiny:llama"')
            page.get_by_text("Verdict:").first.wait_for(timeout=60_000)
            wait_idle(page)
            page.get_by_text("Settings: prompt and controls").click()
            split = page.get_by_role("spinbutton", name="Split")
            split.fill("2")
            split.press("Enter")
            over = page.get_by_text(f"over {tokens('The capital of France is') - 2} positions")
            over.first.wait_for(timeout=120_000)  # the run with split 2 (a wait on what it shows, not on idle)
            wait_idle(page)
            step = page.locator('[data-testid="stRadio"] label', has_text="step")
            click_until(page, step, lambda: step.locator("input").is_checked())
            wait_idle(page)
            assert over.count()
            click_until(page, page.get_by_role("button", name="Reset to defaults"),
                        lambda: split.input_value() == "3")
            wait_idle(page)
            assert split.input_value() == "3"
            assert page.locator('[data-testid="stRadio"] label', has_text="chunk").locator("input").is_checked()
            assert page.get_by_text(f"over {tokens('The capital of France is') - 3} positions").count()
    assert "Traceback" not in (tmp_path / "server.log").read_text()
