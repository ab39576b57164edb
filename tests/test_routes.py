"""Every model route through every view: a local folder, a .gguf file and a hub id from the local HF cache, each
through the CLI (split with a real gap, so the float64 rerun happens; greedy with the float64 path; dtypes;
padding; reuse), with the verdicts asserted. The spec is parsed once and carried whole (kvviz.ModelSpec)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvviz
from kvviz.cli import main
from kvviz.models.loading import default_gguf_path, tiny_folder
from conftest import DEVICE

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Hello world, caching is fun! 123"
HUB_ID = "kvviz-test/tiny-gpt2"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache_layout(arch: str, repo_id: str) -> Path:
    """Lay a tiny model out in the HF cache exactly as huggingface_hub does: refs/main names the snapshot."""
    hub = Path(os.environ["HF_HUB_CACHE"])
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / REVISION
    if not snap.is_dir():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)
        shutil.copytree(tiny_folder(arch), snap, ignore=shutil.ignore_patterns("kvviz-tiny.json"))
    return hub


@pytest.fixture(scope="module")
def folder_model(tmp_path_factory) -> str:
    dst = tmp_path_factory.mktemp("user-models") / "my-llama"
    shutil.copytree(tiny_folder("llama"), dst, ignore=shutil.ignore_patterns("kvviz-tiny.json"))
    return str(dst)


@pytest.fixture(scope="module")
def hub_model() -> str:
    hub_cache_layout("gpt2", HUB_ID)
    return HUB_ID


@pytest.fixture(scope="module")
def gguf_model() -> str:
    return str(default_gguf_path())


ROUTES = ["folder_model", "hub_model", pytest.param("gguf_model", marks=[pytest.mark.heavy, pytest.mark.slow])]  # the real GGUF


def run_cli(capsys, *argv) -> dict:
    code = main([*argv, "--json", "--quiet", "--device", DEVICE, "--no-proof"])  # the routes, not the proofs
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.slow  # the real GGUF
def test_specs_parse_to_their_kind(folder_model, hub_model, gguf_model):
    assert kvviz.parse_spec(folder_model).kind == "folder"
    assert kvviz.parse_spec(hub_model).kind == "hub"
    assert kvviz.parse_spec(gguf_model).kind == "gguf"
    spec = kvviz.parse_spec(folder_model)
    assert kvviz.parse_spec(spec) is spec  # carried whole, never re-parsed


@pytest.mark.parametrize("route", ROUTES)
def test_split_with_a_gap_runs_the_float64_rerun(route, request, capsys):
    model = request.getfixturevalue(route)
    d = run_cli(capsys, "split", "--model", model, "--prompt", PROMPT, "--split", "5", "--left-pad", "3",
                "--position-ids", "omit", "--dtype", "bfloat16")
    assert d["verdict"] == "logic"
    assert d["float64_evidence"]["dtype"] == "float64"
    assert d["float64_evidence"]["max_relative"] > 1e-3
    assert d["settings"]["model"] == model and d["settings"]["spec_kind"] == route.removesuffix("_model")
    # and the same scenario done right is exact in float64, on every route
    d64 = run_cli(capsys, "split", "--model", model, "--prompt", PROMPT, "--split", "5", "--left-pad", "3",
                  "--dtype", "float64")
    assert d64["result"]["max_relative"] is None or d64["result"]["max_relative"] <= 1e-10
    assert d64["verdict"] in ("identical", "precision")


@pytest.mark.parametrize("route", ROUTES)
def test_greedy_with_the_float64_path(route, request, capsys):
    model = request.getfixturevalue(route)
    d = run_cli(capsys, "greedy", "--model", model, "--prompt", PROMPT, "--max-new-tokens", "4",
                "--paths", "no_cache,cache,float64")
    assert d["paths"]["float64"]["forwards"] == 4 and len(d["paths"]["float64"]["token_ids"]) == 4
    pair = next(p for p in d["pairs"] if {p["a"], p["b"]} == {"no_cache", "float64"})
    assert max(pair["max_abs_logit"][: (pair["first_divergence"] or 3) + 1]) < 1e-2  # float32 vs float64: rounding
    gaps = d["paths"]["no_cache"]["float64_gap"]
    assert gaps[0] is not None and gaps[0] < 1e-2


@pytest.mark.parametrize("route", ["folder_model", "hub_model"])
def test_greedy_omitted_positions_with_padding_is_a_logic_gap(route, request, capsys):
    model = request.getfixturevalue(route)
    d = run_cli(capsys, "greedy", "--model", model, "--prompt", PROMPT, "--max-new-tokens", "4", "--left-pad", "4",
                "--position-ids", "omit", "--paths", "no_cache,cache,float64")
    # whether the tokens part depends on the model's margins; the size of the gap does not: it is logic-sized
    # (far above float32 rounding) from the first step fed through the cache, on every machine
    pair = next(p for p in d["pairs"] if {p["a"], p["b"]} == {"no_cache", "cache"})
    assert max(pair["max_abs_logit"][1:2]) > 1e-2
    # against the float64 no-cache path the cache path's gap stays logic-sized while the no-cache path's is rounding
    # (both at step 1, where the cache path first feeds a token through the cache with the wrong position)
    cache64, plain64 = d["paths"]["cache"]["float64_gap"], d["paths"]["no_cache"]["float64_gap"]
    assert cache64[1] is not None and cache64[1] > 1e-2
    assert plain64[1] is not None and plain64[1] < 1e-3
    if pair["first_divergence"] is not None:
        assert pair["verdict"] == "logic"


@pytest.mark.parametrize("route", ROUTES)
def test_dtypes(route, request, capsys):
    model = request.getfixturevalue(route)
    d = run_cli(capsys, "dtypes", "--model", model, "--prompt", PROMPT, "--dtypes", "float32,bfloat16")
    assert d["dtypes"] == ["float64", "float32", "bfloat16"]
    assert d["verdicts"]["float64"] == ["reference"]
    assert d["verdicts"]["float32"][0] in ("identical", "precision")
    assert d["verdicts"]["bfloat16"][0] in ("identical", "precision")
    assert max(d["per_layer"]["max_abs"]["max"]["float64"]) <= 1e-10


@pytest.mark.parametrize("route", ROUTES)
def test_padding(route, request, capsys):
    model = request.getfixturevalue(route)
    d = run_cli(capsys, "padding", "--model", model, "--prompt", PROMPT, "--left-pad", "3")
    cells = {(c["placement"], c["scenario"]): c for c in d["cells"]}
    assert cells[("left-padded", "cache, positions omitted")]["verdict"] == "logic"
    assert cells[("left-padded", "cache")]["verdict"] in ("identical", "precision")
    assert cells[("alone", "cache, mask new-only")]["verdict"] == "logic"
    assert cells[("left-padded", "cache")]["float64_relative"] <= 1e-10


@pytest.mark.parametrize("route", ROUTES)
def test_reuse(route, request, capsys):
    model = request.getfixturevalue(route)
    d = run_cli(capsys, "reuse", "--model", model, "--prefix", "Answer briefly.", "--continuation", " Q: 2+2? A:",
                "--continuation", " Q: Sky colour? A:", "--max-new-tokens", "3")
    by = {(r["index"], r["strategy"]): r for r in d["runs"]}
    assert by[(0, "fresh")]["verdict"] == "reference"
    assert by[(1, "deepcopy")]["verdict"] in ("identical", "precision")
    assert by[(1, "deepcopy")]["float64_relative"] <= 1e-10
    assert by[(1, "reused")]["verdict"] == "logic"  # the reused cache still holds the first continuation


@pytest.mark.heavy
def test_hub_route_from_a_real_subprocess(hub_model):
    """The CLI as users start it, offline, with the HF cache from the environment."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "kvviz", "split", "--model", hub_model, "--prompt", PROMPT,
                           "--split", "4", "--left-pad", "2", "--position-ids", "omit", "--json", "--quiet"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "logic"


def test_hub_id_not_in_the_cache_fails_at_once(capsys):
    code = main(["split", "--model", "nobody/not-cached-model", "--prompt", PROMPT, "--split", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "not in the local Hugging Face cache" in err and "\n" not in err.strip()


def test_a_broken_local_folder_never_falls_back_to_the_hub(tmp_path, capsys):
    bad = tmp_path / "broken-model"
    bad.mkdir()
    (bad / "config.json").write_text("{ not json")
    code = main(["split", "--model", str(bad), "--prompt", PROMPT, "--split", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "could not read the model config" in err
    assert "huggingface" not in err.lower()


def test_twin_keeps_the_route(folder_model):
    lm = kvviz.load_model(folder_model, "bfloat16", DEVICE)
    ref = lm.reference()
    assert ref.spec == lm.spec and ref.dtype.is_floating_point and str(ref.dtype) == "torch.float64"
    assert ref.reference() is ref and lm.twin("bfloat16") is lm


def test_a_hub_model_in_the_local_cache_is_planned_from_its_files(hub_model):
    """The memory plan of a hub id in the local cache reads its shape and counts the prompt with its tokenizer, as
    for the same files in a folder (not a bound on the text's bytes)."""
    from kvviz.core.memory import Workload, plan_workload

    w = Workload(texts=(PROMPT,))
    hub = plan_workload(hub_model, "bfloat16", "cpu", "split", w)
    folder = plan_workload(str(tiny_folder("gpt2")), "bfloat16", "cpu", "split", w)
    assert hub.tokens == folder.tokens < len(PROMPT.encode()) + 2
    assert hub.weights == folder.weights > 0 and hub.total == folder.total
