"""The Lesson (kvviz/teach/lesson.py): each step's live numbers, its answer, its figure, and the offline handout."""
import math
import re

import pytest
import torch

from kvviz import KvvizError
from kvviz.teach import lesson
from kvviz.teach.lesson_figures import figure, handout_html

from conftest import DEVICE

PROMPT = "Hello world, caching is fun! 123"


@pytest.fixture(scope="module")
def models():
    return lesson.model_loader("tiny:llama", DEVICE)


def test_step1_float_anatomy_bfloat16_eps_is_2_to_the_minus_7():
    r = lesson.step_float(0.1, "bfloat16")
    d = r.data
    assert d["eps"] == 2.0 ** -7 and r.choices[r.answer] == "2^-7 ≈ 0.00781"
    assert d["stored"] == 0.10009765625 and d["below"] == 0.099609375 and d["above"] == 0.1005859375
    assert d["ulp"] == 2.0 ** -11  # 0.1 lies in [2^-4, 2^-3): 8 bits of precision there
    assert d["bits"] == ["0", "01111011", "1001101"]
    assert d["dtypes"]["float32"]["eps"] == 2.0 ** -23 and d["dtypes"]["float16"]["eps"] == 2.0 ** -10
    assert d["dtypes"]["float64"]["ulp"] == math.ulp(0.1)
    assert d["dtypes"]["bfloat16"]["mantissa_bits"] == 8
    f = lesson.step_float(1.0, "float16")
    assert f.data["above"] - f.data["stored"] == 2.0 ** -10 and f.data["relative_error"] == 0
    with pytest.raises(KvvizError, match="finite"):
        lesson.step_float(float("nan"), "float32")
    with pytest.raises(KvvizError, match="larger than the largest float16"):
        lesson.step_float(1e6, "float16")


def test_step2_two_orders_differ_by_a_computed_number_of_ulps():
    r = lesson.step_sums(1000, "float32", seed=0)
    d = r.data
    fwd, bwd = d["sums"]["left to right"], d["sums"]["right to left"]
    assert fwd != bwd
    # the reported count is the real distance in float32 steps between the two sums
    a, b = torch.tensor(fwd, dtype=torch.float32), torch.tensor(bwd, dtype=torch.float32)
    steps = 0
    x = torch.minimum(a, b)
    while x < torch.maximum(a, b):
        x = torch.nextafter(x, torch.tensor(math.inf, dtype=torch.float32))
        steps += 1
    assert d["diff_ulps"] == steps > 0
    assert r.answer == (1 if steps <= 64 else 2)
    # sorted small to large is the most accurate sequential order here; both sums are near the exact one
    assert d["error_ulps"]["small to large"] < d["error_ulps"]["left to right"]
    assert abs(fwd - d["exact"]) < 1e-4
    # a long sum of 0.1 gets stuck: bfloat16 at 32 (0.1 < half an ulp of 32), float16 at 256
    assert d["drift"]["bfloat16"][-1] == 32.0 and d["drift"]["float16"][-1] == 256.0
    assert abs(d["drift"]["float32"][-1] - 300) < 0.1 and d["stall"]["float32"] is None
    with pytest.raises(KvvizError, match="count"):
        lesson.step_sums(1, "float32")


def test_step3_row_alone_vs_batch_on_the_models_weights(models):
    r = lesson.step_row_vs_batch(models("float32"), PROMPT)
    d = r.data
    assert d["module"].endswith("q_proj") and d["outputs"] == 64
    for dt, p in d["dtypes"].items():
        assert sum(p["ulps"].values()) == p["total"] == 64
        assert p["differ"] == p["total"] - p["ulps"]["0"]
    f32 = d["dtypes"]["float32"]
    assert r.answer == (0 if f32["differ"] == 0 else 1 if f32["differ"] / 64 < 0.1 else 2)
    assert f"{f32['differ']} of 64" in r.reveal


def test_steps_4_5_cached_vs_full_by_layer(models, row_count_rounding):  # a rounding gap on any CPU/GPU
    five = lesson.step_layers(models, PROMPT)
    d = five.data
    assert d["labels"][0] == "embeddings" and len(d["labels"]) == models("float32").n_layers + 1
    for dt in lesson.SWEEP:
        p = d["dtypes"][dt]
        assert p["eps"] == torch.finfo(getattr(torch, dt)).eps
        assert p["relative"][0] == 0  # same token ids: the embeddings are equal
        assert max(p["relative"]) < 50 * p["eps"]  # rounding-sized
    # 16-bit gaps are far above float32's, and float64's cached run is far below all of them
    assert d["dtypes"]["bfloat16"]["relative"][-1] > 100 * d["dtypes"]["float32"]["relative"][-1]
    assert max(d["float64"]) < 1e-12
    rel = d["dtypes"]["bfloat16"]["relative"]
    k = next(i for i in range(1, len(rel)) if rel[i - 1] > 0)  # the first layer a gap enters
    four = lesson.step_one_layer(models, PROMPT, layer=k, dtype="bfloat16")
    assert four.data["relative"] == rel  # the same computation, the same numbers
    assert four.data["factor"] == pytest.approx(rel[k] / rel[k - 1])
    assert four.answer == (0 if rel[k] / rel[k - 1] < 0.5 else 1 if rel[k] / rel[k - 1] <= 2 else 2)
    born = next(i for i in range(1, len(rel)) if rel[i] > 0)  # where the gap is born: nothing entered
    b = lesson.step_one_layer(models, PROMPT, layer=born, dtype="bfloat16")
    assert b.answer is None and "born in this layer" in b.reveal
    with pytest.raises(KvvizError, match="pick a layer from 1 to"):
        lesson.step_one_layer(models, PROMPT, layer=99)


def test_step7_float64_closes_the_gap_and_invariant_mode_makes_it_zero(models, row_count_rounding):
    r = lesson.step_referee(models, PROMPT, "bfloat16")
    m = r.data["max"]
    assert m["normal"] > 1e-4
    assert m["float64"] < 1e-12 and m["float64"] < m["normal"] * 1e-6
    assert m["invariant"] == 0 and all(v == 0 for v in r.data["invariant"])
    assert r.answer == 1


def test_step8_the_padding_bug_stays_in_float64(models):
    r = lesson.step_bug(models, PROMPT, left_pad=3, dtype="float32")
    rows = {(x["scenario"], x["dtype"]): x["hidden"] for x in r.data["rows"]}
    assert rows[("position ids omitted", "float64")] > 1e-3  # logic: float64 does not close it
    assert rows[("position ids omitted", "float64")] > 0.3 * rows[("position ids omitted", "float32")]
    assert rows[("position ids given", "float64")] < 1e-12  # precision: it closes
    assert r.answer == 1
    with pytest.raises(KvvizError, match="left padding"):
        lesson.step_bug(models, PROMPT, left_pad=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_step6_parts_on_every_machine(models, dtype):
    """Step 6 decodes tiny:flip in bfloat16 whatever the sidebar's model and dtype: no cache "a", the cache "b" at
    step 1, a margin of 2^-7 within a gap of 2^-6 and under 1% of the largest logit (8): a near tie, in words from
    those numbers; at most three sentences of answer and three of explanation."""
    r = lesson.step_greedy(models(dtype), "Hello", 6)
    d = r.data
    assert d["constructed"] and d["model"] == "tiny:flip" and d["dtype"] == "bfloat16"
    assert d["parting"] == 1 and (d["no_cache_token"], d["cache_token"]) == ("a", "b")
    assert d["margins"][1] == 2.0 ** -7 and d["gaps"][1] == 2.0 ** -6 and d["logit_scale"] == 8.0
    assert r.answer == 1 and d["near_tie"] is True
    assert d["verdict"] == "precision" and d["float64_gap"] == 0.0
    assert "no cache chose 'a', the cache 'b'" in r.reveal
    assert "a near tie (under 1% of the largest logit, 8)" in r.reveal
    for text in (r.reveal, r.explanation):
        assert len(re.findall(r"[.!?](?:\s|$)", text)) <= 3, text


def test_step6_the_logit_lens_of_the_flip_names_where_it_is_decided(models):
    """Step 6 runs the lens view (through the run protocol) on the parting step of tiny:flip: the prompt cached, the
    agreed token "a" through the cache. Its first layer's mixer makes the flip (the skip term rounded in the cached
    step only), so the decision depth is layer 1 of 2, both paths' lens margins there are one bfloat16 step of 8
    (2^-7) the opposite way, and they stay apart to the output; said in one sentence from those numbers, drawn as
    the figure's second panel with the depth marked."""
    r = lesson.step_greedy(models("float32"), "Hello", 6)
    v = r.data["flip_lens"]
    assert v["labels"] == ["layer 1", "layer 2", "layer 2 + final norm"] and v["n_layers"] == 2
    assert v["depth"] == 0 and v["apart_from"] == 0 and v["verdict"] == "precision"
    assert v["full"]["top1"] == ["a"] * 3 and v["cached"]["top1"] == ["b"] * 3
    assert v["full"]["top2"] == ["b"] * 3 and v["cached"]["top2"] == ["a"] * 3
    assert v["full"]["margin"] == [2.0 ** -7] * 3 and v["cached"]["margin"] == [2.0 ** -7] * 3
    assert all(k > 0 for k in v["kl"])
    # the lens's last layer is the model's own choice at the parting step (greedy's tokens)
    assert (v["full"]["top1"][-1], v["cached"]["top1"][-1]) == (r.data["no_cache_token"], r.data["cache_token"])
    assert ("decides it at layer 1 of 2: there the full forward already ranks 'a' 0.00781 over 'b' and the cached "
            "path 'b' 0.00781 over 'a', and they stay apart to the output.") in r.reveal
    fig = figure(r)
    lens = [t for t in fig.data if t.xaxis == "x2"]
    assert [list(t.y) for t in lens] == [[2.0 ** -7] * 3] * 2 and [list(t.text) for t in lens] == [["a"] * 3,
                                                                                                  ["b"] * 3]
    assert any(a.text == "decided at layer 1" for a in fig.layout.annotations)


def test_every_figure_and_the_offline_handout(models):
    results = [lesson.run_step(1, models), lesson.run_step(2, models, n=200),
               lesson.run_step(3, models, prompt=PROMPT), lesson.run_step(8, models, prompt=PROMPT)]
    for r in results:
        fig = figure(r)
        assert fig.data and fig.layout.title.text.startswith(f"Step {r.step}")
    page = handout_html(results, "tiny:llama")
    assert page.count('class="step"') == 4
    for r in results:
        assert f'id="lesson-step-{r.step}"' in page and r.explanation[:40] in page
    assert "Steps not computed in this handout: 4, 5, 6, 7" in page
    from kvviz.teach.exercises import EXERCISES

    # answers hidden until revealed: one per step, one per exercise (the handout carries the exercises)
    assert "<details open" not in page and page.count("<details>") == 4 + len(EXERCISES)
    assert page.count('class="exercise"') == len(EXERCISES) and 'id="exercises"' in page
    # offline: plotly inlined once, no script or resource fetched from the network
    assert page.count("<script type=\"text/javascript\">/**") + page.count("plotly.js v") >= 1
    assert not re.search(r"<script[^>]*\bsrc=", page)
    outside_scripts = re.sub(r"<script[^>]*>.*?</script>", "", page, flags=re.S)
    assert not re.search(r"(src|href)=[\"']?https?://", outside_scripts)  # no image, style or link fetched
    assert 'src="http' not in page
    assert page.count("Plotly.newPlot") == 4


def test_unknown_step_is_one_line(models):
    with pytest.raises(KvvizError, match="steps 1 to 8"):
        lesson.run_step(9, models)


def test_the_pages_bench_times_every_lesson_step():
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("pages_bench", ROOT / "bench" / "pages_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls = bench.lesson_calls("tiny:llama")
    assert list(calls) == [f"lesson_{k}" for k in lesson.STEPS]
    for name in ("lesson_1", "lesson_2"):  # the model steps run in the tests above, with the same defaults
        assert calls[name]().step == int(name[-1])


def test_steps_share_their_runs_within_a_lesson_walk(models, monkeypatch):
    from kvviz.core.execution import Executor

    calls = []
    real = Executor.forward
    monkeypatch.setattr(Executor, "forward", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    lesson.clear_memo()
    lesson.step_layers(models, PROMPT)
    walked = len(calls)
    assert walked == 4 * 4  # float64 + three dtypes: full, prefix and one forward per compared token (2)
    lesson.step_one_layer(models, PROMPT, dtype="bfloat16")
    ref = lesson.step_referee(models, PROMPT, "float32")
    assert len(calls) == walked + 4  # only the invariant-mode run is new
    assert ref.data["normal"] == lesson.step_layers(models, PROMPT).data["dtypes"]["float32"]["relative"]


def test_the_no_flip_words_follow_the_numbers():
    """Why the paths did not part, in words computed from the margins and gaps: an exact tie with bit-for-bit equal
    logits is not "a margin within that gap" (both are 0: nothing could flip), a margin inside a nonzero gap is."""
    from kvviz.teach.lesson import _no_flip_words

    equal = _no_flip_words({"margins": [0.5, 0.0, 0.3], "gaps": [0.0, 0.0, 0.0]})
    assert "an exact tie" in equal and "bit for bit equal at every step" in equal and "within that gap" not in equal
    inside = _no_flip_words({"margins": [0.5, 0.01, 0.3], "gaps": [0.0, 0.02, 0.0]})
    assert "1 of 3 steps had a margin within that gap" in inside
    above = _no_flip_words({"margins": [0.5, 0.2, 0.3], "gaps": [0.01, 0.02, 0.0]})
    assert "larger than the gap" in above and "within that gap" not in above
