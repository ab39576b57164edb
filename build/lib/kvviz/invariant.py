"""Invariant mode: every op whose result could depend on how many rows or keys are computed together is computed so
that a row's result depends only on that row's inputs. Then a cached run and a full forward, whose only difference
is *how many* rows/keys each kernel call sees, must agree bit for bit wherever the logic is right - and a gap that
survives is logic, proved.

What changes while the mode is on (a torch function mode: thread-local, entered per run, gone after it, also on
error; the model itself is never touched):

* linear layers (`F.linear`, `addmm`): one kernel call per row, always of shape [1, K] × [K, N], so a row is
  computed by the same kernel with the same reduction order whether 1 or L rows are in the batch;
* other matmuls (attention scores q·kᵀ, attention-weighted values p·v, rotary tables): every output element is a
  sequential sum over the inner dimension (products in float32 or better, then a running sum), so it does not
  depend on how many rows or columns are computed, and keys that are masked out (weight exactly 0) add exactly 0;
* softmax: the maximum (exact in any order), then the normaliser as a sequential running sum, so masked entries
  (exp = 0) and the number of keys in the row do not change it;
* `scaled_dot_product_attention`: the same scores, mask, softmax and weighted sum as above, per query over exactly
  its visible keys (from the mask, `is_causal`, or all keys), grouped heads expanded;
* `conv1d` (the causal short convolutions of Mamba and gated DeltaNet layers): every output element a running sum
  over its own window, so the cached states + new tokens give the bits the full sequence gives;
* elementwise transcendental functions (exp, sigmoid, tanh, silu, gelu, softplus...): every element through the
  kernel's vectorised body (a CPU kernel's scalar remainder rounds differently, and which elements fall in it
  depends on the tensor's length);
* chunked scans a model calls as functions of its modeling module (the gated delta rule of Qwen3-Next, Qwen3.5,
  OLMo-hybrid, Qwen4-exp: `torch_chunk_gated_delta_rule`) run as the step-by-step recurrence the same module defines
  (`torch_recurrent_gated_delta_rule`): chunks anchored at a call's first token group a full forward's terms
  otherwise than a cached rest's;
* MoE experts' grouped_mm (and transformers' fallback for it): one kernel call per token row;
* logsumexp (attention sinks): max + log of a running sum;
* norms (RMSNorm's mean, LayerNorm) already reduce each row on its own and are left as they are.

Pure PyTorch: runs on CPU and CUDA. It is slower (per-row kernel calls, explicit products), which is fine for
proving a point on a prompt; bench/invariant_bench.py measures it.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm, torch.mm,
            torch.Tensor.mm}
_SOFTMAXES = {torch.softmax, F.softmax, torch.Tensor.softmax, torch.nn.functional.softmax}
_STATE = threading.local()


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Products and sums in float32 at least (exact products for 16-bit inputs), float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def seq_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """A sum along `dim` in index order (a running sum): the same bits however long the row is, and trailing
    zeros change nothing. On the CPU torch's cumsum is such a sequential scan; on other devices cumsum is a
    parallel scan whose grouping depends on the length, so the running sum is taken one element at a time."""
    if x.device.type == "cpu":
        return torch.cumsum(x, dim=dim).select(dim, -1)
    acc = x.select(dim, 0).to(_acc_dtype(x.device, x.dtype))
    for k in range(1, x.shape[dim]):
        acc = acc + x.select(dim, k)
    return acc.to(x.dtype)


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with one [1, K] × [K, N] kernel call per row."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.result_type(rows, weight), device=x.device)
    for r in range(rows.shape[0]):
        out[r:r + 1] = F.linear(rows[r:r + 1], weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def rowwise_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta=1, alpha=1) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.result_type(a, b), device=a.device)
    for r in range(a.shape[0]):
        out[r:r + 1] = torch.addmm(bias, a[r:r + 1], b, beta=beta, alpha=alpha)
    return out


def rowwise_grouped_mm(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None):
    """grouped_mm (MoE experts: the tokens routed to expert g times its weight) with one [1, K] × [K, N] kernel call
    per row: how many tokens an expert gets changes nothing in a row's bits."""
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        ends = offs.tolist() if offs is not None else [mat_a.shape[0]]
        groups = [g for g, end in enumerate(ends) for _ in range(end - (ends[g - 1] if g else 0))]
    elif mat_a.dim() == 3 and mat_b.dim() == 3:
        out = torch.stack([rowwise_mm(mat_a[g], mat_b[g]) for g in range(mat_a.shape[0])])
        groups = None
    else:
        raise NotImplementedError("grouped_mm in invariant mode: only 2D x 3D and 3D x 3D")
    if groups is not None:
        out = torch.zeros(mat_a.shape[0], mat_b.shape[-1], dtype=torch.result_type(mat_a, mat_b),
                          device=mat_a.device)
        for r, g in enumerate(groups):
            out[r:r + 1] = torch.mm(mat_a[r:r + 1], mat_b[g])
    if bias is not None:
        out = out + bias
    return out if out_dtype is None else out.to(out_dtype)


def rowwise_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.result_type(a, b), device=a.device)
    for r in range(a.shape[0]):
        out[r:r + 1] = torch.mm(a[r:r + 1], b)
    return out


_GROUPED = tuple(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None)


def _acc_dtype(device: torch.device, wide: torch.dtype) -> torch.dtype:
    """The running sum's accumulator: float64 wherever the device has it (on the CPU this is exactly what torch's
    cumsum does for float32, so `seq_sum` and `fixed_order_matmul` agree), else the wide dtype."""
    return wide if device.type == "mps" else torch.float64


def fixed_order_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with every output element a running sum over the inner dimension in index order.

    One algorithm whatever the sizes: for j = 0, 1, …, K-1, acc += a[..., :, j] * b[..., j, :] (the product in
    float32 or better, the running sum in float64 where the device has it), then one rounding to the result dtype.
    So an element depends only on its own row of a and column of b - not on how many rows, columns or batch
    entries are computed, nor on the inner length when the extra entries are zeros (masked keys: p = 0), at the
    start or the end. (An earlier version switched to one kernel call per row above a size limit: the full forward
    of a long prompt and its cached chunk then took different paths, and a kernel call's own reduction order over
    the keys depends on how many keys there are - on a sliding-window model past its window, invariant mode was
    not order-identical. See tests/test_invariant_sizes.py.)"""
    if a.dim() < 2 or b.dim() < 2:
        return torch.matmul(a, b)
    out_dtype = torch.result_type(a, b)
    wide = _wide(out_dtype)
    acc_dtype = _acc_dtype(a.device, wide)
    k = a.shape[-1]
    shape = (*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    acc = torch.zeros(shape, dtype=acc_dtype, device=a.device)
    aw, bw = a.to(wide), b.to(wide)
    # One outer product per inner index, added to the running sum: contiguous [..., m, n] slices (an earlier version
    # built [..., m, kb, n] product blocks and added strided slices of them - the same bits, ~15x slower on a CPU).
    for j in range(k):
        p = aw[..., :, j:j + 1] * bw[..., j:j + 1, :]
        acc += p if p.dtype == acc_dtype else p.to(acc_dtype)
    return acc.to(wide).to(out_dtype)


def fixed_order_conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """F.conv1d with every output element a running sum over (input channel of its group, tap) in index order, the
    bias added last (products in float32 or better, the sum in float64 where the device has it, one rounding).

    A causal conv1d (Mamba, gated DeltaNet, short convolutions) sees the whole sequence in a full forward and the
    cached states + the new tokens in a cached run: the kernel picks its algorithm and reduction order from the
    length, so the same output position came out different in the last bit. Here it depends on its own window
    only."""
    stride, dilation = (v[0] if isinstance(v, (tuple, list)) else v for v in (stride, dilation))
    k = weight.shape[-1]
    span = (k - 1) * dilation + 1
    if isinstance(padding, str):
        if padding == "valid":
            padding = 0
        elif padding == "same" and stride == 1:
            total = span - 1
            input = F.pad(input, (total // 2, total - total // 2))
            padding = 0
        else:
            return F.conv1d(input, weight, bias, stride, padding, dilation, groups)
    padding = padding[0] if isinstance(padding, (tuple, list)) else padding
    squeeze = input.dim() == 2
    x = input.unsqueeze(0) if squeeze else input
    if padding:
        x = F.pad(x, (padding, padding))
    out_dtype = torch.result_type(x, weight)
    wide = _wide(out_dtype)
    acc_dtype = _acc_dtype(x.device, wide)
    b, cin, _ = x.shape
    cout, cin_g, _ = weight.shape
    win = x.to(wide).unfold(-1, span, stride)[..., ::dilation]  # [b, cin, L_out, k]
    win = win.reshape(b, groups, cin_g, win.shape[-2], k)  # [b, g, cin_g, L_out, k]
    w = weight.to(wide).reshape(groups, cout // groups, cin_g, k)  # [g, cout_g, cin_g, k]
    acc = torch.zeros(b, groups, cout // groups, win.shape[-2], dtype=acc_dtype, device=x.device)
    for c in range(cin_g):
        for j in range(k):
            p = win[:, :, None, c, :, j] * w[None, :, :, c, j, None]  # [b, g, cout_g, L_out]
            acc += p if p.dtype == acc_dtype else p.to(acc_dtype)
    if bias is not None:
        acc += bias.to(acc_dtype).reshape(1, groups, cout // groups, 1)
    out = acc.reshape(b, cout, -1).to(wide).to(out_dtype)
    return out.squeeze(0) if squeeze else out


# Elementwise functions whose CPU kernels have a vectorised body and a scalar remainder that round differently (exp,
# sigmoid, tanh, silu...): which one an element takes depends on where it lies in the tensor - a short convolution's
# output [B, C, T] sliced to T positions puts position t in the tail or the body depending on T.
_LANEWISE = {f for f in (
    torch.exp, torch.Tensor.exp, torch.exp2, torch.Tensor.exp2, torch.expm1, torch.Tensor.expm1, torch.log,
    torch.Tensor.log, torch.log1p, torch.Tensor.log1p, torch.log2, torch.Tensor.log2, torch.sigmoid,
    torch.Tensor.sigmoid, F.sigmoid, torch.tanh, torch.Tensor.tanh, F.tanh, torch.erf, torch.Tensor.erf, torch.erfc,
    torch.Tensor.erfc, torch.rsqrt, torch.Tensor.rsqrt, torch.sin, torch.Tensor.sin, torch.cos, torch.Tensor.cos,
    F.silu, F.gelu, F.softplus, F.mish, F.logsigmoid, F.elu, F.selu, F.celu, torch.special.expit,
    getattr(torch.special, "erf", None)) if f is not None}
_LANE_BLOCK = 1024  # a multiple of every vector width and of a thread's share of a block-aligned range


def lanewise(func, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """func(x) with every element computed by the kernel's vectorised body: x flattened, zero-padded to a multiple
    of _LANE_BLOCK elements, the function applied, the padding dropped. An element's result then depends on its own
    value only, not on its position or on the tensor's length."""
    flat = x.contiguous().reshape(-1)
    pad = (-flat.numel()) % _LANE_BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return func(flat, *args, **kwargs)[:x.numel()].reshape(x.shape)


def fixed_order_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    out_dtype = dtype or x.dtype
    w = x.to(_wide(out_dtype if dtype is not None else x.dtype))
    m = w.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a fully masked row: no NaN
    e = lanewise(torch.exp, w - m)  # a row's length (window cache vs full) must not move elements into the tail
    s = seq_sum(e, dim=dim).unsqueeze(dim)
    return (e / s).to(out_dtype)


def fixed_order_logsumexp(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """logsumexp (attention sinks, some attention kernels' normaliser) as max + log of a running sum: masked keys
    (-inf: exp = 0) and the row's length change nothing."""
    if isinstance(dim, (tuple, list)):
        if len(dim) != 1:
            return torch.logsumexp(x, dim, keepdim=keepdim)
        dim = dim[0]
    m = x.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = lanewise(torch.exp, x - m)
    out = lanewise(torch.log, seq_sum(e, dim=dim).unsqueeze(dim)) + m
    return out if keepdim else out.squeeze(dim)


def invariant_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, **_):
    """scaled_dot_product_attention per query over exactly its visible keys, in a fixed order."""
    hq, hk = query.shape[-3], key.shape[-3]
    if hk != hq:  # grouped KV heads
        key = key.repeat_interleave(hq // hk, dim=-3)
        value = value.repeat_interleave(hq // hk, dim=-3)
    lq, lk = query.shape[-2], key.shape[-2]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = fixed_order_matmul(query, key.transpose(-2, -1)).to(_wide(query.dtype)) * scale
    fill = torch.finfo(scores.dtype).min
    if is_causal:
        causal = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
        scores = scores.masked_fill(~causal, fill)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, fill)
        else:
            scores = (scores + attn_mask.to(scores.dtype)).clamp_min(fill)
    p = fixed_order_softmax(scores, dim=-1).to(query.dtype)
    return fixed_order_matmul(p, value)


class InvariantMode(TorchFunctionMode):
    """Route the shape-sensitive ops to their fixed-order versions (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return rowwise_linear(*args, **kwargs)
        if func is torch.addmm and len(args) >= 3 and args[1].dim() == 2:
            return rowwise_addmm(*args, **kwargs)
        if func in _MATMULS and len(args) == 2 and not kwargs:
            return fixed_order_matmul(*args)
        if func in _MATMULS and len(args) == 2 and set(kwargs) == {"out"}:  # transformers' grouped_mm fallback
            return kwargs["out"].copy_(fixed_order_matmul(*args))
        if func in _GROUPED or "grouped_mm_fallback" in str(getattr(func, "_qualified_op_name", "")):
            return rowwise_grouped_mm(*args, **kwargs)
        if func in (torch.logsumexp, torch.Tensor.logsumexp) and args[0].is_floating_point():
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
            if dim is not None and "out" not in kwargs:
                return fixed_order_logsumexp(x, dim, keepdim)
        if func in _SOFTMAXES:
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
            dtype = kwargs.get("dtype", args[2] if len(args) > 2 else None)
            return fixed_order_softmax(x, dim=dim, dtype=dtype)
        if func is F.scaled_dot_product_attention:
            return invariant_sdpa(*args, **kwargs)
        if (func in _LANEWISE and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()
                and args[0].numel() and "out" not in kwargs):
            return lanewise(func, *args, **kwargs)
        if func is F.conv1d or func is torch.conv1d:
            return fixed_order_conv1d(*args, **kwargs)
        return func(*args, **kwargs)


# Chunked scans a model calls as module-level functions of its transformers modeling module, each with the
# step-by-step recurrence the same module defines (chunked name, recurrent name). The chunked form groups tokens in
# chunks anchored at the call's first token, so a full forward and a cached rest (a call starting elsewhere) add
# the same terms in other groupings; the recurrence computes token t from the state after t-1 alone.
_SCANS = (("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),  # Qwen3-Next, Qwen3.5, OLMo-hybrid
          ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"))  # Kimi-Linear, Bailing-hybrid
_SWAPPED: dict = {}  # (module name, function name) -> the original function
_SWAP_LOCK = threading.Lock()


def _swap_scans() -> None:
    """Route each loaded transformers modeling module's chunked scan to its recurrence while invariant mode is on in
    the calling thread (elsewhere the wrapper calls the original: other threads and normal runs are unchanged)."""
    import sys

    with _SWAP_LOCK:
        for name, mod in list(sys.modules.items()):
            if not name.startswith("transformers.models.") or mod is None:
                continue
            for chunked, recurrent in _SCANS:
                orig, rec = getattr(mod, chunked, None), getattr(mod, recurrent, None)
                if orig is None or rec is None or (name, chunked) in _SWAPPED:
                    continue
                _SWAPPED[(name, chunked)] = orig
                setattr(mod, chunked, _scan_wrapper(orig, rec))


def _scan_wrapper(orig, rec):
    import functools
    import inspect

    sig = inspect.signature(orig)
    takes = inspect.signature(rec).parameters

    @functools.wraps(orig)
    def scan(*args, **kwargs):
        if not active():
            return orig(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)  # by name: the recurrence has no chunk size, and other positions
        bound.apply_defaults()
        named = {k: v for k, v in bound.arguments.items() if k != "chunk_size"}
        extra = {}
        for k, v in named.items():
            if sig.parameters[k].kind is inspect.Parameter.VAR_KEYWORD:
                extra.update(v)
            elif k in takes:
                extra[k] = v
        return rec(**extra)

    scan.kvviz_recurrence = rec
    return scan


def active() -> bool:
    """Is invariant mode on in this thread?"""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def invariant_mode():
    """Everything inside runs in invariant mode (this thread only); restored on exit, also on error."""
    _swap_scans()
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        with InvariantMode():
            yield
    finally:
        _STATE.depth -= 1


def _run_context(settings, lm):
    return invariant_mode() if settings.invariant else None


def _register() -> None:
    from .execution import register_run_context

    register_run_context(_run_context)


_register()
