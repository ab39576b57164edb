"""The serving sweep (issue 41 item 4): requests in flight × prompt length, each cell judged by the serving study."""
from __future__ import annotations

import json

import pytest

import kvviz

from conftest import needs_engine
from kvviz.core.errors import KvvizError
from kvviz.views.serving.sweep import (VERDICT_COLOURS, SweepConfig, SweepResult, build_prompts, cell_of, figure,
                                       run_sweep, summary_text)
from kvviz.views.serving.run import ConditionStats, PromptResult, ServeResult, ServeSettings


def _prompt(i, alone, batch, ref, verdict=None, margin=None):
    from kvviz.core.metrics import first_divergence

    runs = [x for x in alone + batch]
    ds = [d for d in (first_divergence(ref, x) for x in runs) if d is not None]
    return PromptResult(index=i, prompt=f"p{i}", reference=ref, reference_text="", reference_margins=[0.5] * len(ref),
                        completions={"alone": alone, "batch": batch}, texts={}, distinct={},
                        distinct_all=len({tuple(ref)} | {tuple(x) for x in runs}),
                        first_divergence=min(ds) if ds else None, margin=margin if ds else None, verdict=verdict)


def _result(prompts):
    return ServeResult(settings=ServeSettings(conditions=("alone", "batch")), model={}, engine={"name": "fake"},
                       prompts=prompts, notes=[], elapsed_s=1.0,
                       conditions={"alone": ConditionStats("alone", "", 1, 30, 1.0, 0),
                                   "batch": ConditionStats("batch", "", 1, 30, 2.0, 0)})


def test_cell_counts_parting_from_alone_and_the_verdict():
    ref = [1, 2, 3]
    ps = [_prompt(0, [[1, 2, 3]], [[1, 2, 3]], ref),  # identical everywhere
          _prompt(1, [[1, 2, 3]], [[1, 2, 9]], ref, verdict="precision", margin=0.01),  # batch parts at step 2
          _prompt(2, [[1, 7, 7]], [[1, 7, 7]], ref, verdict="precision", margin=0.02)]  # alone parts too, batch same
    cell = cell_of(_result(ps), 4, 16, 3.0, [16, 16, 17])
    assert cell.parting_alone == pytest.approx(1 / 3)  # only prompt 1's batched output differs from its alone run
    assert cell.parting_reference == pytest.approx(2 / 3)
    assert cell.first_divergence == 1 and cell.margin == 0.02  # prompt 2 parts first (step 1)
    assert cell.distinct == [1, 2, 2] and cell.verdict == "precision"
    assert cell.verdicts == {"identical": 1, "precision": 2}
    assert cell.tokens_per_s == pytest.approx(60 / 3.0)
    ps[1].verdict = "logic"
    assert cell_of(_result(ps), 4, 16, 3.0, [16] * 3).verdict == "logic"
    same = cell_of(_result([ps[0]]), 4, 16, 1.0, [16])
    assert same.verdict == "identical" and same.parting_alone == 0 and same.first_divergence is None


def test_figure_colours_by_verdict_and_json_round_trip():
    ref = [1, 2, 3]
    a = cell_of(_result([_prompt(0, [ref], [ref], ref)]), 1, 16, 1.0, [16])
    b = cell_of(_result([_prompt(0, [ref], [[1, 2, 9]], ref, verdict="logic", margin=0.3)]), 4, 16, 1.0, [16])
    res = SweepResult(config={"engine": "fake"}, model={}, engine={"name": "fake"}, cells=[a, b], skipped=[[1, 64]])
    again = SweepResult.from_dict(json.loads(json.dumps(res.to_dict())))
    assert again.to_dict() == res.to_dict()
    fig = figure(again)
    hm = fig.data[0]
    order = list(VERDICT_COLOURS)
    assert list(hm.x) == ["1", "4"] and list(hm.y) == ["16", "64"]
    assert [list(r) for r in hm.z] == [[order.index("identical"), order.index("logic")],
                                       [order.index("not run"), order.index("not run")]]
    assert hm.text[0][1] == "100% part<br>step 2" and hm.text[0][0] == "0% part" and hm.text[1][0] == "not run"
    colours = {c for _, c in hm.colorscale}
    assert colours == set(VERDICT_COLOURS.values())


def test_prompts_are_deterministic_and_of_the_asked_length():
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    a = build_prompts(lm, "The quick brown fox jumps over the lazy dog. " * 3, 64, 4)
    assert a == build_prompts(lm, "The quick brown fox jumps over the lazy dog. " * 3, 64, 4)
    assert len(a) == 4 and len(set(a)) == 4
    from kvviz.core.inputs import encode

    assert all(abs(len(encode(lm, p)) - 64) <= 1 for p in a)


def test_bad_grid_one_line_and_budget_stops_between_cells():
    with pytest.raises(KvvizError, match="concurrency must be whole numbers"):
        SweepConfig(concurrency=(0, 4)).validate()
    with pytest.raises(KvvizError, match="time budget"):
        SweepConfig(budget_s=0).validate()
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    res = run_sweep(lm, SweepConfig(concurrency=(1, 2), lengths=(16, 32), prompts_per_cell=2, max_new_tokens=3,
                                    engine="transformers", budget_s=1e-9))
    # the budget is checked before each cell: the first runs, the rest are listed as not run
    assert len(res.cells) == 1 and res.skipped == [[2, 16], [1, 32], [2, 32]]
    c = res.cells[0]
    assert c.concurrency == 1 and c.length == 16 and c.parting_alone is None and len(c.distinct) == 2
    assert "not run (time budget)" in summary_text(res)


def _stalling_study(monkeypatch, stall: dict):
    """The sweep's study (kvviz.views.serving.run.study), except for the cells in `stall` (c, length) -> how they end: "hang" waits at kvviz's
    checkpoints for ever (as a worker that gives no answer: only a limit or Stop ends it), a string raises that
    line as the engine's KvvizError (as a worker past its own limit does)."""
    import time as time_

    from kvviz.core import cancel
    from kvviz.views.serving import run as study_mod

    real, calls = study_mod.study, []

    def study(lm, scfg, *a, **k):
        n = int(scfg.prompt_source.split(":")[1])
        c = max(scfg.batch_size, 2) if "batch" in scfg.conditions else 1
        calls.append((c, n))
        how = stall.get((c, n))
        if how == "hang":
            while True:
                cancel.check("a cell that hangs")
                time_.sleep(0.01)
        if how:
            raise KvvizError(how)
        return real(lm, scfg, *a, **k)

    monkeypatch.setattr(study_mod, "study", study)
    return calls


def test_a_cell_that_fails_or_passes_the_cell_limit_is_not_finished_and_the_others_are_kept(monkeypatch):
    """The sweep went on after one cell's engine call passed the worker's limit (llama.cpp, 32 in flight × 1024
    tokens), losing every finished cell. Now: that cell is listed as not finished with its line, the cells at least
    as large are not run, the smaller ones run, and the engine starts again for the next cell."""
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    calls = _stalling_study(monkeypatch, {(2, 12): "hang",
                                          (1, 16): "the llama.cpp worker gave no answer to 'generate' within 900 s"})
    # 5 s: the real tiny cells finish well within it, also on a loaded machine (0.5 s did not, under load 10)
    res = run_sweep(lm, SweepConfig(concurrency=(1, 2, 4), lengths=(8, 12, 16), prompts_per_cell=2,
                                    max_new_tokens=2, engine="transformers", cell_limit_s=5))
    assert calls == [(1, 8), (2, 8), (4, 8), (1, 12), (2, 12), (1, 16)]  # 4 × 12, 2 × 16, 4 × 16 not run
    assert [(c.concurrency, c.length) for c in res.cells] == [(1, 8), (2, 8), (4, 8), (1, 12)]
    assert [u[:2] for u in res.unfinished] == [[2, 12], [4, 12], [1, 16], [2, 16], [4, 16]]
    reasons = [u[2] for u in res.unfinished]
    assert reasons[0].startswith("passed the cell limit (5 s) after ") and reasons[0].endswith(" s")
    assert reasons[1] == "not run: the 2 in flight × 12 tokens cell did not finish"
    assert reasons[2].startswith("the llama.cpp worker gave no answer to 'generate' within 900 s after ")
    assert reasons[3] == reasons[4] == reasons[1]  # 2 × 16 and 4 × 16 are at least as large as 2 × 12
    assert "2 cell(s) did not finish and 3 at least as large were not run" in " ".join(res.notes)
    assert res.config["cell_limit_s"] == 5 and not res.skipped
    # every view of it names them
    order = list(VERDICT_COLOURS)
    assert [list(r) for r in figure(res).data[0].z] == [[order.index(c.verdict) for c in res.cells[:3]],
                                                        [order.index(res.cells[3].verdict)] +
                                                        [order.index("not finished")] * 2,
                                                        [order.index("not finished")] * 3]
    assert figure(res).data[0].text[2][0] == "not finished"
    assert f"        2     12   not finished: {reasons[0]}" in summary_text(res)
    from kvviz.views.serving.sweep import frame, verdict

    table = frame(res)
    assert list(table["verdict"][4:]) == [f"not finished: {r}" for r in reasons] and table.iloc[5]["s"] == "—"
    assert "4 cell(s) of 2 prompts" in verdict(res)[1] and "5 not finished (the engine failed" in verdict(res)[1]
    again = SweepResult.from_dict(json.loads(json.dumps(res.to_dict())))
    assert again.unfinished == res.unfinished and again.to_dict() == json.loads(json.dumps(res.to_dict()))


def test_a_sweep_with_no_cell_finished_is_one_line_and_stop_inside_a_limited_cell_stops_the_sweep(monkeypatch):
    from kvviz.core import cancel
    from kvviz.core.protocol import RunContext
    from kvviz.views.serving.sweep import run

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    _stalling_study(monkeypatch, {(1, 8): "hang"})
    with pytest.raises(KvvizError) as e:
        run_sweep(lm, SweepConfig(concurrency=(1, 2), lengths=(8,), prompts_per_cell=2, max_new_tokens=2,
                                  engine="transformers", cell_limit_s=0.3))
    assert str(e.value).startswith("no cell of the sweep finished: the first (1 in flight × 8 tokens) passed the "
                                   "cell limit (0.3 s) after ")
    # Stop while a limited cell hangs: the run stops (Cancelled), it is not a cell that did not finish
    token = cancel.Token()
    threading_timer = __import__("threading").Timer(0.3, token.cancel, ("stopped by the test",))
    threading_timer.start()
    with pytest.raises(cancel.Cancelled, match="stopped by the test"):
        run(lm, SweepConfig(concurrency=(1, 2), lengths=(8,), prompts_per_cell=2, max_new_tokens=2,
                            engine="transformers", cell_limit_s=60), RunContext(token=token))
    with pytest.raises(KvvizError, match="the cell limit must be a positive number of seconds, not 0"):
        SweepConfig(cell_limit_s=0).validate()
    # the real run (no stand-in study): a 1 ms limit stops the first cell inside its reference decode; the model is
    # free again after it (its lock released, its settings restored): the same grid without the limit runs
    monkeypatch.undo()
    with pytest.raises(KvvizError, match=r"^no cell of the sweep finished: the first \(1 in flight × 8 tokens\) "
                                         r"passed the cell limit \(0.001 s\) after "):
        run_sweep(lm, SweepConfig(concurrency=(1,), lengths=(8,), prompts_per_cell=1, max_new_tokens=2,
                                  engine="transformers", cell_limit_s=0.001))
    res = run_sweep(lm, SweepConfig(concurrency=(1,), lengths=(8,), prompts_per_cell=1, max_new_tokens=2,
                                    engine="transformers"))
    assert len(res.cells) == 1 and not res.unfinished


@pytest.mark.slow
@needs_engine("vllm")
def test_vllm_small_grid_default_model_bfloat16():
    lm = kvviz.load_model("default", "bfloat16", "cpu")
    res = run_sweep(lm, SweepConfig(concurrency=(1, 4), lengths=(16, 64), prompts_per_cell=3, max_new_tokens=8,
                                    engine="vllm"))
    assert res.engine["name"] == "vllm" and not res.skipped
    assert [(c.concurrency, c.length) for c in res.cells] == [(1, 16), (4, 16), (1, 64), (4, 64)]
    for c in res.cells:
        assert len(c.distinct) == 3 and all(1 <= d <= 3 for d in c.distinct)  # reference, alone, batch
        assert all(abs(n - c.length) <= 1 for n in c.prompt_tokens)
        assert c.verdict in ("identical", "precision", "logic") and c.tokens_per_s > 0
        assert (c.parting_alone is None) == (c.concurrency == 1)
        assert sum(c.verdicts.values()) == 3


# --- the sweep as every view has it: reopen, HTML, CLI `open`, the Serving page's section, Stop (issue 41 item 6) ---

def _grid() -> SweepResult:
    """Three cells and one left out: 1 × 16 identical, 4 × 16 one of two prompts parts in the batch (precision,
    step 2, margin 0.004), 1 × 64 a logic parting from the reference (alone too), 4 × 64 not run."""
    ref = [1, 2, 3]
    a = cell_of(_result([_prompt(0, [ref], [ref], ref)]), 1, 16, 1.0, [16])
    b = cell_of(_result([_prompt(0, [ref], [[1, 2, 9]], ref, verdict="precision", margin=0.004),
                         _prompt(1, [ref], [ref], ref)]), 4, 16, 2.0, [16, 17])
    c = cell_of(_result([_prompt(0, [[1, 7, 7]], [[1, 7, 7]], ref, verdict="logic", margin=0.3)]), 1, 64, 1.0, [64])
    config = {"engine": "vllm", "dtype": "bfloat16", "device": "cpu", "concurrency": [1, 4], "lengths": [16, 64],
              "prompts_per_cell": 2, "max_new_tokens": 3, "runs": 1, "seed": 0, "budget_s": 5.0, "server": None}
    return SweepResult(config=config, model={"spec": "default", "description": "SmolLM2-135M"},
                       engine={"name": "vllm", "version": "0.0-test"}, cells=[a, b, c], skipped=[[4, 64]],
                       elapsed_s=4.0, notes=["the time budget (5 s) ran out: 1 cells not run"])


def test_the_sweep_reopens_from_its_json_export_through_the_registry():
    from kvviz import views
    from kvviz.io.export import export_json, open_result

    res = _grid()
    text = export_json(res)
    assert json.loads(text)["kvviz_result"]["view"] == "serving_sweep"
    opened = open_result(text)
    again = opened.result
    assert opened.view == "serving_sweep" and type(again) is SweepResult and again.to_dict() == res.to_dict()
    view = views.get(opened.view)
    figs, figs0 = view.main_figures(again), view.main_figures(res)
    assert len(figs) == 1 and [f.to_dict()["data"] for f in figs] == [f.to_dict()["data"] for f in figs0]
    order = list(VERDICT_COLOURS)
    assert [list(r) for r in figs[0].data[0].z] == [[order.index("identical"), order.index("precision")],
                                                    [order.index("logic"), order.index("not run")]]
    assert figs[0].data[0].text[0][1] == "50% part<br>step 2"
    assert view.verdict_text(again) == view.verdict_text(res)
    (table,), (table0,) = view.main_tables(again), view.main_tables(res)
    assert table.equals(table0) and len(table) == 4
    assert list(table["verdict"]) == ["identical", "precision", "logic", "not run (time budget)"]
    assert list(table["part from alone"][:3]) == ["0%", "50%", "0%"] and table["distinct per prompt"][1] == "2, 1"
    assert list(table.iloc[3]) == [4, 64, "not run (time budget)"] + ["—"] * 7  # not NaN


def test_the_sweep_verdict_names_where_batched_completions_first_part():
    from kvviz.views.serving.sweep import verdict

    res = _grid()
    v, text = verdict(res)
    assert v == "logic"
    assert "vllm 0.0-test, SmolLM2-135M in bfloat16: 3 cell(s) of 2 prompts (1, 4 in flight × 16, 64 tokens)" in text
    assert "1 not run (time budget)" in text
    assert ("first part from the same prompt alone at 4 in flight (16-token prompts: 50% of them, first divergence "
            "from the reference at step 2, its top-2 margin there 0.004)") in text
    assert "part from the float64 reference in 2 of 3 cells; beyond the engine's rounding (logic) at 1 × 64" in text
    res.cells = res.cells[:2]
    v, text = verdict(res)
    assert v == "precision" and "in 1 of 2 cells - each within the engine's rounding" in text
    res.cells = res.cells[:1]
    v, text = verdict(res)
    assert v == "identical" and "determinism did not end within this grid" in text


def test_the_sweeps_html_report_draws_the_heatmap_and_its_table():
    from kvviz.io.export import html_report

    page = html_report(_grid())
    assert '"type":"heatmap"' in page.replace(" ", "")
    assert "Where determinism ends: vllm, requests in flight" in page
    assert all(c in page for c in VERDICT_COLOURS.values())  # the verdicts' own colours, not a theme's
    assert "<b>Verdict: logic.</b>" in page and "part from alone" in page and "not run (time budget)" in page
    assert "<tr><th>engine</th><td>vllm</td></tr>" in page and "<tr><th>lengths</th><td>16, 64</td></tr>" in page


def test_cli_sweep_writes_json_and_html_and_open_reopens_it(tmp_path, capsys):
    from kvviz import views
    from kvviz.cli import main
    from kvviz.io.export import open_result

    out, page = tmp_path / "sweep.json", tmp_path / "sweep.html"
    assert main(["serving", "--sweep", "--model", "tiny:llama", "--engine", "transformers", "--concurrency", "1,2",
                 "--lengths", "8,12", "--limit", "2", "--runs", "1", "--max-new-tokens", "2", "--quiet",
                 "--json-out", str(out), "--html", str(page)]) == 0
    printed = capsys.readouterr().out
    assert "in flight length" in printed and "engine transformers" in printed
    d = json.loads(out.read_text())
    assert d["kvviz_result"]["view"] == "serving_sweep" and d["kvviz_result"]["model_fingerprint"]
    assert [(c["concurrency"], c["length"]) for c in d["cells"]] == [(1, 8), (2, 8), (1, 12), (2, 12)]
    assert '"type":"heatmap"' in page.read_text().replace(" ", "")
    res = open_result(out.read_bytes()).result
    verdict, text = views.get("serving_sweep").verdict_text(res)
    again = tmp_path / "again.html"
    assert main(["open", str(out), "--html", str(again)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"a Where determinism ends result — verdict: {verdict}\n{text}")
    assert "4 cell(s) of 2 prompts (1, 2 in flight × 8, 12 tokens)" in shown
    table = views.get("serving_sweep").main_tables(res)[0]
    assert table.to_string(index=False) in shown  # its cell table, as the page shows it
    assert "environment: the same as here" in shown
    assert '"type":"heatmap"' in again.read_text().replace(" ", "")  # the report, written again from the JSON
    assert main(["serving", "--sweep", "--model", "tiny:llama", "--engine", "transformers", "--repro", "r.py"]) == 2
    assert capsys.readouterr().err.strip() == ("kvviz: error: --repro does nothing for `serving --sweep` (no repro "
                                               "script rebuilds a sweep; it has its --json-out and --html exports); "
                                               "leave it out")


def test_a_stopped_sweep_stops_between_cells_and_closes_its_engine(monkeypatch):
    from kvviz.core import cancel
    from kvviz.engines import registry as engines
    from kvviz.core.protocol import RunContext
    from kvviz.views.serving.sweep import run

    made = []
    real = engines.open_engine

    def recording(*a, **k):
        made.append(real(*a, **k))
        closes = made[-1].close if hasattr(made[-1], "close") else (lambda: None)
        made[-1].closed = False

        def close():
            made[-1].closed = True
            closes()

        made[-1].close = close
        return made[-1]

    monkeypatch.setattr(engines, "open_engine", recording)
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    token, seen = cancel.Token(), []

    def progress(f, text):  # Stop pressed as the second cell starts
        seen.append(text)
        if text.startswith("cell 2/"):
            token.cancel("stopped by the test")

    with pytest.raises(cancel.Cancelled):
        run(lm, SweepConfig(concurrency=(1, 2), lengths=(8,), prompts_per_cell=2, max_new_tokens=2,
                            engine="transformers"), RunContext(progress=progress, token=token))
    assert [t.split(":")[0] for t in seen] == ["cell 1/2", "cell 2/2"]
    assert len(made) == 1 and made[0].closed


def _page(**state):
    from streamlit.testing.v1 import AppTest

    from conftest import ROOT

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)
    for k, v in {"serving_limit": 1, "serving_runs": 1, "serving_tokens": 2, **state}.items():
        at.session_state[k] = v
    at.run()
    at.switch_page("pages/serving.py")
    at.run()
    assert not at.exception, at.exception
    return at


@pytest.mark.app
def test_serving_page_sweep_section_runs_on_its_button_only():
    from kvviz.views.serving.sweep import verdict as sweep_verdict

    at = _page(model_preset="tiny:llama")
    charts = len(at.get("plotly_chart"))
    assert "_results_serving_sweep" not in at.session_state  # nothing swept on the first screen
    assert any("press **Run the sweep**: 12 cells of 4 prompts through transformers" in i.value for i in at.info)
    at.text_input(key="serving_sweep_concurrency").set_value("1,x").run()
    assert not at.exception and [e.value for e in at.error] == [
        "requests in flight and prompt lengths take comma-separated whole numbers, like 1,4,16"]
    at.text_input(key="serving_sweep_concurrency").set_value("2,1,2").run()
    at.text_input(key="serving_sweep_lengths").set_value("0").run()
    assert [e.value for e in at.error] == ["lengths must be whole numbers from 1 to 8192, not (0,)"]
    at.text_input(key="serving_sweep_lengths").set_value("8,12").run()
    at.number_input(key="serving_sweep_prompts").set_value(2).run()
    at.number_input(key="serving_sweep_budget").set_value(0.0).run()  # no budget: every cell
    at.number_input(key="serving_sweep_cell_limit").set_value(600.0).run()  # each cell stopped after 10 minutes
    assert not at.error and "_results_serving_sweep" not in at.session_state
    at.button(key="serving_sweep_run").click().run()
    assert not at.exception, at.exception
    (res,) = at.session_state["_results_serving_sweep"].values()
    assert [(c.concurrency, c.length) for c in res.cells] == [(1, 8), (2, 8), (1, 12), (2, 12)]
    assert res.config["prompts_per_cell"] == 2 and res.config["budget_s"] is None and not res.skipped
    assert res.config["cell_limit_s"] == 600.0 and not res.unfinished
    assert not any("Sweeping:" in i.value for i in at.info)  # the pointer to the progress bar is gone once done
    assert all(len(c.distinct) == 2 for c in res.cells)
    charts_now = at.get("plotly_chart")
    assert len(charts_now) == charts + 1
    assert '"type":"heatmap"' in charts_now[-1].proto.spec.replace(" ", "")
    assert len(at.dataframe) == 2  # the study's prompts and the sweep's cells
    v, text = sweep_verdict(res)
    assert any(m.value == f"**Verdict: {v}.** {text}" for m in [*at.success, *at.warning, *at.error])
    # a view-only rerun shows the stored sweep (no second run); a tiny budget leaves cells out, listed as not run
    at.run()
    assert len(at.session_state["_results_serving_sweep"]) == 1 and len(at.get("plotly_chart")) == charts + 1
    at.number_input(key="serving_sweep_budget").set_value(0.001).run()
    assert len(at.get("plotly_chart")) == charts  # a new grid waits for its button
    at.button(key="serving_sweep_run").click().run()
    assert not at.exception, at.exception
    new = [r for r in at.session_state["_results_serving_sweep"].values() if r.skipped]
    assert len(new) == 1 and len(new[0].cells) == 1 and len(new[0].skipped) == 3
    assert any("not run (time budget)" in str(df.value.values.tolist()) for df in at.dataframe)
    # a grid none of whose cells finishes within the cell limit: its one line, and no pointer to a sweep still running
    at.number_input(key="serving_sweep_cell_limit").set_value(0.001).run()
    at.button(key="serving_sweep_run").click().run()
    assert not at.exception, at.exception
    (line,) = [e.value for e in at.error if "no cell" in e.value]
    assert line.startswith("no cell of the sweep finished: the first (1 in flight × 8 tokens) passed the cell limit "
                           "(0.001 s) after ")
    assert not any("Sweeping:" in i.value for i in at.info)


@pytest.mark.slow
@needs_engine("vllm")
def test_vllm_sweep_stopped_mid_grid_kills_the_engine_process(monkeypatch):
    from conftest import record_worker_clients
    from kvviz.core import cancel
    from kvviz.core.protocol import RunContext
    from kvviz.views.serving.sweep import run

    clients = record_worker_clients(monkeypatch)
    lm = kvviz.load_model("default", "bfloat16", "cpu")
    token = cancel.Token()

    def progress(f, text):
        if text.startswith("cell 2/"):
            token.cancel("stopped by the test")

    with pytest.raises(cancel.Cancelled):
        run(lm, SweepConfig(concurrency=(1, 2), lengths=(16,), prompts_per_cell=2, max_new_tokens=2, engine="vllm"),
            RunContext(progress=progress, token=token))
    assert clients and all(c.proc.wait(timeout=30) is not None for c in clients)  # the worker (vLLM) has exited


@pytest.mark.app
@pytest.mark.slow
@needs_engine("vllm")
def test_serving_page_sweeps_a_tiny_grid_through_vllm():
    from kvviz.views.serving.sweep import verdict as sweep_verdict

    at = _page(model_preset="default", dtype="bfloat16", serving_engine="vllm", serving_conditions=["alone"],
               serving_sweep_concurrency="1,2", serving_sweep_lengths="16", serving_sweep_prompts=2)
    assert "_results_serving_sweep" not in at.session_state
    at.button(key="serving_sweep_run").click().run()
    assert not at.exception, at.exception
    (res,) = at.session_state["_results_serving_sweep"].values()
    assert res.engine["name"] == "vllm" and [(c.concurrency, c.length) for c in res.cells] == [(1, 16), (2, 16)]
    assert all(sum(c.verdicts.values()) == 2 and c.tokens_per_s > 0 for c in res.cells)
    v, text = sweep_verdict(res)
    assert any(m.value == f"**Verdict: {v}.** {text}" for m in [*at.success, *at.warning, *at.error])
    assert '"type":"heatmap"' in at.get("plotly_chart")[-1].proto.spec.replace(" ", "")


@pytest.mark.app
def test_open_result_page_shows_a_sweep(monkeypatch):
    from conftest import open_result_page
    from kvviz.io.export import export_json
    from kvviz.views.serving.sweep import verdict

    res = _grid()
    at = open_result_page(monkeypatch, export_json(res).encode(), "kvviz-serving_sweep.json")
    assert any(c.value == "A **serving_sweep** result of `default` in bfloat16 on cpu." for c in at.caption)
    (chart,) = at.get("plotly_chart")
    assert '"type":"heatmap"' in chart.proto.spec.replace(" ", "")
    (table,) = at.dataframe
    assert list(table.value["verdict"]) == ["identical", "precision", "logic", "not run (time budget)"]
    v, text = verdict(res)
    assert [e.value for e in at.error] == [f"**Verdict: {v}.** {text}"]  # logic: the error box


@pytest.mark.parametrize("argv, flag", [
    (["--sweep", "--prefix", "Q: "], "--prefix"), (["--sweep", "--prompt", "Hi"], "--prompt"),
    (["--sweep", "--conditions", "alone"], "--conditions"), (["--sweep", "--page-size", "16"], "--page-size"),
    (["--sweep", "--batch-size", "8"], "--batch-size"), (["--sweep", "--no-proof"], "--no-proof"),
    (["--sweep", "--tensor-parallel-size", "2"], "--tensor-parallel-size"),
    (["--concurrency", "1,2"], "--concurrency"), (["--lengths", "16"], "--lengths"), (["--budget", "5"], "--budget"),
    (["--cell-limit", "60"], "--cell-limit"),
])
def test_an_option_of_the_study_alone_or_the_sweep_alone_is_refused_with_the_other(argv, flag, capsys):
    """Never a flag accepted and ignored: the study's options with --sweep, the sweep's without it - one line, exit 2,
    before any model loads."""
    from kvviz.cli import main

    assert main(["serving", "--model", "tiny:llama", "--engine", "transformers", *argv]) == 2
    err = capsys.readouterr().err.strip()
    with_ = "with" if "--sweep" in argv else "without"
    assert err.startswith(f"kvviz: error: {flag} does nothing {with_} --sweep") and len(err.splitlines()) == 1


def test_the_cli_plans_the_sweep_as_the_sweep(capsys):
    """`serving --sweep --plan` is the sweep's plan (its view's profile, the longest prompt + new tokens, the largest
    batch where the engine's pages are in kvviz's process), as the Serving page plans it - not the study's."""
    from kvviz.cli import main

    base = ["serving", "--sweep", "--model", "tiny:llama", "--lengths", "16,512", "--concurrency", "1,4",
            "--max-new-tokens", "8", "--plan"]
    assert main([*base, "--engine", "transformers"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == ("memory plan: serving_sweep on tiny:llama, float32 on cpu, "
                                                       "520 tokens × batch 4")
    from kvviz.engines import engine_python

    if engine_python("vllm") is None:  # said in one line before any plan
        assert main([*base, "--engine", "vllm"]) == 1 and "vLLM is not installed here" in capsys.readouterr().err
        return
    assert main([*base, "--engine", "vllm"]) == 0  # vLLM's own process holds its batch: kvviz plans one prompt
    assert capsys.readouterr().out.splitlines()[0] == "memory plan: serving_sweep on tiny:llama, float32 on cpu, " \
                                                      "520 tokens"


def test_a_row_of_cells_computes_each_prompts_reference_once(monkeypatch):
    """The same prompts recur in every cell of a row (each concurrency): their no-cache reference decode is computed
    once for the grid, and the cells come out as when every cell computes its own."""
    from kvviz.views.serving import run as serving_run

    calls = []
    real = serving_run._reference

    def counting(ex, lm, text, n):
        calls.append((text, n))
        return real(ex, lm, text, n)

    monkeypatch.setattr(serving_run, "_reference", counting)
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    cfg = dict(concurrency=(1, 2, 3), lengths=(12, 20), prompts_per_cell=2, max_new_tokens=3, engine="transformers")
    shared = run_sweep(lm, SweepConfig(**cfg))
    assert len(calls) == 2 * 2 and len(set(calls)) == 4  # 2 rows x 2 prompts, not x 3 cells
    calls.clear()
    real_study = serving_run.study
    monkeypatch.setattr(serving_run, "study",
                        lambda *a, **k: real_study(*a, **{**k, "memo": None}))  # every cell on its own: no memo
    alone = run_sweep(lm, SweepConfig(**cfg))
    assert len(calls) == 2 * 2 * 3
    keep = ("concurrency", "length", "prompt_tokens", "distinct", "parting_alone", "parting_reference",
            "first_divergence", "margin", "verdict", "verdicts")
    assert [{k: getattr(c, k) for k in keep} for c in shared.cells] == \
        [{k: getattr(c, k) for k in keep} for c in alone.cells]


def test_vllm_starts_once_for_the_grid_with_room_for_its_largest_cell(monkeypatch):
    """A vLLM worker made for a sweep asks for max_num_seqs = the grid's largest concurrency on every run, so a
    cell with fewer requests in flight never restarts the engine (the start key stays the same)."""
    import types

    from kvviz.engines import workers

    from kvviz.engines.serving import vllm_available

    if vllm_available():  # vLLM importable in kvviz's own environment: the in-process engine runs instead
        pytest.skip("vLLM runs in this process here")
    eng = workers.VllmWorkerEngine.open(max_in_flight=16)  # as run_sweep makes it for a grid up to 16 in flight
    started = []
    monkeypatch.setattr(eng, "_start", lambda key, **kw: started.append((key, kw["max_num_seqs"])))
    monkeypatch.setattr(eng, "_generate", lambda groups: [len(g) for g, _ in groups])
    monkeypatch.setattr(workers, "check_vllm_dtype", lambda lm: None)
    lm = types.SimpleNamespace(source="/m", dtype=__import__("torch").bfloat16)
    from kvviz.engines.serving import Request

    reqs = [Request(key=f"r{i}", ids=[1, 2, 3], max_new_tokens=2) for i in range(4)]
    for in_flight in (1, 4, 16, 1):
        eng.generate(lm, reqs, max_in_flight=in_flight, prefix_sharing=False)
    assert {k for k, _ in started} == {started[0][0]} and {s for _, s in started} == {16}
    assert workers.VllmWorkerEngine(1).min_seqs == 1  # the study's engine: sized by each run, as before
