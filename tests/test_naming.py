"""One layer-naming rule (kvviz.core.naming): the heatmap's rows, the bisector's text, tables and the CLI name the same
hidden state the same way; a GGUF file is labelled by its own metadata."""
import copy
import dataclasses
import threading

import numpy as np
import pytest

import kvviz
from kvviz.views.split import figures as split_figures
from kvviz.views.bisect.run import run_bisect
from kvviz.core.execution import ExecSettings
from kvviz.models.loading import gguf_quant_label, gguf_quantization
from kvviz.core.naming import hover_text, layer_label, layer_labels, module_index, module_label, module_row
from kvviz.views.split.run import SplitConfig, run_split

from conftest import DEVICE, PROMPT


def test_the_rule():
    assert layer_labels(4) == ["embeddings", "layer 1", "layer 2", "layer 3 + final norm"]
    assert layer_label(0) == "embeddings" and layer_label(2) == "layer 2"
    assert module_index("model.layers.1.self_attn") == 1 and module_index("transformer.h.3.mlp") == 3
    assert module_index("model.embed_tokens") is None
    assert module_label("model.layers.1.self_attn") == "layer 2 (model.layers.1.self_attn)"
    assert module_row("gpt_neox.layers.0.mlp") == "layer 1" and module_row("lm_head") == "outside the layers"
    assert hover_text("layer 2") == "layer 2: output of model.layers.1"
    assert hover_text("layer 3 + final norm", "gpt_neox.layers") == \
        "layer 3 + final norm: output of gpt_neox.layers.2 then the final norm"
    assert hover_text("embeddings") == "embeddings"


def test_a_state_space_model_has_no_embeddings_row():
    """Mamba-style models (transformers' Mamba, FalconMamba, RWKV) return the hidden state after each block and the
    final norm's output last, no embeddings: rows "layer 1" .. "layer N", "layer N + final norm" - in naming's rule,
    Split point's heatmap rows and the lens's labels alike; a decoder model keeps "embeddings" first."""
    from kvviz.core.naming import model_type
    from kvviz.views.lens.run import lens_labels

    assert layer_labels(4, "mamba") == ["layer 1", "layer 2", "layer 3", "layer 3 + final norm"]
    assert layer_labels(4, "llama") == layer_labels(4) == ["embeddings", "layer 1", "layer 2", "layer 3 + final norm"]
    lm = kvviz.load_model("tiny:mamba", "float32", DEVICE)
    assert model_type(lm) == "mamba"
    out = lm.model(**lm.tokenizer(PROMPT, return_tensors="pt").to(DEVICE), output_hidden_states=True)
    n = len(out.hidden_states)
    assert n == lm.n_layers + 1  # one after each block and the final norm's: no embeddings row
    labels = layer_labels(n, model_type(lm))
    assert labels[0] == "layer 1" and labels[-2] == f"layer {lm.n_layers}" and \
        labels[-1] == f"layer {lm.n_layers} + final norm"
    assert lens_labels(lm, n) == labels
    res = run_split(lm, SplitConfig(PROMPT, 3))
    assert res.layer_labels == labels and "embeddings" not in res.layer_labels  # (tiny:llama's: tests/test_split.py)


def test_bisector_and_heatmap_name_the_same_layer():
    """A gap injected inside model.layers.1 (cached run only): the heatmap's first non-zero row and the
    bisector's text both say "layer 2"; the hover shows model.layers.1."""
    base = kvviz.load_model("tiny:llama", "float32", DEVICE)
    lm = dataclasses.replace(base, model=copy.deepcopy(base.model), lock=threading.RLock())
    total = len(lm.tokenizer(PROMPT)["input_ids"])

    def perturb(m, args, out):
        if args[0].shape[1] >= total:
            return out
        return (out[0] + 1e-3, *out[1:]) if isinstance(out, tuple) else out + 1e-3

    # inside decoder layer 1 (its MLP, whose output the layer adds to the residual): how a hook on the layer itself
    # orders against transformers' own hidden-state capture is not something this test should depend on
    lm.model.get_submodule("model.layers.1.mlp").register_forward_hook(perturb)
    inv = ExecSettings(invariant=True)
    cfg = SplitConfig(PROMPT, split=10, mode="chunk")
    res = run_split(lm, cfg, settings=inv)
    rows = res.main.hidden["max_abs"].max(axis=1)
    first_row = int(np.flatnonzero(rows > 0)[0])
    assert res.layer_labels[first_row] == "layer 2"
    b = run_bisect(lm, cfg, inv)
    assert b.first is not None and module_row(b.first.name) == "layer 2"
    assert "layer 2 (model.layers.1" in b.explanation
    fig = split_figures.split_heatmap(res, "max_abs")
    hovers = {str(c[1]) for c in np.asarray(fig.data[0].customdata)[:, 0]}
    assert "layer 2: output of model.layers.1" in hovers


def test_gguf_label_comes_from_the_file_type_not_the_largest_tensor():
    big_embedding = {"token_embd.weight": ("Q8_0", 28_000_000), "blk.0.attn_q.weight": ("Q4_K", 300_000),
                     "blk.0.ffn_down.weight": ("Q6_K", 800_000), "blk.0.ffn_up.weight": ("Q4_K", 800_000)}
    assert gguf_quant_label(15, big_embedding) == "Q4_K_M"
    assert gguf_quant_label(0, big_embedding) == "F32"
    assert gguf_quant_label(None, big_embedding) == "Q4_K"  # no file type: the layers' weights, not the embedding
    assert gguf_quant_label(None, {}) is None


def written_gguf(path):
    """A GGUF file named Q8_0 whose header says Q4_K_M (file type 15), with one small tensor."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(15)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_label_read_from_a_written_file(tmp_path):
    path = written_gguf(tmp_path / "model-Q8_0.gguf")  # the name says Q8_0; the file says Q4_K_M
    assert gguf_quantization(path) == "Q4_K_M"


def test_a_converted_gguf_is_labelled_from_its_folder_and_relabelled_once_when_older(tmp_path, monkeypatch):
    """A load takes the quantization label from the converted folder's kvviz.json; a folder labelled by older rules
    (no label_version) is labelled from the file once and written back, and later loads never parse the GGUF again
    (its header parse took 0.7 GB for a moment with Gemma 3's 262k-token vocabulary)."""
    import json

    gguf = pytest.importorskip("gguf")
    from kvviz.models.loading import QUANT_LABEL_VERSION, converted_quantization

    path = written_gguf(tmp_path / "model-Q8_0.gguf")
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "kvviz.json").write_text(json.dumps({"source": str(path), "quantization": "Q8_0", "size": 1}))
    assert converted_quantization(path, folder) == "Q4_K_M"  # the older label is replaced
    meta = json.loads((folder / "kvviz.json").read_text())
    assert meta == {"source": str(path), "quantization": "Q4_K_M", "size": 1, "label_version": QUANT_LABEL_VERSION}

    def no_parse(*a, **k):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    assert converted_quantization(path, folder) == "Q4_K_M"
    assert sorted(p.name for p in folder.iterdir()) == ["kvviz.json"]  # no temporary left behind
