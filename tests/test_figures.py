"""Figures are pure functions of results: shapes, labels, hover text, log scales, the device in every title."""
import numpy as np
import pytest

import kvviz
from kvviz import figures
from kvviz.greedy import GreedyConfig, run_greedy
from kvviz.lab import run_dtypes, run_padding, run_reuse
from conftest import DEVICE


@pytest.fixture(scope="module")
def split_res():
    lm = kvviz.load_model("tiny:llama", "bfloat16", DEVICE)
    return kvviz.run_split(lm, kvviz.SplitConfig("Hello world, caching is fun!", 8))


def test_split_heatmap(split_res):
    fig = figures.split_heatmap(split_res, "relative", log=True)
    hm = fig.data[0]
    z = np.array(hm.z, dtype=float)
    assert z.shape == split_res.main.hidden["relative"].shape
    raw = split_res.main.hidden["relative"]
    np.testing.assert_allclose(z[raw > 0], np.log10(raw[raw > 0]))
    assert np.isnan(z[raw == 0]).all()  # exact zeros drawn blank, said so on hover
    hover = np.array(hm.customdata, dtype=object)
    assert hover[0, 0][1] == "embeddings" and hover[0, 0][2] == "0 (bitwise equal)"
    assert list(fig.layout.xaxis.ticktext)[0].startswith("8:")
    assert DEVICE in fig.layout.title.text and "bfloat16" in fig.layout.title.text
    lin = figures.split_heatmap(split_res, "max_abs", log=False)
    np.testing.assert_allclose(np.array(lin.data[0].z, dtype=float), split_res.main.hidden["max_abs"])
    with pytest.raises(ValueError):
        figures.split_heatmap(split_res, "nonsense")


def test_split_lines_and_tables(split_res):
    fig = figures.layer_lines(split_res, "eps_units")
    assert fig.layout.yaxis.type == "log"
    np.testing.assert_allclose(fig.data[0].y, split_res.main.hidden["eps_units"].max(axis=1))
    if split_res.float64 is not None:
        assert any("float64" in t.name for t in fig.data)
    assert len(figures.logits_frame(split_res)) == len(split_res.compared)
    assert list(figures.describe_frame(split_res).columns) == ["without past", "with past", "absolute Δ", "relative Δ"]
    assert len(figures.kv_frame(split_res)) == 4
    import pyarrow as pa

    for f in (figures.logits_frame(split_res), figures.describe_frame(split_res), figures.kv_frame(split_res)):
        pa.Table.from_pandas(f)  # st.dataframe's conversion must not need its "automatic fixes"


def test_greedy_figures():
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    res = run_greedy(lm, GreedyConfig("Hello", 10, left_pad=3, paths=("no_cache", "cache", "user_loop", "float64")))
    m = figures.greedy_margins(res)
    assert len(m.data) == 4 and m.layout.yaxis.type == "log"
    assert any(s.type == "line" for s in m.layout.shapes)  # the parting step is marked
    hm = figures.greedy_heatmap(res, res.pair("no_cache", "user_loop"))
    assert np.array(hm.data[0].z).shape == (5, 10)
    assert figures.greedy_reference_gap(res) is not None
    html = figures.texts_html(res)
    assert html.count("<b>") == 4 and "#f8c9c4" in html  # the first differing token is highlighted
    assert len(figures.greedy_step_frame(res)) == 10
    import pyarrow as pa

    pa.Table.from_pandas(figures.greedy_step_frame(res))
    pa.Table.from_pandas(figures.greedy_pairs_frame(res))
    assert "user_loop" in " ".join(figures.greedy_pairs_frame(res)["paths"])


def test_lab_figures():
    res = run_dtypes("tiny:gpt2", ["Hello world", "Another prompt"], ["float32"], device=DEVICE)
    fig = figures.dtype_curves(res, "eps_units", "max")
    assert [t.name for t in fig.data] == ["float64", "float32"] and "device cpu" in fig.layout.title.text
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    grid = figures.padding_grid(run_padding(lm, "Hello world, caching", left_pad=2))
    assert np.array(grid.data[0].z).shape == (3, 5) and DEVICE in grid.layout.title.text
    frame = figures.reuse_frame(run_reuse(lm, "S:", [" a", " b"], 3))
    assert len(frame) == 6 and "verdict" in frame.columns
    assert str(frame["parts from fresh at step"].dtype) == "Int64"  # one type per column: Arrow can send it
    import pyarrow as pa

    for f in (frame, figures.greedy_pairs_frame(run_greedy(lm, GreedyConfig("Hi", 4, left_pad=2,
                                                                             paths=("cache", "user_loop"))))):
        pa.Table.from_pandas(f)  # what st.dataframe does; raises on mixed-type columns
