"""Keep a float64 model in float64.

transformers "upcasts" in many places so that 16-bit models stay accurate: RMSNorm runs in float32
(`x.to(torch.float32)`, `x.float()`), eager attention takes its softmax with `dtype=torch.float32`. For a float64
model every such upcast is a *down*cast that rounds to float32 (~6e-8), and two runs whose inputs differ by 1e-16
can round to different float32 neighbours. The float64 reference would then carry float32 noise and could even
flip a verdict. While a kvviz float64 model runs, this mode turns float64 → float32 casts into no-ops, so the
computation stays float64 end to end (the same maths, the precision the reference promises).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools

import torch
from torch.overrides import TorchFunctionMode

from .capture import Capture

REFERENCE_CHUNK_BYTES = 128 * 1024 ** 2  # a float64 weight larger than this is applied in slices (kvviz.core.memory plans it)
# invariant mode's kernel probes build their data in float64 a slab at a time, at most this many numbers (the weight's
# copy in its own dtype is the probe's one full-size tensor: a float64 copy of an 8B model's head would be 4 GiB);
# kvviz.core.invariant builds them, kvviz.core.memory plans them
PROBE_SLAB = 1 << 20

_SOFTMAXES = {torch.softmax, torch.log_softmax, torch.nn.functional.softmax, torch.nn.functional.log_softmax,
              torch.Tensor.softmax, torch.Tensor.log_softmax}


def grouped_mm64(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None):
    """torch's grouped_mm (MoE experts) has no float64 kernel: the same product group by group with plain matmul."""
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        ends = offs.tolist() if offs is not None else [mat_a.shape[0]]
        out = mat_a.new_zeros(mat_a.shape[0], mat_b.shape[-1])
        start = 0
        for g, end in enumerate(ends):
            if end > start:
                out[start:end] = mat_a[start:end] @ mat_b[g]
            start = end
    elif mat_a.dim() == 3 and mat_b.dim() == 3:
        out = torch.bmm(mat_a, mat_b)
    else:
        raise NotImplementedError("grouped_mm in float64: only 2D x 3D and 3D x 3D")
    if bias is not None:
        out = out + bias
    return out if out_dtype is None else out.to(out_dtype)


def compat_grouped_mm_functions() -> tuple:
    """torch's grouped matmul(s) a MoE forward may call: `torch.nn.functional.grouped_mm` and, before it was public,
    `torch._grouped_mm` (this module is copied into repro scripts, so it keeps its own compat, imports no kvviz)."""
    return tuple(f for f in (getattr(torch.nn.functional, "grouped_mm", None), getattr(torch, "_grouped_mm", None))
                 if f is not None)


_GROUPED = compat_grouped_mm_functions()


_PRODUCTS = {torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.mm, torch.bmm, torch.einsum,
             torch.Tensor.__matmul__, torch.baddbmm, torch.addmm}


_CREATIONS = {torch.zeros, torch.ones, torch.empty, torch.full, torch.zeros_like, torch.ones_like, torch.empty_like,
              torch.full_like}


def _is64(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.float64


def head_slice_rows(weight_shape) -> int | None:
    """Output features per slice where a float64 linear's weight is over REFERENCE_CHUNK_BYTES (a large vocabulary's
    head), else None. Every float64 run (the twin, a float64 model, the streamed reference) applies such a weight in
    these slices: a matrix kernel's reduction order can depend on how many output features one call has (MKL's dgemm
    on AVX2 with two threads does), so the streamed reference, which can only hold one slice, and the twin must make
    the same calls to agree bit for bit."""
    rows, d = int(weight_shape[0]), int(weight_shape[-1])
    if 8 * rows * d <= REFERENCE_CHUNK_BYTES:
        return None
    return max(1, REFERENCE_CHUNK_BYTES // (8 * max(1, d)))


def sliced_linear64(x: torch.Tensor, n_out: int, rows: int, weight_slice, bias: torch.Tensor | None = None):
    """F.linear in float64 in slices of `rows` output features; weight_slice(i, j) gives rows i:j in float64."""
    out = torch.empty(*x.shape[:-1], n_out, dtype=torch.float64, device=x.device)
    for i in range(0, n_out, rows):
        j = min(n_out, i + rows)
        w = weight_slice(i, j)
        out[..., i:j] = torch.nn.functional.linear(x, w, None if bias is None else bias[i:j])
        del w
    return out


def keep64(func, args, kwargs):
    """The rule of a float64 run, for one torch call: float64 -> float32 casts are no-ops and MoE grouped_mm runs
    group by group. Returns (args, kwargs, result): result is not None when the call is answered here. Used by
    KeepFloat64 and by the streamed reference (kvviz.core.reference), so both keep float64 the same way."""
    if func is torch.nn.functional.linear and len(args) > 1 and _is64(args[0]) and _is64(args[1]) and not kwargs \
            and args[1].dim() == 2:
        rows = head_slice_rows(args[1].shape)
        if rows is not None:
            w, b = args[1], args[2] if len(args) > 2 else None
            return args, kwargs, sliced_linear64(args[0], w.shape[0], rows, lambda i, j: w[i:j], b)
    if func in _PRODUCTS:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len(tensors) == 1 and isinstance(args[-1], (list, tuple)):  # einsum(eq, [a, b])
            tensors = [a for a in args[-1] if isinstance(a, torch.Tensor)]
        if any(_is64(t) for t in tensors) and any(isinstance(t, torch.Tensor) and t.dtype == torch.float32
                                                  for t in tensors):
            # a float32 weight kept by the model (ERNIE's MoE gate in _keep_in_fp32_modules, XLNet's float32
            # positional tensors) meets float64 activations: the product in float64, not a dtype error
            up = lambda a: a.double() if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a  # noqa: E731
            args = tuple(type(a)(up(x) for x in a) if isinstance(a, (list, tuple)) else up(a) for a in args)
            kwargs = {k: up(v) for k, v in kwargs.items()}
        return args, kwargs, None
    if func in _CREATIONS and kwargs.get("dtype") is torch.float32:
        # a float32 state or accumulator made for a float64 run (RWKV's wkv state, zeros_like(key, dtype=float32))
        return args, {**kwargs, "dtype": torch.float64}, None
    if func is torch.full and "dtype" not in kwargs and len(args) > 1 and isinstance(args[1], float) \
            and abs(args[1]) > torch.finfo(torch.float32).max and args[1] != float("inf") \
            and args[1] != float("-inf"):
        # torch.full((), torch.finfo(float64).min) (XGLM's float64 mask floor) made in the default float32 overflows
        return args, {**kwargs, "dtype": torch.float64}, None
    if args and _is64(args[0]):
        if func in _GROUPED:
            return args, kwargs, grouped_mm64(*args, **kwargs)
        if func is torch.Tensor.float:
            return args, kwargs, args[0]
        if func is torch.Tensor.type and (
                (len(args) > 1 and args[1] in (torch.float32, "torch.FloatTensor"))
                or kwargs.get("dtype") in (torch.float32, "torch.FloatTensor")):
            return args, kwargs, args[0]  # MoE routers: F.linear(x.type(torch.float32), w.type(torch.float32))
        if func is torch.Tensor.to:
            if kwargs.get("dtype") == torch.float32:
                kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
            if any(a is torch.float32 for a in args[1:]):
                args = tuple(a for a in args if a is not torch.float32)
            if len(args) == 1 and not kwargs:
                return args, kwargs, args[0]
        elif func in _SOFTMAXES and kwargs.get("dtype") == torch.float32:
            kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
    return args, kwargs, None


class KeepFloat64(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs, done = keep64(func, args, kwargs or {})
        return done if done is not None else func(*args, **kwargs)


def keep_float64(model) -> None:
    """Make `model` (a freshly loaded float64 model, not yet shared) run under KeepFloat64."""
    if getattr(model.forward, "_kvviz_float64", False):
        return
    # parameters a model file creates in float32 on purpose (e.g. a norm built with dtype=torch.float32) stay float32
    # when the model loads in float64; their float32 casts are dropped below, so they must hold float64 too. (Buffers
    # such as rotary inv_freq are left as the model made them: the streamed reference reads them the same way.)
    for t in model.parameters():
        if t.is_floating_point() and t.dtype != torch.float64:
            t.data = t.data.to(torch.float64)
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with KeepFloat64():
            return inner(*args, **kwargs)

    forward._kvviz_float64 = True
    model.forward = forward


# --- the allocator's residue of a long float64 forward on the CPU ---------------------------------------------------
#
# glibc keeps freed blocks below its mmap threshold (which rises with the largest freed mapping, up to 32 MiB) inside
# the process: a float64 forward over a long prompt frees a layer's intermediates (tens of MiB each at 4096 tokens)
# into the heap, and the next layer's, of other sizes, do not all fit in them. Measured on the default model's
# bfloat16 split at 4096 tokens (half compared): the float64 rerun peaked at 5.38 GiB, 4.38 GiB with the freed
# blocks given back before each layer (docs/benchmarks.md) - a gigabyte the memory plan cannot see. Where a float64
# forward's layer input is this large or more, the freed blocks are given back (malloc_trim) before each decoder layer
# and after the last; shorter forwards leave little and skip it (a decode step's call costs more than it returns).
RELEASE_MIN_BYTES = 4 * 1024 ** 2


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where there is none."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl): nothing to give back this way
        return None


def gives_freed_memory_back() -> bool:
    """Whether this process can give freed heap blocks back between a float64 forward's layers (glibc)."""
    return _malloc_trim() is not None


def release_freed_memory() -> bool:
    """Give the heap's freed blocks back to the system (glibc); False where that is not available."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@contextlib.contextmanager
def released_between_layers(layers):
    """A context (kvviz.core.execution's session, float64 runs on the CPU): before each layer of `layers` and after the
    last, the freed blocks go back to the system where the layer's input is RELEASE_MIN_BYTES or more."""
    if layers is None or not len(layers) or _malloc_trim() is None:
        yield
        return

    def pre(_name, _module, args, kwargs, _output=None):
        x = args[0] if args else kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor) and x.numel() * x.element_size() >= RELEASE_MIN_BYTES:
            release_freed_memory()

    with Capture().on_input(layers, pre, with_kwargs=True).on_output([layers[len(layers) - 1]], pre, with_kwargs=True):
        yield
