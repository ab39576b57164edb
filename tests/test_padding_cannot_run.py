"""The padding grid on models that build positions or alibi from the attention mask: BLOOM and OPT crash
on a mask of the new tokens only. Every cell gives a result or a one-line reason - never a traceback - in the
library, the command line, the figure and a JSON round trip."""
import json

import numpy as np
import pytest

import kvviz
from kvviz.cli import main
from kvviz.io.jsonout import dumps
from kvviz.views.padding.figures import padding_grid
from kvviz.views.padding.report import reopen
from kvviz.views.padding.run import CANNOT_RUN, SCENARIOS, run_padding

from conftest import DEVICE

PROMPT = "Hello world, caching is fun! 123"


@pytest.mark.parametrize("spec, kind", [("tiny:bloom", "bloom"), ("tiny:opt", "opt")])
def test_every_cell_gives_a_result_or_a_one_line_reason(spec, kind, capsys):
    lm = kvviz.load_model(spec, "float32", DEVICE)
    res = run_padding(lm, PROMPT, left_pad=2, prove=False)
    assert len(res.cells) == 3 * len(SCENARIOS)  # alone, left-padded, in a batch × every scenario
    failed = [c for c in res.cells if c["verdict"] == CANNOT_RUN]
    ran = [c for c in res.cells if c["verdict"] != CANNOT_RUN]
    assert failed, "the model runs every new-only-mask cell: this test no longer shows the crash"
    for c in failed:
        assert "new-only" in c["scenario"]  # only the new-only-mask scenarios fail
        assert c["reason"].startswith(f"cannot run: {kind}'s forward fails on a mask of the new tokens only (")
        assert "\n" not in c["reason"] and "Traceback" not in c["reason"]
        assert np.isnan(c["hidden_relative"]) and c["bitwise_equal"] is None and c["proved"] is None
    for c in ran:  # the others are judged as before: numbers and a verdict
        assert c["verdict"] in ("identical", "precision", "logic") and c["reason"] is None
        assert np.isfinite(c["hidden_relative"]) and np.isfinite(c["float64_relative"])
    assert {c["scenario"] for c in ran} >= {"no cache", "cache", "cache, positions omitted"}
    assert all(c["verdict"] == "identical" or c["verdict"] == "precision"
               for c in ran if c["scenario"] in ("no cache", "cache"))
    # the figure, the tables and a JSON round trip carry the cells that cannot run
    fig = padding_grid(res)
    assert any(CANNOT_RUN in t for row in fig.data[0].text for t in row)
    back = reopen(json.loads(dumps(res.to_dict())))
    assert back.grid("verdict").equals(res.grid("verdict"))
    assert [c["reason"] for c in back.cells] == [c["reason"] for c in res.cells]
    # the command line: exit 0, each failed cell's reason on one line
    rc = main(["padding", "--model", spec, "--device", DEVICE, "--prompt", PROMPT, "--left-pad", "2", "--no-proof",
               "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in out + err
    assert sum(line.split(": ", 1)[-1].startswith("cannot run:") for line in out.splitlines()) == len(failed)
