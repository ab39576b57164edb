"""One run signature (issue 40): every registered view names its config class and its `run(lm, config, ctx)`;
on tiny:llama each run reports fractions that only grow and end at 1.0, stops on a cancelled token before it runs,
and proves where asked (prove=True) and never when told not to (prove=False)."""
from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

import kvviz
from kvviz.core import cancel
from kvviz import views
from kvviz.engines import engines_root
from kvviz.core.protocol import RunContext
from conftest import DEVICE

PROMPT = "The capital of France is Paris, and the capital of Italy is"


def test_every_view_has_one_run_signature():
    seen = set()
    for v in views.all_views():
        run, config = v.runner(), v.config_type()
        assert dataclasses.is_dataclass(config) and callable(getattr(config, "validate", None)), v.name
        sig = inspect.signature(run)
        assert list(sig.parameters) == ["lm", "config", "ctx"], v.name
        assert sig.parameters["ctx"].default == RunContext(), v.name  # a default context: no settings, proof as needed
        seen.add(v.name)
    assert {"split", "greedy", "dtypes", "padding", "reuse", "loading_trap", "matrix", "kv_reload", "kv_size",
            "quant", "check", "bisect", "serving", "engine_layers"} <= seen


def _configs() -> dict:
    """A small config of every view for tiny:llama (its own config class, found through the registry)."""
    c = {v.name: v.config_type() for v in views.all_views()}
    return {
        "split": c["split"](PROMPT, split=5),
        "greedy": c["greedy"](PROMPT, max_new_tokens=4),
        "dtypes": c["dtypes"]((PROMPT,), dtypes=("float32",)),
        "padding": c["padding"](PROMPT, left_pad=2, only=(("in a batch", "cache"),)),
        "reuse": c["reuse"]("Answer briefly.", (" Q: What is the capital of France? A:",), 3),
        "loading_trap": c["loading_trap"](PROMPT, max_new_tokens=3),
        "matrix": c["matrix"](PROMPT, max_new_tokens=3, attentions=("eager",), repeats=1),
        "kv_reload": c["kv_reload"](PROMPT, " Rome"),
        "kv_size": c["kv_size"](tokens=64, measure=False),
        "quant": c["quant"](PROMPT, kv="quanto:int4", max_new_tokens=4),
        "check": c["check"](),
        "bisect": c["bisect"](PROMPT, split=5, ops=False),
        "serving": c["serving"]([PROMPT, "One, two, three,"], conditions=("alone", "batch"), runs=1,
                                max_new_tokens=3, batch_size=2),
        "engine_layers": c["engine_layers"](PROMPT, max_new_tokens=2),
        "lens": c["lens"](PROMPT, split=5),
        "serving_sweep": c["serving_sweep"](concurrency=(1, 2), lengths=(8,), prompts_per_cell=2, max_new_tokens=2,
                                            engine="transformers"),
    }


@pytest.fixture(scope="module")
def lm():
    return kvviz.load_model("tiny:llama", "float32", DEVICE)


def _runnable(engine_runs: bool = True) -> list:
    """Every view; one that starts an engine's process (vLLM) is skipped without its env, and is slow with it."""
    names = [v.name for v in views.all_views()]
    out = []
    for name in names:
        v = views.get(name)
        if v.page is not None and v.page.starts_engine and engine_runs:
            out.append(pytest.param(name, marks=pytest.mark.skip(reason="needs the vLLM env (make engines)"))
                       if not (engines_root() / "vllm").exists() else pytest.param(name, marks=[pytest.mark.slow, pytest.mark.engine]))
        elif name == "quant" and not _has("optimum.quanto"):
            out.append(pytest.param(name, marks=pytest.mark.skip(reason="optimum-quanto is not installed")))
        else:
            out.append(name)
    return out


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("name", _runnable())
def test_each_run_reports_growing_progress_ending_at_one(lm, name):
    seen: list[float] = []
    ctx = RunContext(progress=lambda f, text: seen.append(f), prove=False)
    v = views.get(name)
    if v.page is not None and v.page.starts_engine:  # vLLM takes a real checkpoint (tiny:llama's config it refuses)
        lm = kvviz.load_model("default", "bfloat16", DEVICE)
    result = v.runner()(lm, _configs()[name], ctx)
    assert type(result).__name__ == views.get(name).result_type
    assert seen and seen == sorted(seen) and seen[-1] == 1.0, seen
    assert all(0.0 <= f <= 1.0 for f in seen)


@pytest.mark.parametrize("name", _runnable(engine_runs=False))  # stopped before it runs: no engine starts
def test_a_cancelled_token_stops_each_run_before_it_runs(lm, name):
    token = cancel.Token()
    token.cancel("stopped by the test")
    seen: list[float] = []
    with pytest.raises(cancel.Cancelled):
        views.get(name).runner()(lm, _configs()[name], RunContext(progress=lambda f, t: seen.append(f), token=token))
    assert seen == []  # nothing ran: not even a first progress line


@pytest.mark.parametrize("name", _runnable(engine_runs=False))
def test_what_a_run_cannot_honour_is_refused_in_one_line_never_ignored(lm, name):
    """A context asking for invariant mode or a proof rerun that the view cannot give (its REFUSES, named in its
    registry entry) is refused before the run starts, in one line that says why; the CLI refuses the matching flag
    with the same reason (one declaration: kvviz.cli.refused_flags reads it)."""
    from kvviz.cli import refused_flags
    from kvviz.core.errors import KvvizError
    from kvviz.core.execution import ExecSettings

    view = views.get(name)
    refuses = view.refusals()
    asks = {"invariant": RunContext(settings=ExecSettings(invariant=True)), "prove": RunContext(prove=True)}
    for what, why in refuses.items():
        seen: list[float] = []
        ctx = dataclasses.replace(asks[what], progress=lambda f, t: seen.append(f))
        with pytest.raises(KvvizError) as e:
            view.runner()(lm, _configs()[name], ctx)
        assert why in str(e.value) and "\n" not in str(e.value) and seen == [], (name, what)
        flag = {"invariant": "invariant", "prove": "no_proof"}[what]
        assert refused_flags(view.command, None)[flag] == why
    assert set(refuses) <= {"invariant", "prove"}
    # the views whose run takes the proof and invariant mode from the context pass them on (read in their code)
    if not refuses:
        import inspect as _inspect

        src = _inspect.getsource(view.runner())
        assert "ctx.settings" in src and "ctx.prove" in src, name


def test_a_token_cancelled_mid_run_stops_it(lm):
    """Cancelled at the first progress line, the split run stops at its next checkpoint (a model call)."""
    token = cancel.Token()
    calls = []

    def progress(f, text):
        calls.append(f)
        token.cancel("stopped mid-run")

    with pytest.raises(cancel.Cancelled):
        views.get("split").runner()(lm, _configs()["split"], RunContext(progress=progress, token=token))
    assert len(calls) == 1


def _proof_state(name: str, res):
    """What a result says about its proof: None where none ran."""
    if name == "split":
        return res.proved
    if name == "greedy":
        return [p.proved for p in res.pairs]
    if name == "padding":
        return [c["proved"] for c in res.cells]
    if name == "reuse":
        return [r.get("proved") for r in res.runs]
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["split", "padding", "reuse", "greedy"])
def test_prove_false_runs_no_proof_and_true_proves(lm, name):
    cfg = _configs()[name]
    if name == "greedy":
        cfg = dataclasses.replace(cfg, max_new_tokens=12)
    run = views.get(name).runner()
    off = _proof_state(name, run(lm, cfg, RunContext(prove=False)))
    on = _proof_state(name, run(lm, cfg, RunContext(prove=True)))
    flat = lambda s: s if isinstance(s, list) else [s]  # noqa: E731
    assert all(p is None for p in flat(off)), off
    assert any(p is not None for p in flat(on)), on
