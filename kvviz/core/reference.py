"""The float64 reference, without a float64 copy of the model.

Every verdict compares a run with the same scenario in float64. A full float64 twin (`lm.twin("float64")`) costs
8 bytes a parameter: 64 GB for an 8B model. The *streamed* reference runs the loaded model itself in float64 instead:
while a run on it is in progress, every operation that reads one of the model's parameters gets that parameter
upcast to float64 just for that operation (freed right after it), so at most one weight is ever held in float64.
bfloat16/float16/float32 → float64 is exact, so where the loaded weights hold the checkpoint's own values the numbers
are bit for bit those of the full twin. Where the user loaded a lower dtype than the checkpoint holds (a float32
checkpoint run in bfloat16), the parameter is read from the checkpoint instead (safetensors, one tensor at a time),
never from the rounded copy.

What else a full twin has, the streamed reference reproduces:
* buffers computed at load time in the model's dtype (Gemma's embedding scale, rotary frequencies): the twin's values
  are taken from a float64 skeleton of the model (parameters on the meta device, buffers real: a few KB);
* `weight.dtype` / `model.dtype` read float64 during the run, as the twin's do;
* transformers' float32 upcasts are kept in float64 inside the model's forward (`kvviz.core.float64.KeepFloat64`), exactly
  where the twin's `keep_float64` forward does it — and not outside it (generate() casts its logits to float32 for
  both).

Nothing of the shared model is changed: parameters and buffers are substituted per operation by a torch function
mode, in this thread only. The only thing attached to the model for the run's duration (under the model's lock,
held by `Executor.session()`) is a pair of hooks on the top-level module that say when its forward is running;
they are removed on exit, also on error.

`reference_model(lm, strategy)` is the one function every consumer gets its reference from (`lm.reference()`):
"twin" (the full float64 copy), "streamed", or "auto" (the twin where it is small next to the memory there is,
streamed otherwise; see kvviz.core.memory).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
import transformers
from accelerate import init_empty_weights
from safetensors import safe_open

from .capture import capture
from .dtypes import check_attention_dtype, exact_in
from .errors import KvvizError
from .float64 import head_slice_rows, keep64, sliced_linear64
from .dtypes import supports_dtype
from .memory import choose_reference, stream_keep_bytes

STRATEGIES = ("auto", "twin", "streamed")
ENV_STRATEGY = "KVVIZ_REFERENCE"

# Tensor methods and properties that only read metadata: answered from the loaded parameter, never upcast.
_META_METHODS = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.ndimension,
                 torch.Tensor.nelement, torch.Tensor.is_floating_point, torch.Tensor.is_contiguous,
                 torch.Tensor.data_ptr, torch.Tensor.stride, torch.Tensor.storage_offset, torch.Tensor.get_device,
                 torch.Tensor.__len__, torch.Tensor.is_complex}
_VALUE_PROPERTIES = {"T", "mT", "H", "mH", "data", "real"}


@dataclass
class StreamPlan:
    """How each parameter of one loaded model is made float64: from the loaded tensor or from the checkpoint."""

    from_checkpoint: dict[str, tuple[str, str]] = field(default_factory=dict)  # param name -> (file, key)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # buffer name -> the twin's value
    keep_bytes: int = 0  # upcast weights kept from run to run (a small model's: see memory.stream_keep_bytes)
    kept: dict = field(default_factory=dict, repr=False)  # id(param) -> (param, its float64 value)


# ------------------------------------------------------------------------------------------------------------------
# The strategy


def reference_model(lm, strategy: str | None = None):
    """The float64 reference of `lm` (itself when it is float64): the full twin or the streamed reference.

    strategy: "auto" (default; $KVVIZ_REFERENCE overrides), "twin" or "streamed"."""
    if lm.dtype == torch.float64:
        return lm
    check_attention_dtype(getattr(lm, "attn_implementation", ""), torch.float64, lm.device)
    strategy = (strategy or os.environ.get(ENV_STRATEGY) or "auto").strip().lower()
    if strategy not in STRATEGIES:
        raise KvvizError(f"unknown float64 reference strategy '{strategy}'; choose one of {', '.join(STRATEGIES)}")
    if strategy == "auto":
        strategy = choose_reference(lm)
    if strategy == "streamed" and can_stream(lm):
        try:
            return streamed_reference(lm)
        except CannotStream:
            pass
    return lm.twin("float64")


def can_stream(lm) -> bool:
    """The streamed reference runs on the model's own device, which must have float64 (not MPS), and on plain
    floating-point weights (not quantized ones)."""
    if is_streamed(lm) or not supports_dtype(lm.device, torch.float64):
        return False
    if not getattr(lm, "inference_mode", True):
        return False
    return all(p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in lm.model.parameters())


_STREAMED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_STREAMED_LOCK = threading.Lock()


def streamed_reference(lm):
    """The streamed float64 reference of `lm`: the same model object, tokenizer and lock, dtype float64, run under
    `streamed_float64` by every Executor session (cached per loaded model)."""
    with _STREAMED_LOCK:
        hit = _STREAMED.get(lm.model)
        if hit is not None and hit[0] is lm:
            return hit[1]
    plan = _stream_plan(lm)
    note = ("float64 reference streamed: the loaded weights are upcast to float64 one operation at a time "
            "(exact), so no float64 copy of the model is held")
    if plan.from_checkpoint:
        note += f"; {len(plan.from_checkpoint)} weight tensor(s) read from the checkpoint in its own dtype"
    ref = dataclasses.replace(lm, dtype=torch.float64, stream64=plan, warnings=list(lm.warnings) + [note],
                              lock=lm.lock)
    with _STREAMED_LOCK:
        _STREAMED[lm.model] = (lm, ref)
    return ref


def _skeleton_buffers(lm) -> dict[str, torch.Tensor]:
    """The buffers a float64 twin would hold (computed at load in its dtype), from a skeleton: parameters on the
    meta device, buffers real. Only those that differ from the loaded ones' values or dtype are kept."""
    loaded = dict(lm.model.named_buffers())
    if not loaded:
        return {}
    cfg = copy.deepcopy(lm.model.config)
    with init_empty_weights(include_buffers=False):
        skel = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64,
                                                             trust_remote_code=bool(getattr(lm, "trust_remote_code", False)))
    out = {}
    for name, b in skel.named_buffers():
        mine = loaded.get(name)
        if mine is None:
            continue
        if b.dtype != mine.dtype or b.shape != mine.shape or not torch.equal(b, mine.to(b.device)):
            out[name] = b.to(lm.device)
    del skel
    return out


def _checkpoint_index(folder: Path) -> dict[str, tuple[str, torch.dtype]]:
    """key -> (file, dtype) for every tensor in the folder's safetensors files (headers only)."""
    names = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    out: dict[str, tuple[str, torch.dtype]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for key, meta in header.items():
            if key != "__metadata__":
                out[key] = (str(f), names.get(meta.get("dtype")))
    return out


class CannotStream(KvvizError):
    """The streamed reference cannot reproduce the twin for this model; the twin is used instead."""


def _renamed(p: torch.Tensor, index: dict, used: set) -> str | None:
    """The checkpoint key of a parameter transformers renamed on load (e.g. GPT-NeoX's embed_out -> lm_head): the
    one unclaimed tensor of the same shape whose values, in the loaded dtype, are the parameter's."""
    hits = []
    for key, (file, _) in index.items():
        if key in used:
            continue
        with safe_open(file, framework="pt") as f:
            sl = f.get_slice(key)
            if tuple(sl.get_shape()) != tuple(p.shape):
                continue
            t = f.get_tensor(key)
        if torch.equal(t.to(device=p.device, dtype=p.dtype), p):
            hits.append(key)
    return hits[0] if len(hits) == 1 else None


def _stream_plan(lm) -> StreamPlan:
    # a dispatched model (accelerate's offload hooks) swaps its weights in and out each forward: nothing is kept
    dispatched = bool(getattr(lm.model, "hf_device_map", None))
    plan = StreamPlan(buffers=_skeleton_buffers(lm),
                      keep_bytes=0 if dispatched else stream_keep_bytes(sum(p.numel() for p in lm.model.parameters())))
    folder = Path(lm.source) if lm.source and Path(lm.source).is_dir() else None
    index = _checkpoint_index(folder) if folder is not None else {}
    groups: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, p in lm.model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
        params[id(p)] = p
    used = {n for names in groups.values() for n in names if n in index}
    all_exact = all(exact_in(dt, p.dtype) for p in params.values() for _, dt in index.values())
    for pid, names in groups.items():
        p = params[pid]
        held = [n for n in names if n in index]
        if not held and index:
            key = _renamed(p, index, used)
            held = [key] if key is not None else []
        if not held:
            # not in the checkpoint under its own name (built at load): exact only when nothing was rounded
            if index and not all_exact:
                raise CannotStream(f"{names[0]} is not in the checkpoint of {lm.name}")
            continue
        file, dt = index[held[0]]
        if not exact_in(dt, p.dtype):
            for n in names:
                plan.from_checkpoint[n] = (file, held[0])
    return plan


# ------------------------------------------------------------------------------------------------------------------
# The run context


_STATE = threading.local()


class StreamedFloat64(TorchFunctionMode):
    """Substitutes the model's parameters and buffers by float64 values in every operation that reads them, and
    keeps float64 tensors float64 (KeepFloat64's rule) while the model's forward runs."""

    def __init__(self, lm, plan: StreamPlan):
        super().__init__()
        self.subs: dict[int, tuple[torch.Tensor, object]] = {}
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = plan.kept  # id -> (param, float64 value)
        self.room = plan.keep_bytes - sum(8 * v.numel() for _, v in self.kept.values())
        self._handles: dict[str, object] = {}
        for name, p in lm.model.named_parameters(remove_duplicate=False):
            self.subs[id(p)] = (p, plan.from_checkpoint.get(name))
        buffers = dict(lm.model.named_buffers())
        for name, value in plan.buffers.items():
            b = buffers.get(name)
            if b is not None:
                self.subs[id(b)] = (b, value)

    # -- values

    def _open(self, file: str) -> "CheckpointReader":
        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = CheckpointReader(file)
        return h

    def _value(self, t: torch.Tensor, src) -> torch.Tensor:
        if isinstance(src, torch.Tensor):  # a buffer: the twin's own value
            return src
        if not t.dtype.is_floating_point and src is None:
            return t
        hit = self.kept.get(id(t))
        if hit is not None and hit[0] is t:  # the same tensor object, not another one at a reused address
            return hit[1]
        if src is not None:
            file, key = src
            v = self._open(file).tensor(key).to(device=t.device, dtype=torch.float64)
        else:
            v = t.to(torch.float64)
        if 8 * v.numel() <= self.room:  # a small model: each weight is upcast once a run, not once a forward
            self.kept[id(t)] = (t, v)
            self.room -= 8 * v.numel()
        return v

    def _sub(self, a):
        if isinstance(a, torch.Tensor):
            return self._value(a, self.subs[id(a)][1]) if self._hit(a) else a
        if isinstance(a, (list, tuple)) and a and any(isinstance(x, torch.Tensor) for x in a):
            return type(a)(self._sub(x) for x in a)
        return a

    def _hit(self, a) -> bool:
        hit = self.subs.get(id(a))
        return hit is not None and hit[0] is a

    # -- dispatch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and self._hit(args[0]):
            p = args[0]
            desc = getattr(func, "__self__", None)
            prop = getattr(desc, "__name__", None) if getattr(func, "__name__", "") == "__get__" else None
            if prop is not None and prop not in _VALUE_PROPERTIES:
                src = self.subs[id(p)][1]
                if prop == "dtype" and isinstance(src, torch.Tensor):  # a buffer: the twin's value's dtype
                    return src.dtype
                if prop == "dtype" and p.dtype.is_floating_point:
                    return torch.float64
                return func(*args, **kwargs)
            if func in _META_METHODS:
                return func(*args, **kwargs)
            if func is torch.Tensor.element_size and p.dtype.is_floating_point:
                return 8
        if func is F.embedding and len(args) > 1 and self._hit(args[1]):
            weight, src = self.subs[id(args[1])]
            if src is not None and not isinstance(src, torch.Tensor):
                hit = self.kept.get(id(weight))
                if (hit is None or hit[0] is not weight) and _plain_lookup(args, kwargs):
                    return self._checkpoint_rows(args[0], weight, src)  # only the looked-up rows, from the checkpoint
                weight = self._value(weight, src)  # (the kept float64 value where there is one)
            out = func(args[0], weight, *args[2:], **kwargs)
            return out.to(torch.float64) if out.dtype.is_floating_point else out
        if func is F.linear and len(args) > 1 and self._hit(args[1]) and not kwargs and \
                args[1].dim() == 2 and head_slice_rows(args[1].shape) is not None and id(args[1]) not in self.kept:
            return self._sliced_linear(*args)  # a weight over the slice size: never held whole in float64
        args = tuple(self._sub(a) for a in args)
        if kwargs:
            kwargs = {k: self._sub(v) for k, v in kwargs.items()}
        if getattr(_STATE, "forward", 0) > 0:
            args, kwargs, done = keep64(func, args, kwargs)
            if done is not None:
                return done
        return func(*args, **kwargs)

    def _sliced_linear(self, x, weight, bias=None):
        """A linear layer whose float64 weight is over REFERENCE_CHUNK_BYTES (a large vocabulary's head): applied in
        slices of output features, so only one slice is ever held in float64 - the same slices every float64 run
        makes (kvviz.core.float64.head_slice_rows), so each output is the same kernel call as the twin's."""
        src = self.subs[id(weight)][1]
        x = self._sub(x)
        b64 = self._sub(bias) if bias is not None else None

        def piece(i, j):
            if src is not None and not isinstance(src, torch.Tensor):
                file, key = src
                return self._open(file).rows(key, i, j).to(device=x.device, dtype=torch.float64)
            return weight[i:j].to(torch.float64)

        return sliced_linear64(x, weight.shape[0], head_slice_rows(weight.shape), piece, b64)

    def _checkpoint_rows(self, ids: torch.Tensor, weight: torch.Tensor, src) -> torch.Tensor:
        """An embedding lookup of a weight held rounded in the loaded model: the rows the ids name, read from the
        checkpoint in its own dtype and upcast (the same values as the whole float64 table would give)."""
        file, key = src
        wanted, where = torch.unique(ids.reshape(-1).cpu(), return_inverse=True)
        reader = self._open(file)
        table = torch.cat([reader.rows(key, int(r), int(r) + 1) for r in wanted.tolist()]) if wanted.numel() else \
            torch.empty(0, weight.shape[1])
        table = table.to(device=weight.device, dtype=torch.float64)
        return F.embedding(where.reshape(ids.shape).to(weight.device), table)

    def close(self) -> None:
        for h in self._handles.values():
            h.close()
        self._handles.clear()


def _plain_lookup(args, kwargs) -> bool:
    """F.embedding called as a lookup only (no max_norm renormalisation, which would write into the weight)."""
    max_norm = kwargs.get("max_norm", args[3] if len(args) > 3 else None)
    return max_norm is None and args[0].dtype in (torch.int64, torch.int32)


class CheckpointReader:
    """One safetensors file, read with plain file reads (not mapped into the process: the pages a reference reads
    from the checkpoint do not stay in the run's resident memory), a whole tensor or a range of its rows."""

    _DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool}

    def __init__(self, file: str):
        self.fh = open(file, "rb")  # noqa: SIM115 - closed by close()
        n = int.from_bytes(self.fh.read(8), "little")
        self.header = json.loads(self.fh.read(n))
        self.base = 8 + n

    def _read(self, offset: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        if out.numel():
            buf = out.view(-1).view(torch.uint8).numpy()
            self.fh.seek(offset)
            got = self.fh.readinto(memoryview(buf))
            if got != buf.nbytes:
                raise KvvizError(f"{self.fh.name} ends inside a tensor (damaged checkpoint?)")
        return out

    def tensor(self, key: str) -> torch.Tensor:
        meta = self.header[key]
        return self._read(self.base + meta["data_offsets"][0], meta["shape"], self._DTYPES[meta["dtype"]])

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop (the first dimension) of a tensor."""
        meta = self.header[key]
        shape, dt = list(meta["shape"]), self._DTYPES[meta["dtype"]]
        stop = min(stop, shape[0])
        row = dt.itemsize * math.prod(shape[1:])
        return self._read(self.base + meta["data_offsets"][0] + start * row, [max(0, stop - start)] + shape[1:], dt)

    def close(self) -> None:
        self.fh.close()


@contextlib.contextmanager
def streamed_float64(lm):
    """Run `lm` (a streamed reference) in float64 for the duration (this thread). The caller holds the model's
    lock (Executor.session does)."""
    model = lm.model

    def enter(_name, module, args):
        _STATE.forward = getattr(_STATE, "forward", 0) + 1

    def leave(_name, module, args, output):
        _STATE.forward = max(0, getattr(_STATE, "forward", 0) - 1)

    mode = StreamedFloat64(lm, lm.stream64)
    saved = getattr(_STATE, "forward", 0)
    try:
        with capture(model, "", on_input=enter, on_output=leave, always_call=True), mode:
            yield
    finally:
        mode.close()
        _STATE.forward = saved


def is_streamed(lm) -> bool:
    return getattr(lm, "stream64", None) is not None

