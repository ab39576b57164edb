"""Loading: specs, tiny models through the folder path, the model cache, clear errors."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import kvviz
from kvviz.core.errors import KvvizError
from kvviz.models.loading import parse_spec, tiny_folder

from conftest import DEVICE


def test_tiny_models_are_saved_and_loaded_as_folders(kvviz_cache):
    folder = tiny_folder("llama")
    assert Path(folder).is_relative_to(kvviz_cache)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert json.loads((folder / "kvviz-tiny.json").read_text())["arch"] == "llama"
    a = kvviz.load_model(str(folder), "float32", DEVICE)  # the same model through the plain folder path
    b = kvviz.load_model("tiny:llama", "float32", DEVICE)
    assert a is not b
    for (n1, p1), (n2, p2) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


@pytest.mark.parametrize("arch", kvviz.TINY_ARCHS)
def test_each_tiny_arch_loads_with_its_quirks(arch):
    from kvviz.models.tiny import TINY_MODEL_TYPES

    lm = kvviz.load_model(f"tiny:{arch}", "float32", DEVICE)
    assert lm.arch == TINY_MODEL_TYPES.get(arch, arch)
    assert lm.n_layers == (6 if arch == "gemma3" else 4)  # gemma3: five sliding layers, then a global one
    cfg = lm.config
    if arch == "gemma3":
        assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and cfg.sliding_window == 8
    if arch in ("llama", "qwen2", "mistral", "gemma2"):
        assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped KV heads
    if arch in ("mistral", "gemma2"):
        assert cfg.sliding_window == 8
    if arch == "gemma2":
        assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    if arch == "roberta":
        assert not cfg.is_decoder


def test_cache_is_keyed_and_models_are_never_mutated():
    f32 = kvviz.load_model("tiny:qwen2", "float32", DEVICE)
    before = {n: p.clone() for n, p in f32.model.named_parameters()}
    f16 = kvviz.load_model("tiny:qwen2", "float16", DEVICE)
    bf16 = kvviz.load_model("tiny:qwen2", "bfloat16", DEVICE)
    eager = kvviz.load_model("tiny:qwen2", "float32", DEVICE, "eager")
    assert len({id(f32), id(f16), id(bf16), id(eager)}) == 4
    assert kvviz.load_model("tiny:qwen2", "float32", DEVICE) is f32
    assert next(f32.model.parameters()).dtype == torch.float32
    assert next(f16.model.parameters()).dtype == torch.float16
    assert eager.attn_implementation == "eager" and f32.attn_implementation == "sdpa"
    for n, p in f32.model.named_parameters():
        assert torch.equal(p, before[n])


def test_float64_models_stay_float64():
    import torch

    lm = kvviz.load_model("tiny:llama", "float64", DEVICE, "eager")
    assert lm.attn_implementation == "eager"
    assert any("kept in float64" in w for w in lm.warnings)
    norm = lm.model.model.norm  # LlamaRMSNorm casts to float32 inside; under kvviz it must not round
    x = torch.randn(1, 3, 64, dtype=torch.float64, device=lm.device)
    with torch.inference_mode():
        from kvviz.core.float64 import KeepFloat64

        with KeepFloat64():
            exact = norm(x)
        plain = norm(x)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
    assert (exact - expected).abs().max() < 1e-15
    assert (plain - expected).abs().max() > 1e-12  # the float32 round trip transformers does on its own
    assert getattr(lm.model.forward, "_kvviz_float64", False)  # the loaded float64 model runs under the mode
    f32 = kvviz.load_model("tiny:llama", "float32", DEVICE, "eager")
    assert not getattr(f32.model.forward, "_kvviz_float64", False)  # 16/32-bit runs keep transformers" own casts


@pytest.mark.parametrize("spec, msg", [
    ("", "no model given"),
    ("tiny:nope", "unknown tiny model"),
    ("/definitely/not/here", "not found"),
    ("no such model!", "unknown model"),
    ("missing.gguf", "GGUF file not found"),
])
def test_bad_specs(spec, msg):
    with pytest.raises(KvvizError, match=msg):
        parse_spec(spec)


def test_folder_without_config(tmp_path):
    with pytest.raises(KvvizError, match="no config.json"):
        kvviz.load_model(str(tmp_path), "float32", DEVICE)


def test_hub_id_offline_fails_fast(monkeypatch):
    """Offline, a hub id that is not cached is refused at once: no connection is even attempted (a timing bound
    would depend on the machine; a connection attempt is what makes it slow)."""
    import socket

    attempts = []

    def no_network(self, address, *a, **k):
        attempts.append(address)
        raise OSError("network disabled in this test")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(KvvizError, match="not in the local Hugging Face cache"):
        kvviz.load_model("someone/not-a-cached-model", "float32", DEVICE)
    assert attempts == []


def test_bad_dtype_device_attention():
    with pytest.raises(KvvizError, match="unknown dtype"):
        kvviz.load_model("tiny:gpt2", "float8", DEVICE)
    with pytest.raises(KvvizError, match="unknown device"):
        kvviz.load_model("tiny:gpt2", "float32", "tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(KvvizError, match="no CUDA GPU"):
            kvviz.load_model("tiny:gpt2", "float32", "cuda")
    with pytest.raises(KvvizError, match="unknown attention"):
        kvviz.load_model("tiny:gpt2", "float32", DEVICE, "magic")


def test_trust_remote_code_is_off_by_default_and_warned_when_on():
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    assert not lm.trust_remote_code and not any("trust_remote_code" in w for w in lm.warnings)
    on = kvviz.load_model("tiny:gpt2", "float32", DEVICE, trust_remote_code=True)
    assert on is not lm and on.trust_remote_code
    assert any("trust_remote_code is on" in w for w in on.warnings)


def test_cache_dir_honours_xdg(monkeypatch, tmp_path):
    from kvviz.models.loading import cache_dir

    monkeypatch.delenv("KVVIZ_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "kvviz"


def test_concurrent_runs_on_one_cached_model_match_a_single_run():
    import threading

    from kvviz.views.greedy.run import GreedyConfig, run_greedy
    from kvviz.views.split.run import SplitConfig, run_split

    lm = kvviz.load_model("tiny:llama", "bfloat16", DEVICE)
    before = {n: p.clone() for n, p in lm.model.named_parameters()}
    cfg = SplitConfig("Hello world, caching is fun! 123", 9, left_pad=2)
    alone = run_split(lm, cfg)
    alone_g = run_greedy(lm, GreedyConfig("Hello", 8, paths=("no_cache", "cache")))
    results, errors = [], []

    def work(i):
        try:
            if i % 2:
                results.append(("split", run_split(lm, cfg)))
            else:
                results.append(("greedy", run_greedy(lm, GreedyConfig("Hello", 8, paths=("no_cache", "cache")))))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 8
    for kind, r in results:
        if kind == "split":
            for m in alone.main.hidden:
                assert (r.main.hidden[m] == alone.main.hidden[m]).all()
            assert r.verdict == alone.verdict
        else:
            assert r.paths["cache"].token_ids == alone_g.paths["cache"].token_ids
            assert r.paths["no_cache"].margins == alone_g.paths["no_cache"].margins
    for n, p in lm.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert lm.model.dtype == torch.bfloat16 and not lm.model.training


def test_safe_defaults_in_config_and_code():
    import re
    import tomllib

    from conftest import ROOT

    cfg = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert cfg["server"]["address"] == "127.0.0.1"
    assert cfg["server"]["enableXsrfProtection"] is True
    assert cfg["browser"]["gatherUsageStats"] is False
    code = {p: p.read_text() for p in list((ROOT / "kvviz").rglob("*.py")) + list((ROOT / "pages").glob("*.py"))
            + [ROOT / "app.py"]}
    for path, text in code.items():
        assert not re.search(r"^\s*import pickle|^\s*from pickle|torch\.load\((?![^)]*weights_only=True)", text,
                             re.M), path
        assert not re.search(r"trust_remote_code\s*=\s*True", text), path
    # streamlit stays out of the library
    for path, text in code.items():
        if path.relative_to(ROOT).parts[0] == "kvviz":  # the library folder, whatever the clone's folder is called
            assert not re.search(r"^\s*(import|from) streamlit", text, re.M), path


def test_within_a_conversion_a_gguf_is_parsed_once_and_each_name_map_built_once(tmp_path, monkeypatch):
    """convert_gguf runs inside compat.gguf_read_once: transformers' config, tokenizer and legacy loader, kvviz's
    stream and its label each open the file with `gguf.GGUFReader` (imported at each call), and transformers builds
    the tensor-name map once per module; inside the block each file is parsed once and each map built once (the
    default model's conversion: 74 s -> 22 s under load, bench/gguf_convert_bench.py read-once). Restored on exit,
    also on error."""
    gguf = pytest.importorskip("gguf")
    from kvviz.models import compat
    from kvviz.models.loading import gguf_quantization

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_file_type(15)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    path = tmp_path / "m.gguf"
    parsed, built = [], []
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "GGUFReader", lambda p, *a, **k: parsed.append(str(p)) or reader_cls(p, *a, **k))
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda a, n: built.append((a, n)) or name_map(a, n))
    before = (gguf.GGUFReader, gguf.get_tensor_name_map)
    with compat.gguf_read_once():
        from gguf import GGUFReader, get_tensor_name_map  # as transformers' loader imports them, at each call

        first = gguf.GGUFReader(str(path))
        assert GGUFReader(path) is first and gguf.GGUFReader(str(tmp_path / "." / "m.gguf")) is first
        assert gguf_quantization(path) == "Q4_K_M" and parsed == [str(path)]
        llama = gguf.MODEL_ARCH.LLAMA
        assert get_tensor_name_map(llama, 2) is gguf.get_tensor_name_map(llama, 2) and len(built) == 1
        assert get_tensor_name_map(llama, 3) is not get_tensor_name_map(llama, 2) and len(built) == 2
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == before
    gguf.GGUFReader(str(path))
    assert len(parsed) == 2  # outside the block: parsed again
    with pytest.raises(RuntimeError), compat.gguf_read_once():
        raise RuntimeError("a conversion that fails")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == before
