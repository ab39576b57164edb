"""Converting a GGUF file to sharded safetensors one tensor at a time.

transformers' own GGUF loading dequantizes the whole file into a float32 model before anything can be saved: a
7B GGUF needs ~28 GB of RAM just to be converted. Here the file is read through gguf's memory-mapped reader and
each tensor is dequantized, given transformers' name and layout (the same per-architecture `TensorProcessor` that
transformers' legacy GGUF loader applies), written straight to the current shard, and dropped. Peak RAM is about
one float32 tensor (plus the pages of the mapped file the OS keeps); the written tensors are byte for byte the
ones the whole-model conversion saves (tests/test_gguf_stream.py compares every tensor on the default model).

Architectures this cannot reproduce exactly (transformers' newer GGUF path: qwen35, lfm2…; processors that merge
several GGUF tensors into one, such as MoE experts; a checkpoint whose names the model renames on load) raise
`NotStreamable`, and `kvviz.models.loading.convert_gguf` falls back to the whole-model conversion.

The folder is loaded by transformers as any sharded checkpoint: `model.safetensors.index.json` maps every tensor
name to its shard, and `from_pretrained` reads the shards through it.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch
import transformers

from ..core.cancel import Progress
from .compat import checkpoint_renamer, gguf_utils

INDEX_NAME = "model.safetensors.index.json"
SHARD_BYTES = 2 * 1024 ** 3  # like transformers' own shards: a 7B float32 model is ~14 files


class NotStreamable(Exception):
    """This GGUF needs the whole-model conversion (the reason is the message)."""


class ShardWriter:
    """Writes safetensors shards one tensor at a time, holding none of them in memory.

    A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte offsets), then the raw
    bytes. The header can only be written once every tensor of the shard is known, so a shard's bytes go to a side
    file first and are copied behind the header when the shard closes (in blocks; never read whole)."""

    def __init__(self, folder: Path, shard_bytes: int = SHARD_BYTES):
        self.folder = Path(folder)
        self.shard_bytes = int(shard_bytes)
        self.shards: list[tuple[dict, Path]] = []  # (header, side file) of closed shards
        self._header: dict = {}
        self._data = None
        self._size = 0
        self.weight_map: dict[str, int] = {}  # tensor name -> shard number (0-based until finish)
        self.total_size = 0

    def _open(self) -> None:
        path = self.folder / f".shard-{len(self.shards):05d}.data"
        self._data = open(path, "wb")
        self._data_path = path
        self._header = {}
        self._size = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if name in self.weight_map:
            raise NotStreamable(f"tensor {name} appears twice")
        if array.dtype != np.float32:
            raise NotStreamable(f"tensor {name} is {array.dtype}, not float32")
        array = np.ascontiguousarray(array, dtype="<f4")
        n = array.nbytes
        if self._data is not None and self._size and self._size + n > self.shard_bytes:
            self._close()
        if self._data is None:
            self._open()
        self._header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [self._size, self._size + n]}
        self._data.write(memoryview(array).cast("B"))
        self._size += n
        self.total_size += n
        self.weight_map[name] = len(self.shards)

    def _close(self) -> None:
        self._data.close()
        self.shards.append((self._header, self._data_path))
        self._data = None

    def finish(self) -> list[str]:
        """Write the shard files and the index; returns the shard file names."""
        if self._data is not None:
            self._close()
        if not self.shards:
            raise NotStreamable("the file holds no tensor the model uses")
        n = len(self.shards)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for (header, data_path), name in zip(self.shards, names):
            head = dict(header)
            head["__metadata__"] = {"format": "pt"}
            blob = json.dumps(head, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
            with open(self.folder / name, "wb") as out, open(data_path, "rb") as data:
                out.write(struct.pack("<Q", len(blob)))
                out.write(blob)
                while chunk := data.read(64 * 1024 * 1024):
                    out.write(chunk)
            os.remove(data_path)
        index = {"metadata": {"total_size": self.total_size},
                 "weight_map": {k: names[v] for k, v in sorted(self.weight_map.items())}}
        (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2))
        return names


def _meta_model(config):
    """The model's skeleton on the meta device (no memory): its parameter names and which of them are tied."""
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def stream_gguf(path: Path, folder: Path, config, progress: Progress, shard_bytes: int = SHARD_BYTES) -> dict:
    """Write `path`'s tensors into `folder` as float32 safetensors shards + index, one tensor at a time.

    `config` is the model config transformers reads from the GGUF's metadata. Raises NotStreamable where the
    result could differ from transformers' whole-model conversion. Returns a small summary."""
    import gguf  # here, not at the top: 0.35-0.5 s of `import kvviz`'s ~4 s, and only GGUF files need it

    mg, is_gguf_arch_supported = gguf_utils()

    reader = gguf.GGUFReader(str(path))  # the module's attribute: compat.gguf_read_once replaces it
    arch = mg.read_field(reader, "general.architecture")[0]
    if is_gguf_arch_supported(arch):
        raise NotStreamable(f"transformers loads {arch} GGUFs through its own conversion path")
    processor_cls = mg.TENSOR_PROCESSORS.get(arch, mg.TensorProcessor)
    if processor_cls not in (mg.TensorProcessor, mg.LlamaTensorProcessor, mg.Gemma2TensorProcessor,
                             mg.NemotronTensorProcessor, mg.BloomTensorProcessor, mg.GPT2TensorProcessor,
                             mg.T5TensorProcessor, mg.MambaTensorProcessor, mg.Lfm2TensorProcessor):
        raise NotStreamable(f"{arch} merges several GGUF tensors into one")
    # the same config dict the legacy loader gives its processor
    parsed = mg.load_gguf_checkpoint(str(path), return_tensors=False)
    processor = processor_cls(config=parsed.get("config", {}))

    model = _meta_model(config)
    expected = set(model.state_dict().keys())
    tied = tied_names(model)
    mapping = mg.get_gguf_hf_weights_map(model, processor)
    renamed = checkpoint_renamer(model)  # the name a tensor gets when `from_pretrained` loads it

    writer = ShardWriter(folder, shard_bytes)
    tensors = list(reader.tensors)
    extra: dict = {"tensors": {}}
    for i, t in enumerate(tensors):
        progress(i / len(tensors), f"tensor {i + 1}/{len(tensors)} ({t.name})")
        weights = gguf.dequantize(t.data, t.tensor_type)
        result = processor.process(weights=weights, name=t.name, tensor_key_mapping=mapping,
                                   parsed_parameters=extra)
        for name, tensor in extra["tensors"].items():  # gpt2 hands its output head over whole, under its own name
            if name not in expected:
                raise NotStreamable(f"{name} is not a parameter of {type(model).__name__}")
            writer.add(tied.get(name, name), tensor.numpy())
        extra["tensors"].clear()
        if result.name not in mapping:
            continue
        name = mapping[result.name]
        name = tied.get(name, name)
        if renamed(name) != name:
            raise NotStreamable(f"{type(model).__name__} renames {name} when it loads")
        if name not in expected:
            raise NotStreamable(f"{name} is not a parameter of {type(model).__name__}")
        writer.add(name, np.asarray(result.weights))
        del weights, result
    missing = expected - set(writer.weight_map) - {n for n, keep in tied.items() if n != keep}
    missing = {m for m in missing if not _is_non_weight(model, m)}
    if missing:
        raise NotStreamable(f"the file has no tensor for {sorted(missing)[0]}"
                            + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    shards = writer.finish()
    return {"tensors": len(writer.weight_map), "shards": len(shards), "bytes": writer.total_size}


def tied_names(model) -> dict[str, str]:
    """Parameter name -> the name it is saved under: parameters sharing one tensor (tied embeddings) are saved
    once, under the standard name - the input embedding's (`model.embed_tokens.weight`), as `save_pretrained`
    writes it and as other engines (vLLM) read it: a folder holding only `lm_head.weight` makes vLLM tie its head to
    an empty embedding. Groups without the input embedding keep the first name in sorted order."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    emb = getattr(model.get_input_embeddings(), "weight", None) if hasattr(model, "get_input_embeddings") else None
    out: dict[str, str] = {}
    for key, names in groups.items():
        if len(names) < 2:
            continue
        keep = sorted(names)[0]
        if emb is not None and key == id(emb):
            own = [n for n, p in model.named_parameters(remove_duplicate=False) if p is emb]
            input_names = [n for n in own if "embed" in n] or own
            keep = sorted(input_names)[0]
        for name in names:
            out[name] = keep
    return out


def _is_non_weight(model, name: str) -> bool:
    """Persistent buffers the checkpoint need not hold (their values come from the config)."""
    return name not in dict(model.named_parameters(remove_duplicate=False))
