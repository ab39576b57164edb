"""The backends matrix on tiny models (CPU): honest cells, error cells that do not stop the grid, flags that never
leak, compile that really compiles, quantized caches judged lossy, the sliding-window preset past the sliding window."""
import json

import pytest
import torch

import kvviz
from kvviz.core import backends, flags
from kvviz.core.errors import KvvizError
from kvviz.core.execution import ExecSettings, Executor
from kvviz.views.matrix.run import MatrixConfig, run_matrix, sliding_window_config

from conftest import DEVICE

PROMPT = "Hello world, caching is fun!"


def cells_by_label(res):
    return {(c.attention, c.cache, c.compile, tuple(c.flags)): c for c in res.cells}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_backends_grid_has_no_logic_and_one_output_per_cell(arch):
    cfg = MatrixConfig(PROMPT, 6, attentions=("eager", "sdpa"), caches=("dynamic", "static", "offloaded"),
                       repeats=2)
    res = run_matrix(f"tiny:{arch}", cfg, "float32", DEVICE)
    assert len(res.cells) == 6
    for c in res.cells:
        if c.cache == "offloaded" and DEVICE == "cpu":
            assert c.error and "CUDA" in c.error and c.verdict is None  # honest: transformers needs CUDA for it
            continue
        assert c.error is None, c.error
        assert c.verdict in ("identical", "precision") and c.distinct_outputs == 1
        assert c.max_abs_logit < 1e-3 and len(c.tokens) == 6 and c.seconds_per_token > 0
    d = json.loads(json.dumps(res.to_dict()))  # the JSON the CLI prints
    assert {"settings", "environment", "reference", "cells"} <= set(d)
    assert {"attention", "cache", "compile", "flags", "verdict", "first_divergence", "distinct_outputs",
            "max_abs_logit", "seconds_per_token", "compiled", "error"} <= set(d["cells"][0])
    assert d["environment"]["flags"]["deterministic_algorithms"] is False


def test_omitted_positions_with_left_padding_is_a_logic_cell():
    cfg = MatrixConfig(PROMPT, 6, attentions=("eager",), caches=("dynamic", "static"), left_pad=3,
                       position_ids="omit", repeats=1)
    res = run_matrix("tiny:llama", cfg, "float32", DEVICE)
    assert [c.verdict for c in res.cells] == ["logic", "logic"]
    assert all(c.float64_gap > 1e-3 for c in res.cells)


def test_an_unsupported_attention_is_an_error_cell_and_the_rest_runs():
    cfg = MatrixConfig(PROMPT, 4, attentions=("flash_attention_2", "eager"), caches=("dynamic",), repeats=1)
    res = run_matrix("tiny:llama", cfg, "float32", "cpu")
    flash, eager = res.cells
    assert flash.error and "flash_attention_2" in flash.error and "\n" not in flash.error and flash.verdict is None
    assert eager.error is None and eager.verdict in ("identical", "precision")


def test_quantized_cache_is_lossy_with_its_numbers():
    cfg = MatrixConfig(PROMPT, 6, attentions=("eager",), caches=("quantized",), repeats=1)
    cell = run_matrix("tiny:llama", cfg, "float32", DEVICE).cells[0]
    assert cell.error is None and cell.verdict == "lossy"
    assert cell.max_abs_logit > 1e-4 and cell.max_kl >= 0 and len(cell.step_kl) >= 1


def test_quantized_cache_on_a_sliding_model_is_an_error_cell():
    cfg = MatrixConfig(PROMPT, 4, attentions=("eager",), caches=("quantized", "dynamic"), repeats=1)
    q, dyn = run_matrix("tiny:gemma2", cfg, "float32", DEVICE).cells
    assert q.error and "full attention" in q.error and dyn.error is None


def test_flags_are_restored_after_a_run_that_raised():
    before = flags.flag_state()
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    with pytest.raises(RuntimeError, match="boom"):
        with Executor(lm, ExecSettings(flags=("tf32", "deterministic", "no-bf16-reduced-reduction"))).session():
            assert torch.backends.cuda.matmul.allow_tf32 and torch.are_deterministic_algorithms_enabled()
            assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
            raise RuntimeError("boom")
    assert flags.flag_state() == before
    assert not torch.are_deterministic_algorithms_enabled() and torch.get_float32_matmul_precision() == "highest"


def test_flag_runs_have_the_process_to_themselves():
    import threading
    import time

    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    seen = []

    def plain_run():
        with Executor(lm).session():
            seen.append(torch.are_deterministic_algorithms_enabled())

    with Executor(kvviz.load_model("tiny:llama", "float32", DEVICE), ExecSettings(flags=("deterministic",))).session():
        t = threading.Thread(target=plain_run)
        t.start()
        time.sleep(0.3)
        assert seen == []  # the plain run waits while the flags are set
    t.join()
    assert seen == [False]  # and never sees them


def test_bad_axes_are_one_line_errors():
    with pytest.raises(KvvizError, match="unknown flag 'turbo'"):
        MatrixConfig(PROMPT, flag_sets=(("turbo",),)).validate()
    with pytest.raises(KvvizError, match="unknown compile mode"):
        MatrixConfig(PROMPT, compiles=("fastest",)).validate()
    with pytest.raises(KvvizError, match="unknown cache kind"):
        MatrixConfig(PROMPT, caches=("paged-ish",)).validate()


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_preset_runs_past_the_window(arch):
    lm = kvviz.load_model(f"tiny:{arch}", "bfloat16", DEVICE)
    cfg = sliding_window_config(lm)
    window = lm.config.sliding_window
    assert cfg.max_new_tokens > window and cfg.batch_with
    assert len(lm.tokenizer(cfg.batch_with[0])["input_ids"]) > window
    res = run_matrix(lm, cfg)
    assert res.reference["row0_pad"] > 0  # the short prompt is left-padded in the batch
    for c in res.cells:
        assert c.error is None and c.verdict in ("identical", "precision") and c.distinct_outputs == 1


def test_sliding_window_preset_needs_a_window():
    with pytest.raises(KvvizError, match="no sliding window"):
        sliding_window_config(kvviz.load_model("tiny:llama", "float32", DEVICE))


@pytest.mark.heavy
def test_compile_really_compiles_where_a_compiler_exists():
    import shutil

    ok, why = backends.compiler_works()
    # torch.compile needs CUDA or a C++ compiler: where one of them is there, kvviz must say it can compile
    assert ok == (torch.cuda.is_available() or any(shutil.which(c) for c in ("g++", "c++", "clang++"))), why
    if not ok:
        pytest.skip(why)  # only on a machine with neither (never CI: the Makefile's machines have g++)
    cfg = MatrixConfig("Hi there", 3, attentions=("sdpa",), caches=("dynamic",), compiles=("default",), repeats=1)
    cell = run_matrix("tiny:llama", cfg, "float32", DEVICE).cells[0]
    assert cell.error is None, cell.error
    assert cell.compiled["requested"] and cell.compiled["frames"] >= 1  # dynamo really compiled frames
    assert cell.verdict in ("identical", "precision")


def test_compile_without_a_compiler_is_an_error_cell_naming_it(monkeypatch):
    monkeypatch.setattr(backends, "compiler_works", lambda: (False, "no C++ compiler found for torch.compile"))
    cfg = MatrixConfig("Hi there", 3, attentions=("sdpa",), caches=("dynamic",), compiles=("default",), repeats=1)
    cell = run_matrix("tiny:llama", cfg, "float32", DEVICE).cells[0]
    assert cell.error and "compiler" in cell.error.lower() and cell.verdict not in ("identical", "precision")
