"""Memory plans (kvviz.core.memory): computed before loading, printed by --plan, carried by every JSON result, and a run
that cannot fit is refused in one line; an allocation failure is never called a damaged file."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT

from kvviz import cli
from kvviz.io import clirun
from kvviz.core import memory
from kvviz.core.errors import KvvizError, is_out_of_memory
from kvviz.core.memory import KNOWN_SHAPES, ModelShape, plan_run, plan_shape


def _no_loading(monkeypatch):
    import kvviz.models.loading

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(kvviz.models.loading, "load_model", boom)


def test_plan_reads_the_model_files_without_loading(monkeypatch, capsys):
    _no_loading(monkeypatch)
    plan = plan_run("tiny:llama", "float32", "cpu", "split", tokens=20)
    sh = memory.model_shape("tiny:llama")
    import kvviz.models.tiny

    cfg = kvviz.models.tiny.TINY_CONFIGS["llama"]
    assert (sh.layers, sh.hidden, sh.vocab) == (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"])
    assert plan.weights == 4 * sh.params and sh.checkpoint_dtype == "float32"
    assert plan_run("tiny:llama", "bfloat16", "cpu", "split", tokens=20).weights == 2 * sh.params
    rc = cli.main(["split", "--model", "tiny:llama", "--prompt", "Hello world", "--split", "3", "--plan"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("memory plan: split on tiny:llama") and "total" in out and "fits" in out


def test_weight_quantization_plans_the_model_copy(monkeypatch, capsys):
    """quant and the card with --weights deep-copy the model to quantize it: the plan counts that copy."""
    _no_loading(monkeypatch)
    from kvviz.cli import build_parser

    def plan(argv):
        return clirun.plan_for_args(build_parser().parse_args(argv))

    for view, extra in (("check", []), ("quant", ["--prompt", "Hello world"])):
        base = plan([view, "--model", "tiny:llama", "--dtype", "bfloat16"] + extra)
        quant = plan([view, "--model", "tiny:llama", "--dtype", "bfloat16", "--weights", "int8"] + extra)
        assert base.extra_models == 0
        assert quant.extra_models == quant.weights == base.weights > 0
        assert quant.total == base.total + base.weights
        assert any("weight quantization" in n for n in quant.notes)


def test_streamed_reference_is_planned_for_big_models():
    big = KNOWN_SHAPES["Llama-3.1-8B"]
    p = plan_shape(big, "8B", "bfloat16", "cuda", "split", 512, free=80 * 10 ** 9)
    assert p.reference == "streamed" and p.reference_bytes < 10 ** 9  # not the 64 GB twin
    twin = plan_shape(big, "8B", "bfloat16", "cuda", "split", 512, reference="twin", free=80 * 10 ** 9)
    assert twin.reference_bytes == 8 * big.params and not twin.fits and p.fits
    small = ModelShape(params=1000, layers=2, hidden=8, vocab=10, intermediate=16, heads=2, kv_heads=1,
                       head_dim=4, largest=80)
    assert plan_shape(small, "s", "float32", "cpu", "split", 8, free=10 ** 10).reference == "twin"
    assert plan_shape(small, "s", "float64", "cpu", "split", 8, free=10 ** 10).reference_bytes == 0
    table = memory.fits_table()
    assert "| Llama-3.1-8B | bfloat16 | twin | no (" in table  # 16 GB of weights + a 64 GB twin: nowhere
    assert "| Llama-3.1-8B | float32 | streamed | no (" in table  # 32 GB of weights + activations: not on 24 GB
    assert "| Llama-3.1-70B | bfloat16 | streamed | no (" in table  # 141 GB of weights: not on one GPU


def test_impossible_run_refused_in_one_line_before_loading(monkeypatch, capsys):
    _no_loading(monkeypatch)
    monkeypatch.setattr(memory, "free_bytes", lambda dev: (200 * 1024 ** 2, "test"))
    rc = cli.main(["greedy", "--model", "tiny:llama", "--prompt", "x " * 2000, "--max-new-tokens", "16",
                   "--paths", "no_cache,cache"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1
    assert err.startswith("kvviz: error: this greedy run needs about") and "lower: fewer tokens" in err


def test_json_result_carries_the_plan_with_the_measured_peak(capsys, tmp_path):
    out = tmp_path / "r.json"
    rc = cli.main(["split", "--model", "tiny:llama", "--prompt", "Hello world, caching", "--split", "4", "--json",
                   "--quiet", "--no-proof", "--json-out", str(out)])
    d = json.loads(capsys.readouterr().out)
    plan = d["memory_plan"]
    assert rc == 0 and plan["view"] == "split" and plan["total"] > plan["weights"] > 0
    assert plan["measured_peak"] > 0 and plan["fits"] is True
    saved = json.loads(out.read_text())
    assert saved["memory_plan"]["tokens"] == plan["tokens"]
    assert cli.main(["open", str(out)]) == 0  # an exported result with its plan opens again


def _plan(**kw):
    return plan_shape(KNOWN_SHAPES["Llama-3.2-1B"], "m", "bfloat16", "cpu", "split", 64, free=100 * memory.GB, **kw)


def test_a_peak_over_the_plan_is_said_in_one_line():
    plan = _plan()
    plan.measured_peak = plan.total  # at the plan: nothing to say
    assert plan.over_plan() is None and plan.to_dict()["over_plan"] is None
    plan.measured_peak = int(plan.total * 1.25)
    line = plan.over_plan()
    assert line.startswith("memory: this run peaked at") and "25 % over its plan" in line and "\n" not in line
    assert plan.to_dict()["over_plan"] == line and line in "\n".join(plan.lines())
    # a run in a process that already held more than the process itself (a page in the app's server): the plan
    # allows that plus the run's parts
    plan.peak_baseline = 3 * memory.GB
    plan.measured_peak = plan.peak_baseline + plan.total - plan.runtime
    assert plan.over_plan() is None
    plan.measured_peak += 256 * 1024 ** 2
    assert "held before it" in plan.over_plan()


def _too_small_a_plan(monkeypatch):
    """The test hook: every plan made too small for its run (all parts 1 MiB)."""
    real = memory.plan_shape

    def small(*a, **k):
        p = real(*a, **k)
        for part in ("weights", "reference_bytes", "activations", "cache", "kept", "runtime", "extra_models"):
            setattr(p, part, 1024 ** 2 if getattr(p, part) else 0)
        for later in (p.if_identical, p.if_unproved):  # what `settle` puts in after the run: as small
            for part, value in (later or {}).items():
                if isinstance(value, int):
                    later[part] = 1024 ** 2 if value else 0
        return p

    monkeypatch.setattr(memory, "plan_shape", small)


@pytest.mark.parametrize("json_flag", (False, True))
def test_cli_says_when_the_run_peaked_over_its_plan(monkeypatch, capsys, tmp_path, json_flag):
    _too_small_a_plan(monkeypatch)
    out = tmp_path / "r.json"
    argv = ["split", "--model", "tiny:llama", "--prompt", "Hello world, caching", "--split", "4", "--quiet",
            "--no-proof", "--json-out", str(out)] + (["--json"] if json_flag else [])
    assert cli.main(argv) == 0
    o, e = capsys.readouterr()
    line = json.loads(out.read_text())["memory_plan"]["over_plan"]
    assert line.startswith("memory: this run peaked at") and "% over its plan of 6.0 MiB" in line
    if json_flag:
        assert json.loads(o)["memory_plan"]["over_plan"] == line and e.strip() == f"kvviz: {line}"
    else:
        assert o.strip().splitlines()[-1] == line


def test_free_memory_honours_rlimit_as():
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (6 * 1024**3, resource.RLIM_INFINITY)); "
            "from kvviz.core.memory import free_bytes; import json; print(json.dumps(free_bytes('cpu')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                       env=_child_env())
    free, src = json.loads(r.stdout)
    assert free < 6 * 1024 ** 3
    assert src.startswith("RLIMIT_AS") or free < 6 * 1024 ** 3  # the cap, or something smaller still


def test_allocation_failure_is_not_a_damaged_file(monkeypatch):
    import transformers

    from kvviz.models.loading import clear_cache, load_model

    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert is_out_of_memory(OSError(12, "Cannot allocate memory"))
    assert not is_out_of_memory(OSError(2, "No such file or directory"))

    def fail(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:116] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 25769803776 bytes")

    clear_cache()
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)
    with pytest.raises(KvvizError) as e:
        load_model("tiny:gpt2", "float16", "cpu")
    assert "not enough memory" in str(e.value) and "damaged" not in str(e.value)


def test_logits_compared_in_chunks_of_positions(monkeypatch):
    import torch

    from kvviz.core import metrics

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(37, 1000, generator=g, dtype=torch.float32)
    got = ref + 1e-3 * torch.randn(37, 1000, generator=g)
    got[5, 7] = ref[5].max() + 1  # a changed argmax
    whole = metrics.logits_divergence(ref, got)
    monkeypatch.setattr(metrics, "LOGITS_CHUNK_BYTES", 8 * 1000 * 4)  # 4 positions a chunk
    chunked = metrics.logits_divergence(ref, got)
    assert whole.keys() == chunked.keys()
    for k in whole:
        assert whole[k].shape == chunked[k].shape == (37,)
        if k == "kl":
            assert torch.allclose(whole[k], chunked[k], rtol=1e-12, atol=0)
        else:
            assert torch.equal(whole[k], chunked[k]), k
    assert not bool(chunked["argmax_agree"][5]) and bool(chunked["argmax_agree"][4])


# ----------------------------------------------------------------------------------------------------------------
# The plan is an upper bound of the measured peak (here on tiny models, in fresh processes; the peaks recorded on
# models at their real size are checked by `bench/memory_bench.py plans`, as they belong to the machine they ran on)


def _child_env() -> dict:
    """A kvviz child's environment: the checkout importable, and under xdist this worker's share of the cores (at the
    machine's count its OpenMP threads ran beside the other worker's: a tiny run took 11 CPU-s instead of 6.5; the
    measured peak was the same, 500 MiB either way)."""
    import os

    from browser import child_threads_env

    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]), **child_threads_env())


_RUNS: dict = {}  # (argv, ballast) -> (memory plan, stderr): one fresh process per distinct run, shared read-only


def _run_in_fresh_process(argv: list[str], ballast: int = 0) -> tuple[dict, str]:
    """`python -m kvviz ARGV --json --quiet` in a fresh process that first holds `ballast` MiB (bytes it keeps
    resident): its memory plan and its stderr. The same run asked twice (the greedy case below and the unballasted
    process of test_a_bigger_process_is_planned_bigger) is made once per test worker."""
    key = (tuple(argv), ballast)
    if key not in _RUNS:
        code = (f"ballast = b'x' * ({ballast} << 20)\nimport sys, runpy\n"
                f"sys.argv = ['kvviz'] + {list(argv) + ['--json', '--quiet']!r}\n"
                "runpy.run_module('kvviz', run_name='__main__')")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=_child_env(),
                           timeout=600)
        assert r.returncode == 0, (argv, ballast, r.stderr[-800:])
        _RUNS[key] = (json.loads(r.stdout)["memory_plan"], r.stderr)
    return _RUNS[key]


def _on_cpu_by_default() -> bool:
    from kvviz.core.dtypes import resolve_device

    return resolve_device("auto").type == "cpu"


# the greedy run of test_a_bigger_process_is_planned_bigger (where --device auto is the CPU: the same run)
GREEDY = ["greedy", "--model", "tiny:llama", "--prompt", "Hello world", "--max-new-tokens", "8", "--dtype",
          "bfloat16"]


@pytest.mark.parametrize("argv", [
    ["split", "--model", "tiny:gemma3", "--prompt", "Hello world, caching is fun! 123 " * 3, "--split", "40",
     "--dtype", "bfloat16"],
    GREEDY,
    ["check", "--model", "tiny:mistral", "--dtype", "bfloat16"],
    ["bisect", "--model", "tiny:gemma3", "--prompt", "Hello world, caching is fun! 123 " * 3, "--split", "40",
     "--dtype", "float64"],
])
def test_plan_bounds_the_measured_peak_on_tiny_models(argv, kvviz_cache):
    """A fresh process per run (the test process's own peak would count every earlier test): the plan's total
    is at least the peak RSS the run measured."""
    if argv == GREEDY and _on_cpu_by_default():  # what auto resolves to here: test_a_bigger_process_is_planned_bigger's
        argv = argv + ["--device", "cpu"]  # run, made once
    plan, stderr = _run_in_fresh_process(argv)
    # a real measurement: on the CPU the process with torch and transformers (peak RSS); on CUDA the allocator's
    # peak (the model and cuBLAS's workspaces)
    assert plan["measured_peak"] > (100 if plan["device"] == "cpu" else 1) * 1024 ** 2
    assert plan["total"] >= plan["measured_peak"], plan
    assert plan["over_plan"] is None and "over its plan" not in stderr  # a right plan: nothing said


def test_a_bigger_process_is_planned_bigger(kvviz_cache):
    """The runtime part is this process as measured, not a constant: a process that holds 0.4 GB more before kvviz
    is imported (what a CUDA build of torch maps on a CPU run: a tiny greedy run in CI peaked at 0.92 GB over a
    fixed 0.86 GB plan) is planned 0.4 GB bigger, and its plan still bounds its peak."""
    argv = GREEDY + ["--device", "cpu"]
    plans = [_run_in_fresh_process(argv, ballast)[0] for ballast in (0, 400)]
    small, big = plans
    assert big["measured_peak"] - small["measured_peak"] > 350 * 1024 ** 2  # the ballast is resident
    assert big["runtime"] - small["runtime"] > 350 * 1024 ** 2
    for plan in plans:
        assert plan["total"] >= plan["measured_peak"] and plan["over_plan"] is None, plan


@pytest.mark.parametrize("free, runs", ((1024 ** 2, False), (None, True)))
def test_a_split_runs_its_bisector_only_where_it_fits_beside_the_model(monkeypatch, free, runs):
    """The bisector a split runs after a failed proof is not in the split's plan: it runs only where its own
    estimate fits in what is free beside the loaded model."""
    from kvviz.core.execution import DEFAULT_SETTINGS
    from kvviz.models.loading import load_model
    from kvviz.views.split import run as split

    calls = []
    found = SimpleNamespace(finding=lambda: "found")
    monkeypatch.setattr(split, "_registry_bisector", lambda *a: calls.append(a) or found)
    monkeypatch.setattr(memory, "free_bytes", lambda device: (free, "a test limit"))
    lm = load_model("tiny:gemma3", "float32", "cpu")
    first = split._bisect_first(lm, split.SplitConfig("Hello world, caching is fun!", split=4), DEFAULT_SETTINGS)
    assert bool(calls) == runs and first == ("found" if runs else None)


def test_the_memory_matrix_keeps_a_cell_with_its_proof_beside_the_one_without(tmp_path):
    """bench/memory_bench.py: a view run with its invariant proof is its own cell ("…/split/proof"), so the table
    shows it beside the same view without the proof instead of one replacing the other."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import memory_bench
    finally:
        sys.path.remove(str(ROOT / "bench"))
    cell = {"rc": 0, "wall_s": 1.0, "over_plan": None, "stderr_tail": ""}
    out = tmp_path / "m.json"
    out.write_text(json.dumps({
        "gguf/bfloat16/split": dict(cell, peak_rss=2e9, plan_total=2.4e9, ratio=1.2, no_proof=True),
        "gguf/bfloat16/split/proof": dict(cell, peak_rss=2.5e9, plan_total=2.4e9, ratio=0.96, no_proof=False)}))
    rows = memory_bench.matrix_table([out]).splitlines()[2:]
    assert rows == ["| gguf | bfloat16 | split (no proof) | 2.40 | 2.00 | 1.20 |",
                    "| gguf | bfloat16 | split | 2.40 | 2.50 | 0.96 MISS |"]


def test_the_over_plan_line_tells_the_user_what_it_means_and_what_to_do():
    plan = _plan()
    plan.measured_peak = plan.total + memory.GB
    line = plan.over_plan()
    assert "result is not affected" in line and "could run out of memory instead of being refused" in line
    assert "keep about 1.00 GiB more free than the plan says" in line and "(bfloat16, 64 tokens)" in line
    assert "\n" not in line and "undercounts" not in line  # one line, in the user's words


def _split_plan(dtype="float32", view="split", tokens=4096, **kw):
    return plan_shape(KNOWN_SHAPES["Llama-3.2-1B"], "m", dtype, "cpu", view, tokens, free=100 * memory.GB,
                      compared=tokens // 2, **kw)


def test_the_plan_knows_the_split_reruns_in_float64_only_where_its_paths_differ():
    """Split point reruns in float64 only where its cached path is not bit for bit the full forward
    (run_split): the plan before the run counts that phase; after a run whose paths were identical (no float64 in
    its result) it is dropped - the reference, its float64 cache and its phase of the activations."""
    before = _split_plan()
    assert before.if_identical is not None and before.reference == "streamed"
    kept = _split_plan().settle(SimpleNamespace(float64=object()))  # the rerun happened: nothing changes
    assert kept.total == before.total and kept.reference == before.reference
    after = _split_plan().settle(SimpleNamespace(float64=None))
    assert after.reference == "not run" and after.reference_bytes == 0 and after.if_identical is None
    assert after.activations < before.activations and after.cache < before.cache and after.total < before.total
    assert after.activations == memory.activation_bytes(KNOWN_SHAPES["Llama-3.2-1B"], "float32", 4096, 1, "split",
                                                        False, 2048)
    assert any("no float64 rerun" in n for n in after.notes)
    # no such rule where the run is float64 already, for views that always run their reference, or without a result
    assert _split_plan("float64").if_identical is None and _split_plan(view="greedy").if_identical is None
    assert _split_plan().settle(None).total == before.total


@pytest.mark.parametrize("argv, float64_ran", [
    (["--invariant"], False),  # invariant mode: the paths are bit for bit equal where the logic is right
    (["--attention-mask", "new-only"], True),  # a logic error: the float64 rerun tells it from rounding
])
def test_a_split_result_carries_the_plan_of_what_it_ran(tmp_path, argv, float64_ran):
    out = tmp_path / "r.json"
    # its own process: the measured peak is the run's (a test worker's process peaked higher in earlier tests)
    subprocess.run([sys.executable, "-m", "kvviz", "split", "--model", "tiny:llama", "--prompt",
                    "Hello world, caching is fun", "--split", "5", "--quiet", "--no-proof", "--json-out", str(out)]
                   + argv, cwd=ROOT, check=True, capture_output=True, timeout=600, env=_child_env())
    saved = json.loads(out.read_text())
    plan = saved["memory_plan"]
    assert (saved["float64_evidence"] is not None) == float64_ran
    assert (plan["reference"] == "not run") == (not float64_ran) and (plan["reference_bytes"] == 0) != float64_ran
    assert plan["total"] >= plan["measured_peak"] and plan["over_plan"] is None


def test_the_plan_counts_the_attention_kernel_the_run_asks_for():
    """--attn reaches the plan (eager attention materialises its scores: a long prompt plans more than with SDPA);
    the matrix's list plans its largest."""
    from kvviz.cli import build_parser

    prompt = "word " * 1500
    plans = {a: clirun.plan_for_args(build_parser().parse_args(
        ["split", "--model", "tiny:llama", "--prompt", prompt, "--split", "10"] + (["--attn", a] if a else [])))
        for a in ("", "sdpa", "eager")}
    assert plans[""].activations == plans["sdpa"].activations < plans["eager"].activations
    assert memory.attention_kernel("eager,sdpa") == "eager" and memory.attention_kernel("auto") == "sdpa"
    assert memory.Workload().attention == "auto"


def test_a_peak_within_measurement_noise_of_its_plan_says_nothing():
    """A peak 2.1 MiB over a 1.2 GiB plan (RSS moves by pages and arenas) drew the over-plan box above the chart;
    only a real miss speaks."""
    from kvviz.core.memory import over_plan_slack

    plan = memory.plan_workload("tiny:llama", "float32", "cpu", "split", memory.Workload(texts=("Hello world",)))
    allowed = plan.allowed()
    plan.measured_peak = allowed + 2 * 1024 ** 2
    assert plan.over_plan() is None
    plan.measured_peak = allowed + over_plan_slack(allowed) + 1
    assert plan.over_plan() is not None and "over its plan" in plan.over_plan()


def test_greedy_without_a_float64_path_plans_its_reference_only_where_a_parting_builds_it():
    """Greedy paths without the float64 path builds its float64 reference only to replay a parting for its verdict
    (GreedyResult.reference_ran): the plan before the run counts it; after a run where no two paths parted `settle`
    drops the reference, its cache and its phase (the default model's float32 greedy run of 256 tokens, nothing
    parted: planned 2.78 GiB with the twin for a 1.05 GiB peak, 1.35 GiB settled). With the float64 path the
    reference always runs: nothing to drop."""
    from kvviz.models.loading import load_model
    from kvviz.views.greedy.run import DEFAULT_PATHS, GreedyConfig, run_greedy

    w = memory.Workload(texts=("Hello world",), new_tokens=4, paths=DEFAULT_PATHS)
    before = memory.plan_workload("tiny:llama", "float32", "cpu", "greedy", w)
    assert "float64" not in DEFAULT_PATHS and before.if_identical is not None and before.reference_bytes > 0
    kept = memory.plan_workload("tiny:llama", "float32", "cpu", "greedy", w).settle(
        SimpleNamespace(reference_ran=True, proof_s=1.0))
    assert kept.total == before.total and kept.reference == before.reference
    after = memory.plan_workload("tiny:llama", "float32", "cpu", "greedy", w).settle(
        SimpleNamespace(reference_ran=False, proof_s=None))
    assert after.reference == "not run" and after.reference_bytes == 0 and after.total < before.total
    assert after.cache < before.cache and any("no two paths parted" in n for n in after.notes)
    shape = memory.model_shape("tiny:llama")
    assert after.activations >= memory.activation_bytes(shape, "float32", before.tokens, 1, "greedy", False,
                                                        steps=4, reference_decodes=False)
    with_f64 = memory.plan_workload("tiny:llama", "float32", "cpu", "greedy",
                                    memory.Workload(texts=("Hello world",), new_tokens=4,
                                                    paths=("cache", "float64")))
    assert with_f64.if_identical is None
    # the flag is what the run did: the reference is built exactly where two paths part (or a float64 path runs)
    lm = load_model("tiny:llama", "float32", "cpu")
    for paths in (DEFAULT_PATHS, ("cache", "float64")):
        res = run_greedy(lm, GreedyConfig("Hello world", 4, paths=paths), prove=False)
        parted = any(p.first_divergence is not None for p in res.pairs)
        assert res.reference_ran == (parted or "float64" in paths), (paths, parted)
