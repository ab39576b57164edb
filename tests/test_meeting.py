"""Prepare the meeting: chosen scenarios run ahead into results Open a result shows at once, one HTML bundles them."""
import pytest

from kvviz.errors import KvvizError
from kvviz.export import open_result
from kvviz.meeting import prepare, prepared


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


def test_an_unknown_scenario_is_one_clear_line(tmp_path):
    with pytest.raises(KvvizError, match="unknown scenario nope"):
        prepare(["nope"], tmp_path)
