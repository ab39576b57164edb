"""Time estimates from measurement (issue 53.1): kvviz.core.estimate, the run context that carries the estimate, the
result and JSON that carry it beside the seconds taken, the CLI's --plan, the progress line's time left. No test
depends on real timing: paces are given or measured by a fake clock."""
from __future__ import annotations

import ast
import json
from dataclasses import replace
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
    lengths = estimate.calibration_lengths(lm)  # 1, 256 and 1,024 tokens within the model's context
    limit = lm.config.max_position_embeddings
    assert lengths == [1, 256, min(1024, limit)] if limit > 256 else len(set(lengths)) == 3 and max(lengths) <= limit
    assert timed == [(n, False) for n in lengths] + [(8, True), (32, True)]
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
    # three calls of 100 s (a call's fixed cost: the prefix, the rest through the cache, the full forward), the
    # float64 rerun at float64's rate (2x float32's before it is measured: the fixed cost too), the proof (invariant
    # mode unmeasured: 3x the run); the last two only where the paths differ: quoted apart
    assert line.startswith("time: about 5 min, up to 30 min if the paths differ (run 5 min; if they differ: float64 "
                           "rerun 10 min, invariant proof 15 min)"), line
    assert "from this machine's measured pace" in line


def test_each_views_workload_declares_what_its_run_computes():
    """What each view's run does, counted from its run.py, is declared in its workload (kvviz.core.estimate never
    compares view names): its forwards and decode steps, the dtypes it runs in, the copies of the model it loads or
    casts, the float64 rerun (certain or only where the paths differ), the lens."""
    from kvviz import views
    from kvviz.views.greedy.run import DEFAULT_PATHS

    def cfg(name, *a, **k):
        return views.get(name).config_type()(*a, **k)

    d = cfg("dtypes", (PROMPT,), ("float32", "float16", "bfloat16")).workload()
    assert d.run_dtypes == ("float64", "float32", "float16", "bfloat16") == d.copies  # three dtypes + float64
    assert (d.forwards, d.proves, d.float64_rerun) == (2.0, True, False)
    two = cfg("dtypes", (PROMPT, PROMPT + " again"), ("bfloat16",)).workload()
    assert (two.run_dtypes, two.forwards, two.proves) == (("float64", "bfloat16"), 4.0, False)

    p = cfg("padding", PROMPT, None, 4).workload()  # 5 scenarios in 3 placements (2 batch-mates: 3 rows) + reference
    assert (p.forwards, p.float64_certain, p.copies, p.proves) == (26.0, True, ("float64",), True)
    assert cfg("padding", PROMPT, None, 0).workload().forwards == 21.0  # no left-padded placement
    assert cfg("padding", PROMPT, left_pad=2, only=(("in a batch", "cache"),)).workload().forwards == 4.0

    r = cfg("reuse", "You are kind.\n", ("Q: one?", "Q: two?"), 8).workload()  # fresh, deepcopy, reused
    assert (r.forwards, r.decode_paths, r.new_tokens, r.float64_certain) == (4.0, 6, 8, True)
    assert cfg("reuse", "P", ("Q",), 3, ways=("deepcopy",)).workload().decode_paths == 2  # + fresh, the reference

    t = cfg("loading_trap", "This is a ", 12, "bfloat16").workload()
    assert (t.run_dtypes, t.copies, t.casts, t.full_paths, t.forwards) == \
        (("bfloat16",), ("bfloat16", "float32"), ("bfloat16",), 2, 0.0)  # the prompt's forward: each path's first step

    m = cfg("matrix", prompt=PROMPT, max_new_tokens=8).workload()  # 2 attentions x 2 caches x 2 repeats
    assert (m.forwards, m.decode_paths, m.full_paths, m.float64_paths) == (10.0, 8, 1, 1)
    assert m.copies == ("@eager", "@sdpa", "float64@eager")

    q = cfg("quant", PROMPT, kv="quanto:int4", max_new_tokens=24).workload()
    assert (q.forwards, q.decode_paths, q.casts) == (3.0, 3, ())
    assert cfg("quant", PROMPT, kv="none", weights="int8").workload().casts == ("int8",)

    c = cfg("check").workload()
    assert (c.run_dtypes, c.copies, c.forwards) == (("float64",), ("float64",), 20.0)

    s = cfg("serving", prompts=["a b", "c d e", "f", "g h", "i"], runs=3, max_new_tokens=8, batch_size=4).workload()
    # 3 runs of: alone 5 requests one at a time, batch 2 batches of 4 (3 fill-ups), warm 5 (+ 5 warmers' prefills);
    # 5 no-cache references
    assert (s.full_paths, s.decode_paths, s.forwards) == (5, 3 * (5 + 2 + 5), 5 + 3 * (5 + 2 + 10.0))

    lens = cfg("lens").workload()
    assert (lens.lens, lens.proves, lens.float64_rerun) == (2.0, False, True)  # the lens refuses the proof
    g = GreedyConfig(prompt=PROMPT, paths=tuple(DEFAULT_PATHS)).workload()
    assert g.copies == (("float64",) if "float64" in map(str, DEFAULT_PATHS) else ())


def test_the_workloads_extra_costs_are_priced_from_the_measured_pace():
    """Each dtype at its measured rate, every copy not loaded yet and every cast at the copy rate (the checkpoint read
    and written in the copy's dtype), the lens per hidden state and compared position; a copy already loaded costs nothing."""
    pace = Pace(0.0, 1e-3, 0.0, params=10**9, layers=5, rates={"float32": 1.0, "float64": 2.5, "float16": 4.0,
                                                                "bfloat16": 3.0}, head=1e-3, load_gb_s=2.0,
                copy_gb_s=0.5)
    w = Workload(texts=(PROMPT,), forwards=2.0, run_dtypes=("float64", "float32", "bfloat16"),
                 copies=("float64", "bfloat16"))
    est = estimate.estimate(pace, w, 100, dtype="float32")
    work = 2 * 100 * 1e-3  # two forwards of 100 tokens
    assert est.seconds("run") == pytest.approx(work * (2.5 + 1 + 3) + 0.5 * (12 + 8) + 0.5 * (12 + 2))  # 2 copies
    loaded = estimate.estimate(pace, w, 100, dtype="float32", loaded=lambda c: c == "float64")
    assert loaded.seconds("run") == pytest.approx(work * 6.5 + 0.5 * (12 + 2))
    # in a bfloat16 model the rates are taken against bfloat16's
    assert estimate.rate(pace, "float64", "bfloat16") == pytest.approx(2.5 / 3)
    # a cast copy: a deep copy in the model's dtype (read + write) and the cast (read + write), at 0.5 s a GB
    cast = estimate.estimate(pace, Workload(texts=(PROMPT,), forwards=0.0, casts=("bfloat16",)), 100)
    assert cast.seconds("run") == pytest.approx(0.5 * (3 * 4 + 2))
    # the lens: 2 head calls x 5 hidden states, each 20 ms (reading the head) + 96 compared positions (100 tokens
    # split at 4) x 1 ms
    lens = estimate.estimate(replace(pace, head0=0.02), Workload(texts=(PROMPT,), forwards=0.0, split=4, lens=2.0),
                             100)
    assert lens.seconds("run") == pytest.approx(2 * 5 * (0.02 + 96 * 1e-3))
    # a split's float64 twin loads when its float64 rerun starts: in that "may happen" phase, not the run's
    split = estimate.estimate(pace, SplitConfig(prompt=PROMPT, split=3).workload(), 100, dtype="float32")
    assert split.seconds("run") == pytest.approx(work)
    assert split.seconds("float64") == pytest.approx(work * 2.5 + 0.5 * (12 + 8))
    # the padding grid's float64 rerun always runs (certain); its proof only where a cell is precision
    pad = estimate.estimate(pace, Workload(texts=(PROMPT,), forwards=2.0, float64_certain=True, copies=("float64",),
                                           proves=True), 100)
    assert [(p.name, p.maybe) for p in pad.phases] == [("run", False), ("float64", False), ("proof", True)]
    assert pad.seconds("run") == pytest.approx(work + 10.0)
    # without a measured copy rate, a copy at the first load's rate for its size
    assert estimate.copy_seconds(replace(pace, copy_gb_s=None), "float64", "float32") == pytest.approx(2.0 * 8)


def test_may_happen_phases_are_quoted_apart_and_a_run_is_compared_with_what_ran():
    """A split's float64 rerun and proof run only where the paths differ: the line says the certain part and the most
    it can take; a run that came out bit for bit equal is compared with its run phase only."""
    est = Estimate((Phase("run", 4.0), Phase("float64", 3.0, maybe=True), Phase("proof", 3.0, maybe=True)),
                   basis="from this machine's measured pace")
    assert (est.certain_s, est.total_s) == (4.0, 10.0)
    assert est.line() == ("about 4 s, up to 10 s if the paths differ (run 4 s; if they differ: float64 rerun 3 s, "
                          "invariant proof 3 s), from this machine's measured pace")
    assert est.ran_s({"run": 3.9}) == 4.0 and est.ran_s({"run": 3.0, "float64": 2.0}) == 7.0
    assert est.to_dict()["certain_s"] == 4.0 and est.to_dict()["maybe"] == ["float64", "proof"]
    sure = Estimate((Phase("run", 4.0), Phase("float64", 3.0)))
    assert sure.line() == "about 7 s (run 4 s, float64 rerun 3 s)" and sure.ran_s({}) == 7.0


def test_calibration_measures_the_extras_once_on_the_model_itself(store):
    """params, hidden states, each dtype's rate against the model's own (its own: 1), the head, the model's own
    load per GB (LoadedModel.load_s) and the copy rate: measured with the forwards, kept, read back."""
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    extras = estimate.measure_extras(lm)
    assert extras["params"] == sum(p.numel() for p in lm.model.parameters())
    assert extras["layers"] == lm.n_layers + 1 and extras["rates"]["float32"] == 1.0
    assert set(extras["rates"]) == {"float64", "float32", "float16", "bfloat16"}
    assert extras["head"] >= 0 and extras["head0"] >= 0 and extras["copy_gb_s"] > 0
    assert lm.load_s > 0 and extras["load_gb_s"] == pytest.approx(lm.load_s / (extras["params"] * 4 / 1e9))
    fake = dict(extras, rates={"float32": 1.0, "float64": 2.0}, head=1e-4)
    pace = estimate.calibrate(lm, clock_forward=lambda n, inv: 0.01 + 1e-4 * n, extras=lambda m: fake)
    assert (pace.params, pace.layers, pace.rates, pace.head) == (fake["params"], fake["layers"], fake["rates"], 1e-4)
    again = estimate.load_pace(estimate.key_of_model(lm))
    assert again == pace  # kept as JSON and read back whole


def test_a_copy_loaded_already_is_known_before_the_run(store):
    """LoadedModel.has_copy: the model in another dtype or attention is loaded (twin() would return it from the
    cache) or not - the estimate prices only the copies still to load."""
    from kvviz.models import loading

    loading.clear_cache()
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    assert lm.has_copy() and not lm.has_copy("float64") and not lm.has_copy(None, "eager")
    lm.twin("float64")
    assert lm.has_copy("float64")
    kvviz.load_model("tiny:llama", "float32", "cpu", "eager")
    assert lm.has_copy(None, "eager")
    w = Workload(texts=(PROMPT,), copies=("float64", "@eager", "bfloat16"))
    missing = []
    estimate.for_model(lm, w, 8).phases  # noqa: B018 - its calibration
    pace = estimate.calibrate(lm)
    est = estimate.estimate(pace, w, 8, loaded=lambda c: (missing.append(c), lm.has_copy(
        c.partition("@")[0] or None, c.partition("@")[2] or None))[1])
    assert missing == ["float64", "@eager", "bfloat16"]
    assert est.seconds("run") == pytest.approx(pace.forward(8) + estimate.copy_seconds(pace, "bfloat16", "float32"))
