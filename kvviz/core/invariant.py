"""Invariant mode: every op whose result could depend on how many rows or keys are computed together is computed so
that a row's result depends only on that row's inputs and the keys it sees (masked keys add exactly 0). A cached run
and a full forward, which differ only in *how many* rows/keys each kernel call sees, must then agree bit for bit
wherever the logic is right - and a gap that survives is logic, proved.

A torch function mode (thread-local, entered per run, gone after it, also on error; the model is never touched).
Fixed shapes and fixed reduction splits, at library-GEMM speed; the per-row and element-by-element forms below are
the fallback where no fixed shape passes its probe:

* linear layers (`F.linear`, `addmm`): rows in blocks of one of a probed family of sizes (e.g. 256, 16, 1; the last
  block zero-padded), so a row's K-reduction never depends on how many rows came with it;
* `scaled_dot_product_attention`: the library's fused kernel (flash attention on the CPU: each query row by itself,
  keys in fixed blocks) given every row's keys from its first visible key on, padded with masked zero keys to a
  multiple of the block and the rows to a multiple of 8 - where a probe shows a row gets the same bits in the full
  forward, a cached chunk, alone, left-padded, beside another sequence and through a sliding window's cache; where a
  row's bits depend on its slot in the kernel's block of rows (AVX2), every call has 32 rows, a row at the slot its
  number of keys names. Otherwise, and with `ExecSettings(sdpa_as_eager=True)` (the matrix): eager attention's steps
  op for op with fixed-shape GEMMs, key blocks starting at each query's first visible key (fast_sdpa), so eager and
  SDPA models agree bit for bit;
* other matmuls (eager attention's q·kᵀ and p·v): [t, t] x [t, t] tile GEMMs, the inner dimension in blocks of t
  aligned at each row's first nonzero, partial products added in index order;
* softmax and logsumexp (attention sinks): the maximum, then the normaliser as a running sum, so masked entries
  (exp = 0) and the row's length change nothing;
* `conv1d` (Mamba and gated DeltaNet short convolutions): every output element a running sum over its own window;
* elementwise transcendental functions (exp, sigmoid, silu...): every element through the kernel's vectorised body
  (a CPU kernel's scalar remainder rounds differently, and which elements fall in it depends on the length);
* chunked scans a modeling module calls (`torch_chunk_gated_delta_rule`: Qwen3-Next, Qwen3.5, OLMo-hybrid...) run
  as the recurrence the same module defines: chunks anchored at a call's first token group a full forward's terms
  otherwise than a cached rest's;
* MoE experts' grouped_mm (and transformers' fallback for it): one kernel call per token row;
* norms already reduce each row on its own and are left as they are.

Every fixed shape is probed once per device, dtype, shape and thread count (rows, columns and batch entries rolled;
data whose products cancel, so a 16-bit output still shows a summation order): a GEMM library picks its algorithm
from the shape, and on some CPUs (AVX2 MKL) an output depends on where its row sits. Pure PyTorch: CPU and CUDA.
bench/invariant_bench.py measures the cost.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..models import compat
from .errors import KvvizError
from .float64 import PROBE_SLAB, _GROUPED
from .execution import register_run_context

_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm, torch.mm,
            torch.Tensor.mm}
_SOFTMAXES = {torch.softmax, F.softmax, torch.Tensor.softmax, torch.nn.functional.softmax}
_STATE = threading.local()


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Products and sums in float32 at least (exact products for 16-bit inputs), float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _repeat_kv(query, key, value, dim: int = -3):
    """key and value with grouped KV heads repeated to the query's heads (at `dim`)."""
    hq, hk = query.shape[dim], key.shape[dim]
    if hk == hq:
        return key, value
    return key.repeat_interleave(hq // hk, dim=dim), value.repeat_interleave(hq // hk, dim=dim)


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


def _per_row(rows: torch.Tensor, other: torch.Tensor, n_out: int, call) -> torch.Tensor:
    """call(row [1, K]) for every row of `rows`, one kernel call each, written into one [R, n_out] output."""
    out = torch.empty(rows.shape[0], n_out, dtype=torch.result_type(rows, other), device=rows.device)
    for r in range(rows.shape[0]):
        out[r:r + 1] = call(rows[r:r + 1])
    return out


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with one [1, K] × [K, N] kernel call per row."""
    out = _per_row(x.reshape(-1, x.shape[-1]), weight, weight.shape[0], lambda row: F.linear(row, weight, bias))
    return out.reshape(*x.shape[:-1], weight.shape[0])


def rowwise_grouped_mm(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None):
    """grouped_mm (MoE experts: the tokens routed to expert g times its weight) with one [1, K] × [K, N] kernel call
    per row: how many tokens an expert gets changes nothing in a row's bits."""
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        ends = offs.tolist() if offs is not None else [mat_a.shape[0]]
        groups = [g for g, end in enumerate(ends) for _ in range(end - (ends[g - 1] if g else 0))]
        out = torch.zeros(mat_a.shape[0], mat_b.shape[-1], dtype=torch.result_type(mat_a, mat_b),
                          device=mat_a.device)
        for r, g in enumerate(groups):
            out[r:r + 1] = torch.mm(mat_a[r:r + 1], mat_b[g])
    elif mat_a.dim() == 3 and mat_b.dim() == 3:
        out = torch.stack([rowwise_mm(mat_a[g], mat_b[g]) for g in range(mat_a.shape[0])])
    else:
        raise NotImplementedError("grouped_mm in invariant mode: only 2D x 3D and 3D x 3D")
    if bias is not None:
        out = out + bias
    return out if out_dtype is None else out.to(out_dtype)


def rowwise_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _per_row(a, b, b.shape[1], lambda row: torch.mm(row, b))


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
    start or the end. No size limit and no second path: a kernel call's own reduction order depends on the number
    of keys (tests/test_invariant_sizes.py)."""
    if a.dim() < 2 or b.dim() < 2:
        return torch.matmul(a, b)
    out_dtype = torch.result_type(a, b)
    wide = _wide(out_dtype)
    acc_dtype = _acc_dtype(a.device, wide)
    k = a.shape[-1]
    shape = (*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    acc = torch.zeros(shape, dtype=acc_dtype, device=a.device)
    aw, bw = a.to(wide), b.to(wide)
    # one contiguous [..., m, n] outer product per inner index (strided product blocks: same bits, ~15x slower)
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
    return _softmax(x, dim, dtype, seq_sum)


def _softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None, total) -> torch.Tensor:
    """softmax with its normaliser `total(e, dim)`: a running sum (seq_sum) or the tile GEMMs' grouping (block_sum)."""
    out_dtype = dtype or x.dtype
    w = x.to(_wide(out_dtype))
    m = w.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a fully masked row: no NaN
    e = lanewise(torch.exp, w - m)  # a row's length (window cache vs full) must not move elements into the tail
    s = total(e, dim).unsqueeze(dim)
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
    key, value = _repeat_kv(query, key, value)
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


# --- fixed-shape kernels: the same bits at library-GEMM speed --------------------------------------------------------
#
# A library GEMM picks its algorithm from the call's shape, so every call here has one of a few fixed shapes; each is
# probed (the call, and again with its rows, columns or batch entries rolled) and used only where an element's bits do
# not depend on where it sits (on AVX2 MKL's sgemm they do for some row counts). A matmul's inner dimension goes in
# blocks of T aligned at each row's first nonzero (its first visible key), combined in index order, so a cached row
# whose keys start elsewhere (a sliding window's cache, left padding) groups the same terms as the full forward's.

# Row-block families, in order of preference: a family's sizes must each be position-free AND give a row the same
# bits as each other, so a long prompt goes in the big blocks and a decode step's one row in a small one.
LINEAR_BLOCKS = {"cpu": ((256, 16, 1), (256, 32), (256, 64), (128, 16), (128, 64), (64, 16), (256,), (128,), (64,), (32,), (16,),
                         (48,), (24,), (8,)),
                 "cuda": ((256, 64), (128, 32), (256,), (128,), (64,), (32,), (16,))}
TILES = {"cpu": (64, 32, 16, 48, 24), "cuda": (64, 32, 16)}
# every tile bmm call multiplies exactly one of these many [T, T] x [T, T] pairs (the last chunk padded); the probe
# checks a pair's bits are the same in each
TILE_BATCHES = (1024, 128, 16)
_PROBES: dict = {}
_PROBE_LOCK = threading.Lock()


def _where(device: torch.device) -> tuple:
    """What a probe's verdict depends on besides the shape: the device, its kernels and the thread count."""
    if device.type == "cpu":
        return ("cpu", torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())
    if device.type == "cuda":
        return ("cuda", torch.cuda.get_device_name(device), torch.backends.cuda.matmul.allow_tf32)
    return (device.type,)


def _probe(key, candidates, works):
    with _PROBE_LOCK:
        if key in _PROBES:
            return _PROBES[key]
    found = next((c for c in candidates if works(c)), 0)
    with _PROBE_LOCK:
        _PROBES[key] = found
    return found


def _probe_data(shape, dtype, device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def _cancelling(shape, stride, dtype, device, k_dim: int, seed: int, negate: bool = False) -> torch.Tensor:
    """Probe data whose products cancel: along the inner dimension (k_dim) the second half repeats the first (negated
    with `negate`), so a row times a weight sums to exactly 0 and what a kernel returns is its rounding alone - which
    differs, in nearly every output and whatever the output dtype, between two summation orders. 2-D; built in
    slabs along the other dimension (PROBE_SLAB numbers of float64 at a time)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    o_dim, k = 1 - k_dim, shape[k_dim]
    step = max(1, PROBE_SLAB // max(1, k))
    for i in range(0, shape[o_dim], step):
        part = list(shape)
        part[o_dim] = min(step, shape[o_dim] - i)
        full = torch.randn(part, generator=g, dtype=torch.float64)
        full.mul_(torch.randint(-6, 7, part, generator=g, dtype=torch.float64).exp2_())
        half = k // 2
        first = full.narrow(k_dim, 0, half)
        full.narrow(k_dim, half, half).copy_(-first if negate else first)
        if k % 2:
            full.narrow(k_dim, k - 1, 1).zero_()
        out.narrow(o_dim, i, part[o_dim]).copy_(full)
    return out


def linear_block(x_dtype: torch.dtype, weight: torch.Tensor, bias, call, k: int, kind: tuple = ("linear",)) -> tuple:
    """Row-block sizes (largest first) for `call(rows [b, k], weight, bias)`, each call of one of these shapes: every
    row's bits the same wherever it sits in a block and whichever size it goes in; () where none is found here.
    The probe runs `call` on data of the weight's shape, strides and dtype (a kernel is chosen by those, not by the
    values) built so that products cancel, and on random data."""
    key = (*kind, _where(weight.device), x_dtype, weight.dtype, tuple(weight.shape), weight.stride(),
           None if bias is None else (bias.dtype, tuple(bias.shape), bias.stride()))
    with _PROBE_LOCK:
        if key in _PROBES:  # probed already (the probe data below is as large as the weight)
            return _PROBES[key] or ()
    k_dim = 1 if kind[0] == "linear" else 0  # where the inner dimension is in the weight: [N, K] or [K, N]
    dev = weight.device
    w_probe = _cancelling(tuple(weight.shape), weight.stride(), weight.dtype, dev, k_dim, 3)
    b_probe = None if bias is None else torch.zeros_like(bias)

    def works(family: tuple) -> bool:
        big = max(family)
        for rep in range(2):
            x = _cancelling((big, k), (k, 1), x_dtype, dev, 1, 7, negate=True) if rep == 0 else \
                _probe_data((big, k), x_dtype, dev, 7)
            w_ = w_probe if rep == 0 else weight
            b_ = b_probe if rep == 0 else bias
            y = call(x, w_, b_)
            for b in family:  # block by block: a family that fails stops at its first differing block
                if b != big and not all(torch.equal(call(x[i:i + b].clone(), w_, b_), y[i:i + b])
                                        for i in range(0, big, b)):
                    return False
                if not all(torch.equal(call(x[:b].roll(s_, 0), w_, b_), y[:b].roll(s_, 0)) for s_ in (1, b // 2 + 1)):
                    return False
        return True

    return _probe(key, LINEAR_BLOCKS.get(weight.device.type, LINEAR_BLOCKS["cuda"]), works) or ()


def _blocked_rows(rows: torch.Tensor, n_out: int, sizes: tuple, call, out_dtype) -> torch.Tensor:
    """call(block, out=...) on rows in blocks of exactly one of `sizes` rows: the largest that the rows left fill,
    the last block in the smallest (the input padded once with zero rows; every block a contiguous view of it),
    each block's result written in place into the output."""
    r = rows.shape[0]
    desc, small = sorted(sizes, reverse=True), min(sizes)
    plan, i = [], 0
    while i < r:
        b = next((b_ for b_ in desc if r - i >= b_), small)
        plan.append((i, b))
        i += b
    total = i
    if total != r or not rows.is_contiguous():
        padded = rows.new_zeros(total, rows.shape[1])
        padded[:r] = rows
    else:
        padded = rows
    out = torch.empty(total, n_out, dtype=out_dtype, device=rows.device)
    for i, b in plan:
        call(padded[i:i + b], out=out[i:i + b])
    return out[:r]


def block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with every kernel call of one shape [b, K] x [K, N] (b probed; rows in blocks, the last padded)."""
    wt = weight.t()
    if bias is None:
        call = lambda blk, out=None: torch.mm(blk, wt, out=out)  # noqa: E731
    else:
        call = lambda blk, out=None: torch.addmm(bias, blk, wt, out=out)  # noqa: E731
    probe = lambda blk, w_, c_: torch.mm(blk, w_.t()) if c_ is None else torch.addmm(c_, blk, w_.t())  # noqa: E731
    b = linear_block(x.dtype, weight, bias, probe, weight.shape[-1]) if x.dtype == weight.dtype else 0
    if not b:
        return rowwise_linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = _blocked_rows(rows, weight.shape[0], b, call, torch.result_type(rows, weight))
    return out.reshape(*x.shape[:-1], weight.shape[0])


def block_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta=1, alpha=1) -> torch.Tensor:
    """torch.addmm (GPT-2's Conv1D) with every kernel call of one shape, as block_linear. A bias given as a matrix
    ([R, N] or [1, N]) goes row by row, one [1, K] call each with the row's own bias row, however many rows come
    (a [1, N] too: a decode step's one row cannot tell a broadcast bias from its own row of a prefill's [R, N])."""
    if bias.dim() == 2 and bias.shape[0] in (1, a.shape[0]):  # (other row counts: torch.addmm's own error below)
        out = torch.empty(a.shape[0], b.shape[1], dtype=torch.result_type(a, b), device=a.device)
        for r in range(a.shape[0]):
            out[r:r + 1] = torch.addmm(bias[r:r + 1] if bias.shape[0] > 1 else bias, a[r:r + 1], b, beta=beta,
                                       alpha=alpha)
        return out
    call = lambda blk, out=None: torch.addmm(bias, blk, b, beta=beta, alpha=alpha, out=out)  # noqa: E731
    rows_b = 0 if a.dtype != b.dtype else \
        linear_block(a.dtype, b, bias, lambda blk, w_, c_: torch.addmm(c_, blk, w_, beta=beta, alpha=alpha),
                     b.shape[0], ("addmm", float(beta), float(alpha)))
    if not rows_b:
        return _per_row(a, b, b.shape[1], lambda row: torch.addmm(bias, row, b, beta=beta, alpha=alpha))
    return _blocked_rows(a, b.shape[1], rows_b, call, torch.result_type(a, b))


def tile_size(device: torch.device, dtype: torch.dtype) -> int:
    """T for the tile GEMMs (bmm calls of [n, T, T] x [n, T, T], n in TILE_BATCHES), 0 where none is position-free:
    a pair's product must not depend on where it sits in the call (batch entry, row, column) nor on n."""
    key = ("tile", _where(device), dtype)

    def works(t: int) -> bool:
        big = TILE_BATCHES[0]
        a = _probe_data((big, t, t), dtype, device, 2 * t)
        b = _probe_data((big, t, t), dtype, device, 2 * t + 1)
        y = torch.bmm(a, b)
        return (torch.equal(torch.bmm(a.roll(1, 0), b.roll(1, 0)), y.roll(1, 0))
                and all(torch.equal(torch.bmm(a.roll(s, 1), b), y.roll(s, 1)) for s in (1, t // 2 + 1))
                and all(torch.equal(torch.bmm(a, b.roll(s, 2)), y.roll(s, 2)) for s in (1, t // 2 + 1))
                and all(torch.equal(torch.bmm(a[:n], b[:n]), y[:n]) and
                        torch.equal(torch.bmm(a[n:2 * n], b[n:2 * n]), y[n:2 * n]) for n in TILE_BATCHES[1:]))

    return _probe(key, TILES.get(device.type, TILES["cuda"]), works)


def _ordered_sum(parts: torch.Tensor) -> torch.Tensor:
    """parts [R, n, ...] summed over n in index order (the same bits whatever n is, trailing zeros change nothing)."""
    if parts.device.type == "cpu":
        return torch.cumsum(parts, dim=1).select(1, -1)
    acc = parts[:, 0].clone()
    for j in range(1, parts.shape[1]):
        acc += parts[:, j]
    return acc


def _fixed_bmm(lhs: torch.Tensor, rhs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = bmm of [E, t, t] pairs, in calls of exactly TILE_BATCHES sizes (the last one zero-padded)."""
    total, t = lhs.shape[0], lhs.shape[1]
    e0 = 0
    while e0 < total:
        left = total - e0
        size = next((b_ for b_ in TILE_BATCHES if b_ <= left), TILE_BATCHES[-1])
        if left >= size:
            torch.bmm(lhs[e0:e0 + size].contiguous(), rhs[e0:e0 + size].contiguous(), out=out[e0:e0 + size])
        else:
            x = lhs.new_zeros(size, t, t)
            y = rhs.new_zeros(size, t, t)
            x[:left], y[:left] = lhs[e0:], rhs[e0:]
            out[e0:] = torch.bmm(x, y)[:left]
        e0 += size
    return out


TILE_PAIRS = 4096  # [t, t] pairs gathered at a time
TILE_PARTS_BYTES = 32 * 1024 ** 2  # partial products held at a time


def tiled_mm(a: torch.Tensor, b: torch.Tensor, t: int) -> torch.Tensor:
    """a [G, M, K] @ b [G, K, N] (same float dtype) in [t, t] x [t, t] tiles: the inner dimension in blocks of t
    aligned at each row's first nonzero, the blocks' partial products added in index order; blocks where a row tile
    is all zero are skipped (they add exactly 0). Every bmm call has the shape [n, t, t] x [n, t, t], n in
    TILE_BATCHES."""
    if bool((a[..., 0] != 0).all()):
        f = None  # every row starts at its first column: no shift anywhere (scores, causal attention weights)
    else:
        lo = (a != 0).to(torch.uint8).argmax(-1)  # (0 where a row has none)
        f = (t - lo % t) % t  # zeros put in front of the row so its first nonzero starts a block
        if not bool((f == f[:, :1]).all()):
            return _tiled_rows(a, b, t, f)
        f = f[:, 0]
    return _tiled_uniform(a, b, t, f)


def _tiled_uniform(a, b, t, f):
    """tiled_mm where every row of a batch entry has the same shift f[g] (or none)."""
    g_n, m, k = a.shape
    n = b.shape[-1]
    dev, dt = a.device, a.dtype
    fmax = 0 if f is None else int(f.max())
    nk, nq, nn = -(-(k + fmax) // t), -(-m // t), -(-n // t)
    if f is None and m % t == 0 and k % t == 0:
        at = a
    else:
        at = torch.zeros(g_n, nq * t, nk * t, dtype=dt, device=dev)
    bp = torch.zeros(g_n, nk * t, nn * t, dtype=dt, device=dev)
    for fv in ([0] if f is None else torch.unique(f).tolist()):
        sel = slice(None) if f is None else (f == fv)
        if at is not a:
            at[sel, :m, fv:fv + k] = a[sel]
        bp[sel, fv:fv + k, :n] = b[sel]
    a5 = at.reshape(g_n, nq, t, nk, t)
    b5 = bp.view(g_n, nk, t, nn, t).permute(0, 1, 3, 2, 4)  # [g, j, n, row, column]
    acc = torch.empty(g_n, nq, nn, t, t, dtype=dt, device=dev)
    per_q = max(1, TILE_PARTS_BYTES // max(1, g_n * nk * nn * t * t * a.element_size()))
    for q0 in range(0, nq, per_q):
        q1 = min(nq, q0 + per_q)
        # every (entry, row tile, inner block, column block) pair; inner blocks in index order, then summed in it
        lhs = a5[:, q0:q1].permute(0, 1, 3, 2, 4)[:, :, :, None].expand(g_n, q1 - q0, nk, nn, t, t)
        rhs = b5[:, None].expand(g_n, q1 - q0, nk, nn, t, t)
        parts = torch.empty(g_n, q1 - q0, nk, nn, t, t, dtype=dt, device=dev)
        _fixed_bmm(lhs.reshape(-1, t, t), rhs.reshape(-1, t, t), parts.view(-1, t, t))
        acc[:, q0:q1] = parts[:, :, 0] if nk == 1 else _ordered_sum(parts.view(-1, nk, nn, t, t)).view(
            g_n, q1 - q0, nn, t, t)
    return acc.permute(0, 1, 3, 2, 4).reshape(g_n, nq * t, nn * t)[:, :m, :n]


def _tiled_rows(a: torch.Tensor, b: torch.Tensor, t: int, f: torch.Tensor) -> torch.Tensor:
    """tiled_mm where rows of one batch entry have different shifts (a sliding window past its size): rows are
    grouped by (batch entry, shift) into row tiles, each with its own shifted blocks of b."""
    g_n, m, k = a.shape
    n = b.shape[-1]
    dev, dt = a.device, a.dtype
    nk = -(-(k + t - 1) // t)
    kp = nk * t
    nn = -(-n // t)
    key = (torch.arange(g_n, device=dev)[:, None] * t + f).reshape(-1)
    order = torch.argsort(key, stable=True)
    skey = key[order]
    counts = torch.bincount(skey, minlength=g_n * t)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=dev) - starts[skey]
    per_key = (counts + t - 1) // t
    base = torch.cumsum(per_key, 0) - per_key
    tile_of = base[skey] + rank // t
    slot = rank % t
    n_tiles = int(per_key.sum())
    tile_key = torch.zeros(n_tiles, dtype=skey.dtype, device=dev)
    tile_key[tile_of] = skey
    tile_g, tile_f = tile_key // t, tile_key % t
    rows_g, rows_m, rows_f = order // m, order % m, f.reshape(-1)[order]
    at = torch.zeros(n_tiles, t, kp, dtype=dt, device=dev)
    for fv in torch.unique(rows_f).tolist():
        sel = rows_f == fv
        at[tile_of[sel], slot[sel], fv:fv + k] = a[rows_g[sel], rows_m[sel]]
    bp = torch.zeros(g_n, t + kp, nn * t, dtype=dt, device=dev)  # t zero rows in front: shift fv reads from t - fv
    bp[:, t:t + k, :n] = b
    at4 = at.view(n_tiles, t, nk, t)
    live = at4.ne(0).any(1).any(-1)  # [tiles, nk]
    bu = bp.view(g_n, t + kp, nn, t).unfold(1, t, 1)  # [g, start row, column block, column, row]
    e_tile, e_j = live.nonzero(as_tuple=True)
    order_j = torch.argsort(e_j, stable=True)
    e_tile, e_j = e_tile[order_j], e_j[order_j]
    counts_j = torch.bincount(e_j, minlength=nk).tolist()
    acc = torch.zeros(n_tiles, nn, t, t, dtype=dt, device=dev)
    flat = acc.view(-1, t, t)
    ar_n = torch.arange(nn, device=dev)
    e0 = 0
    for j, c in enumerate(counts_j):
        for s0 in range(e0, e0 + c, max(1, TILE_PAIRS // nn)):
            s1 = min(e0 + c, s0 + max(1, TILE_PAIRS // nn))
            et = e_tile[s0:s1]
            lhs = at4[et, :, j, :][:, None].expand(s1 - s0, nn, t, t).reshape(-1, t, t)
            rhs = bu[tile_g[et][:, None], (t - tile_f[et] + j * t)[:, None], ar_n].transpose(-1, -2).reshape(-1, t, t)
            idx = (et[:, None] * nn + ar_n).reshape(-1)
            flat[idx] = flat[idx] + _fixed_bmm(lhs, rhs, torch.empty_like(lhs))
        e0 += c
    out = acc.permute(0, 2, 1, 3).reshape(n_tiles, t, nn * t)
    res = torch.empty(g_n, m, n, dtype=dt, device=dev)
    res[rows_g, rows_m] = out[tile_of, slot, :n]
    return res


def fast_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for invariant mode: tile GEMMs where the device has a position-free tile, else fixed_order_matmul.
    Products and sums in float32 or better (float64 stays float64), one rounding to the result dtype."""
    if a.dim() < 2 or b.dim() < 2:
        return torch.matmul(a, b)
    out_dtype = torch.result_type(a, b)
    wide = _wide(out_dtype)
    t = tile_size(a.device, wide)
    if not t:
        return fixed_order_matmul(a, b)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    aa = a.to(wide).expand(*batch, m, k).reshape(-1, m, k)
    bb = b.to(wide).expand(*batch, k, n).reshape(-1, k, n)
    return tiled_mm(aa, bb, t).reshape(*batch, m, n).to(out_dtype)


def block_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """A sum along `dim` with the tile GEMMs' grouping (blocks aligned at the first nonzero, in index order): the
    same bits however long the row is and wherever its nonzeros start; falls back to seq_sum."""
    t = tile_size(x.device, x.dtype) if x.dtype in (torch.float32, torch.float64) else 0
    if not t or x.device.type == "cpu":  # the CPU's cumsum is a sequential scan: alignment-free already
        return seq_sum(x, dim)
    moved = x.movedim(dim, -1)
    rows = moved.reshape(1, -1, moved.shape[-1])
    ones = torch.ones(1, moved.shape[-1], 1, dtype=x.dtype, device=x.device)
    return tiled_mm(rows, ones, t).reshape(moved.shape[:-1])


def fast_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _softmax(x, dim, dtype, block_sum)


ATTENTION_ROWS = {"cpu": (64, 32, 16, 48), "cuda": (64, 128, 32)}
ATTENTION_KEYS = (256, 512, 128, 64)


def attention_tiles(device: torch.device, dtype: torch.dtype, d_qk: int, d_v: int) -> tuple[int, int] | None:
    """(rows, keys) of the two fixed-shape GEMMs fast_sdpa makes per batch entry and head - scores [rows, d_qk] x
    [d_qk, keys], weighted values [rows, keys] x [keys, d_v] - where a row's (and a key's) result does not depend
    on where it sits in the call, else None."""
    out = [(r, k) for r in ATTENTION_ROWS.get(device.type, ATTENTION_ROWS["cuda"]) for k in ATTENTION_KEYS]

    def works(rk: tuple[int, int]) -> bool:
        r, k = rk
        q = _probe_data((r, d_qk), dtype, device, r)
        table = _probe_data((d_qk, 3 * k), dtype, device, k)
        kt = table[:, :k]  # a slice of a wider key table, as in fast_sdpa (whose width varies with the prompt)
        y = torch.mm(q, kt)
        if not (all(torch.equal(torch.mm(q.roll(s_, 0), kt), y.roll(s_, 0)) for s_ in (1, r // 2 + 1)) and
                all(torch.equal(torch.mm(q, kt.roll(s_, 1)), y.roll(s_, 1)) for s_ in (1, k // 2 + 1)) and
                torch.equal(torch.mm(q, table[:, :2 * k][:, :k]), y) and
                torch.equal(torch.mm(q, table[:, k:2 * k]), torch.mm(q, table[:, k:2 * k].contiguous()))):
            return False
        wide_p = _probe_data((r, 3 * k), dtype, device, r + k)
        p = wide_p[:, :k]
        v = _probe_data((2 * k, d_v), dtype, device, k + 1)
        z = torch.mm(p, v[:k])
        return (all(torch.equal(torch.mm(p.roll(s_, 0), v[:k]), z.roll(s_, 0)) for s_ in (1, r // 2 + 1)) and
                torch.equal(torch.mm(wide_p[:, :2 * k][:, :k], v[:k]), z) and
                torch.equal(torch.mm(wide_p[:, k:2 * k], v[k:]), torch.mm(wide_p[:, k:2 * k].contiguous(), v[k:])))

    return _probe(("attention", _where(device), dtype, d_qk, d_v), out, works) or None


def _bmm_as_mm(n: int, m: int, k: int, cols: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Does one bmm of n [m, k] x [k, cols] pairs (operands slices of wider tensors, as fast_sdpa's) give every pair
    the bits of its own torch.mm? Then a call over all heads at once is the per-head calls' computation."""
    def works(_):
        a = _probe_data((n, m, 3 * k), dtype, device, n + m)[:, :, k:2 * k]
        b = _probe_data((n, k, 3 * cols), dtype, device, n + cols)[:, :, cols:2 * cols]
        y = torch.bmm(a, b)
        return all(torch.equal(y[i], torch.mm(a[i], b[i])) for i in range(n))

    return bool(_probe(("bmm", _where(device), dtype, n, m, k, cols), (1,), works))


# --- attention through the library's own fused kernel, where it is invariant -------------------------------------
#
# The CPU flash-attention kernel computes each query row by itself and walks the keys in fixed blocks with an online
# softmax (a block a row does not see adds exactly 0); what can still change a row's bits is where its keys sit. So
# every call gets its keys from the row's first visible key on, padded with masked zero keys to a multiple of
# NATIVE_KEY_BLOCK; probed per device, dtype and head size (native_attention_mode), else the fixed-shape path runs.
NATIVE_KEY_BLOCK = 512
# query rows per call: a multiple of this, so the kernel's last block of rows (it splits them in 32, 64 or 256) has
# at least 8: on the CPU a block of 1 or 2 rows goes through another GEMM and rounds a row's scores differently
NATIVE_ROW_MULTIPLE = 8
# Where a row's bits depend on its place in the kernel's block of query rows (AVX2), every call has exactly this many
# rows (one kernel block below 192 rows) and a row sits at slot (its last visible key - its first) mod
# NATIVE_SLOT_ROWS, the same in every run; unfilled slots hold a zero query, dropped. Blocks of slots go in one call
# as batch entries over the same keys (expanded, not copied).
NATIVE_SLOT_ROWS = 32
_EAGER_EQUAL = threading.local()


@contextlib.contextmanager
def _eager_sdpa():
    """Inside, invariant mode's SDPA takes eager attention's steps op for op (fast_sdpa's fixed-shape path), so an
    eager and an SDPA model agree bit for bit: a run's ExecSettings(sdpa_as_eager=True) (the matrix, which compares
    attention implementations). Elsewhere SDPA runs through the native fused kernel where its probe passes (faster,
    and the normal run's numerics)."""
    _EAGER_EQUAL.depth = getattr(_EAGER_EQUAL, "depth", 0) + 1
    try:
        yield
    finally:
        _EAGER_EQUAL.depth -= 1


def _visible_only(mask: torch.Tensor) -> torch.Tensor | None:
    """A float mask as visibility (True: the key is seen) where it only hides keys (every entry 0 or -inf-like),
    else None (a bias the bool form would lose)."""
    if mask.dtype == torch.bool:
        return mask
    floor = torch.finfo(mask.dtype).min / 2
    zero = mask == 0
    return zero if bool((zero | (mask <= floor)).all()) else None


class _Call:
    """One native call of a plan: query rows `rows` (None: all) of batch entry `entry` (None: all) and heads `heads`,
    over the keys from `start` to `start + kp` (kp a multiple of NATIVE_KEY_BLOCK; masked zero keys past the end),
    with `mask` (additive, the query's dtype: [n, 1 or h, rows padded to NATIVE_ROW_MULTIPLE, kp]); a slotted call
    (`slot` set) puts row i at (block blk[i], slot slot[i]) of [blocks, h, NATIVE_SLOT_ROWS] queries, its mask
    [n, blocks, 1 or h, NATIVE_SLOT_ROWS, kp]."""
    __slots__ = ("entry", "heads", "rows", "start", "kp", "mask", "blk", "slot")

    def __init__(self, entry, heads, rows, start, kp, mask, blk=None, slot=None):
        self.entry, self.heads, self.rows, self.start, self.kp, self.mask = entry, heads, rows, start, kp, mask
        self.blk, self.slot = blk, slot


def _additive(vis: torch.Tensor, dtype) -> torch.Tensor:
    """A bool mask as SDPA turns it into an additive one (0 where seen, -inf where hidden), once for every layer."""
    return torch.zeros(vis.shape, dtype=dtype, device=vis.device).masked_fill_(~vis, float("-inf"))


def _block_call(vis, entry, heads, rows, start: int, kp: int, dtype) -> _Call:
    """The call for `vis`'s rows (already selected: [n, 1 or h, lq, lk]): rows padded to NATIVE_ROW_MULTIPLE with
    copies of the last (the kernel's last block of rows never of 1 or 2: another GEMM, other bits), keys from
    `start` to `start + kp`."""
    n, hm, lq, lk = vis.shape
    padded = -(-lq // NATIVE_ROW_MULTIPLE) * NATIVE_ROW_MULTIPLE
    if padded > lq:
        vis = torch.cat([vis, vis[:, :, -1:].expand(n, hm, padded - lq, lk)], 2)
    if start + kp <= lk:
        mm = vis[..., start:start + kp]
    else:
        mm = torch.zeros(n, hm, padded, kp, dtype=torch.bool, device=vis.device)
        mm[..., :lk - start] = vis[..., start:]
    return _Call(entry, heads, rows, start, kp, _additive(mm, dtype))


def _slot_call(vis, entry, heads, rows, start: int, kp: int, dtype, slot: torch.Tensor) -> _Call:
    """The slotted call for `vis`'s rows ([n, 1 or h, r, lk], already selected; `rows` their indices, slot: [r]):
    rows of one slot in successive blocks; a slot no row fills sees every key (a zero query: finite, dropped)."""
    n, hm, r, lk = vis.shape
    dev = vis.device
    order = torch.argsort(slot, stable=True)
    counts = torch.bincount(slot, minlength=NATIVE_SLOT_ROWS)
    blk = torch.empty_like(slot)
    blk[order] = torch.arange(r, device=dev) - (torch.cumsum(counts, 0) - counts)[slot[order]]
    nblk = int(counts.max())
    w = min(kp, lk - start)
    mm = torch.zeros(n, nblk, hm, NATIVE_SLOT_ROWS, kp, dtype=torch.bool, device=dev)
    mm[:, blk, :, slot, :w] = vis[..., start:start + w].permute(2, 0, 1, 3)
    empty = torch.ones(nblk, NATIVE_SLOT_ROWS, dtype=torch.bool, device=dev)
    empty[blk, slot] = False
    mm.permute(1, 3, 0, 2, 4)[empty] = True
    return _Call(entry, heads, torch.arange(r, device=dev) if rows is None else rows, start, kp, _additive(mm, dtype),
                 blk, slot)


def _grouped_calls(vis, entry, heads, start: int, need: torch.Tensor, dtype, slot=None) -> list:
    """Calls for rows that all see keys from `start` on; need: [rows], the key blocks (from `start`) each row needs at
    most. Rows grouped by it, a call a group: a block no row of a call sees is not computed (it would add exactly 0:
    a causal prompt's first rows need one). slot: [rows] where the calls are slotted, else None."""
    if int(need.min()) == int(need.max()):
        kp = int(need[0]) * NATIVE_KEY_BLOCK
        return [_block_call(vis, entry, heads, None, start, kp, dtype) if slot is None else
                _slot_call(vis, entry, heads, None, start, kp, dtype, slot)]
    calls = []
    for blocks in torch.unique(need).tolist():
        rows = (need == blocks).nonzero().squeeze(1)
        kp = blocks * NATIVE_KEY_BLOCK
        calls.append(_block_call(vis[:, :, rows], entry, heads, rows, start, kp, dtype) if slot is None else
                     _slot_call(vis[:, :, rows], entry, heads, rows, start, kp, dtype, slot[rows]))
    return calls


def _native_plan(vis, b: int, lq: int, lk: int, dtype, device, slotted: bool = False):
    """(calls, unseen) for query rows seeing keys as `vis` says (bool broadcastable to [b, 1 or h, lq, lk]; None: all
    seen): each row over its keys from its first visible key on; rows that start at the same key (every row of a
    causal prompt, of a left-padded one) grouped; a sliding window's rows, which start each at its own key, a call
    per start. unseen: [b, Hm, lq] rows that see no key (they give 0), None where every row sees one. Depends on the
    mask and shapes only: made once a forward (_plan_for), run in every layer. slotted: every call of
    NATIVE_SLOT_ROWS rows, each row at its slot (see there)."""
    if vis is None:
        vis = torch.ones(1, 1, 1, lk, dtype=torch.bool, device=device)
    hm = vis.shape[1]
    vis = vis.expand(b, hm, lq, lk)
    first = vis.view(torch.uint8).argmax(-1)  # [B, Hm, lq] (0 where a row sees nothing: `seen` says)
    nb = -(-lk // NATIVE_KEY_BLOCK)
    blocks = torch.stack([vis[..., j * NATIVE_KEY_BLOCK:(j + 1) * NATIVE_KEY_BLOCK].any(-1) for j in range(nb)], -1)
    seen = blocks.any(-1)
    last_block = nb - 1 - blocks.flip(-1).view(torch.uint8).argmax(-1)  # the block of each row's last visible key
    first = torch.where(seen, first, -1)
    unseen = None if bool(seen.all()) else ~seen
    slot = None
    if slotted:
        last = lk - 1 - vis.flip(-1).view(torch.uint8).argmax(-1)
        slot = torch.where(seen, (last - first) % NATIVE_SLOT_ROWS, -1)

    def need(f, lb):  # key blocks from the row's first key to the end of its last visible key's block (an upper bound)
        return (-(-((lb + 1) * NATIVE_KEY_BLOCK - f) // NATIVE_KEY_BLOCK)).clamp_min(1)

    lo = first.amax()
    row_slot = None if slot is None else slot.amax(0).amax(0)
    if bool(((first == lo) | ~seen).all()) and (slot is None or bool(((slot == row_slot) | ~seen).all())):
        # one start for every row of every entry (and one slot for a row in all): one call per row group
        st = max(int(lo), 0)
        return _grouped_calls(vis, None, slice(None), st, need(st, torch.where(seen, last_block, 0)).amax(0).amax(0),
                              dtype, None if slot is None else row_slot.clamp_min(0)), unseen
    calls = []
    for e in range(b):
        for g in range(hm):
            heads = slice(None) if hm == 1 else slice(g, g + 1)
            f = first[e, g]
            for st in torch.unique(f[f >= 0]).tolist():
                rows = (f == st).nonzero().squeeze(1)
                for c in _grouped_calls(vis[e:e + 1, g:g + 1, rows], e, heads, st, need(st, last_block[e, g, rows]),
                                        dtype, None if slot is None else slot[e, g, rows]):
                    c.rows = rows if c.rows is None else rows[c.rows]
                    calls.append(c)
    return calls, unseen


def _key_window(key, value, c: _Call):
    """key and value [n, h, *, d] from c.start to c.start + c.kp: views where the keys are there, else zero-padded
    copies."""
    lk, s, kp = key.shape[-2], c.start, c.kp
    if s + kp <= lk:
        return key[:, :, s:s + kp], value[:, :, s:s + kp]
    kk = key.new_zeros(*key.shape[:2], kp, key.shape[-1])
    vv = value.new_zeros(*value.shape[:2], kp, value.shape[-1])
    kk[:, :, :lk - s] = key[:, :, s:]
    vv[:, :, :lk - s] = value[:, :, s:]
    return kk, vv


def _run_call(query, key, value, c: _Call, scale):
    n, h, lq, d = query.shape
    padded = c.mask.shape[2]
    if padded > lq:
        query = torch.cat([query, query[:, :, -1:].expand(n, h, padded - lq, d)], 2)
    kk, vv = _key_window(key, value, c)
    return F.scaled_dot_product_attention(query, kk, vv, attn_mask=c.mask, scale=scale)[:, :, :lq]


def _run_slotted(query, key, value, c: _Call, scale, out):
    """A slotted call (see _Call) for query/key/value [n, h, *, d] of its entries and heads, written into out."""
    n, h, _, d = query.shape
    nblk = c.mask.shape[1]
    for i in range(n):
        kk, vv = _key_window(key[i:i + 1], value[i:i + 1], c)
        qc = query.new_zeros(nblk, h, NATIVE_SLOT_ROWS, d)
        qc[c.blk, :, c.slot] = query[i][:, c.rows].transpose(0, 1)
        res = F.scaled_dot_product_attention(qc, kk.expand(nblk, -1, -1, -1), vv.expand(nblk, -1, -1, -1),
                                             attn_mask=c.mask[i if c.mask.shape[0] > 1 else 0], scale=scale)
        out[i][:, c.rows] = res[c.blk, :, c.slot].transpose(0, 1)


def _run_plan(query, key, value, plan, scale):
    calls, unseen = plan
    if len(calls) == 1 and calls[0].rows is None and calls[0].entry is None:  # (a slotted call always has rows)
        out = _run_call(query, key, value, calls[0], scale)
    else:
        out = query.new_zeros(*query.shape[:-1], value.shape[-1])
        for c in calls:
            es = slice(None) if c.entry is None else slice(c.entry, c.entry + 1)
            q, k, v, o = query[es, c.heads], key[es, c.heads], value[es, c.heads], out[es, c.heads]
            if c.slot is not None:
                _run_slotted(q, k, v, c, scale, o)
            elif c.rows is not None:
                o[:, :, c.rows] = _run_call(q[:, :, c.rows], k, v, c, scale)
            else:
                o.copy_(_run_call(q, k, v, c, scale))
    return out if unseen is None else out.masked_fill(unseen.unsqueeze(-1), 0)


def _native_core(query, key, value, vis, scale, slotted: bool = False):
    """query [B, H, lq, d], key/value [B, H, lk, d], vis: bool broadcastable to [B, 1 or H, lq, lk] or None (all
    seen). Each row through the native kernel over its keys from its first visible key on (_native_plan). A row
    that sees no key gives 0."""
    b, _, lq, _ = query.shape
    return _run_plan(query, key, value, _native_plan(vis, b, lq, key.shape[-2], query.dtype, query.device, slotted),
                     scale)


# A forward passes one mask to every layer: its plan is made once and reused while the mask is the same tensor (same
# storage, offset, shape, strides and version; the entry holds the mask, so its memory is not reused meanwhile). One
# entry per thread; invariant mode's exit drops it.
_PLANS = threading.local()


def _plan_for(attn_mask, is_causal: bool, b: int, hq: int, lq: int, lk: int, dtype, device, slotted: bool = False):
    """The plan of _native_sdpa's call, or None where the native path does not apply (a mask that is a bias)."""
    key = (b, hq, lq, lk, dtype, device, bool(is_causal), slotted)
    if attn_mask is not None:
        key += (attn_mask.data_ptr(), tuple(attn_mask.shape), attn_mask.stride(), attn_mask.storage_offset(),
                compat.tensor_version(attn_mask), attn_mask.dtype)
    hit = getattr(_PLANS, "entry", None)
    if hit is not None and hit[0] == key:
        return hit[2]
    vis = None
    if attn_mask is not None:
        vis = _visible_only(attn_mask)
        while vis is not None and vis.dim() < 4:
            vis = vis.unsqueeze(0)
        if vis is None or vis.shape[1] not in (1, hq):
            _PLANS.entry = (key, attn_mask, None)
            return None
    if is_causal:  # aligned at the bottom right, as fast_sdpa (transformers asks for it only where lq == lk)
        c = torch.arange(lk, device=device)[None] <= torch.arange(lq, device=device)[:, None] + (lk - lq)
        vis = c[None, None] if vis is None else vis & c
    plan = _native_plan(vis, b, lq, lk, dtype, device, slotted)
    _PLANS.entry = (key, attn_mask, plan)
    return plan


def native_attention_ok(device: torch.device, dtype: torch.dtype, d_qk: int, d_v: int) -> bool:
    return bool(native_attention_mode(device, dtype, d_qk, d_v))


def native_attention_mode(device: torch.device, dtype: torch.dtype, d_qk: int, d_v: int, modes=(1, 2)) -> int:
    """Does _native_core give a row the same bits whatever the call: the full forward, a cached chunk of rows, one
    row with only its keys, left-padded, beside another sequence? 1: with the rows as they come, 2: slotted
    (NATIVE_SLOT_ROWS), 0: neither (probed once per device, dtype, sizes, threads)."""
    def works(mode):
        core = functools.partial(_native_core, slotted=mode == 2)
        n, h = 800, 3
        q = _probe_data((1, h, n, d_qk), dtype, device, 71)
        k = _probe_data((1, h, n, d_qk), dtype, device, 72)
        v = _probe_data((1, h, n, d_v), dtype, device, 73)
        half = n // 2  # the second half's keys repeat the first's with values negated: sums that nearly cancel
        k[:, :, half:2 * half] = k[:, :, :half]
        v[:, :, half:2 * half] = -v[:, :, :half]

        def causal(r0, r1, lk, pad=0):
            rows = torch.arange(r0, r1, device=device)[:, None] + pad
            c = torch.arange(lk, device=device)[None]
            return ((c <= rows) & (c >= pad))[None, None]

        full = core(q, k, v, causal(0, n, n), None)
        if not bool(torch.isfinite(full).all()):
            return False
        tries = [(389, n, n), (0, 64, n), (450, 451, 451), (n - 1, n, n), (n - 2, n, n), (n - 33, n, n),
                 (n - 193, n, n), (200, 264, 300), (0, 700, 700)]
        for r0, r1, lk in tries:
            got = core(q[:, :, r0:r1], k[:, :, :lk], v[:, :, :lk], causal(r0, r1, lk), None)
            if not torch.equal(got, full[:, :, r0:r1]):
                return False
        pad = 37  # left padding: junk keys the mask hides, the rows' keys shifted
        kj = torch.cat([_probe_data((1, h, pad, d_qk), dtype, device, 74), k], 2)
        vj = torch.cat([_probe_data((1, h, pad, d_v), dtype, device, 75), v], 2)
        got = core(q, kj, vj, causal(0, n, n + pad, pad), None)
        if not torch.equal(got, full):
            return False
        # beside another sequence (a batch of two, the other unpadded): each as alone
        qq = torch.cat([q, q.flip(2)]); kk = torch.cat([kj, torch.cat([k, k[:, :, :pad]], 2)])
        vv = torch.cat([vj, torch.cat([v, v[:, :, :pad]], 2)])
        vis = torch.cat([causal(0, n, n + pad, pad), causal(0, n, n + pad)])
        got = core(qq, kk, vv, vis, None)
        other = core(q.flip(2), k, v, causal(0, n, n), None)
        if not (torch.equal(got[:1], full) and torch.equal(got[1:], other)):
            return False
        win = 300  # a sliding window: the full forward's rows start each at its own key; a cached row's cache holds
        i = torch.arange(n, device=device)  # its window only
        wfull = core(q, k, v, ((i[None] <= i[:, None]) & (i[None] > i[:, None] - win))[None, None], None)
        return all(torch.equal(core(q[:, :, t:t + 1], k[:, :, t - win + 1:t + 1], v[:, :, t - win + 1:t + 1],
                                            None, None), wfull[:, :, t:t + 1]) for t in (win - 1, win + 37, n - 1))

    return _probe(("native_sdpa", _where(device), dtype, d_qk, d_v, tuple(modes)), tuple(modes), works)


def _native_sdpa(query, key, value, attn_mask, is_causal, scale):
    """fast_sdpa through the native kernel (see above), or None where that path does not apply."""
    if query.dim() != 4 or getattr(_EAGER_EQUAL, "depth", 0) > 0:
        return None
    mode = native_attention_mode(query.device, query.dtype, query.shape[-1], value.shape[-1])
    if not mode:
        return None
    b = max(query.shape[0], key.shape[0])
    plan = _plan_for(attn_mask, is_causal, b, query.shape[1], query.shape[-2], key.shape[-2], query.dtype,
                     query.device, mode == 2)
    if plan is None:
        return None
    key, value = _repeat_kv(query, key, value, 1)
    return _run_plan(query.expand(b, *query.shape[1:]), key.expand(b, *key.shape[1:]),
                     value.expand(b, *value.shape[1:]), plan, scale)


def fast_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **_):
    """scaled_dot_product_attention in invariant mode: the native kernel over fixed key blocks where its probe passes
    (_native_sdpa; not with ExecSettings(sdpa_as_eager=True)), else eager attention's steps op for op (so eager and
    SDPA models agree bit for bit) - scores rounded to the dtype, scaled and masked in it; the softmax in float32 or
    better, its normaliser a running sum; the weights rounded to the dtype, times v - every GEMM of one of two fixed
    shapes (attention_tiles), a chunk of queries at a time over only the keys it sees. The weighted sum goes in key
    blocks starting at each query's first visible key, added in order. A query with no visible key gives 0."""
    if not dropout_p:
        native = _native_sdpa(query, key, value, attn_mask, is_causal, scale)
        if native is not None:
            return native
    wide = _wide(query.dtype)
    tiles = attention_tiles(query.device, wide, query.shape[-1], value.shape[-1])
    if tiles is None:
        return invariant_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale)
    mq, w = tiles
    key, value = _repeat_kv(query, key, value)
    lq, lk, dqk, d = query.shape[-2], key.shape[-2], query.shape[-1], value.shape[-1]
    scale = dqk ** -0.5 if scale is None else scale
    pow2 = scale > 0 and math.frexp(scale)[0] == 0.5
    batch = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2])
    dt, dev = query.dtype, query.device
    q = query.expand(*batch, lq, dqk).reshape(-1, lq, dqk).to(wide)
    g_n = q.shape[0]
    if lq % mq:
        q = torch.cat([q, q.new_zeros(g_n, mq - lq % mq, dqk)], 1)
    lkp = -(-lk // w) * w
    kt = torch.zeros(g_n, dqk, lkp, dtype=wide, device=dev)
    kt[:, :, :lk] = key.expand(*batch, lk, dqk).reshape(-1, lk, dqk).transpose(1, 2)
    vp = torch.zeros(g_n, lkp + w, d, dtype=wide, device=dev)  # w zero rows past the end: a block may run over
    vp[:, :lk] = value.expand(*batch, lk, d).reshape(-1, lk, d)
    out = torch.empty(g_n, lq, d, dtype=dt, device=dev)
    floor = torch.finfo(wide).min / 2
    cols = torch.arange(lk, device=dev)
    heads_qk = _bmm_as_mm(g_n, mq, dqk, w, wide, dev)  # all heads in one call where it is the per-head one
    heads_pv = _bmm_as_mm(g_n, mq, w, d, wide, dev)
    # the chunks' working buffers, allocated once (a fresh large buffer per chunk costs its page faults every time)
    sc_buf = torch.empty(g_n * (lkp // w) * mq * w, dtype=wide, device=dev)
    flat_buf = torch.empty(-(-g_n * mq * lkp // _LANE_BLOCK) * _LANE_BLOCK, dtype=wide, device=dev)
    pp_buf = torch.empty(g_n * mq * (lkp + w), dtype=wide, device=dev)
    st_buf = torch.empty(g_n * mq * lkp, dtype=wide, device=dev)
    cs_buf = torch.empty(g_n * mq * lkp, dtype=wide, device=dev)
    lo_buf = torch.empty(g_n * mq * lkp, dtype=dt, device=dev)
    for r0 in range(0, lq, mq):
        r1 = min(lq, r0 + mq)
        nr = r1 - r0
        # which keys each query sees: [1 or entries, rows, keys], broadcast over what does not vary
        visible = torch.ones(1, nr, lk, dtype=torch.bool, device=dev)
        if is_causal:
            visible = (cols <= torch.arange(r0, r1, device=dev)[:, None] + (lk - lq))[None]
        mk = None
        if attn_mask is not None:
            mk = attn_mask[..., r0:r1, :].expand(*batch, nr, lk).reshape(-1, nr, lk)
            visible = visible & (mk if mk.dtype == torch.bool else mk > floor)
        seen = visible.any(1).any(0).nonzero()
        if seen.numel() == 0:
            out[:, r0:r1] = 0
            continue
        k0, k1 = int(seen[0]), int(seen[-1]) + 1
        c0, c1 = k0 // w * w, -(-k1 // w) * w  # the scores' key chunks: aligned anywhere (no sum over keys)
        sc = sc_buf[:g_n * (c1 - c0) * mq].view(g_n, (c1 - c0) // w, mq, w)
        for i, c in enumerate(range(c0, c1, w)):
            if heads_qk:
                torch.bmm(q[:, r0:r0 + mq], kt[:, :, c:c + w], out=sc[:, i])
            else:
                for g in range(g_n):
                    torch.mm(q[g, r0:r0 + mq], kt[g, :, c:c + w], out=sc[g, i])
        span = k1 - k0
        full = st_buf[:g_n * mq * (c1 - c0)].view(g_n, mq, c1 - c0)
        full.view(g_n, mq, (c1 - c0) // w, w).copy_(sc.permute(0, 2, 1, 3))
        sc = full[:, :nr, k0 - c0:k1 - c0]
        if dt == wide:
            sc.mul_(scale)
        else:  # the scores rounded to the dtype and scaled in it, as eager attention does
            low = lo_buf[:g_n * nr * span].view(g_n, nr, span)
            if pow2:  # scaling by a power of two is exact: one rounding
                low.copy_(sc.mul_(scale))
            else:
                low.copy_(sc)
                low.mul_(scale)
            sc.copy_(low)
        vis = visible[..., k0:k1]
        if mk is not None and mk.dtype != torch.bool:
            sc = (sc.to(dt) + mk[..., k0:k1].to(dt)).to(wide)
            vis = vis & (sc > floor)
        hidden = (~vis).any(0).any(0).nonzero()  # the key columns some query of the chunk does not see
        if hidden.numel():
            h0 = int(hidden[0])
            sc[..., h0:] = sc[..., h0:].masked_fill(~vis[..., h0:], float("-inf"))
        mx = sc.amax(-1, keepdim=True)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        # exp over a buffer whose length is a multiple of _LANE_BLOCK: every element through the vectorised body
        n_el = sc.numel()
        flat = flat_buf[:-(-n_el // _LANE_BLOCK) * _LANE_BLOCK]
        flat[n_el:] = 0
        e = flat[:n_el].view(sc.shape)
        torch.sub(sc, mx, out=e)
        torch.exp(flat, out=flat)
        if e.device.type == "cpu":  # the normaliser: a running sum (the CPU's cumsum is a sequential scan)
            den = torch.cumsum(e, -1, out=cs_buf[:n_el].view(e.shape))[..., -1:]
        else:
            den = block_sum(e, -1).unsqueeze(-1)
        pp = pp_buf[:g_n * nr * (span + w)].view(g_n, nr, span + w)  # w more columns: a block may run past the end
        pp[..., span:].zero_()
        den = den.masked_fill(den == 0, 1)  # a query that sees no key: e is all 0, so are its weights
        if dt != wide:  # the weights in the dtype, as eager attention holds them (divided, rounded once)
            pp[..., :span] = torch.div(e, den, out=lo_buf[:n_el].view(e.shape))
        else:
            torch.div(e, den, out=pp[..., :span])
        # the weighted sum: blocks of w keys from each query's first visible key (not its first nonzero weight: one
        # that underflowed to 0 would move the blocks, and a run whose underflows fall elsewhere would group otherwise)
        first = vis.to(torch.uint8).argmax(-1)  # relative to k0; [1 or entries, rows]
        uniform = first.shape[0] == 1 and bool((first == first[0, 0]).all())
        if uniform and nr == mq and heads_pv:  # every head's queries start at one key: all heads in one call
            lo = int(first[0, 0])
            acc = None
            for c in range(lo, span, w):
                part = torch.bmm(pp[:, :, c:c + w], vp[:, k0 + c:k0 + c + w])
                acc = part if acc is None else acc.add_(part)
            out[:, r0:r1] = acc.to(dt)
            continue
        for g in range(g_n):
            fg = first[0 if first.shape[0] == 1 else g]
            starts = [int(fg[0])] if uniform or bool((fg == fg[0]).all()) else torch.unique(fg).tolist()
            for lo in starts:
                rows = None if len(starts) == 1 else (fg == lo).nonzero().squeeze(1)
                pr = pp[g] if rows is None else pp[g, rows]
                n_rows = pr.shape[0]
                acc = None
                for c in range(lo, span, w):
                    blk = pr[:, c:c + w]
                    if n_rows < mq:
                        blk = torch.cat([blk, blk.new_zeros(mq - n_rows, w)])
                    part = torch.mm(blk, vp[g, k0 + c:k0 + c + w])
                    acc = part if acc is None else acc.add_(part)
                res = acc[:n_rows].to(dt)
                if rows is None:
                    out[g, r0:r1] = res
                else:
                    out[g, r0 + rows] = res
    return out.reshape(*batch, lq, d)


class InvariantMode(TorchFunctionMode):
    """Route the shape-sensitive ops to their fixed-order versions (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PLAIN:  # most ops (views, adds, casts): passed through without the routing below
            return func(*args, **kwargs)
        if func is F.linear:
            return block_linear(*args, **kwargs)
        if func is torch.addmm and len(args) >= 3 and args[1].dim() == 2:
            return block_addmm(*args, **kwargs)
        if func in _MATMULS and len(args) == 2 and not kwargs:
            return fast_matmul(*args)
        if func in _MATMULS and len(args) == 2 and set(kwargs) == {"out"}:  # transformers' grouped_mm fallback
            return kwargs["out"].copy_(fast_matmul(*args))
        if func in _GROUPED or "grouped_mm_fallback" in compat.op_qualified_name(func):
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
            return fast_softmax(x, dim=dim, dtype=dtype)
        if func is F.scaled_dot_product_attention:
            return fast_sdpa(*args, **kwargs)
        if func is F.embedding:  # a forward starts: the last one's mask plan is not reused (a mask may be rebuilt in
            _PLANS.entry = None  # place between forwards; within one, every layer gets the same)
        if (func in _LANEWISE and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()
                and args[0].numel() and "out" not in kwargs):
            return lanewise(func, *args, **kwargs)
        if func is F.conv1d or func is torch.conv1d:
            return fixed_order_conv1d(*args, **kwargs)
        if func not in _ROUTED and "grouped_mm_fallback" not in compat.op_qualified_name(func):
            _PLAIN.add(func)
        return func(*args, **kwargs)


_PLAIN: set = set()  # ops InvariantMode never routes, learned as they are first seen
# every op InvariantMode may route (some only for some arguments): never taken into _PLAIN
_ROUTED = frozenset({F.linear, torch.addmm, *_MATMULS, *_GROUPED, torch.logsumexp, torch.Tensor.logsumexp,
                     *_SOFTMAXES, F.scaled_dot_product_attention, F.embedding, *_LANEWISE, F.conv1d, torch.conv1d})


# Chunked scans a transformers modeling module calls as module-level functions, each with the step-by-step recurrence
# the same module defines (chunked name, recurrent name): chunks anchored at the call's first token group a full
# forward's terms otherwise than a cached rest's; the recurrence computes token t from the state after t-1 alone.
_SCANS = (("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),  # Qwen3-Next, Qwen3.5, OLMo-hybrid
          ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"))  # Kimi-Linear, Bailing-hybrid
# The signatures kvviz was written for (transformers 5.23-5.25: the same names in every module that defines them). A
# scan is swapped only when both of its functions still have exactly these named parameters; otherwise the models
# of that module are refused a proof in one line (the call kvviz would make could mean something else).
_SCAN_PARAMS = {
    "torch_chunk_gated_delta_rule": ("query", "key", "value", "g", "beta", "chunk_size", "initial_state",
                                     "output_final_state", "use_qk_l2norm_in_kernel"),
    "torch_recurrent_gated_delta_rule": ("query", "key", "value", "g", "beta", "initial_state", "output_final_state",
                                         "use_qk_l2norm_in_kernel"),
    "chunk_kimi_delta_attention": ("query", "key", "value", "g", "beta", "chunk_size", "initial_state",
                                   "output_final_state", "use_qk_l2norm_in_kernel"),
    "recurrent_kimi_delta_attention": ("query", "key", "value", "g", "beta", "initial_state", "output_final_state",
                                       "use_qk_l2norm_in_kernel"),
}
_SWAPPED: dict = {}  # (module name, function name) -> the original function
_REFUSED: dict = {}  # module name -> why invariant mode cannot prove its models (a scan's signature changed)
_SWAP_LOCK = threading.Lock()


def _named_parameters(f) -> tuple[str, ...]:
    """The named parameters of the plain function under f's decorators (no *args / **kwargs)."""
    params = inspect.signature(compat.plain_function(f)).parameters.values()
    return tuple(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def scan_change(name: str, f) -> str | None:
    """None when f (a scan named `name`) has the signature kvviz binds to; else one phrase saying what changed."""
    want = _SCAN_PARAMS[name]
    try:
        have = _named_parameters(f)
    except (TypeError, ValueError) as e:  # no signature to read (a builtin, a C extension)
        return f"{name} changed (its signature cannot be read: {e})"
    if have == want:
        return None
    return f"{name} changed (it takes {', '.join(have) or 'nothing by name'}; kvviz knows {', '.join(want)})"


def _swap_scans() -> None:
    """Route each loaded transformers modeling module's chunked scan to its recurrence while invariant mode is on in
    the calling thread (elsewhere the wrapper calls the original: other threads and normal runs are unchanged). A
    module whose scan signatures are not the known ones is left as it is and recorded in _REFUSED."""
    with _SWAP_LOCK:
        for name, mod in compat.transformers_model_modules():
            for chunked, recurrent in _SCANS:
                orig, rec = getattr(mod, chunked, None), getattr(mod, recurrent, None)
                if orig is None or rec is None or (name, chunked) in _SWAPPED or name in _REFUSED:
                    continue
                change = scan_change(chunked, orig) or scan_change(recurrent, rec)
                if change is not None:
                    _REFUSED[name] = change
                    continue
                _SWAPPED[(name, chunked)] = orig
                setattr(mod, chunked, _scan_wrapper(orig, rec))


def refuse_unproven(model) -> None:
    """One line (KvvizError) when the model runs modeling code whose scan invariant mode could not swap: the proof
    would be a chunked scan's, not the recurrence's, and a gap could not be told from rounding."""
    _swap_scans()
    mods = {type(m).__module__ for m in model.modules()}
    why = next((_REFUSED[m] for m in sorted(mods) if m in _REFUSED), None)
    if why is not None:
        mtype = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        raise KvvizError(f"invariant mode cannot prove {mtype} on transformers {compat.TRANSFORMERS_VERSION}: {why}")


def _scan_wrapper(orig, rec):
    sig = inspect.signature(compat.plain_function(orig))  # bound by name: the decorated objects take (*args, **kwargs)
    takes = inspect.signature(compat.plain_function(rec)).parameters
    passes_rest = any(p.kind is p.VAR_KEYWORD for p in takes.values())

    @functools.wraps(compat.plain_function(orig))
    def scan(*args, **kwargs):
        if not active():
            return orig(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        call = {}
        for k, v in bound.arguments.items():
            if sig.parameters[k].kind is inspect.Parameter.VAR_KEYWORD:
                call.update(v if passes_rest else {x: y for x, y in v.items() if x in takes})
            elif k in takes:  # the recurrence has no chunk size
                call[k] = v
        return rec(**call)

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
        _PLANS.entry = None  # the last forward's mask and plan are not kept past the run


@contextlib.contextmanager
def _invariant_run(sdpa_as_eager: bool):
    with invariant_mode(), (_eager_sdpa() if sdpa_as_eager else contextlib.nullcontext()):
        yield


def _run_context(settings, lm):
    if not settings.invariant:
        return None
    refuse_unproven(lm.model)
    return _invariant_run(settings.sdpa_as_eager)


def register() -> None:
    """Add invariant mode's run context to the execution seam; kvviz/__init__.py calls it once (idempotent)."""
    register_run_context(_run_context)
