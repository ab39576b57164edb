"""The Lesson page (AppTest): every step computes, asks, reveals its answer and figure, and view-only changes (a
prediction, the reveal, moving between steps) never rerun a step; the handout is offered as one download."""
import pytest

pytest.importorskip("streamlit")  # the app tests need Streamlit (a GPU image may lack it)

import kvviz.teach.lesson as lesson_mod

from test_app import alerts, count_calls, start

pytestmark = pytest.mark.app


def test_the_lesson_walks_every_step_and_reveals_each_figure(monkeypatch):
    calls = count_calls(monkeypatch, lesson_mod, "run_step")
    at = start("pages/lesson.py", model="tiny:llama")
    assert "Lesson" in at.title[0].value
    labels = at.radio(key="lesson_step").options
    assert len(labels) == 9 and labels[-1].startswith("Exercises")
    for i, label in enumerate(labels[:8], start=1):
        at.radio(key="lesson_step").set_value(label).run()
        assert not at.exception, (label, at.exception)
        assert len(calls) == i, label  # each step computed once, when opened
        assert "Predict." in " ".join(m.value for m in at.markdown), label
        assert len(at.get("plotly_chart")) == 0  # the figure waits for the reveal
        at.button(key=f"lesson_reveal_{i}").click().run()
        assert not at.exception, (label, at.exception)
        text = " ".join(m.value for m in at.markdown)
        assert "Why." in text and len(at.get("plotly_chart")) == 1, label
        assert len(calls) == i, label  # revealing does not rerun the step
    # back to step 1: its result and its reveal are kept, nothing reruns
    at.radio(key="lesson_step").set_value(labels[0]).run()
    assert len(at.get("plotly_chart")) == 1 and len(calls) == 8


def test_a_prediction_is_graded_against_the_measured_answer():
    at = start("pages/lesson.py", model="tiny:llama")
    pred = [r for r in at.radio if r.key and r.key.startswith("lesson_pred_1")][0]
    pred.set_value("2^-7 ≈ 0.00781").run()  # the default number and dtype: 0.1 in bfloat16
    assert not at.exception
    assert "Right" in alerts(at) and len(at.get("plotly_chart")) == 1
    at.selectbox(key="lesson_dtype1").set_value("float16").run()
    pred = [r for r in at.radio if r.key and r.key.startswith("lesson_pred_1")][0]
    pred.set_value("2^-7 ≈ 0.00781").run()
    assert "Not this time" in alerts(at) and "2^-10" in alerts(at)


def test_bad_input_is_one_line_and_the_handout_downloads():
    at = start("pages/lesson.py", model="tiny:llama")
    at.radio(key="lesson_step").set_value(at.radio(key="lesson_step").options[5]).run()
    at.text_input(key="lesson_prompt6").input("   ").run()
    assert not at.exception and "empty" in alerts(at)
    at.text_input(key="lesson_prompt6").input("Hello").run()
    assert not at.exception
    at.button(key="lesson_handout").click().run()
    assert not at.exception
    assert len(at.get("download_button")) == 1


def test_find_the_bug_exercises_check_the_students_verdict(monkeypatch):
    import kvviz.teach.exercises as exercises

    calls = count_calls(monkeypatch, exercises, "run_exercise")
    at = start("pages/lesson.py", model="tiny:llama")
    at.radio(key="lesson_step").set_value(at.radio(key="lesson_step").options[-1]).run()
    assert not at.exception and len(calls) == 1
    assert [r for r in at.radio if r.key == "lesson_ex"][0].value == "server"
    assert len(at.get("plotly_chart")) == 1
    # the float64 rerun is shown on request, without running anything again
    at.button(key="lesson_ex64_server").click().run()
    assert "float64" in " ".join(m.label for m in at.metric) and len(calls) == 1
    # the pad-bug exercise: answering logic is right, and the hidden setting is named
    at.radio(key="lesson_ex").set_value("batch").run()
    at.radio(key="lesson_ex_answer_batch").set_value("logic").run()
    assert not at.exception and len(calls) == 2
    assert "Right." in alerts(at) and "position ids" in alerts(at)
    at.radio(key="lesson_ex_answer_batch").set_value("precision").run()
    assert "Not this one: it is logic" in alerts(at) and len(calls) == 2
