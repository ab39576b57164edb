"""Defects, each with the test that fails if it comes back."""
import dataclasses

import pytest

import kvviz
from kvviz.views.check.run import run_check
from kvviz.cli import main
from kvviz.errors import KvvizError
from kvviz.views.quant.run import QuantConfig, check_feasible, run_quant
from kvviz.repro import repro_script
from kvviz.views.split.run import SplitConfig, run_split

from conftest import DEVICE, PROMPT, QUANTO


@pytest.mark.parametrize("arch,kv,weights,dtype,message", [
    pytest.param("gemma2", "quanto:int4", "none", "float32", "only full attention", marks=QUANTO),  # QuantizedCache refuses sliding layers
    ("mistral", "fp8", "none", "float32", "only full attention"),
    pytest.param("llama", "none", "int8", "float64", "not float64", marks=QUANTO),
    ("llama", "none", "bnb-nf4", "float32", "needs a CUDA GPU"),
])
def test_the_card_refuses_a_quantization_it_cannot_run_before_its_battery(arch, kv, weights, dtype, message,
                                                                         monkeypatch):
    if "CUDA" in message and kvviz.load_model(f"tiny:{arch}", dtype, DEVICE).device.type == "cuda":
        pytest.skip("bitsandbytes runs on a CUDA GPU: there is nothing to refuse")
    lm = kvviz.load_model(f"tiny:{arch}", dtype, DEVICE)
    battery = []
    import kvviz.views.check.run as check

    monkeypatch.setattr(check, "_split_gap", lambda *a, **k: battery.append(a) or 0.0)
    with pytest.raises(KvvizError, match=message):
        run_check(lm, kv=kv, weights=weights)
    assert battery == []  # refused before the first float64 check ran
    with pytest.raises(KvvizError, match=message):
        check_feasible(lm, kv, weights)


def test_a_missing_quantization_package_is_named_before_anything_runs(monkeypatch):
    import kvviz.views.quant.run as quant

    monkeypatch.setattr(quant, "package_available", lambda backend: backend not in ("hqq",))
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    with pytest.raises(KvvizError, match="needs the package hqq"):
        check_feasible(lm, "hqq:int4", "none")
    check_feasible(lm, "fp8", "none")  # no package needed: fine


def test_quant_on_a_model_without_a_cache_is_one_line(capsys):
    lm = kvviz.load_model("tiny:roberta", "float32", DEVICE)
    with pytest.raises(KvvizError, match="returns no KV cache"):
        run_quant(lm, QuantConfig("Hello", kv="fp8", max_new_tokens=3))
    code = main(["quant", "--model", "tiny:roberta", "--prompt", "Hello", "--kv", "fp8", "--max-new-tokens", "3",
                 "--quiet", "--device", DEVICE])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("kvviz: error:") and "no KV cache" in err and "Unexpected" not in err


@pytest.mark.parametrize("model", [r"C:\Users\ana\models\llama", 'odd """ name\nwith a line break\\'])
def test_a_repro_script_compiles_whatever_the_model_spec(model):
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    res = run_split(lm, SplitConfig(PROMPT, split=5))
    res.settings = dataclasses.replace(res.settings, model=model)
    script = repro_script(res, lm)
    compile(script, "kvviz_repro.py", "exec")  # a SyntaxError here is the defect
    assert script.startswith("# kvviz repro: split of C:") or "odd" in script.splitlines()[0]


@pytest.mark.app
def test_greedy_page_ab_without_both_paths_says_what_to_do():
    from streamlit.testing.v1 import AppTest

    from conftest import ROOT

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=240)
    at.session_state["model_preset"] = "tiny:llama"
    at.session_state["greedy_n"] = 3
    at.session_state["greedy_paths"] = ["no_cache", "generate"]
    at.run()
    at.switch_page("pages/greedy.py").run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    assert any("choose both paths" in i.value for i in at.info)
