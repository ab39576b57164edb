"""Time estimates from measurement (issue 53.1): kvviz.core.estimate, the run context that carries the estimate, the
result and JSON that carry it beside the seconds taken, the CLI's --plan, the progress line's time left. No test
depends on real timing: paces are given or measured by a fake clock."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvviz
from kvviz.core import estimate
from kvviz.core.estimate import Estimate, Pace, Phase
from kvviz.core.inputs import SplitConfig, Workload
from kvviz.views.greedy.run import GreedyConfig

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Hello world, caching is fun!"


@pytest.fixture
def store(monkeypatch, tmp_path):
    """A store of this test's own (the session's cache dir is shared by every test)."""
    path = tmp_path / "estimates.json"
    monkeypatch.setattr(estimate, "store_path", lambda: path)
    return path


def test_the_pace_is_fitted_through_three_lengths_quadratic_part_included():
    """c0 + a·n + b·n² through 1, 64 and 256 tokens: the quadratic part is measured, not assumed."""
    c0, a, b = 0.02, 1e-3, 2e-6
    points = [(n, c0 + a * n + b * n * n) for n in (1, 64, 256)]
    got = estimate.fit(points)
    assert got == pytest.approx((c0, a, b), rel=1e-6)
    # noise that would make the quadratic part negative: it is dropped, never negative
    assert estimate.fit([(1, 0.01), (64, 0.5), (256, 1.0)])[2] == 0.0


def test_calibration_is_kept_as_json_per_model_dtype_device_and_threads(store):
    """Measured once (the forwards timed by a fake clock here), kept in estimates.json (no pickle), read back."""
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    timed = []

    def clock_forward(n, invariant):
        timed.append((n, invariant))
        return (0.5 if invariant else 0.01) + 1e-3 * n + 1e-5 * n * n

    pace = estimate.calibrate(lm, invariant=True, clock_forward=clock_forward)
    assert timed == [(1, False), (64, False), (256, False), (8, True), (32, True)]
    d = json.loads(store.read_text())
    (key,) = d
    assert key == estimate.key_of_model(lm) and key.startswith("tiny:llama|float32|cpu|threads=")
    assert d[key]["b"] == pytest.approx(1e-5, rel=0.02) and pace.inv is not None
    assert estimate.calibrate(lm, invariant=True, clock_forward=clock_forward) == pace and len(timed) == 5


def test_greedy_without_cache_grows_with_the_square_of_its_new_tokens():
    """The no-cache path reruns the whole sequence at each step: 1,024 new tokens cost far more than 8 x 128 - the
    "about 2 min" for a 713 s run of issue 53."""
    pace = Pace(0.01, 1e-3, 1e-6)
    w = GreedyConfig(prompt=PROMPT, max_new_tokens=1024).workload()
    assert (w.forwards, w.decode_paths, w.full_paths) == (3.0, 2, 1)
    est = estimate.estimate(pace, w, 10, view="greedy")
    no_cache = sum(pace.forward(10 + i) for i in range(1024))
    cached = 2 * sum(pace.step(10 + i) for i in range(1024))
    assert est.names() == ("run",)
    assert est.seconds("run") == pytest.approx(3 * pace.forward(10) + no_cache + cached)
    short = estimate.estimate(pace, GreedyConfig(prompt=PROMPT, max_new_tokens=128).workload(), 10)
    assert est.total_s > 20 * short.total_s  # 8x the tokens, more than 20x the time


def test_a_split_is_costed_with_its_float64_rerun_and_its_proof():
    pace = Pace(0.0, 1e-3, 0.0, inv=(0.0, 1e-2, 0.0))
    w = SplitConfig(prompt=PROMPT, split=3).workload()
    est = estimate.estimate(pace, w, 100, view="split", dtype="float32")
    assert est.names() == ("run", "float64", "proof")
    assert est.seconds("run") == pytest.approx(0.2)  # two forwards of 100 tokens at 1 ms a token
    assert est.seconds("float64") == pytest.approx(0.2 * estimate.FLOAT64_PRIOR["float32"])
    assert est.seconds("proof") == pytest.approx(2.0)  # invariant mode's own measured pace
    assert est.bar()["run"] == pytest.approx((0.0, 0.2 / 2.6))
    assert estimate.estimate(pace, Workload(texts=(PROMPT,), prove=False, proves=True, float64_rerun=True), 100,
                             dtype="float32").names() == ("run", "float64")  # --no-proof: no proof phase


def test_each_finished_run_refines_its_views_phases(store):
    """A run estimated at 0.2 s that took 0.4 s: the view's next estimate of that phase is 0.4 s; another view's is
    unchanged."""
    key = "tiny:llama|float32|cpu|threads=1"
    estimate.save_pace(key, Pace(0.0, 1e-3, 0.0))
    w = Workload(texts=(PROMPT,), forwards=2.0)
    est = estimate.estimate(estimate.load_pace(key), w, 100, view="split")
    estimate.record(key, "split", est, {"run": 0.4})
    pace = estimate.load_pace(key)
    assert estimate.estimate(pace, w, 100, view="split").seconds("run") == pytest.approx(0.4)
    assert estimate.estimate(pace, w, 100, view="greedy").seconds("run") == pytest.approx(0.2)
    estimate.record(key, "split", estimate.estimate(pace, w, 100, view="split"), {"run": 0.8})
    assert estimate.load_pace(key).fix["split"]["run"] == pytest.approx((2 * 4) ** 0.5)  # geometric mean 2 and 4


def test_runs_estimated_before_another_was_recorded_do_not_compound(store):
    """Four runs estimated at once (0.2 s each, before any finished), each measured at 0.4 s: the correction is 2,
    not 2, 4, 8, 16 (CI once saw 1,000x after four browser sessions at once: each record divided by a correction its
    estimate had not used)."""
    key = "tiny:llama|float32|cpu|threads=1"
    estimate.save_pace(key, Pace(0.0, 1e-3, 0.0))
    w = Workload(texts=(PROMPT,), forwards=2.0)
    ests = [estimate.estimate(estimate.load_pace(key), w, 100, view="split") for _ in range(4)]
    for est in ests:
        estimate.record(key, "split", est, {"run": 0.4})
    assert estimate.load_pace(key).fix["split"]["run"] == pytest.approx(2.0)
    assert estimate.estimate(estimate.load_pace(key), w, 100, view="split").seconds("run") == pytest.approx(0.4)


def test_a_run_that_shared_the_model_with_another_does_not_refine_the_pace(store, monkeypatch):
    """pages/runner: a run marked as overlapped (it waited for the model or ran beside another run on it) is timed
    on its result but never recorded; a run alone is."""
    from types import SimpleNamespace

    from pages import runner

    key = "tiny:llama|float32|cpu|threads=1"
    estimate.save_pace(key, Pace(0.0, 1e-3, 0.0))
    monkeypatch.setattr(estimate, "key_of_model", lambda lm: key)
    est = estimate.estimate(estimate.load_pace(key), Workload(texts=(PROMPT,), forwards=2.0), 100, view="split")
    lm = SimpleNamespace()
    shared = Estimate(est.phases, fix=est.fix)
    result = SimpleNamespace()
    runner._finish_timings(lm, "split", {"estimate": shared, "overlapped": True}, result, 40.0)
    assert estimate.load_pace(key).fix == {}
    runner._finish_timings(lm, "split", {"estimate": est}, result, 0.4)
    assert estimate.load_pace(key).fix["split"]["run"] == pytest.approx(2.0)


def test_time_left_moves_to_the_next_phases_estimate_at_a_phase_change():
    """Fake clock: a run of three phases estimated 10 s, 20 s and 30 s. Before any pace, the line says the estimate;
    at the float64 phase it says that phase's estimate plus the proof's; in the proof, the proof's own pace."""
    from pages.runner import _Ticker

    est = Estimate((Phase("run", 10.0), Phase("float64", 20.0), Phase("proof", 30.0)))
    now, drawn = [0.0], []
    t = _Ticker(lambda f, text: drawn.append((f, text)), lambda: now[0], estimate=est)
    t.phase("run")
    t.report(0.0, "Prefix forward…")
    assert drawn[-1][1] == "Prefix forward… — about 60 s left"
    now[0] = 12.0
    t.phase("float64")
    t.report(1 / 6, "float64: rerunning the same scenario for the verdict…")
    assert drawn[-1][1] == "float64: rerunning the same scenario for the verdict… — about 50 s left"
    now[0] = 17.0
    t.tick()
    assert drawn[-1][1].endswith("about 45 s left")  # 20 - 5 s in the phase, + 30
    now[0] = 40.0
    t.phase("proof")
    t.report(0.5, "invariant proof: rerunning in invariant mode…")
    assert drawn[-1][1].endswith("about 30 s left")  # the proof's estimate
    now[0] = 70.0
    t.report(0.6, "invariant proof: Rest through the cache…")  # 30 s for a tenth of the bar: 120 s for the rest
    assert drawn[-1][1].endswith("about 2 min left")
    assert t.phases.measured() == {"run": 12.0, "float64": 28.0, "proof": 30.0}


def test_split_writes_no_module_state_during_a_run(store):
    """PHASE_COST, AUTO_PROOF and _bisector are gone: the split module's globals are the same before and after a run
    (a warm-up run first: the registry resolves lazily), and nothing in it says `global`."""
    from kvviz import views
    from kvviz.core.protocol import RunContext
    from kvviz.views.split import run as split

    tree = ast.parse(Path(split.__file__).read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)]
    assert not hasattr(split, "PHASE_COST") and not hasattr(split, "AUTO_PROOF") and not hasattr(split, "_bisector")
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    run = views.get("split").runner()
    run(lm, SplitConfig(prompt=PROMPT, split=4), RunContext(prove=False))

    def state():
        return {k: (type(v), repr(v)) for k, v in vars(split).items()
                if isinstance(v, (dict, list, set)) and not k.startswith("__")}

    before = state()
    phases = []
    res = run(lm, SplitConfig(prompt=PROMPT, split=4),
              RunContext(auto_proof=False, on_phase=phases.append,
                         estimate=Estimate((Phase("run", 1.0), Phase("float64", 1.0)))))
    assert state() == before
    assert phases == ["run", "float64"] and res.proof_s is None  # auto_proof False: no proof phase
    assert res.timings.estimate_s == 2.0 and res.timings.elapsed_s > 0


def test_a_runs_json_carries_its_estimate_and_elapsed_time(store, tmp_path):
    """The CLI's --json and --json-out: estimate_s (the estimate it started with, measured on this machine) beside
    elapsed_s; opened again, the result keeps both."""
    from kvviz.io.export import open_result

    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "kvviz", "split", "--model", "tiny:llama", "--prompt", PROMPT,
                           "--split", "4", "--json", "--json-out", str(out), "--quiet", "--no-proof"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**__import__("os").environ, "KVVIZ_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["estimate_s"] > 0 and d["elapsed_s"] > 0
    saved = json.loads(out.read_text())
    assert saved["estimate_s"] == d["estimate_s"]
    opened = open_result(out.read_text()).result
    assert opened.timings.estimate_s == d["estimate_s"]
    kept = json.loads((tmp_path / "cache" / "estimates.json").read_text())  # measured and refined by the run
    (pace,) = kept.values()
    assert "split" in pace["fix"] and pace["c0"] >= 0


def test_plan_prints_the_estimate_beside_the_memory_plan(store, capsys):
    """--plan (nothing loaded): a first guess before this machine measured the model, the measured pace after."""
    from kvviz.cli import main

    args = ["split", "--model", "tiny:llama", "--prompt", PROMPT, "--split", "4", "--plan"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "memory plan:" in out and "time: about" in out and "a first guess" in out
    estimate.save_pace(estimate.key_of("tiny:llama", "float32", "cpu"), Pace(100.0, 0.0, 0.0))
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("time:"))
    # two forwards of 100 s, the float64 rerun at twice that, the proof (invariant mode unmeasured: 3x the run)
    assert line.startswith("time: about 20 min (run 3 min, float64 rerun 7 min, invariant proof 10 min)"), line
    assert "from this machine's measured pace" in line
