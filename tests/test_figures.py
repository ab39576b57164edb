"""Figures are pure functions of results: shapes, labels, hover text, log scales, the device in every title."""
import numpy as np
import pytest

import kvviz
from kvviz.core import plotting
from kvviz.views.dtypes import figures as dtypes_figures
from kvviz.views.greedy import figures as greedy_figures
from kvviz.views.padding import figures as padding_figures
from kvviz.views.reuse import figures as reuse_figures
from kvviz.views.split import figures as split_figures
from kvviz.views.greedy.run import GreedyConfig, run_greedy
from kvviz.views.dtypes.run import run_dtypes
from kvviz.views.padding.run import run_padding
from kvviz.views.reuse.run import run_reuse
from conftest import DEVICE


@pytest.fixture(scope="module")
def split_res():
    lm = kvviz.load_model("tiny:llama", "bfloat16", DEVICE)
    return kvviz.run_split(lm, kvviz.SplitConfig("Hello world, caching is fun!", 8))


def test_heatmap_draws_zeros_in_their_own_colour():
    z = np.array([[0.0, 1e-3], [1e-6, 0.0]])
    fig = plotting.heatmap(z, ["a", "b"], ["embeddings", "layer 1"], "t", "relative gap", log=True)
    main, zeros, legend = fig.data
    np.testing.assert_allclose(np.array(main.z, dtype=float)[z > 0], np.log10(z[z > 0]))
    assert np.isnan(np.array(main.z, dtype=float)[z == 0]).all()
    assert (np.array(zeros.z, dtype=float)[z == 0] == 1).all() and np.isnan(np.array(zeros.z, dtype=float)[z > 0]).all()
    assert legend.name == "0: bitwise equal" and legend.showlegend
    hover = np.array(main.customdata, dtype=object)
    assert hover[0, 0][2] == "0 (bitwise equal)" and hover[0, 1][2] == "0.001"
    assert "bitwise identical" not in fig.layout.title.text


def test_an_identical_comparison_is_drawn_plainly():
    """Invariant mode makes the comparison bitwise identical on any machine: the full layer axis, an all-zero map
    in the zero colour, and the note."""
    lm = kvviz.load_model("tiny:llama", "bfloat16", DEVICE)
    res = kvviz.run_split(lm, kvviz.SplitConfig("Hello world, caching is fun!", 8),
                          settings=kvviz.ExecSettings(invariant=True))
    fig = split_figures.split_heatmap(res, "relative", log=True)
    assert "bitwise identical: 0 everywhere" in fig.layout.title.text
    assert list(fig.layout.yaxis.ticktext) == res.layer_labels and len(res.layer_labels) == 5
    assert len(fig.layout.xaxis.ticktext) == len(res.compared)
    assert (np.array(fig.data[0].z, dtype=float) == 1).all()  # every cell in the zero colour
    lines = split_figures.layer_lines(res, "relative")
    assert any("0 (bitwise equal)" in (a.text or "") for a in lines.layout.annotations)


def test_split_heatmap_with_a_gap():
    lm = kvviz.load_model("tiny:llama", "bfloat16", DEVICE)
    res = kvviz.run_split(lm, kvviz.SplitConfig("Hello world, caching is fun!", 8, left_pad=3, position_ids="omit"))
    fig = split_figures.split_heatmap(res, "relative", log=True)
    raw = res.main.hidden["relative"]
    z = np.array(fig.data[0].z, dtype=float)
    np.testing.assert_allclose(z[raw > 0], np.log10(raw[raw > 0]))
    assert list(fig.layout.xaxis.ticktext)[0].startswith("8:")
    assert res.settings.device in fig.layout.title.text and "bfloat16" in fig.layout.title.text
    lin = split_figures.split_heatmap(res, "max_abs", log=False)
    np.testing.assert_allclose(np.array(lin.data[0].z, dtype=float), res.main.hidden["max_abs"])
    with pytest.raises(ValueError):
        split_figures.split_heatmap(res, "nonsense")
    # in ε units the float64 rerun is drawn in bfloat16's ε, like the run itself
    eps = split_figures.layer_lines(res, "eps_units")
    f64 = [t for t in eps.data if "float64" in t.name][0]
    np.testing.assert_allclose(f64.customdata, res.float64.hidden["relative"].max(axis=1) / 2 ** -7)


def test_split_lines_and_tables(split_res):
    fig = split_figures.layer_lines(split_res, "eps_units")
    assert fig.layout.yaxis.type == "log"
    np.testing.assert_allclose(fig.data[0].customdata, split_res.main.hidden["eps_units"].max(axis=1))
    assert min(fig.data[0].y) > 0  # zeros sit on the labelled floor, not off the log axis
    if split_res.float64 is not None:
        assert any("float64" in t.name for t in fig.data)
    assert len(split_figures.logits_frame(split_res)) == len(split_res.compared)
    assert list(split_figures.describe_frame(split_res).columns) == ["without past", "with past", "absolute Δ", "relative Δ"]
    assert len(split_figures.kv_frame(split_res)) == 4
    import pyarrow as pa

    for f in (split_figures.logits_frame(split_res), split_figures.describe_frame(split_res), split_figures.kv_frame(split_res)):
        pa.Table.from_pandas(f)  # st.dataframe's conversion must not need its "automatic fixes"


def test_greedy_figures():
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    res = run_greedy(lm, GreedyConfig("Hello", 10, left_pad=3, paths=("no_cache", "cache", "user_loop", "float64")))
    m = greedy_figures.greedy_margins(res)
    assert len(m.data) == 4 and m.layout.yaxis.type == "log"
    assert any(s.type == "line" for s in m.layout.shapes)  # the parting step is marked
    hm = greedy_figures.greedy_heatmap(res, res.pair("no_cache", "user_loop"))
    assert np.array(hm.data[0].z).shape == (5, 10)
    assert greedy_figures.greedy_reference_gap(res) is not None
    html = greedy_figures.texts_html(res)
    assert html.count("<b>") == 4 and "#f8c9c4" in html  # the first differing token is highlighted
    assert len(greedy_figures.greedy_step_frame(res)) == 10
    import pyarrow as pa

    pa.Table.from_pandas(greedy_figures.greedy_step_frame(res))
    pa.Table.from_pandas(greedy_figures.greedy_pairs_frame(res))
    assert "user_loop" in " ".join(greedy_figures.greedy_pairs_frame(res)["paths"])


def test_lab_figures():
    res = run_dtypes("tiny:gpt2", ["Hello world", "Another prompt"], ["float32"], device=DEVICE)
    fig = dtypes_figures.dtype_curves(res, "eps_units", "max")
    assert [t.name for t in fig.data] == ["float64 (in float32's ε)", "float32"]
    # the reference is in float32's ε, never in its own (where it would look worse than the dtypes it checks)
    rel64 = res.stat("relative", "max")["float64"].to_numpy()
    shown = np.array(fig.data[0].y, dtype=float)
    np.testing.assert_allclose(shown[rel64 > 0], rel64[rel64 > 0] / np.finfo(np.float32).eps)
    assert (shown[rel64 > 0] < 1).all()  # far below one float32 rounding
    raw = dtypes_figures.dtype_curves(res, "max_abs", "max")
    assert [t.name for t in raw.data] == ["float64", "float32"]
    zeros = res.stat("max_abs", "max")["float32"].to_numpy() == 0
    assert zeros[0]  # the embeddings of the same tokens are identical by construction, on any machine
    assert any(a.text == "0 (bitwise equal)" for a in raw.layout.annotations)  # drawn on the labelled floor
    assert not np.isnan(np.array(raw.data[1].y, dtype=float)).any()  # no gaps, no vertical drops
    assert f"device {res.settings.device}" in fig.layout.title.text
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    grid = padding_figures.padding_grid(run_padding(lm, "Hello world, caching", left_pad=2))
    assert np.array(grid.data[0].z).shape == (3, 5) and str(lm.device) in grid.layout.title.text
    frame = reuse_figures.reuse_frame(run_reuse(lm, "S:", [" a", " b"], 3))
    assert len(frame) == 6 and "verdict" in frame.columns
    assert str(frame["parts from fresh at step"].dtype) == "Int64"  # one type per column: Arrow can send it
    import pyarrow as pa

    for f in (frame, greedy_figures.greedy_pairs_frame(run_greedy(lm, GreedyConfig("Hi", 4, left_pad=2,
                                                                             paths=("cache", "user_loop"))))):
        pa.Table.from_pandas(f)  # what st.dataframe does; raises on mixed-type columns


def test_ab_heatmaps_share_one_scale_and_draw_the_difference():
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    a = kvviz.run_split(lm, kvviz.SplitConfig("Hello world, caching is fun!", 8, left_pad=3, position_ids="omit"))
    b = kvviz.run_split(lm, kvviz.SplitConfig("Hello world, caching is fun!", 8, left_pad=3))
    fa, fb, fd = split_figures.ab_heatmaps(a, b, "omit", "auto", "max_abs", log=False)
    za, zb = a.main.hidden["max_abs"], b.main.hidden["max_abs"]
    assert (fa.data[0].zmin, fa.data[0].zmax) == (fb.data[0].zmin, fb.data[0].zmax)
    assert fa.data[0].zmin == pytest.approx(min(za.min(), zb.min()))
    assert fa.data[0].zmax == pytest.approx(max(za.max(), zb.max()))
    np.testing.assert_allclose(np.array(fd.data[0].z, dtype=float), np.abs(zb - za))
    assert za.max() > 0  # omitted positions on a left-padded prompt: a logic gap on any machine
    # log scale: the shared range spans both maps' non-zero values
    la, lb, _ = split_figures.ab_heatmaps(a, b, "omit", "auto", "max_abs", log=True)
    both = np.concatenate([za.ravel(), zb.ravel()])
    assert la.data[0].zmax == pytest.approx(np.log10(both[both > 0].max()))
    assert la.data[0].zmin == lb.data[0].zmin
    other = kvviz.run_split(lm, kvviz.SplitConfig("Hello world, caching is fun!", 5))
    with pytest.raises(ValueError):
        split_figures.ab_heatmaps(a, other, "a", "b")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_display_tokens_whole_characters_and_never_the_replacement_sign(arch):
    from kvviz.core.text import display_tokens, fmt_number

    tok = kvviz.load_model(f"tiny:{arch}", "float32", DEVICE).tokenizer
    ids = tok.encode("a世b🤖", add_special_tokens=False)
    shown = display_tokens(tok, ids)
    assert len(shown) == len(ids)  # one entry per token: positions stay aligned
    assert "世" in shown and "🤖" in shown and "\ufffd" not in "".join(shown)
    # pieces of characters that never complete (random bytes, as a random model generates) show as bytes
    cont = tok.encode("世", add_special_tokens=False)
    stray = display_tokens(tok, cont[1:] + cont[:1])
    assert "\ufffd" not in "".join(stray)
    assert stray[0].startswith("⟨") and stray[-1] == "⟨" + f"{'世'.encode()[0]:02x}" + "⟩"
    assert [fmt_number(v) for v in (None, float("nan"), 0.0, 2e-15, 0.1234567, 12345.678)] == \
        ["—", "—", "0", "2.00e-15", "0.123", "1.23e+04"]


def test_padding_grid_without_padding_and_its_ab():
    """No padding: no "left-padded" row (it would be "alone" again), in the grid and its A/B; A and B share one
    colour range."""
    from kvviz.views.padding.run import run_padding

    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    res = run_padding(lm, "Hello world, caching", left_pad=0, prove=False)
    fig = padding_figures.padding_grid(res)
    assert list(fig.data[0].y) == ["alone", "in a batch"]
    b = run_padding(lm.twin("bfloat16"), "Hello world, caching", left_pad=0, prove=False)
    fa, fb, fd = padding_figures.ab_padding_grids(res, b, "float32", "bfloat16")
    assert list(fa.data[0].y) == ["alone", "in a batch"]
    assert (fa.data[0].zmin, fa.data[0].zmax) == (fb.data[0].zmin, fb.data[0].zmax)
    assert fa.data[0].zmax > -2  # the logic cells (mask new-only) are far above rounding on any machine
    assert "|B − A|" in fd.layout.title.text


def test_a_dtype_line_hidden_under_another_says_so():
    res = run_dtypes("tiny:gpt2", ["Hello world"], ["bfloat16"], device=DEVICE)
    for metric in res.per_prompt:  # construct a second dtype with exactly bfloat16's numbers
        res.per_prompt[metric]["float16"] = res.per_prompt[metric]["bfloat16"].copy()
    res.dtypes = ["float64", "float16", "bfloat16"]
    names = [t.name for t in dtypes_figures.dtype_curves(res).data]
    assert names == ["float64", "float16 (= bfloat16, under it)", "bfloat16"]


def test_the_tie_hover_names_both_tokens():
    from kvviz.views.greedy import figures

    lm = kvviz.load_model("tiny:tie", "bfloat16", DEVICE)
    res = run_greedy(lm, GreedyConfig("Once upon a time", 3, paths=("no_cache", "cache")), prove=False)
    fig = figures.greedy_margins(res)
    for trace in fig.data:
        assert "!r" not in trace.hovertemplate  # plotly has no !r: it drew "chose - over -"
        assert all(c[0].startswith(("'", '"')) and c[1].startswith(("'", '"')) for c in trace.customdata)
