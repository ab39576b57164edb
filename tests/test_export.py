"""Exports: JSON with the environment that reopens without any model, self-contained HTML, repro scripts that
reproduce the key figure bit for bit."""
import contextlib
import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvviz
from kvviz.core import loops
from kvviz.views.greedy import figures as greedy_figures
from kvviz.views.split import figures as split_figures
from kvviz.cli import main
from kvviz.views.dtypes.run import run_dtypes
from kvviz.core.errors import KvvizError
from kvviz.io.export import export_json, html_report, open_result
from kvviz.views.greedy.run import GreedyConfig, run_greedy
from kvviz.views.padding.run import run_padding
from kvviz.io.repro import key_figure, repro_script
from kvviz.views.reuse.run import run_reuse

from conftest import DEVICE, PROMPT, QUANTO
import dataclasses
from kvviz.views.split.run import SplitConfig, run_split


@pytest.fixture(scope="module")
def lm():
    return kvviz.load_model("tiny:llama", "bfloat16", DEVICE)


@pytest.fixture(scope="module")
def results(lm):
    return {
        "split": kvviz.run_split(lm, kvviz.SplitConfig(PROMPT, 8, left_pad=2, position_ids="omit")),
        "greedy": run_greedy(lm, GreedyConfig("Hello", 4, paths=("no_cache", "cache", "float64"))),
        "dtypes": run_dtypes(lm, [PROMPT], ["float32", "bfloat16"]),
        "padding": run_padding(lm, PROMPT, left_pad=2),
        "reuse": run_reuse(lm, "Answer.", [" Q?", " R?"], 3),
    }


@pytest.mark.parametrize("view", ["split", "greedy", "dtypes", "padding", "reuse"])
def test_json_round_trip_without_a_model(results, view, monkeypatch):
    res = results[view]
    text = export_json(res)
    head = json.loads(text)["kvviz_result"]
    assert head["view"] == view and head["environment"]["torch"] and "flags" in head["environment"]
    monkeypatch.setattr(kvviz.models.loading, "_load", lambda *a, **k: pytest.fail("opening a result loaded a model"))
    opened = open_result(text)
    assert opened.view == view and opened.environment_differences == []
    assert export_json(opened.result) == text.replace(json.dumps(head, ensure_ascii=False), json.dumps(
        json.loads(export_json(opened.result))["kvviz_result"], ensure_ascii=False))


def test_reopened_results_draw_the_same_figures(results):
    split = open_result(export_json(results["split"])).result
    a, b = split_figures.split_heatmap(results["split"]), split_figures.split_heatmap(split)
    np.testing.assert_array_equal(np.array(a.data[0].z, dtype=float), np.array(b.data[0].z, dtype=float))
    assert split.verdict == results["split"].verdict and split.settings.execution.is_default
    greedy = open_result(export_json(results["greedy"])).result
    assert greedy_figures.greedy_pairs_frame(greedy).equals(greedy_figures.greedy_pairs_frame(results["greedy"]))
    dt = open_result(export_json(results["dtypes"])).result
    assert dt.stat("max_abs", "max").equals(results["dtypes"].stat("max_abs", "max"))


def test_environment_differences_are_named(results):
    d = json.loads(export_json(results["split"]))
    d["kvviz_result"]["environment"]["torch"] = "1.0.0"
    d["kvviz_result"]["environment"]["flags"]["cuda_matmul_allow_tf32"] = True
    diffs = open_result(json.dumps(d)).environment_differences
    assert any(x.startswith("torch: 1.0.0 there") for x in diffs) and any("allow_tf32" in x for x in diffs)


@pytest.mark.parametrize("data, msg", [
    ("not json", "not JSON"), ("{}", "not a kvviz result"),
    ('{"kvviz_result": {"view": "split", "format": 99}}', "format 99"),
    ('{"kvviz_result": {"view": "nope", "format": 1}}', "unknown view"),
    ('{"kvviz_result": {"view": "split", "format": 1}, "settings": {}}', "incomplete or damaged"),
])
def test_bad_files_are_one_line_errors(data, msg):
    with pytest.raises(KvvizError, match=msg):
        open_result(data)


@pytest.mark.parametrize("view", ["split", "greedy", "dtypes", "padding", "reuse"])
def test_html_report_is_self_contained(results, view):
    page = html_report(results[view])
    assert 'src="http' not in page and "<script" in page or view == "reuse"
    assert "Verdict:" in page and "Environment" in page
    if view != "reuse":
        assert "plotly" in page.lower() and page.count("Plotly.newPlot") >= 1


@contextlib.contextmanager
def torch_threads(n: int):
    """The test body at n torch threads (as an xdist worker runs at 1), the worker's own count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def other_caller_env(threads: int) -> dict:
    """A script's environment unlike the process that computed the figure: the other thread count, and other CPU
    kernels asked of ATen and MKL. The script must set the result's own numerics over all of them."""
    cap = torch.backends.cpu.get_cpu_capability()
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(3 - threads), MKL_NUM_THREADS=str(3 - threads),
                ATEN_CPU_CAPABILITY="default" if cap != "DEFAULT" else "avx2",
                MKL_ENABLE_INSTRUCTIONS="AVX2" if mkl != "AVX2" else "SSE4_2")


def numerics_line(threads: int) -> str:
    return f"numerics: {threads} thread(s), CPU capability {torch.backends.cpu.get_cpu_capability()}"


def test_exports_record_the_numerics(results):
    """JSON and HTML say which threads, CPU capability and flags computed the result; reopening at another thread
    count names the difference."""
    from kvviz.core.numerics import describe, numerics

    for threads in (1, 2):
        with torch_threads(threads):
            head = json.loads(export_json(results["split"]))["kvviz_result"]
            page = html_report(results["split"])
        n = head["numerics"]
        assert n["threads"] == threads and n["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        assert n["float32_matmul_precision"] == torch.get_float32_matmul_precision()
        assert n["deterministic_algorithms"] is torch.are_deterministic_algorithms_enabled()
        assert f"{threads} thread{'s' if threads > 1 else ''}, CPU capability {n['cpu_capability']}" in page
    with torch_threads(1):
        text = export_json(results["split"])
    with torch_threads(2):
        assert "numerics threads: 1 there, 2 here" in open_result(text).environment_differences
    assert describe(numerics()) in html_report(results["split"])


@pytest.mark.heavy
@pytest.mark.parametrize("arch, dtype, kw, threads", [  # each case one direction, both directions covered
    ("llama", "bfloat16", dict(mode="step", left_pad=2, position_ids="omit"), 1),
    ("gpt2", "float32", dict(mode="chunk"), 2),
    ("gemma2", "float16", dict(mode="step", attention_mask="new-only"), 1),
    ("llama", "float64", dict(mode="chunk", left_pad=1), 2),
])
def test_repro_script_reproduces_the_figure_bit_for_bit(arch, dtype, kw, threads, tmp_path):
    """Computed at 1 or at 2 threads (an xdist worker runs at 1), the script run with the other count and other CPU
    kernels asked in its environment: it sets the result's numerics, so its last line is the figure exactly."""
    with torch_threads(threads):
        m = kvviz.load_model(f"tiny:{arch}", dtype, DEVICE)
        res = kvviz.run_split(m, kvviz.SplitConfig(PROMPT, 9, **kw))
        script = tmp_path / "repro.py"
        script.write_text(repro_script(res, m))
    assert "import kvviz" not in script.read_text() and "from kvviz" not in script.read_text()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env=other_caller_env(threads), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-500:]
    assert numerics_line(threads) in out.stdout and "note:" not in out.stdout
    assert out.stdout.strip().splitlines()[-1] == f"max |Δ logits| = {key_figure(res)!r}"


def test_repro_refuses_what_it_cannot_rebuild(lm, results):
    from kvviz.views.check.run import run_check

    rob = kvviz.load_model("tiny:roberta", "float32", DEVICE)
    with pytest.raises(KvvizError, match="no split-based check"):  # a bidirectional model's card: nothing cached
        repro_script(run_check(rob), rob)
    inv = kvviz.run_split(lm, kvviz.SplitConfig(PROMPT, 8), settings=kvviz.ExecSettings(invariant=True))
    with pytest.raises(KvvizError, match="invariant"):
        repro_script(inv, lm)


def test_cli_exports_and_open(tmp_path, capsys):
    j, h, r = tmp_path / "r.json", tmp_path / "r.html", tmp_path / "r.py"
    assert main(["split", "--model", "tiny:llama", "--prompt", PROMPT, "--split", "6", "--dtype", "bfloat16",
                 "--device", DEVICE, "--quiet", "--json-out", str(j), "--html", str(h), "--repro", str(r)]) == 0
    assert json.loads(j.read_text())["kvviz_result"]["model_fingerprint"]["architecture"] == "llama"
    assert "Plotly" in h.read_text() and "max |Δ logits|" in r.read_text()
    capsys.readouterr()
    assert main(["open", str(j)]) == 0
    out = capsys.readouterr().out
    assert "verdict:" in out and "environment: the same as here" in out
    for cmd in (["greedy", "--prompt", "Hi", "--max-new-tokens", "2"], ["padding", "--prompt", PROMPT],
                ["reuse", "--prefix", "A.", "--continuation", " B", "--max-new-tokens", "2"],
                ["dtypes", "--prompt", PROMPT, "--dtypes", "float32"],
                ["loading-trap", "--prompt", PROMPT, "--max-new-tokens", "2"],
                ["quant", "--prompt", PROMPT, "--kv", "fp8", "--max-new-tokens", "2"]):
        out_json = tmp_path / f"{cmd[0]}.json"
        script = tmp_path / f"{cmd[0]}.py"
        assert main([*cmd, "--model", "tiny:llama", "--device", DEVICE, "--quiet", "--json-out", str(out_json),
                     "--html", str(tmp_path / f"{cmd[0]}.html"), "--repro", str(script)]) == 0
        assert open_result(out_json.read_text()).view == cmd[0].replace("-", "_")
        last = script.read_text().rstrip().splitlines()[-1]
        assert last.startswith('print("max |Δ logits| = " + repr('), (cmd[0], last)
        compile(script.read_text(), str(script), "exec")  # a valid Python file


def _loops_calling_forward(script: str) -> list[int]:
    """Lines of the `for`/`while` loops in a script, outside the copied kvviz loops, that call the model."""
    import ast

    found = []
    tree = ast.parse(script)
    for top in tree.body:
        if isinstance(top, ast.FunctionDef) and top.name in ("decode", "feed"):
            continue
        for node in ast.walk(top):
            if isinstance(node, (ast.For, ast.While)) and any(
                    isinstance(c, ast.Call) and getattr(c.func, "id", None) in ("forward", "model")
                    for c in ast.walk(ast.Module(body=node.body, type_ignores=[]))):
                found.append(node.lineno)
    return found


# the views whose scripts are checked from each side: every view once, both directions covered
VIEWS_BY_THREADS = {1: ("greedy", "padding", "reuse", "check"), 2: ("dtypes", "loading_trap", "quant", "matrix")}


@pytest.mark.heavy
@QUANTO  # the quant case: int8 weights, a quanto cache
@pytest.mark.parametrize("threads", [1, 2])
def test_repro_scripts_of_every_view_reproduce_their_figure_bit_for_bit(threads, tmp_path):
    """greedy, dtypes, padding, reuse, loading trap, quantized, the backends matrix and the card: each script makes
    kvviz's calls and sets the result's numerics (computed here at 1 or 2 threads, the script's caller asking for the
    other count and other CPU kernels), so its last line, run from the exported folder, is the figure exactly. Each
    view is checked in one direction (VIEWS_BY_THREADS), the two directions between them."""
    with torch_threads(threads):
        every_view_case(threads, tmp_path)


def every_view_case(threads, tmp_path):
    from kvviz.views.check.run import run_check
    from kvviz.views.loading_trap.run import run_loading_trap
    from kvviz.views.matrix.run import MatrixConfig, run_matrix
    from kvviz.views.quant.run import QuantConfig, run_quant
    from kvviz.views.dtypes.run import run_dtypes
    from kvviz.views.greedy.run import GreedyConfig, run_greedy
    from kvviz.views.padding.run import run_padding
    from kvviz.views.reuse.run import run_reuse

    models = {}

    def m(name, dtype):
        if name not in models:
            models[name] = kvviz.load_model(f"tiny:{name}", dtype, DEVICE)
        return models[name]

    runs = {
        "greedy": lambda: (run_greedy(m("gpt2", "float32"), GreedyConfig(PROMPT, max_new_tokens=6, left_pad=2)),
                           m("gpt2", "float32")),
        "padding": lambda: (run_padding(m("llama", "bfloat16"), PROMPT, left_pad=3), m("llama", "bfloat16")),
        "reuse": lambda: (run_reuse(m("gemma2", "float16"), "Answer briefly.", [" Q: 2+2? A:", " Q: sky? A:"], 4),
                          m("gemma2", "float16")),
        "dtypes": lambda: (run_dtypes(m("llama", "bfloat16"), [PROMPT, "Another prompt"], ["float32", "bfloat16"],
                                      split="half"), m("llama", "bfloat16")),
        "loading_trap": lambda: (run_loading_trap(m("gpt2", "float32"), PROMPT, 4, "float16"), m("gpt2", "float32")),
        "quant": lambda: (run_quant(m("llama", "bfloat16"), QuantConfig(PROMPT, kv="quanto:int2", residual_length=2,
                                                                         weights="int8", max_new_tokens=4)),
                          m("llama", "bfloat16")),
        "matrix": lambda: (run_matrix(m("llama", "bfloat16"), MatrixConfig(
            PROMPT, 3, attentions=("eager", "sdpa"), caches=("dynamic", "static", "quantized:quanto"),
            flag_sets=((), ("deterministic", "sdpa=math")), repeats=1, left_pad=1,
            batch_with=("A longer batch-mate than the prompt",))), m("llama", "bfloat16")),
        "check": lambda: (run_check(m("gpt2", "float32")), m("gpt2", "float32")),
    }
    assert sorted(v for vs in VIEWS_BY_THREADS.values() for v in vs) == sorted(runs)  # every view, once
    cases = {view: runs[view]() for view in VIEWS_BY_THREADS[threads]}
    procs = {}
    for view, (res, model) in cases.items():
        script = tmp_path / f"{view}.py"
        script.write_text(repro_script(res, model, script.name))
        text = script.read_text()
        assert "import kvviz" not in text and "from kvviz" not in text
        assert inspect.getsource(loops.decode) in text and inspect.getsource(loops.feed) in text  # the library's loop
        assert _loops_calling_forward(text) == [], view  # and no loop of its own
        procs[view] = subprocess.Popen([sys.executable, script.name], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=other_caller_env(threads), cwd=tmp_path)
    for view, p in procs.items():  # two at a time on two cores would be no faster: all run together
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, (view, err[-500:])
        assert numerics_line(threads) in out and "note:" not in out, (view, out[:500])
        res = cases[view][0]
        assert out.strip().splitlines()[-1] == f"max |Δ logits| = {key_figure(res)!r}", view
    if "padding" in cases:  # the figure includes the logic cells (positions omitted with pads): far from zero
        assert key_figure(cases["padding"][0]) > 0.01
    if "reuse" in cases:  # "reused" saw the earlier continuation: logic, a real gap
        assert key_figure(cases["reuse"][0]) > 0
    if "quant" in cases:  # int2 keys and int8 weights: lossy by design
        assert key_figure(cases["quant"][0]) > 0


def test_repro_refuses_fast_greedy_and_views_without_a_script(lm):
    from kvviz.views.greedy.run import GreedyConfig, run_greedy

    fast = run_greedy(lm, GreedyConfig(PROMPT, max_new_tokens=3, fast=True))
    with pytest.raises(KvvizError, match="fast"):
        repro_script(fast, lm)
    only = run_greedy(lm, GreedyConfig(PROMPT, max_new_tokens=3, paths=("cache", "generate")))
    with pytest.raises(KvvizError, match="no-cache loop"):
        repro_script(only, lm)


def test_loading_trap_and_check_card_export_and_reopen(lm):
    from kvviz.views.check.run import run_check
    from kvviz.views.loading_trap.run import run_loading_trap

    for res, view in ((run_loading_trap(lm, "Hello", 3, "bfloat16"), "loading_trap"), (run_check(lm), "check")):
        text = export_json(res)
        opened = open_result(text)
        assert opened.view == view and opened.result.to_dict() == res.to_dict()
        page = html_report(opened.result)
        verdict = res.verdict if view == "loading_trap" else res.overall
        assert f"<b>Verdict: {verdict}.</b>" in page and f"kvviz — {view}" in page
    assert opened.result.settings["device"] == str(lm.device)


def test_bisect_exports_and_reopens(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["bisect", "--model", "tiny:llama", "--device", DEVICE, "--prompt", PROMPT, "--split", "4",
                 "--left-pad", "2", "--position-ids", "omit", "--quiet", "--json-out", str(out),
                 "--html", str(tmp_path / "b.html")]) == 0
    opened = open_result(out.read_text())
    assert opened.view == "bisect" and opened.result.first is not None  # positions omitted with pads: logic
    page = (tmp_path / "b.html").read_text()
    assert f"first difference: {opened.result.first.name}" in page and "Plotly" in page


def test_kv_cache_results_export_and_reopen(lm):
    from kvviz.views.cache.size import size_report
    from kvviz.views.cache.run import continue_and_compare, load_cache, save_cache_bytes

    data, _ = save_cache_bytes(lm, PROMPT)
    reload = continue_and_compare(lm, load_cache(lm, data), " and more")
    for res, view, verdict in ((reload, "kv_reload", "bitwise equal"), (size_report(lm, 16), "kv_size", "size")):
        opened = open_result(export_json(res))
        assert opened.view == view and opened.result.to_dict() == res.to_dict()
        assert f"<b>Verdict: {verdict}.</b>" in html_report(res)


def test_a_result_with_its_memory_plan_reopens_for_every_view_type(tmp_path, capsys):
    """JSON results carry `memory_plan`; reopening must not hand it to the result's own type."""
    from kvviz.cli import main

    out = tmp_path / "t.json"
    assert main(["loading-trap", "--model", "tiny:llama", "--max-new-tokens", "3", "--quiet", "--json-out",
                 str(out)]) == 0
    capsys.readouterr()
    d = json.loads(out.read_text(encoding="utf-8"))
    assert "memory_plan" in d
    opened = open_result(out.read_bytes())
    assert opened.view == "loading_trap" and opened.header["memory_plan"] == d["memory_plan"]


@pytest.mark.parametrize("model", [r"C:\Users\ana\models\llama", 'odd """ name\nwith a line break\\'])
def test_a_repro_script_compiles_whatever_the_model_spec(model):
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    res = run_split(lm, SplitConfig(PROMPT, split=5))
    res.settings = dataclasses.replace(res.settings, model=model)
    script = repro_script(res, lm)
    compile(script, "kvviz_repro.py", "exec")  # a SyntaxError here is the defect
    assert script.startswith("# kvviz repro: split of C:") or "odd" in script.splitlines()[0]
