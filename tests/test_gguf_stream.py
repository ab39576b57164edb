"""GGUF conversion tensor by tensor (kvviz.models.gguf_stream): sharded safetensors + index, the same bytes as the
whole-model conversion, loaded by transformers through the index."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import kvviz
from kvviz.models.gguf_stream import INDEX_NAME, NotStreamable, ShardWriter
from kvviz.models.loading import (_convert_whole, clear_cache, convert_gguf, converted_gguf_folder, default_gguf_path,
                                  tiny_folder)


def _read_index(folder):
    index = json.loads((folder / INDEX_NAME).read_text())
    out = {}
    for name, shard in index["weight_map"].items():
        with safe_open(str(folder / shard), "pt") as f:
            out[name] = f.get_tensor(name)
    return index, out


def test_shard_writer_splits_and_indexes(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {f"t{i}": rng.standard_normal((7, 5 + i)).astype(np.float32) for i in range(6)}
    arrays["t_strided"] = rng.standard_normal((6, 4)).astype(np.float32).T  # not contiguous: written as its values
    w = ShardWriter(tmp_path, shard_bytes=7 * 6 * 4 * 2)
    for name, a in arrays.items():
        w.add(name, a)
    names = w.finish()
    assert len(names) > 2 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    assert not list(tmp_path.glob(".shard-*"))  # side files are gone
    index, back = _read_index(tmp_path)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in arrays.values())
    assert set(back) == set(arrays)
    for name, a in arrays.items():
        assert back[name].dtype == torch.float32 and torch.equal(back[name], torch.from_numpy(np.ascontiguousarray(a)))
    for shard in names:  # every shard is a valid safetensors file on its own, no bigger than asked (one tensor max)
        assert load_file(str(tmp_path / shard))
    with pytest.raises(NotStreamable):
        w2 = ShardWriter(tmp_path / "x")
        w2.add("a", np.zeros(3, dtype=np.float16))


def test_sharded_folder_loads_through_the_index(tmp_path):
    """A folder written by ShardWriter (many shards) loads through transformers' index into the same model."""
    src = tiny_folder("llama")
    folder = tmp_path / "sharded"
    folder.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    w = ShardWriter(folder, shard_bytes=16 * 1024)
    for name, t in tensors.items():
        w.add(name, t.float().numpy())
    assert len(w.finish()) > 3
    clear_cache()
    a = kvviz.load_model("tiny:llama", "float32", "cpu")
    b = kvviz.load_model(str(folder), "float32", "cpu")
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


@pytest.mark.slow
def test_streamed_conversion_equals_whole_model_conversion(tmp_path, default_first_load):
    """The default model: every tensor bit for bit, the same config and tokenizer as transformers' conversion."""
    gguf = default_gguf_path()
    # the default model's first load converted it into an empty cache (once per process: tests/conftest.py), with
    # convert_gguf's own progress reports and a copy of the tokenizer it read from the GGUF header
    new = Path(default_first_load.source)
    assert new.parent.parent == default_first_load.cache and new.name == converted_gguf_folder(gguf).name
    msgs = default_first_load.conversion
    assert json.loads((new / "kvviz.json").read_text())["conversion"] == "streamed"
    assert not (new / "model.safetensors").exists() and (new / INDEX_NAME).is_file()
    fracs = [f for f, _ in msgs]
    assert fracs == sorted(fracs) and len(msgs) > 100  # a report per tensor: the page's ETA and Stop use them
    assert any("Dequantizing" in m for _, m in msgs)

    old = tmp_path / "whole"
    old.mkdir()
    tok = default_first_load.tokenizer  # what _read_gguf_header(gguf) gave (a deep copy, not the object it saved)
    _convert_whole(gguf, old, lambda f, m: None).save_pretrained(old)
    tok.save_pretrained(old)
    want = load_file(str(old / "model.safetensors"))
    _, got = _read_index(new)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(got[name].view(torch.int32), want[name].view(torch.int32)), name
    assert json.loads((new / "config.json").read_text()) == json.loads((old / "config.json").read_text())
    for f in os.listdir(old):
        if f.startswith("tokenizer") or f.startswith("special_tokens"):
            assert (new / f).read_bytes() == (old / f).read_bytes(), f


@pytest.mark.slow
def test_stop_during_conversion_leaves_no_folder(tmp_path, monkeypatch):
    """Stop (the page's progress callback raising) mid-conversion: nothing half-written stays in the cache."""
    monkeypatch.setenv("KVVIZ_CACHE", str(tmp_path / "cache"))

    class Stop(Exception):
        pass

    def progress(frac, msg):
        if "tensor 3/" in msg:
            raise Stop

    with pytest.raises(Stop):
        convert_gguf(default_gguf_path(), progress)
    gguf_dir = tmp_path / "cache" / "gguf"
    assert not gguf_dir.exists() or not any(gguf_dir.iterdir())
