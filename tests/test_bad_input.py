"""Bad input, across the pages and the CLI: one clear line, no traceback, the app keeps working, and no partial
result shown as if it were complete."""
import os
import shutil

import pytest
import torch

import kvviz
from kvviz.cli import main
from kvviz.core.errors import KvvizError
from kvviz.models.loading import tiny_folder

from conftest import ROOT, DEVICE


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad-models")
    (d / "broken.gguf").write_bytes(b"GGUF" + os.urandom(300))
    shutil.copytree(tiny_folder("llama"), d / "truncated")
    st = d / "truncated" / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    (d / "noconfig").mkdir()
    (d / "noconfig" / "weights.bin").write_bytes(b"\0" * 16)
    from transformers import AutoConfig

    AutoConfig.for_model("vit", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32).save_pretrained(d / "nohead")
    (d / "notes.txt").write_text("not a model")
    return d


MODEL_CASES = [  # (spec under the bad folder or as is, expected words)
    ("{bad}/broken.gguf", "could not read GGUF file"),
    ("{bad}/truncated", "missing or damaged file"),
    ("{bad}/noconfig", "no config.json"),
    ("{bad}/nohead", "no causal-LM head"),
    ("{bad}/notes.txt", "not a .gguf model"),
    ("someone/unknown-model-xyz", "not in the local Hugging Face cache"),
    ("tiny:nonexistent", "unknown tiny model"),
]


@pytest.mark.parametrize("spec, words", MODEL_CASES)
def test_bad_models_library(bad, spec, words):
    with pytest.raises(KvvizError, match=words):
        kvviz.load_model(spec.format(bad=bad), "float32", DEVICE)


@pytest.mark.parametrize("spec, words", MODEL_CASES)
def test_bad_models_cli(bad, capsys, spec, words):
    code = main(["split", "--model", spec.format(bad=bad), "--prompt", "Hello world", "--split", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_attention_not_installed(capsys):
    with pytest.raises(KvvizError, match="flash_attention_2"):
        kvviz.load_model("tiny:llama", "float32", DEVICE, "flash_attention_2")
    code = main(["split", "--model", "tiny:llama", "--prompt", "Hello world", "--split", "2", "--attn",
                 "flash_attention_2", "--quiet"])
    assert code == 1 and "not available" in capsys.readouterr().err


def test_dtype_the_device_cannot_run():
    with pytest.raises(KvvizError, match="float64 is not supported on mps"):
        kvviz.load_model("tiny:llama", "float64", torch.device("mps"))
    if not torch.cuda.is_available():
        with pytest.raises(KvvizError, match="no CUDA GPU"):
            kvviz.load_model("tiny:llama", "float16", "cuda")


def test_one_megabyte_prompt(capsys):
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    big = "word " * 210_000
    with pytest.raises(KvvizError, match="at most 100,000"):
        kvviz.run_split(lm, kvviz.SplitConfig(big, 3))
    code = main(["split", "--model", "tiny:gpt2", "--prompt", big, "--split", "3", "--quiet"])
    assert code == 1 and "characters" in capsys.readouterr().err


def test_split_equal_to_length():
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    n = len(lm.tokenizer("Hello")["input_ids"])
    with pytest.raises(KvvizError, match="outside the prompt"):
        kvviz.run_split(lm, kvviz.SplitConfig("Hello", n))


def test_out_of_memory_is_one_line_and_frees(monkeypatch, capsys):
    import kvviz.views.split.run as split_mod

    def boom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(split_mod, "_run", boom)
    freed = []
    monkeypatch.setattr("kvviz.cli.free_memory", lambda e=None: freed.append(e))
    code = main(["split", "--model", "tiny:gpt2", "--prompt", "Hello world", "--split", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "out of memory" in err and "shorter prompt" in err and freed


@pytest.mark.parametrize("error, limit, fallback, typed, line", [
    (ValueError("\n  \n  shape mismatch: [3, 4] vs [3, 5]  \n at layer 2\n"), 300, None, False,
     "shape mismatch: [3, 4] vs [3, 5]"),
    (RuntimeError(), 300, None, False, "RuntimeError"),
    (RuntimeError(" "), 300, "", False, ""),
    (ValueError("x" * 50), 10, None, False, "x" * 9 + "…"),
    (ValueError("x" * 10), 10, None, False, "x" * 10),
    (ValueError("\n bad shape \n more"), 300, None, True, "ValueError: bad shape"),
    (RuntimeError(" "), 300, "", True, "RuntimeError"),
    (KeyError("x" * 50), 20, None, True, "KeyError: 'xxxxxxxx…"),
])
def test_first_line_of_an_error(error, limit, fallback, typed, line):
    """Every one-line message of an error kvviz did not foresee (CLI, app, engines, sweeps) is cut the same way;
    typed: with the class name in front (matrix and padding cells, the arch sweep, the serving engines)."""
    from kvviz.core.errors import first_line

    assert first_line(error, limit, fallback, typed=typed) == line


# ---------------------------------------------------------------------------------------------------------------
# The same in the app: a message, no exception, no charts, and the app works again afterwards


def app(page: str):
    from streamlit.testing.v1 import AppTest  # here, so the library tests above run where Streamlit is absent

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.session_state["model_preset"] = "tiny:gpt2"
    at.run()
    at.switch_page(page)
    at.run()
    assert not at.exception
    return at


def messages(at) -> str:
    return " | ".join(e.value for e in list(at.error) + list(at.warning) + list(at.info))


def recovers(at) -> None:
    at.selectbox(key="model_preset").set_value("tiny:gpt2").run()
    at.selectbox(key="attn").set_value("auto").run()
    assert not at.exception and len(at.get("plotly_chart")) >= 1


@pytest.mark.parametrize("spec, words", MODEL_CASES)
@pytest.mark.app
def test_bad_models_in_the_app(bad, spec, words):
    at = app("pages/split.py")
    at.selectbox(key="model_preset").set_value("other…").run()
    at.text_input(key="model_other").input(spec.format(bad=bad)).run()
    assert not at.exception
    assert words in messages(at)
    assert len(at.get("plotly_chart")) == 0
    recovers(at)


@pytest.mark.app
def test_attention_not_installed_in_the_app():
    at = app("pages/split.py")
    at.selectbox(key="attn").set_value("flash_attention_2").run()
    assert not at.exception and "not available" in messages(at)
    assert len(at.get("plotly_chart")) == 0
    recovers(at)


@pytest.mark.parametrize("prompt, words", [
    ("", "empty"),
    ("  \n\t  ", "empty"),
    ("word " * 210_000, "at most 100,000"),
    ("x" * 600, "longer than the model's context"),
])
@pytest.mark.app
def test_bad_prompts_in_the_app(prompt, words):
    at = app("pages/split.py")
    at.text_area(key="split_prompt").input(prompt).run()
    assert not at.exception and words in messages(at)
    assert len(at.get("plotly_chart")) == 0
    at.text_area(key="split_prompt").input("A fine prompt again").run()
    assert not at.exception and len(at.get("plotly_chart")) == 2


@pytest.mark.app
def test_out_of_memory_in_the_app(monkeypatch):
    import kvviz.views.split.run as split_mod

    real = split_mod._run
    monkeypatch.setattr(split_mod, "_run", lambda *a, **k: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")))
    at = app("pages/split.py")
    assert not at.exception
    assert "Out of memory" in messages(at) and "shorter prompt" in messages(at)
    assert len(at.get("plotly_chart")) == 0
    monkeypatch.setattr(split_mod, "_run", real)
    at.slider(key="split_k_slider").set_value(3).run()
    assert not at.exception and len(at.get("plotly_chart")) == 2


@pytest.mark.app
def test_greedy_page_context_overflow_in_the_app():
    at = app("pages/greedy.py")
    at.text_area(key="greedy_prompt").input("y" * 500).run()
    at.number_input(key="greedy_n").set_value(200).run()
    assert not at.exception and "context" in messages(at)
    assert len(at.get("plotly_chart")) == 0


def test_bad_upload_in_the_dtypes_page():
    from kvviz.core.prompts import parse_prompts

    # the page hands uploads to parse_prompts; its messages are what the page shows
    for data, words in ((b"\xff\xfe\xfa", "not UTF-8"), (b"", "no prompts")):
        with pytest.raises(KvvizError, match=words):
            parse_prompts(data, "upload.txt")


def test_a_cache_longer_than_the_context_is_one_line(tmp_path, capsys):
    # saving the cache of a prompt past the model's position table indexed out of range (IndexError)
    from kvviz.views.cache.run import save_cache_bytes

    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    with pytest.raises(KvvizError, match="longer than the model's context"):
        save_cache_bytes(lm, "word " * 600)
    code = main(["cache", "save", "--model", "tiny:gpt2", "--prompt", "word " * 600, "--out",
                 str(tmp_path / "c.safetensors")])
    err = capsys.readouterr().err
    assert code == 1 and "longer than the model's context" in err and "Traceback" not in err


@pytest.mark.app
def test_a_cache_longer_than_the_context_in_the_app():
    at = app("pages/cache.py")
    at.text_area(key="cache_prompt").input("word " * 600).run()
    assert not at.exception and "longer than the model's context" in messages(at)
    assert "Unexpected" not in messages(at)
    at.text_area(key="cache_prompt").input("The capital of France is").run()
    assert not at.exception and not at.error and "Download the cache" in at.get("download_button")[0].proto.label


def _damaged_split_results() -> dict[str, tuple[bytes, str]]:
    """A split result exported from a tiny run, damaged in ways a hand-edited or truncated file is: name -> (bytes,
    the words of its one line)."""
    import json

    from kvviz.io.export import export_json

    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    good = json.loads(export_json(kvviz.run_split(lm, kvviz.SplitConfig("Hello world again", 2), prove=False)))
    header_text = {**good, "kvviz_result": "yes"}
    wrong_kinds = {**good, "verdict": {"garbage": 1}, "tokens": {"garbage": 1}}
    return {"good": (json.dumps(good).encode(), ""),
            "header": (json.dumps(header_text).encode(), "its kvviz_result header is not an object"),
            "fields": (json.dumps(wrong_kinds).encode(), "this split result is incomplete or damaged")}


def test_a_damaged_result_header_is_one_line():
    from kvviz.io.export import open_result

    with pytest.raises(KvvizError, match="header is not an object"):
        open_result(_damaged_split_results()["header"][0])


@pytest.mark.app
def test_a_damaged_result_in_open_a_result_is_one_line_and_the_page_keeps_working(monkeypatch):
    # a header that is text raised AttributeError ("Unexpected error"); fields of another kind (a verdict that is
    # an object) raised while the page drew them: Streamlit's exception box
    import streamlit
    from streamlit.testing.v1 import AppTest

    files = _damaged_split_results()
    current = {"data": files["header"][0]}

    class Upload:
        name = "kvviz-split.json"

        def getvalue(self):
            return current["data"]

    monkeypatch.setattr(streamlit, "file_uploader", lambda *a, **k: Upload())
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.run()
    at.switch_page("pages/open_result.py").run()
    for name in ("header", "fields", "good"):
        current["data"], words = files[name]
        at.run()
        assert not at.exception, (name, at.exception)
        if words:
            assert [e.value for e in at.error] and words in at.error[0].value and "Unexpected" not in messages(at)
            assert len(at.get("plotly_chart")) == 0 and not any("result of" in c.value for c in at.caption), name
        else:
            assert not at.error and len(at.get("plotly_chart")) >= 1


def test_flex_attention_in_float64_on_the_cpu_is_one_line(capsys):
    # torch's FlexAttention has no float64 CPU kernel: the float64 reference failed deep in inductor (a traceback
    # in the CLI, "Unexpected error (InductorError)" on the page)
    if str(DEVICE) != "cpu":
        pytest.skip("a CPU limit of torch's FlexAttention")
    with pytest.raises(KvvizError, match="flex_attention has no float64 kernel"):
        kvviz.load_model("tiny:llama", "float64", DEVICE, "flex_attention")
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE, "eager")
    from kvviz.core.reference import reference_model

    class Flex:  # the float32 model as loaded with flex_attention: its reference is refused before any run
        dtype, device, attn_implementation = lm.dtype, lm.device, "flex_attention"

    with pytest.raises(KvvizError, match="flex_attention has no float64 kernel"):
        reference_model(Flex())
