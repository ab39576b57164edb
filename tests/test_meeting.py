"""Prepare the meeting: chosen scenarios run ahead into results Open a result shows at once, one HTML bundles them.
Every scenario of kvviz.teach.presets runs here (the sliding-window one in the heavy tier), each with the effect it
promises."""
import pytest

from kvviz.core.errors import KvvizError
from kvviz.io.export import open_result
from kvviz.teach.meeting import prepare, prepared
from kvviz.teach.presets import PRESETS



def test_prepared_scenarios_reopen_with_their_verdicts_and_one_report_bundles_them(tmp_path):
    paths = prepare(["padding", "newonly"], tmp_path)
    assert [p.name for p in paths] == ["padding.json", "newonly.json"]
    got = {title: open_result(path.read_bytes()) for title, path in prepared(tmp_path)}
    assert set(got) == {"Left padding without position ids", "A mask that covers only the new tokens"}
    assert all(o.view == "split" and o.result.verdict == "logic" for o in got.values())
    assert got["Left padding without position ids"].result.settings.left_pad == 4
    html = (tmp_path / "meeting.html").read_text()
    assert html.count("* plotly.js v") == 1  # inlined once for all reports
    assert html.count("<section") == 2 and "Verdict: logic" in html
    assert "Left padding without position ids" in html and "A mask that covers only the new tokens" in html


def _reopened(tmp_path, keys):
    prepare(keys, tmp_path)
    return {p.name.removesuffix(".json"): open_result(p.read_bytes()) for _, p in prepared(tmp_path)}


def _check_window(o):
    r = o.result
    assert o.view == "matrix"
    window = 8  # tiny:mistral's sliding window
    assert r.settings.max_new_tokens > window and len(r.settings.batch_with) == 1
    assert len(r.settings.batch_with[0]) > len(r.settings.prompt)
    assert {(c.attention, c.cache) for c in r.cells} == {(a, c) for a in ("eager", "sdpa") for c in ("dynamic", "static")}
    assert all(c.verdict in ("identical", "precision") and c.distinct_outputs == 1 for c in r.cells), r.cells


def test_every_scenario_but_the_window_prepares_with_its_effect(tmp_path):
    keys = [p.key for p in PRESETS if p.key != "window"]
    got = _reopened(tmp_path, keys)
    assert list(got) == keys and (tmp_path / "meeting.html").read_text().count("<section") == len(keys)
    tie = got["tie"].result  # greedy: bfloat16 ties and chooses "a", float64 chooses "b"
    assert got["tie"].view == "greedy"
    assert tie.paths["no_cache"].text == "aaaaaa" and tie.paths["float64"].text == "bbbbbb"
    pair = tie.pair("no_cache", "float64")
    assert pair.verdict == "precision" and pair.first_divergence == 0
    for key in ("padding", "newonly", "bidirectional"):
        assert got[key].view == "split" and got[key].result.verdict == "logic", key
    proof = got["proof"].result  # invariant mode: the cached run equals the full forward bit for bit
    assert proof.verdict == "identical" and proof.settings.execution.invariant
    layers = got["layers"].result  # dtypes: four dtypes over four built-in prompts, half cached, token by token
    assert got["layers"].view == "dtypes" and layers.dtypes == ["float64", "float32", "float16", "bfloat16"]
    assert len(layers.prompts) == 4 and set(layers.verdicts["float64"]) == {"reference"}
    assert (layers.settings.split, layers.settings.mode) == ("half", "step")
    for d in ("float32", "float16", "bfloat16"):  # whether rows round apart is the machine's kernels' business
        assert set(layers.verdicts[d]) <= {"identical", "precision"}, (d, layers.verdicts[d])


def test_the_layers_scenario_shows_a_16_bit_gap_where_rows_round_apart(tmp_path, row_count_rounding):
    """The card's promise: half cached, token by token, many 1-row products against the full forward's many-row
    ones; where a kernel's blocking depends on the number of rows (built here, the same on every machine) every
    16-bit dtype parts as precision on every prompt, and float64 closes it."""
    layers = _reopened(tmp_path, ["layers"])["layers"].result
    assert set(layers.verdicts["float64"]) == {"reference"}
    for d in ("float32", "float16", "bfloat16"):
        assert set(layers.verdicts[d]) == {"precision"}, (d, layers.verdicts[d])


@pytest.mark.heavy
def test_the_sliding_window_scenario_prepares(tmp_path):
    _check_window(_reopened(tmp_path, ["window"])["window"])


def test_an_unknown_scenario_is_one_clear_line(tmp_path):
    with pytest.raises(KvvizError, match="unknown scenario nope"):
        prepare(["nope"], tmp_path)


def test_the_guide_counts_its_reports():
    from conftest import ROOT

    guide = (ROOT / "docs" / "guide.md").read_text()
    rows = [line for line in guide.split("## The numbers")[0].splitlines() if line.startswith("| ")
            and not line.startswith("| report")]
    words = {5: "five", 6: "six", 7: "seven"}
    assert f"made from {words[len(rows)]} public reports" in guide, len(rows)


def _sections(html: str) -> dict[str, str]:
    """The bundle's sections: title -> body."""
    import re

    return dict(re.findall(r'<section id="s\d+"><h1>(.*?)</h1>(.*?)</section>', html, re.S))


def test_a_bundle_of_saved_runs_reopens_them_without_loading_a_model(tmp_path, monkeypatch):
    """The presenter's own runs, as saved JSON (a file and a text), bundled with no scenario: no model is loaded or
    run; each is its own section with its verdict and settings, kept in runs/ and listed by prepared()."""
    import kvviz
    from kvviz import views
    from kvviz.io.export import export_json
    from kvviz.models import loading
    from conftest import DEVICE, PROMPT

    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    res = kvviz.run_split(lm, kvviz.SplitConfig(PROMPT, 8, left_pad=2, position_ids="omit"))
    assert res.verdict == "logic"
    saved = tmp_path / "my-run.json"
    saved.write_text(export_json(res), encoding="utf-8")

    def refuse(*a, **k):
        raise AssertionError("a model was loaded or run for a saved result")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr(kvviz, "load_model", refuse)
    monkeypatch.setattr(views.View, "runner", refuse)
    out = tmp_path / "meeting"
    paths = prepare([], out, runs=[saved, saved.read_text(encoding="utf-8")])
    assert [p.relative_to(out).as_posix() for p in paths] == ["runs/1-split.json", "runs/2-split.json"]
    titles = ["Split point: tiny:llama — logic", "Split point: tiny:llama — logic (2)"]
    assert [t for t, _ in prepared(out)] == titles
    again = open_result(prepared(out)[0][1].read_bytes()).result
    assert (again.settings.model, again.settings.left_pad, again.settings.position_ids) == ("tiny:llama", 2, "omit")
    html = (out / "meeting.html").read_text(encoding="utf-8")
    sections = _sections(html)
    assert list(sections) == titles and html.count("* plotly.js v") == 1
    body = sections[titles[0]]
    assert "Verdict: logic." in body and "reopened from its saved result (JSON), not rerun" in body
    assert "<tr><th>model</th><td>tiny:llama</td></tr>" in body
    assert "<tr><th>left_pad</th><td>2</td></tr>" in body and "<tr><th>position_ids</th><td>omit</td></tr>" in body
    # a later Prepare without runs leaves none of these behind
    prepare([], out)
    assert prepared(out) == [] and not list((out / "runs").glob("*.json"))


def test_a_saved_run_that_is_not_a_result_is_one_line(tmp_path):
    with pytest.raises(KvvizError, match=r"^run 1 added to the meeting: this file is not JSON") as e:
        prepare(["padding"], tmp_path, runs=[b"not json"])  # refused before any scenario runs
    assert "\n" not in str(e.value) and not (tmp_path / "padding.json").exists()
    with pytest.raises(KvvizError, match=r"^run 1 added to the meeting: this JSON is not a kvviz result"):
        prepare([], tmp_path, runs=["{}"])
