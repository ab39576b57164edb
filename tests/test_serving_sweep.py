"""The serving sweep (issue 41 item 4): requests in flight × prompt length, each cell judged by the serving study."""
from __future__ import annotations

import json

import pytest

import kvviz
from kvviz.engines import engine_python
from kvviz.errors import KvvizError
from kvviz.views.serving.sweep import (VERDICT_COLOURS, SweepConfig, SweepResult, build_prompts, cell_of, figure,
                                       run_sweep, summary_text)
from kvviz.views.serving.run import ConditionStats, PromptResult, ServeResult, ServeSettings


def _prompt(i, alone, batch, ref, verdict=None, margin=None):
    from kvviz.metrics import first_divergence

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
    from kvviz.inputs import encode

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


@pytest.mark.slow
@pytest.mark.skipif(engine_python("vllm") is None, reason="vLLM's environment is not built here (make engines)")
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
