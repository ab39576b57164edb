"""Quantized KV caches and quantized weights against the unquantized run (kvviz.views.quant.run), the card, CLI and page."""
import json
import math

import pytest
import torch

import kvviz
from kvviz.views.quant import run as quant
from kvviz.views.check.run import run_check
from kvviz.cli import main
from kvviz.core.errors import KvvizError
from kvviz.io.export import export_json, html_report, open_result
from kvviz.views.quant.run import QuantConfig, parse_kv, quantize_weights, run_quant

from conftest import DEVICE, HQQ, QUANTO
from kvviz.views.quant.run import check_feasible

PROMPT = "The museum guard knew every painting in the building"


@pytest.fixture(scope="module")
def llama():
    return kvviz.load_model("tiny:llama", device=DEVICE)


def test_kv_choices_parse_and_bad_ones_are_one_line():
    assert parse_kv("quanto:int4") == ("quanto", 4)
    assert parse_kv("hqq:int2") == ("hqq", 2)
    assert parse_kv("fp8") == ("fp8", None)
    for bad, words in (("quanto:int3", "no 3-bit mode"), ("zip:int4", "unknown quantized KV cache"),
                       ("hqq", "bit width")):
        with pytest.raises(KvvizError, match=words):
            parse_kv(bad)
    with pytest.raises(KvvizError, match="nothing is quantized"):
        QuantConfig(PROMPT, kv="none", weights="none").validate()
    with pytest.raises(KvvizError, match="residual length"):
        QuantConfig(PROMPT, residual_length=0).validate()


@pytest.mark.parametrize("kv", [pytest.param("quanto:int4", marks=QUANTO), pytest.param("quanto:int2", marks=QUANTO),
                                pytest.param("hqq:int4", marks=HQQ), "fp8"])
def test_quantized_kv_cache_is_lossy_after_the_prefill(llama, kv):
    n = 10
    res = run_quant(llama, QuantConfig(PROMPT, kv=kv, residual_length=2, max_new_tokens=n))
    assert res.verdict == "lossy" and not res.bitwise_equal
    if not all(math.isfinite(v) for v in res.logits_max_abs):  # transformers' fp8 QuantizedCache on CUDA gives NaN
        assert kv == "fp8" and llama.device.type == "cuda", res.logits_max_abs
        assert res.explanation.startswith("Lossy, and worse:") and "non-finite" in res.explanation
        return
    assert len(res.kl) == len(res.logits_max_abs) == len(res.argmax_agree) == n
    assert len(res.layers) == len(res.layer_relative) == llama.n_layers + 1
    # the prefill's own forward reads the keys unquantized: the first step is the unquantized computation exactly
    assert res.kl[0] == 0.0 and res.logits_max_abs[0] == 0.0 and res.argmax_agree[0]
    # decode steps read the quantized past
    assert max(res.logits_max_abs[1:]) > 0 and res.kl_max > 0
    assert res.layer_relative[0] == 0.0  # embeddings of the same tokens cannot move
    assert max(res.layer_relative) > 0
    assert 1 <= res.agreement <= n
    assert res.reference_tokens[:res.agreement] == res.quantized_tokens[:res.agreement]
    if res.agreement < n:
        assert res.reference_tokens[res.agreement] != res.quantized_tokens[res.agreement]
    assert "Lossy by design" in res.explanation and f"{res.agreement}" in res.explanation


@QUANTO
def test_fewer_bits_lose_more(llama):
    r4 = run_quant(llama, QuantConfig(PROMPT, kv="quanto:int4", residual_length=1, max_new_tokens=8))
    r2 = run_quant(llama, QuantConfig(PROMPT, kv="quanto:int2", residual_length=1, max_new_tokens=8))
    assert r2.kl_mean > r4.kl_mean
    assert max(r2.layer_relative) > max(r4.layer_relative)


def test_a_missing_package_gives_a_clear_message(llama, monkeypatch):
    monkeypatch.setattr(quant, "package_available", lambda backend: backend not in ("quanto", "hqq"))
    with pytest.raises(KvvizError, match="needs the package optimum-quanto, which is not installed"):
        run_quant(llama, QuantConfig(PROMPT, kv="quanto:int4"))
    with pytest.raises(KvvizError, match="needs the package hqq"):
        run_quant(llama, QuantConfig(PROMPT, kv="hqq:int2"))
    with pytest.raises(KvvizError, match="int8 weights needs the package optimum-quanto"):
        run_quant(llama, QuantConfig(PROMPT, kv="none", weights="int8"))


def test_bitsandbytes_weights_say_what_they_need(llama, monkeypatch):
    if llama.device.type != "cuda":
        with pytest.raises(KvvizError, match="bitsandbytes, which needs a CUDA GPU; this run is on cpu"):
            run_quant(llama, QuantConfig(PROMPT, kv="none", weights="bnb-nf4"))
    monkeypatch.setattr(quant.optional, "importable", lambda name: False)  # bitsandbytes missing or broken
    fake = type("LM", (), {"device": torch.device("cuda", 0), "name": "m"})()
    with pytest.raises(KvvizError, match="need the package bitsandbytes"):
        quant._need_bnb(fake, "bnb-int8")


@QUANTO
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_weights_leave_the_shared_model_alone(llama, scheme):
    ids = torch.tensor([[3, 7, 11, 19]], device=llama.device)
    with torch.no_grad():
        before = llama.model(ids).logits.clone()
    q = quantize_weights(llama, scheme)
    assert q is not llama and q.model is not llama.model
    assert type(llama.model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert type(q.model.model.layers[0].self_attn.q_proj).__name__ == "QLinear"
    assert any(f"{scheme} weights: 29 of 29 linear layers" in w for w in q.warnings)
    assert quantize_weights(llama, scheme) is q  # kept: a page rerun does not quantize again
    res = run_quant(llama, QuantConfig(PROMPT, kv="none", weights=scheme, max_new_tokens=6))
    assert res.verdict == "lossy"
    assert res.kl[0] > 0  # quantized weights change the very first step
    assert res.layer_relative[0] == 0.0 and max(res.layer_relative[1:]) > 0
    with torch.no_grad():
        assert torch.equal(llama.model(ids).logits, before)


@QUANTO
def test_weights_on_conv1d_models_and_float64_are_explained():
    gpt2 = kvviz.load_model("tiny:gpt2", device=DEVICE)
    q = quantize_weights(gpt2, "int8")
    note = [w for w in q.warnings if "int8 weights" in w][0]
    assert "1 of 17 linear layers" in note and "Conv1D" in note
    res = run_quant(gpt2, QuantConfig(PROMPT, kv="none", weights="int8", max_new_tokens=4))
    assert res.worst_layer == "—" and "only the output head" in res.explanation  # only lm_head was quantized
    with pytest.raises(KvvizError, match="not float64"):
        quantize_weights(gpt2.reference(), "int8")


@QUANTO
def test_the_card_reports_a_quantized_model_as_lossy(llama):
    card = run_check(llama, weights="int8")
    assert card.overall == "lossy"
    q = [c for c in card.checks if c.name.startswith("quantized (")]
    assert len(q) == 1 and q[0].status == "note" and "per-step KL" in q[0].evidence
    assert q[0].figure > 0 and "per-step KL" in card.summary
    assert all(c.status != "fail" for c in card.checks)
    # a bidirectional model stays unsafe, quantized or not
    rob = run_check(kvviz.load_model("tiny:roberta", device=DEVICE), kv="quanto:int4")
    assert rob.overall == "unsafe"


@HQQ
def test_export_round_trip_and_report(llama):
    res = run_quant(llama, QuantConfig(PROMPT, kv="hqq:int4", residual_length=2, max_new_tokens=5))
    opened = open_result(export_json(res))
    assert opened.view == "quant"
    back = opened.result
    assert back.kl == res.kl and back.agreement == res.agreement and back.settings.kv == "hqq:int4"
    assert back.explanation == res.explanation and back.worst_layer == res.worst_layer
    page = html_report(res)
    assert "Verdict: lossy" in page and "plotly" in page and "KL(unquantized" in page


@QUANTO
def test_cli_quant_and_check(capsys, tmp_path):
    out = tmp_path / "q.json"
    assert main(["quant", "--model", "tiny:llama", "--device", DEVICE, "--prompt", PROMPT, "--kv", "quanto:int2",
                 "--residual", "1", "--max-new-tokens", "6", "--json", "--quiet", "--json-out", str(out)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verdict"] == "lossy" and len(d["kl"]) == 6 and d["settings"]["kv"] == "quanto:int2"
    assert json.loads(out.read_text())["kvviz_result"]["view"] == "quant"
    assert main(["quant", "--model", "tiny:llama", "--prompt", "x", "--kv", "quanto:int8"]) == 1
    assert "no 8-bit mode" in capsys.readouterr().err
    assert main(["check", "--model", "tiny:llama", "--device", DEVICE, "--weights", "int8", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["overall"] == "lossy"


@pytest.mark.app
def test_quantized_page_and_card_controls():
    from test_app import alerts, start

    at = start("pages/quant.py", model="tiny:llama", quant_residual=2, quant_n=6)
    assert "Verdict: lossy" in alerts(at)
    assert len(at.get("plotly_chart")) == 2
    assert at.metric[0].value.split(" tokens")[0].endswith("/ 6")  # "a / 6 tokens": the unit on the tile
    at.selectbox(key="quant_kv").set_value("none").run()
    assert not at.exception and "nothing is quantized" in alerts(at)
    at.selectbox(key="quant_weights").set_value("int8").run()
    assert not at.exception and "Verdict: lossy" in alerts(at)
    at = start("pages/check.py", model="tiny:llama", check_weights="int8")
    assert "LOSSY" in alerts(at)


@QUANTO
def test_quant_figures_draw_exact_zeros_on_a_labelled_floor(llama):
    import math

    from kvviz.views.quant import figures as quant_figures

    res = run_quant(llama, QuantConfig(PROMPT, kv="quanto:int2", residual_length=1, max_new_tokens=6))
    fig = quant_figures.quant_steps(res)
    floor = min(k for k in res.kl if k > 0) / 10
    assert fig.data[0].y[0] == floor  # step 0 (exactly 0) sits on the floor, not off the chart
    label = [a for a in fig.layout.annotations if a.text == "0 (identical)"]
    assert len(label) == 1 and math.isclose(label[0].y, math.log10(floor))  # log axis: y is the exponent
    names = [t.name for t in fig.data]
    assert "KL per step" in names and "× another token" in names
    bars = quant_figures.quant_layers(res)
    assert list(bars.data[0].x) == res.layers and bars.data[0].marker.color[0] == "#b0bec5"  # embeddings: 0
    frame = quant_figures.quant_frame(res)
    assert list(frame["step"]) == list(range(6)) and frame["KL"][0] == "0"


@QUANTO
@HQQ
def test_quantized_cache_kinds_on_the_seam_and_progress_per_token(llama):
    """The seam's quantized:quanto / quantized:hqq cache kinds pick a group size that fits the model (tiny models have
    kv_heads x head_dim = 32, below transformers' default group of 64), and run_quant reports every token."""
    from kvviz.core.execution import ExecSettings
    from kvviz.views.greedy.run import GreedyConfig, run_greedy

    assert quant.kv_group_size(llama) == 32
    for kind in ("quantized:quanto", "quantized:hqq"):
        res = run_greedy(llama, GreedyConfig(PROMPT, 3, paths=("no_cache", "cache")), settings=ExecSettings(cache=kind))
        assert res.steps == 3 and res.settings.execution.lossy
    seen = []
    run_quant(llama, QuantConfig(PROMPT, max_new_tokens=3), progress=lambda f, m: seen.append((f, m)))
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert sum(m.endswith(" of 3") for _, m in seen) == 9  # three passes of three tokens


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
