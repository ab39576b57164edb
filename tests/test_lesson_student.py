"""The Lesson as a student meets it: for every step, the question, the figure and the revealed answer agree, each
asserted from the step's own data - in float32 and bfloat16, and again on the forced AVX2 path (ATen, MKL and
oneDNN limited to AVX2, 1 and 2 threads) in a child process. Step 6 must show a parting on every path: a demo that
flips only on this CPU is the bug this file guards against."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from kvviz.teach import lesson
from kvviz.teach.lesson_figures import figure, handout_html

from conftest import DEVICE, PROMPT, ROOT

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_CBWR": "AVX2"}  # as make test-any-cpu forces it
CHILD = "KVVIZ_LESSON_STUDENT_CHILD"


@pytest.fixture(scope="module")
def models():
    return lesson.model_loader("tiny:llama", DEVICE)


def _annotations(fig) -> dict[str, object]:
    return {a.text: a for a in fig.layout.annotations}


def _zero_label_at_the_floor(fig, values) -> None:
    """The "0" label sits on the zero line, which lies under every value drawn (not at the top of the figure)."""
    zero = next(a for a in fig.layout.annotations if a.text.startswith("0 ("))
    floor = 10 ** zero.y
    assert any(s.y0 == floor and s.y1 == floor for s in fig.layout.shapes)
    assert all(v is None or v == 0 or v > floor for v in values)


def check_step(r: lesson.StepResult) -> None:
    """The question, the figure and the answer of one computed step agree; every claim from r.data."""
    d, fig = r.data, figure(r)
    title = fig.layout.title.text.replace("<br>", " ")  # fit_text wraps a long title on two lines
    assert title.startswith(f"Step {r.step}") and r.question and r.explanation
    assert "a last bit or two" not in r.reveal + r.explanation
    if r.answer is not None:
        assert 0 <= r.answer < len(r.choices)
    if r.step == 1:
        eps, name = d["eps"], d["dtype"]
        assert name in r.question and r.choices[r.answer] == f"2^-{round(-math.log2(eps))} ≈ {eps:.3g}"
        assert not any(dt in c for c in r.choices for dt in lesson.LAYOUT)  # the options never name a dtype
        assert f"{eps:.4g}" in title and f"{eps:.6g}" in r.reveal
    elif r.step == 2:
        diff = d["diff_ulps"]
        assert r.answer == (0 if diff == 0 else 1 if diff <= 64 else 2)
        assert f"differ by {diff:.0f} ulp" in title
        assert (f"they differ by {diff:.0f} ulp" in r.reveal) == (diff > 0)
    elif r.step == 3:
        f32 = d["dtypes"]["float32"]
        frac = f32["differ"] / f32["total"]
        assert r.answer == (0 if not f32["differ"] else 1 if frac < 0.1 else 2)
        stacks = [sum(t.y[i] for t in fig.data) for i in range(len(d["dtypes"]))]
        assert stacks == [d["outputs"]] * len(d["dtypes"])
        for dt, p in d["dtypes"].items():
            assert f"{dt}: {p['differ']} of {p['total']} outputs differ (at most {p['max_ulps']:.0f} ulp" in r.reveal
            if p["max_ulps"] > 2:  # a large count is explained by the output's size, with the scale's count beside
                assert f"the largest, {p['max_ulps']:.0f} ulp, is at an output {p['worst_size']:.2g}" in r.reveal
                assert f"at most {p['ulps_of_largest']:.2g} ulp" in r.reveal
    elif r.step == 4:
        f = d["factor"]
        assert r.answer == (None if f is None else 0 if f < 0.5 else 1 if f <= 2 else 2)
        points = next(t for t in fig.data if t.name == "growth factor")
        assert list(points.y) == [g if g else None for g in d["growth"]]
        lo, hi = fig.layout.yaxis2.range  # centred on ×1: ×0.99 sits on the line, the band is the answer's
        assert lo == pytest.approx(-hi) and hi >= math.log10(2)
        assert any(s.y0 == 0.5 and s.y1 == 2 for s in fig.layout.shapes)
        assert fig.layout.yaxis.type != "log"  # gap in and out on a linear axis: a 1 % change looks like 1 %
        if f is not None:
            assert f"×{f:.3g}" in title and f"×{f:.3g}" in r.reveal
    elif r.step == 5:
        last = {dt: p["relative"][-1] for dt, p in d["dtypes"].items()}
        worst = max(last, key=last.get)
        assert r.answer == (list(d["dtypes"]).index(worst) if last[worst] > 0 else None)
        labels = _annotations(fig)
        boxes = []
        for dt, p in d["dtypes"].items():
            a = labels[f"ε {dt}"]
            assert a.y == pytest.approx(math.log10(p["eps"]))  # at its own line (plotly reads log10 on a log axis)
            boxes.append((a.y, a.yanchor))
        # labels on lines closer than 1.5 decades go on opposite sides, so they never print on top of each other
        for (y1, s1), (y2, s2) in zip(sorted(boxes), sorted(boxes)[1:]):
            assert y2 - y1 >= 1.5 or (s1, s2) == ("top", "bottom")
        _zero_label_at_the_floor(fig, [v for p in d["dtypes"].values() for v in p["relative"]])
    elif r.step == 6:
        t = d["parting"]
        assert t is not None, "step 6 must show a parting on every machine"
        m, g = d["margins"][t], d["gaps"][t]
        assert r.answer == (1 if m <= g else 0)
        assert f"part at step {t}" in r.reveal and f"{m:.3g}" in r.reveal and f"{g:.3g}" in r.reveal
        assert f"they part at step {t}" in title and d["dtype"] in title
        assert d["cache_token"] != d["no_cache_token"]
        # the same constructed case on every machine (tiny:flip in bfloat16), its near tie in words from the numbers
        assert d["constructed"] and "(constructed)" in title and d["model"] in r.reveal
        near = max(d["margins"][t], 0) <= 0.01 * d["logit_scale"]
        assert ("a near tie" in r.reveal) == near and ("not a near tie" in r.reveal) == (not near)
        _zero_label_at_the_floor(fig, d["margins"] + d["gaps"])
    elif r.step == 7:
        m = d["max"]
        assert f"{m['normal']:.2g}" in title
        a, b, c = m["normal"], m["float64"], m["invariant"]
        want = (None if not a else 2 if b == c == 0 else 1 if c == 0 and b < a * 1e-6 else
                0 if b > a * 0.1 and c > a * 0.1 else None)
        assert r.answer == want  # a result that fits no choice is not graded
        assert ("exactly 0 on every layer" in r.reveal) == (c == 0)
        assert ("proves nothing here" in r.reveal) == bool(a and c and b < a * 1e-6)
        _zero_label_at_the_floor(fig, d["normal"] + d["float64"] + d["invariant"])
    elif r.step == 8:
        rows = {(x["scenario"], x["dtype"]): x["hidden"] for x in d["rows"]}
        bug64 = rows[("position ids omitted", "float64")]
        assert r.answer == (1 if bug64 > 1e-9 else 0)
        assert f"still {bug64:.3g} in float64" in r.reveal
        _zero_label_at_the_floor(fig, list(rows.values()))


def walk(models, dtype: str) -> list[lesson.StepResult]:
    """Every step as the page runs it, in `dtype` where the step has one; each checked."""
    opts = {1: dict(dtype=dtype), 2: dict(dtype=dtype, n=300), 3: dict(prompt=PROMPT),
            4: dict(prompt=PROMPT, dtype=dtype), 5: dict(prompt=PROMPT), 6: dict(prompt="Hello", n=6, dtype=dtype),
            7: dict(prompt=PROMPT, dtype=dtype), 8: dict(prompt=PROMPT, dtype=dtype)}
    done = []
    for k in lesson.STEPS:
        r = lesson.run_step(k, models, **opts[k])
        check_step(r)
        done.append(r)
    return done


def check_handout(results) -> None:
    page = handout_html(results, "tiny:llama")
    assert "<details open" not in page  # every answer hidden until revealed
    from kvviz.teach.exercises import EXERCISES

    assert page.count("<details>") == len(results) + len(EXERCISES)  # and one per exercise
    outside = re.sub(r"<details>.*?</details>", "", page, flags=re.S)
    assert "Answer:" not in outside and "Why." not in outside
    for r in results:
        if r.answer is not None:
            assert f"<b>Answer:</b> {r.choices[r.answer]}" in page


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_step_agrees_with_its_figure_and_answer(models, dtype):
    check_handout(walk(models, dtype))


def test_a_prediction_is_graded_from_a_typed_answer():
    r = lesson.step_float(0.1, "float16")
    assert r.is_right(r.answer) is True and r.is_right((r.answer + 1) % 4) is False and r.is_right(None) is None
    assert r.graded(r.answer).startswith("Right") and r.graded((r.answer + 1) % 4).startswith("Not this time")


@pytest.mark.skipif(bool(os.environ.get(CHILD)), reason="the child process runs the walk itself")
@pytest.mark.skipif(os.environ.get("ATEN_CPU_CAPABILITY") == "avx2",
                    reason="AVX2 is forced in this process: the walk above runs on it (make test-any-cpu)")
@pytest.mark.parametrize("threads", [2])  # 1 and 2 threads: make test-any-cpu runs the walk itself at each
def test_every_step_agrees_on_the_forced_avx2_path(threads):
    env = {**os.environ, **AVX2, CHILD: "1", "KVVIZ_TEST_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    env.pop("PYTEST_XDIST_WORKER", None)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:randomly", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "test_lesson_student.py"), "-k", "every_step_agrees_with"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "2 passed" in p.stdout
    # the child really ran on AVX2 kernels
    cap = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=env, capture_output=True, text=True, timeout=300).stdout.strip()
    assert cap in ("AVX2", "DEFAULT") or not torch.backends.cpu.get_cpu_capability().startswith("AVX"), cap


@pytest.mark.slow
def test_the_default_models_lesson_agrees_with_itself():
    """The Lesson a newcomer opens: the default model, every step with the page's default options."""
    models = lesson.model_loader("default", DEVICE)
    done = []
    for k in lesson.STEPS:
        r = lesson.run_step(k, models)
        check_step(r)
        done.append(r)
    check_handout(done)
    assert all(r.answer is not None for r in done if r.step != 4), [(r.step, r.reveal) for r in done]
