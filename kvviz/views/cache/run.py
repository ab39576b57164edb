"""The KV cache as an object: save it, reload it, continue from it, and check it against a freshly computed one.

A saved cache is one safetensors file: every layer's keys and values as they are stored (sliding layers keep only
their window), the token ids, and JSON metadata under the header key "kvviz" - kvviz version, the model's
fingerprint (architecture, config hash, weights size+mtime hash, tokenizer hash), dtype, device, cache kind and each
layer's class. Never pickle. Loading checks everything before building anything: a cache from another model,
tokenizer or dtype is refused with a message naming what differs; a truncated or tampered file, wrong shapes or a
missing tensor give one clear line; nothing is half-loaded.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
import tempfile

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save_file
from transformers import DynamicCache

from ... import __version__
from ...models.compat import fill_cache_layer, output_cache
from ...core.dtypes import dtype_name
from ...core.errors import KvvizError
from ...core.memory import Workload
from ...core.execution import Executor, cache_layers
from ...core.fingerprint import fingerprint
from ...core.inputs import check_context, encode
from ...models.loading import LoadedModel
from ...core.protocol import DEFAULT_CONTEXT, RunContext
from ...core.streaming import HeldRows, LayerGaps
from ...core.estimate import Timed

FORMAT = "kvviz-kv-cache/1"

# ------------------------------------------------------------------------------------------------------------------
# Save


def prefill(lm: LoadedModel, token_ids: list[int]):
    """The cache of `token_ids` (no padding), computed through the seam; returns the cache object."""
    ex = Executor(lm)
    with ex.session():
        out = ex.forward(torch.tensor([token_ids], device=lm.device), hidden=False)
    if output_cache(out) is None:
        raise KvvizError(f"{lm.name} returns no cache (a bidirectional model): there is no KV cache to save")
    return output_cache(out)


def save_cache(lm: LoadedModel, prompt: str, path: str | Path) -> dict:
    """Compute the cache of `prompt` and write it to `path` (safetensors). Returns the metadata written."""
    ids = encode(lm, prompt)
    check_context(lm, ids)
    cache = prefill(lm, ids)
    tensors = {"token_ids": torch.tensor(ids, dtype=torch.long)}
    layers = []
    for i, layer in enumerate(cache.layers):
        k, v = layer.keys, layer.values
        tensors[f"layers.{i}.keys"] = k.detach().to("cpu").contiguous()
        tensors[f"layers.{i}.values"] = v.detach().to("cpu").contiguous()
        layers.append({"class": type(layer).__name__, "sliding_window": getattr(layer, "sliding_window", None),
                       "stored": int(k.shape[-2]), "shape": list(k.shape)})
    meta = {"format": FORMAT, "kvviz": __version__, "model": lm.name, "fingerprint": fingerprint(lm),
            "device": str(lm.device), "cache_kind": type(cache).__name__, "n_tokens": len(ids), "layers": layers,
            "prompt": prompt}
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".part")
    try:
        save_file(tensors, str(tmp), metadata={"kvviz": json.dumps(meta)})
        tmp.replace(path)
    except OSError as e:
        raise KvvizError(f"could not write {path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return meta


def save_cache_bytes(lm: LoadedModel, prompt: str) -> tuple[bytes, dict]:
    """The same as save_cache, as bytes (for a download button)."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "cache.safetensors"
        meta = save_cache(lm, prompt, p)
        return p.read_bytes(), meta


# ------------------------------------------------------------------------------------------------------------------
# Load


@dataclass
class LoadedCache:
    cache: object
    token_ids: list[int]
    meta: dict


def _read(path_or_bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    try:
        if isinstance(path_or_bytes, (bytes, bytearray)):
            tensors = load(bytes(path_or_bytes))
        else:
            p = Path(path_or_bytes)
            if not p.is_file():
                raise KvvizError(f"no such cache file: {p}")
            tensors = load_file(str(p))
        raw_meta = _raw_metadata(path_or_bytes)
    except (SafetensorError, ValueError, OSError, RuntimeError) as e:
        raise KvvizError(f"this is not a readable safetensors cache file (truncated or damaged?): "
                         f"{str(e).splitlines()[0][:150]}") from None
    if not raw_meta or "kvviz" not in raw_meta:
        raise KvvizError("this safetensors file was not written by kvviz (no kvviz metadata): not a saved KV cache")
    try:
        meta = json.loads(raw_meta["kvviz"])
    except json.JSONDecodeError:
        raise KvvizError("the cache file's kvviz metadata is not valid JSON (tampered?)") from None
    if meta.get("format") != FORMAT:
        raise KvvizError(f"unknown cache format {meta.get('format')!r}; this kvviz reads {FORMAT}")
    return meta, tensors


def _raw_metadata(source) -> dict | None:
    """The safetensors header's __metadata__ of a file's bytes or path (of a file, only the header is read)."""
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
        return json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__")
    with open(source, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little"))).get("__metadata__")


def _check_model(lm: LoadedModel, meta: dict) -> None:
    saved, here = meta.get("fingerprint", {}), fingerprint(lm)
    names = {"architecture": "architecture", "config": "model config", "weights": "weights", "tokenizer": "tokenizer",
             "dtype": "dtype", "layers": "number of layers"}
    diffs = [f"{names[k]} ({saved.get(k)} in the file, {here[k]} here)" for k in names if saved.get(k) != here[k]]
    if diffs:
        raise KvvizError(f"this cache was saved from another model ({meta.get('model')}): its "
                         + "; ".join(diffs) + " differ. Load it with the model it came from.")


def _check_tensors(lm: LoadedModel, meta: dict, tensors: dict) -> list[int]:
    if "token_ids" not in tensors:
        raise KvvizError("the cache file has no token_ids tensor (tampered?)")
    ids = tensors["token_ids"].tolist()
    if len(ids) != meta.get("n_tokens"):
        raise KvvizError(f"the cache file holds {len(ids)} token ids but its metadata says {meta.get('n_tokens')}")
    layers = meta.get("layers", [])
    if len(layers) != lm.n_layers:
        raise KvvizError(f"the cache file has {len(layers)} layers; this model has {lm.n_layers}")
    for i, info in enumerate(layers):
        for part in ("keys", "values"):
            name = f"layers.{i}.{part}"
            if name not in tensors:
                raise KvvizError(f"the cache file is missing the tensor {name}")
            t = tensors[name]
            if list(t.shape) != info["shape"] or t.dim() != 4 or t.shape[-2] > len(ids):
                raise KvvizError(f"{name} has shape {list(t.shape)}, not the {info['shape']} its metadata says")
            if dtype_name(t.dtype) != meta["fingerprint"]["dtype"]:
                raise KvvizError(f"{name} is {dtype_name(t.dtype)}, not {meta['fingerprint']['dtype']}")
            if not torch.isfinite(t).all():
                raise KvvizError(f"{name} holds non-finite values (tampered or damaged file)")
    return ids


def _build(lm: LoadedModel, meta: dict, tensors: dict, n_tokens: int):
    """A cache object of the model's own kind with the saved layers in place (built whole, then returned)."""
    cache = DynamicCache(config=lm.config)
    if len(cache.layers) != lm.n_layers:
        raise KvvizError(f"this model's cache has {len(cache.layers)} layers, the file {lm.n_layers}")
    for i, layer in enumerate(cache.layers):
        k = tensors[f"layers.{i}.keys"].to(lm.device)
        v = tensors[f"layers.{i}.values"].to(lm.device)
        want = meta["layers"][i]["class"]
        if type(layer).__name__ != want:
            raise KvvizError(f"layer {i} is a {type(layer).__name__} here but a {want} in the file")
        fill_cache_layer(layer, k, v, n_tokens)
    return cache


def load_cache(lm: LoadedModel, source) -> LoadedCache:
    """Read, check and rebuild a saved cache for `lm` (a path or the file's bytes)."""
    meta, tensors = _read(source)
    _check_model(lm, meta)
    ids = _check_tensors(lm, meta, tensors)
    return LoadedCache(cache=_build(lm, meta, tensors, len(ids)), token_ids=ids, meta=meta)


# ------------------------------------------------------------------------------------------------------------------
# Continue and compare


@dataclass
class ContinueResult(Timed):
    bitwise_equal: bool
    max_abs_logits: float
    max_abs_hidden: float
    max_abs_kv: float
    n_cached: int
    continuation_tokens: list[str]
    next_token_loaded: str
    next_token_fresh: str
    meta: dict

    def to_dict(self) -> dict:
        return asdict(self)


def continue_and_compare(lm: LoadedModel, loaded: LoadedCache, text: str) -> ContinueResult:
    """Feed `text` through the reloaded cache and through a freshly computed cache of the same tokens; compare the
    hidden states, logits and the grown caches bit for bit."""
    cont = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    if not text or not cont:
        raise KvvizError("the continuation is empty; give some text to feed after the cached tokens")
    n = len(loaded.token_ids)
    limit = lm.max_positions
    if limit is not None and n + len(cont) > limit:
        raise KvvizError(f"cached {n} + continuation {len(cont)} tokens exceed the model's context of {limit}")
    fresh = prefill(lm, loaded.token_ids)
    ids = torch.tensor([cont], device=lm.device)
    mask = torch.ones((1, n + len(cont)), dtype=torch.long, device=lm.device)
    pos = torch.arange(n, n + len(cont), device=lm.device)[None]
    ex = Executor(lm)
    held = HeldRows(lambda h: h[0])  # the reloaded cache's run, layer by layer; the fresh one compared as it comes
    gaps = LayerGaps(held, 1.0, "the fresh cache's run", free=True, equal=True)
    with ex.session():
        a = ex.forward(ids, mask, pos, loaded.cache, hidden=held)
        b = ex.forward(ids, mask, pos, fresh, hidden=gaps.sink(lambda h: h[0]))
    la, lb = a.logits[0], b.logits[0]
    hidden_max_abs = float(gaps.matrices()["max_abs"].max())
    pairs = [(x, y) for (ka, va), (kb, vb) in zip(cache_layers(output_cache(a)), cache_layers(output_cache(b)))
             for x, y in ((ka, kb), (va, vb))]  # the grown caches' keys and values, side by side
    kv = [float((x.double() - y.double()).abs().max()) for x, y in pairs]
    equal = torch.equal(la, lb) and gaps.equal and all(torch.equal(x, y) for x, y in pairs)
    tok = lm.tokenizer
    return ContinueResult(bitwise_equal=bool(equal), max_abs_logits=float((la.double() - lb.double()).abs().max()),
                          max_abs_hidden=hidden_max_abs, max_abs_kv=max(kv) if kv else 0.0, n_cached=n,
                          continuation_tokens=[tok.decode([i]) for i in cont],
                          next_token_loaded=tok.decode([int(la[-1].argmax())]),
                          next_token_fresh=tok.decode([int(lb[-1].argmax())]),
                          meta={k: v for k, v in loaded.meta.items() if k != "layers"})


@dataclass(frozen=True)
class ReloadConfig:
    """A saved cache reloaded and continued with `continuation`, against a fresh cache of the same tokens. source: a
    saved cache (its path or bytes); None: the prompt's cache saved now."""
    prompt: str = ""
    continuation: str = ""
    source: "str | Path | bytes | None" = None

    def validate(self) -> "ReloadConfig":
        if not self.continuation:
            raise KvvizError("the continuation is empty; give some text to feed after the cached tokens")
        if self.source is None and not (isinstance(self.prompt, str) and self.prompt):
            raise KvvizError("give a prompt to cache or a saved cache to reload")
        return self

    def workload(self) -> Workload:
        """What the run holds, for its memory plan: the reloaded cache and a fresh one of the saved tokens, then the
        continuation (its UTF-8 bytes + 1 bound its tokens from above: a byte-level BPE token spans a byte or more).
        The saved token count is read from the file's header alone; an unreadable file plans the continuation only
        (the run then says what is wrong in its own line). No continuation and no source: the prompt's cache saved
        (`cache save`, the page's download)."""
        cont = len(self.continuation.encode("utf-8")) + 1
        if self.source is None and not self.continuation:
            return Workload(texts=(self.prompt,))
        if self.source is None:
            return Workload(texts=(self.prompt,), tokens=len(self.prompt.encode("utf-8")) + 1 + cont)
        return Workload(tokens=saved_token_count(self.source) + cont)


def saved_token_count(source) -> int:
    """The number of cached tokens a saved cache holds (its kvviz metadata's n_tokens), from the header alone; 0 where
    the file cannot be read as one."""
    try:
        return max(0, int(json.loads((_raw_metadata(source) or {})["kvviz"]).get("n_tokens", 0)))
    except (OSError, ValueError, KeyError, TypeError):
        return 0


# what its run cannot honour (kvviz.core.protocol.RunContext.running; the CLI refuses the matching flag)
REFUSES = {'invariant': 'the reload is compared with a plain fresh cache', 'prove': 'it runs no proof rerun'}


def run(lm: LoadedModel, config: ReloadConfig, ctx: RunContext = DEFAULT_CONTEXT) -> ContinueResult:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    config.validate()
    with ctx.running(REFUSES) as progress:
        source = config.source
        if source is None:
            progress(0.1, "Saving the prompt's cache…")
            source, _ = save_cache_bytes(lm, config.prompt)
        progress(0.5, "Reloading it and continuing…")
        return continue_and_compare(lm, load_cache(lm, source), config.continuation)
