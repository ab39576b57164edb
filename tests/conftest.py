import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ARTIFACTS = ROOT / "test-artifacts"

# One kvviz cache for the whole run (tiny models, the converted default model), fresh for every test session so
# the default model's first load really converts; HF stays offline as on the target machines.
_CACHE = Path(os.environ.get("KVVIZ_TEST_CACHE", "")) if os.environ.get("KVVIZ_TEST_CACHE") else None
if _CACHE is None:
    import atexit
    import shutil
    import tempfile

    _CACHE = Path(tempfile.mkdtemp(prefix="kvviz-test-cache-"))
    # this process's own cache (up to 0.5 GB: the converted default model) goes with it; left behind, every run kept
    # one per worker and a developer's /tmp filled up (60 GB here after a few days)
    atexit.register(shutil.rmtree, _CACHE, True)
os.environ["KVVIZ_CACHE"] = str(_CACHE)
# A Hugging Face cache of the tests' own (tests/test_routes.py lays a hub model out in it), set before anything
# imports huggingface_hub, which reads it once; offline as on the target machines.
os.environ["HF_HUB_CACHE"] = str(_CACHE / "hf-hub")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# MKL may use fewer threads than asked when the machine is busy (MKL_DYNAMIC), which changes a GEMM's reduction split
# and so the last bits between a figure and its repro script; tests pin the thread count they ask for.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

# Under pytest-xdist (`make test` runs `-n 2`), the cores are shared: each worker gets its share of torch's threads,
# so two workers do not each start a pool as wide as the machine (oversubscribed, both run slower).
# KVVIZ_TEST_THREADS pins the count instead (`make test-any-cpu` runs the bit-for-bit tests at 1 and at 2 threads).
if os.environ.get("KVVIZ_TEST_THREADS"):
    import torch

    torch.set_num_threads(int(os.environ["KVVIZ_TEST_THREADS"]))
elif os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

PROMPT = "Hello world, caching is fun! 123"
# The device library tests run on: cpu by default (CI); `make gpu-check` sets KVVIZ_TEST_DEVICE=auto on a GPU machine.
DEVICE = os.environ.get("KVVIZ_TEST_DEVICE", "cpu")



def open_result_page(monkeypatch, data: bytes, name: str):
    """The app's Open a result page, run (AppTest) with `data` as the uploaded file `name`."""
    import streamlit
    from streamlit.testing.v1 import AppTest

    class Upload:
        def getvalue(self):
            return data

    Upload.name = name
    monkeypatch.setattr(streamlit, "file_uploader", lambda *a, **k: Upload())
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.run()
    at.switch_page("pages/open_result.py")
    at.run()
    assert not at.exception, at.exception
    return at


def needs(*modules: str):
    """Skip a test whose optional packages (optimum-quanto, hqq) are missing - only off the CPU: gpu-check's image
    may lack them, while CI installs the lock and must run every such test (a missing package there fails)."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing) and DEVICE != "cpu",
                              reason=f"{', '.join(missing)} not installed here (optional; CI runs these on the CPU)")


QUANTO = needs("optimum")  # optimum-quanto (its module is optimum.quanto)
HQQ = needs("hqq")


def record_worker_clients(monkeypatch) -> list:
    """Every kvviz.engines.WorkerClient started from now on, in order (a test then checks each worker's process)."""
    from kvviz.engines import WorkerClient

    clients, init = [], WorkerClient.__init__

    def recording(self, *a, **k):
        init(self, *a, **k)
        clients.append(self)

    monkeypatch.setattr(WorkerClient, "__init__", recording)
    return clients


def needs_engine(name: str):
    """A test that drives a real serving engine in its own environment (vLLM, llama.cpp: `make engines`): marked
    `engine` (`make test-engines` runs these, `make test` leaves them to it) and skipped where the environment is not
    built."""
    from kvviz.engines import engine_python

    label = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}[name]
    skip = pytest.mark.skipif(engine_python(name) is None,
                              reason=f"{label}'s environment is not built here (make engines)")
    return lambda test: pytest.mark.engine(skip(test))

# Property tests explore the same examples on every run, so CI is reproducible (and a failure can be replayed).
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("kvviz", derandomize=True, database=None, print_blob=True)
_hyp_settings.load_profile("kvviz")


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def kvviz_cache() -> Path:
    return _CACHE


@pytest.fixture(scope="session")
def default_first_load(tmp_path_factory):
    """The default model's first load into an empty kvviz cache of its own, which converts the GGUF: done once per
    test process for the tests of that conversion (tests/test_default_model.py, tests/test_gguf_stream.py), not once
    each. A namespace: cache (that cache), msgs (the load's progress reports), conversion (convert_gguf's own reports,
    as it gave them to the load), tokenizer (a deep copy of the tokenizer the conversion read from the GGUF header),
    source / arch / n_layers / config / description (the loaded model's), digests (sha256 of every parameter's bytes,
    by name). The model itself is not kept. The folder then also serves the session's cache (hard links), where no
    load converted the default model yet, so the process does not convert it twice."""
    import copy
    import hashlib
    import shutil
    from types import SimpleNamespace

    import kvviz
    from kvviz.models import loading

    cache = tmp_path_factory.mktemp("first-load") / "kvviz-cache"
    msgs, conversion, tokenizers = [], [], []
    read_header, convert = loading._read_gguf_header, loading.convert_gguf

    def recording_header(path):  # records, changes nothing
        config, tok = read_header(path)
        tokenizers.append(copy.deepcopy(tok))
        return config, tok

    def recording_convert(path, progress=loading._noop):  # records, changes nothing
        def both(frac, msg):
            conversion.append((frac, msg))
            progress(frac, msg)

        return convert(path, both)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVVIZ_CACHE", str(cache))
        mp.setattr(loading, "_read_gguf_header", recording_header)
        mp.setattr(loading, "convert_gguf", recording_convert)
        loading.clear_cache()
        try:
            lm = kvviz.load_model("default", "float32", DEVICE, progress=lambda f, m: msgs.append((f, m)))
            first = SimpleNamespace(
                cache=cache, msgs=msgs, conversion=conversion, tokenizer=tokenizers[0] if tokenizers else None,
                source=lm.source, arch=lm.arch, n_layers=lm.n_layers, config=lm.config, description=lm.description,
                digests={n: hashlib.sha256(p.detach().cpu().contiguous().numpy()).hexdigest()
                         for n, p in lm.model.named_parameters()})
            del lm
        finally:
            loading.clear_cache()  # later loads read the session's own cache again (the key does not name the cache)
    session_copy = loading.converted_gguf_folder(loading.default_gguf_path())
    if not (session_copy / "kvviz.json").is_file():
        def link_or_copy(src, dst):
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)

        loading._atomic_folder(session_copy, lambda tmp: shutil.copytree(first.source, tmp, dirs_exist_ok=True,
                                                                          copy_function=link_or_copy))
    return first


# --- a rounding gap built on purpose, the same on every CPU and GPU -------------------------------------------------
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402


class RowCountRounding(TorchFunctionMode):
    """A linear layer over several rows sums its inner dimension in two parts, split where the number of rows
    says, each rounded to the dtype, then added; over one row in one go: a matrix kernel whose blocking depends on
    how many rows it gets. A full forward and a cached run then differ by rounding on every CPU and GPU (a 16-bit
    dtype rounds the parts visibly), the gap closes in float64, and invariant mode - whose linear layers go one row
    at a time - has none of it. The gap case of the verdict rule, built instead of hoped for from this machine's
    kernels."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows, inner = x.reshape(-1, x.shape[-1]).shape
            if rows > 1 and inner > 2:
                k = 1 + rows % (inner - 1)
                out = F.linear(x[..., :k], w[:, :k]) + F.linear(x[..., k:], w[:, k:])
                return out if bias is None else out + bias
        return func(*args, **kwargs)


@pytest.fixture
def row_count_rounding():
    with RowCountRounding():
        yield


# --- one app server per test process ---------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def app_server():
    """`streamlit run app.py` for the browser test modules of this process (tests/browser.py's app_server_fixture
    gives each module its `server` and checks its part of the log): (URL, log path)."""
    from browser import streamlit_server

    ARTIFACTS.mkdir(exist_ok=True)
    with streamlit_server() as (url, log):
        yield url, log


# --- the longest tests start first -----------------------------------------------------------------------------------
# `make test` runs 2 xdist workers with --dist worksteal: each takes half of the collection in order and an idle one
# takes the back half of the other's queue. A long test near the end of the collection (text-fit and wheel tests
# sort last by name) left one worker running it alone for minutes. Modules are ordered by their expected time,
# longest first, and within a module the known-slow tests first; a module's tests stay together (its module-scoped
# fixtures are set up once per worker). Seconds below: `make test`'s slowest durations on CI's 2 cores (they only
# order; a test missing here is estimated by its markers).
KNOWN_SLOW_S = {
    "tests/test_engine_layers.py::test_vllm_batch_vs_alone_and_tensor_parallel_3_float32": 140,
    "tests/test_engine_layers.py::test_vllm_warm_vs_cold_bfloat16_layer_by_layer": 40,
    "tests/test_no_silent_waits.py::test_the_compiled_kernel_built_with_a_limit": 95,
    "tests/test_no_silent_waits.py::test_with_the_compiled_kernel_a_stale_lock": 31,
    "tests/test_no_silent_waits.py::test_a_build_killed_midway": 26,
    "tests/test_lesson_browser.py::test_the_lesson_walks_every_step": 100,
    "tests/test_text_fit.py::test_the_lessons_figures_fit": 60,
    "tests/test_browser.py::test_split_page_draws_heatmap_with_default_model": 85,
    "tests/test_browser.py::test_first_screen_in_normal_mode[light]": 150,  # with text fit in normal mode
    "tests/test_browser.py::test_first_screen_in_normal_mode[dark]": 25,
    "tests/test_browser.py::test_every_page_in_presenter_mode": 75,
    "tests/test_browser.py::test_greedy_page_in_browser": 50,
    "tests/test_browser.py::test_four_sessions_at_once": 43,
    "tests/test_browser.py::test_a_copied_link_reopens": 30,
    "tests/test_browser.py::test_presenter_mode_fits_verdict_and_chart_and_custom_html_is_readable[light]": 90,
    "tests/test_browser.py::test_presenter_mode_fits_verdict": 26,
    "tests/test_serving_sweep.py::test_vllm_small_grid_default_model": 60,
    "tests/test_serving_server.py::test_real_vllm_server": 40,
    "tests/test_engines.py::test_vllm_cold_and_warm_prefix": 45,
    "tests/test_wheel.py::test_the_readme_notebook_snippet": 50,
    "tests/test_gguf_stream.py::test_streamed_conversion_equals": 50,
    "tests/test_gguf_stream.py::test_stop_during_conversion": 25,
    "tests/test_default_model.py::test_default_model_converts_once": 44,
    "tests/test_export.py::test_repro_scripts_of_every_view": 40,
    "tests/test_archsweep.py::test_subset_runs_and_matches_the_table": 45,
    "tests/test_kvcache.py::test_default_model_is_safe": 31,
    "tests/test_cancel_browser.py::test_stop_frees_the_model": 28,
    "tests/test_lesson_student.py::test_every_step_agrees_on_the_forced_avx2_path": 28,
    "tests/test_lesson_student.py::test_the_default_models_lesson": 25,
    "tests/test_protocol.py::test_each_run_reports_growing_progress_ending_at_one[engine_layers]": 44,
}
_MARKER_S = {"browser": 15.0, "heavy": 10.0, "slow": 8.0, "app": 2.0}


def _expected_s(item) -> float:
    for prefix, s in KNOWN_SLOW_S.items():
        if item.nodeid.startswith(prefix):
            return s
    return max([_MARKER_S[m.name] for m in item.iter_markers() if m.name in _MARKER_S], default=0.3)


@pytest.hookimpl(trylast=True)  # after pytest's own ordering (parametrized module fixtures)
def pytest_collection_modifyitems(session, config, items):
    def module(it) -> str:
        return it.nodeid.split("::")[0]

    expected = {id(it): _expected_s(it) for it in items}
    per_module: dict[str, float] = {}
    for it in items:
        per_module[module(it)] = per_module.get(module(it), 0.0) + expected[id(it)]
    own = {id(it): -expected[id(it)] if expected[id(it)] >= 20 else 0.0 for it in items}  # known-slow first
    order = sorted(range(len(items)), key=lambda i: (-per_module[module(items[i])], module(items[i]),
                                                      own[id(items[i])], i))
    items[:] = [items[i] for i in order]


# tests/test_compat.py, tests/test_cli.py: one interpreter runs every case (name, argv) as `python -m kvviz ARGV`
# runs it (runpy of kvviz.__main__, SystemExit's code), each case's file descriptors 1 and 2 into files of its own
# (all it prints, logging's and C code's included), its models loaded afresh (kvviz's model cache cleared before
# it); one JSON line a case on the real stdout (case, rc, stdout, stderr).
EACH_CASE_AS_ITS_COMMAND = r"""
import json, os, runpy, sys, tempfile, traceback

real_stdout = os.dup(1)
for name, args in json.loads(sys.argv[1]):
    if "kvviz.models.loading" in sys.modules:  # kvviz is imported by the first case, as `python -m kvviz` does
        sys.modules["kvviz.models.loading"].clear_cache()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(); sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        sys.argv = ["kvviz", *args]
        try:
            runpy.run_module("kvviz", run_name="__main__")
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        except BaseException:
            traceback.print_exc()
            rc = 1
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        os.close(saved[0]); os.close(saved[1])
        out.seek(0); err.seek(0)
        line = json.dumps({"case": name, "rc": rc, "stdout": out.read().decode(errors="replace"),
                           "stderr": err.read().decode(errors="replace")})
    os.write(real_stdout, (line + "\n").encode())
"""
