"""Find the bug (kvviz/teach/exercises.py): each exercise's hidden scenario gives the verdict its story promises, and the
check grades an answer against it."""
import pytest

from kvviz import KvvizError
from kvviz.teach import exercises, lesson

from conftest import DEVICE

PROMPT = "Hello world, caching is fun! 123"


@pytest.fixture(scope="module")
def models():
    return lesson.model_loader("tiny:llama", DEVICE)


@pytest.mark.parametrize("key, verdict", [("server", "precision"), ("batch", "logic"), ("loop", "logic"),
                                          ("half", "precision")])
def test_each_exercise_has_the_verdict_its_hidden_setting_makes(models, key, verdict, row_count_rounding):
    # the rounding gap is built (a linear layer whose summation split depends on its row count): on every CPU and GPU
    run = exercises.run_exercise(key, models, PROMPT)
    assert run.verdict == verdict
    assert run.gap > 0 and run.float64_gap is not None
    if verdict == "logic":
        assert run.float64_gap > 1e-6  # the bug stays in float64
    else:
        assert run.float64_gap < 1e-12 < run.gap  # rounding closes in float64
    right, text = run.check(verdict)
    assert right and text.startswith("Right.") and run.exercise.hidden in text
    wrong, text = run.check("logic" if verdict == "precision" else "precision")
    assert not wrong and f"it is {verdict}" in text
    with pytest.raises(KvvizError, match="precision or logic"):
        run.check("rounding")


def test_unknown_exercise_is_one_line(models):
    with pytest.raises(KvvizError, match="unknown exercise"):
        exercises.run_exercise("nope", models)
