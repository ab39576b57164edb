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


def fixed_order_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    out_dtype = dtype or x.dtype
    w = x.to(_wide(out_dtype if dtype is not None else x.dtype))
    m = w.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a fully masked row: no NaN
    e = torch.exp(w - m)
    s = seq_sum(e, dim=dim).unsqueeze(dim)
    return (e / s).to(out_dtype)


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
        if func in _SOFTMAXES:
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
            dtype = kwargs.get("dtype", args[2] if len(args) > 2 else None)
            return fixed_order_softmax(x, dim=dim, dtype=dtype)
        if func is F.scaled_dot_product_attention:
            return invariant_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


def active() -> bool:
    """Is invariant mode on in this thread?"""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def invariant_mode():
    """Everything inside runs in invariant mode (this thread only); restored on exit, also on error."""
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
