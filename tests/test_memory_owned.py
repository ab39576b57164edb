"""Issue 52 item 5: views own their memory knowledge. kvviz/core/memory.py keeps the arithmetic and the plan; a view
that holds something of its own declares it in its folder (a MemoryProfile subclass in kvviz/views/<view>/memory.py)
and the plan asks it, by the view's name, through the registry."""
from __future__ import annotations

import ast
import dataclasses

import pytest

from kvviz import views
from kvviz.core import memory
from kvviz.core.inputs import Workload

from conftest import ROOT

SHAPE = memory.KNOWN_SHAPES["Llama-3.2-1B"]


def test_each_view_s_own_formula_is_declared_in_its_folder():
    from kvviz.views.bisect.memory import BisectMemory, bisect_bytes
    from kvviz.views.check.memory import CheckMemory
    from kvviz.views.padding.memory import PaddingMemory, batch_grid_bytes
    from kvviz.views.serving.memory import ServingMemory

    kinds = {v.name: type(v.memory) for v in views.all_views()}
    assert kinds["padding"] is PaddingMemory and kinds["bisect"] is BisectMemory
    assert kinds["serving"] is ServingMemory and kinds["check"] is CheckMemory
    assert memory.activation_bytes(SHAPE, "bfloat16", 600, 1, "check", False) == 0  # only its float64 reference runs
    assert kinds["greedy"] is kinds["reuse"] is memory.Decoding and kinds["split"] is memory.MemoryProfile
    # the plan's activations are the view's own formula (1 GiB-class numbers, not a default)
    grid = batch_grid_bytes(SHAPE, "bfloat16", 600, 4, 20, True)
    assert memory.activation_bytes(SHAPE, "bfloat16", 600, 4, "padding", True, 20) == grid > 0
    rec = bisect_bytes(SHAPE, 2, 600, 20)
    assert memory.activation_bytes(SHAPE, "bfloat16", 600, 1, "bisect", False, 20) == max(
        rec, memory.forward_bytes(views.memory_profile("bisect"), SHAPE, "bfloat16", 600, 1, False, 20))
    # kvviz/core/memory.py names no view's own field (they moved to the views' folders)
    src = (ROOT / "kvviz" / "core" / "memory.py").read_text(encoding="utf-8")
    names = {n.attr for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Attribute)} | {
        n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
    assert not names & {"batch_texts", "engine_calls", "bisector", "past_window", "batch_grid_bytes", "bisect_bytes"}
    fields = {f.name for f in dataclasses.fields(memory.MemoryProfile)}
    assert not fields & {"batch_texts", "engine_calls", "bisector", "past_window", "decoded_runs", "cache_copies",
                         "stepwise_reference"}


def test_a_view_s_own_profile_drives_the_plan(monkeypatch):
    """A profile declared outside kvviz/core (as a view's folder would) sets the plan's tokens, batch and
    activations with no edit to kvviz/core/memory.py."""

    @dataclasses.dataclass(frozen=True)
    class Toy(memory.MemoryProfile):
        def sizes(self, spec, w, tokens, batch, compared):
            return 1000, 3, compared  # its own prompts: 1000 tokens, 3 rows

        def activations(self, shape, dtype, tokens, batch, reference, compared=None, steps=None,
                        reference_decodes=True, runs=None, attention="sdpa", device="cpu"):
            return 7 * tokens * batch  # what it holds: 7 bytes a token a row

    looked_up = memory._profiles
    monkeypatch.setattr(memory, "_profiles", lambda name: Toy(reference=False) if name == "toy" else looked_up(name))
    plan = memory.plan_workload("tiny:llama", "float32", "cpu", "toy", Workload(texts=("hi",)))
    assert (plan.tokens, plan.batch, plan.activations) == (1000, 3, 21000)
    assert plan.reference == "none" and plan.reference_bytes == 0
    shape = memory.model_shape("tiny:llama")
    assert plan.cache == memory.cache_bytes(shape, "float32", 1000, 3, False)
    assert plan.notes == []
    settled = plan.settle(type("R", (), {"float64": None})())  # no float64 rerun to drop: the plan is unchanged
    assert settled.activations == 21000


@pytest.mark.parametrize("view,note", [("split", "the cached path equalled the full forward bit for bit"),
                                       ("greedy", "no two paths parted, so none was replayed in float64"),
                                       ("serving", "no prompt parted from its reference")])
def test_a_settled_plan_says_why_in_the_view_s_words(view, note):
    steps = {"greedy": dict(steps=4, reference_decodes=False)}.get(view, {})
    engine = memory.PagedCalls(((2, 1),), ((1, 1),), 8) if view == "serving" else None
    plan = memory.plan_shape(SHAPE, "m", "bfloat16", "cpu", view, 64, compared=10, engine=engine,
                             free=10 ** 12, **steps)
    assert plan.if_identical is not None
    plan.settle(type("R", (), {"float64": None, "reference_ran": False})())
    assert plan.notes[-1] == "no float64 rerun: " + note and plan.reference_bytes == 0
