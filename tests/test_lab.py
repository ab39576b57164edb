"""Precision lab on tiny models: dtypes over a prompt set, padding grid, prompt-cache reuse, prompt files."""
import json

import numpy as np
import pytest

import kvviz
from kvviz.core.errors import KvvizError
from kvviz.views.dtypes.run import run_dtypes
from kvviz.views.padding.run import PLACEMENTS, SCENARIOS, run_padding
from kvviz.views.reuse.run import run_reuse
from kvviz.core.prompts import builtin_prompts, load_prompts, parse_prompts
from kvviz.views.split.run import SplitConfig, run_split
import kvviz.io.jsonout  # noqa: E402,F401
from conftest import DEVICE

PROMPTS = ["Hello world, caching is fun", "def f(x):\n    return x", "Bonjour tout le monde", "1, 2, 3, 4, 5,"]


def test_builtin_set_is_large_and_varied():
    rows = builtin_prompts()
    assert len(rows) >= 200
    cats = {r["category"] for r in rows}
    assert {"prose", "code", "lists", "dialogue", "languages"} <= cats
    assert len({r["prompt"] for r in rows}) == len(rows)
    assert any(any(ord(ch) > 0x3000 for ch in r["prompt"]) for r in rows)  # CJK among the languages
    assert load_prompts("builtin:code", 5) == [r["prompt"] for r in rows if r["category"] == "code"][:5]


def test_dtypes_set_average_equals_mean_of_single_runs():
    res = run_dtypes("tiny:llama", PROMPTS, ["float32", "bfloat16"], device=DEVICE)
    assert res.dtypes == ["float64", "float32", "bfloat16"]
    for d in res.dtypes:
        lm = kvviz.load_model("tiny:llama", d, DEVICE)
        singles = []
        for p in PROMPTS:
            n = len(lm.tokenizer(p)["input_ids"])
            singles.append(run_split(lm, SplitConfig(p, n - 1)).main.hidden["max_abs"].max(axis=1))
        np.testing.assert_array_equal(res.stat("max_abs", "mean")[d].to_numpy(), np.mean(singles, axis=0))
        np.testing.assert_array_equal(res.stat("max_abs", "max")[d].to_numpy(), np.max(singles, axis=0))
    # float64 rows are at the harness's floor
    assert res.stat("max_abs", "max")["float64"].max() <= 1e-10
    assert set(res.verdicts["float64"]) == {"reference"}  # the yardstick, not counted as precision
    assert "float64" not in res.verdict_counts().columns
    # eps units divide by each dtype's own epsilon
    eps = kvviz.machine_eps(kvviz.parse_dtype("bfloat16"))
    np.testing.assert_allclose(res.per_prompt["eps_units"]["bfloat16"], res.per_prompt["relative"]["bfloat16"] / eps)
    d = json.loads(kvviz.io.jsonout.dumps(res.to_dict()))
    assert set(d["per_layer"]["max_abs"]["mean"]) == {"float64", "float32", "bfloat16"}
    assert d["verdict_counts"]["float32"]["logic"] == 0


def test_dtypes_single_prompt_keeps_full_results():
    res = run_dtypes("tiny:gpt2", PROMPTS[:1], ["float16"], device=DEVICE, split="half")
    assert set(res.single) == {"float64", "float16"}
    assert res.single["float16"].main.hidden["max_abs"].shape[0] == 5


def test_dtypes_roberta_says_no_cache():
    with pytest.raises(KvvizError, match="no cache"):
        run_dtypes("tiny:roberta", PROMPTS[:1], ["float32"], device=DEVICE)


def test_padding_grid_tells_precision_from_logic():
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    res = run_padding(lm, "Hello world, caching is fun!", left_pad=3)
    grid = res.grid()
    assert list(grid.index) == list(PLACEMENTS) and list(grid.columns) == [s[0] for s in SCENARIOS]
    assert grid.loc["alone", "no cache"] == "identical"
    for placement in PLACEMENTS:
        assert grid.loc[placement, "cache"] in ("precision", "identical")
        assert grid.loc[placement, "cache, mask new-only"] == "logic"
    assert grid.loc["left-padded", "no cache"] in ("precision", "identical")
    assert grid.loc["in a batch", "no cache"] in ("precision", "identical")
    assert grid.loc["left-padded", "cache, positions omitted"] == "logic"
    assert grid.loc["in a batch", "cache, positions omitted"] == "logic"
    # alone there are no pads, so omitting position ids is harmless
    assert grid.loc["alone", "cache, positions omitted"] in ("precision", "identical")
    f64 = res.grid("float64_relative")
    assert f64.loc["left-padded", "cache"] <= 1e-10
    assert f64.loc["left-padded", "cache, positions omitted"] > 1e-3


def test_reuse_after_growth_is_logic():
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    res = run_reuse(lm, "Story: ", [" Once upon", " The cat", " A dog ran"], 8)
    by = {(r["index"], r["strategy"]): r for r in res.runs}
    for i in range(3):
        assert by[(i, "fresh")]["verdict"] == "reference" and by[(i, "fresh")]["first_divergence"] is None
        assert by[(i, "deepcopy")]["verdict"] in ("identical", "precision")
        assert by[(i, "deepcopy")]["float64_relative"] <= 1e-10
    assert by[(0, "reused")]["verdict"] in ("identical", "precision")  # first use: nothing grew it yet
    for i in (1, 2):
        assert by[(i, "reused")]["verdict"] == "logic"
        assert by[(i, "reused")]["float64_relative"] > 1e-3


@pytest.mark.parametrize("data, name, expect", [
    (b"one\ntwo\n\nthree\n", "p.txt", ["one", "two", "three"]),
    (b'{"prompt": "a"}\n{"text": "b"}\n"c"\n', "p.jsonl", ["a", "b", "c"]),
    ("line with \\n break\n".encode(), "p.txt", ["line with \n break"]),
])
def test_prompt_files(data, name, expect):
    assert parse_prompts(data, name) == expect


@pytest.mark.parametrize("data, name, msg", [
    (b"\xff\xfe\x00bad", "p.txt", "not UTF-8"),
    (b"", "p.txt", "no prompts"),
    (b"  \n \n", "p.txt", "no prompts"),
    (b"{not json\n", "p.jsonl", "not valid JSON"),
    (b'{"other": 1}\n', "p.jsonl", "expected a string"),
])
def test_bad_prompt_files(data, name, msg):
    with pytest.raises(KvvizError, match=msg):
        parse_prompts(data, name)


def test_load_prompts_errors(tmp_path):
    with pytest.raises(KvvizError, match="not found"):
        load_prompts(tmp_path / "missing.txt")
    with pytest.raises(KvvizError, match="limit"):
        load_prompts("builtin", 0)


def test_reuse_runs_only_the_ways_asked_for():
    from kvviz.views.reuse.run import run_reuse

    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    res = run_reuse(lm, "Answer.", [" Q?", " R?"], 2, ways=("deepcopy",))
    assert [r["strategy"] for r in res.runs] == ["fresh", "deepcopy"] * 2
    with pytest.raises(kvviz.KvvizError, match="unknown way"):
        run_reuse(lm, "Answer.", [" Q?"], 2, ways=("copy",))
