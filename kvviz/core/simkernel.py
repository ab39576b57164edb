"""A simulated batch-variant GEMM, for constructed cases that must part on any machine.

Real GEMM libraries pick their kernel (tile sizes, split-K) from the shapes they see, so one row of a linear layer
can be summed in another order when it comes with other rows - the root of batch-dependent outputs in serving
engines. Whether that changes the bits on a given machine depends on its kernels, so a test cannot rely on it.
`split_k_kernel()` makes the effect explicit and the same everywhere: while it is entered (this thread), every
`F.linear` (and 2-D `torch.mm` / `addmm`) on float32/16-bit inputs that sees more than one row sums its inner dimension in two halves (each a
running sum in index order, then the two added), and a single row - or any float64 input - is one running sum in
index order. With `tiny:split` (kvviz/models/tiny.py) the top token then depends on how many rows the head saw, by
construction; invariant mode (kvviz/core/invariant.py) gives every linear call one shape (a fixed block of rows, the last
padded), so under it every row is summed the same way - here always in two halves - and nothing parts.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .invariant import seq_sum


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    prod = rows.to(wide).unsqueeze(1) * weight.to(wide).unsqueeze(0)  # [M, N, K]
    if rows.shape[0] > 1 and x.dtype != torch.float64:
        half = prod.shape[-1] // 2
        out = seq_sum(prod[..., :half], -1) + seq_sum(prod[..., half:], -1)
    else:
        out = seq_sum(prod, -1)
    if bias is not None:
        out = out + bias.to(wide)
    return out.to(torch.result_type(x, weight)).reshape(*x.shape[:-1], weight.shape[0])


def _mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
        beta=1, alpha=1):
    """torch.mm / addmm (2-D) as the same simulated kernel: a's rows times b's columns."""
    res = _linear(a, b.t())
    if alpha != 1:
        res = res * alpha
    if bias is not None:
        res = res + (bias if beta == 1 else bias * beta)
    return res if out is None else out.copy_(res)


class SplitKMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return _linear(*args, **kwargs)
        if func is torch.mm and len(args) == 2 and args[0].dim() == 2:  # every GEMM is the simulated one
            return _mm(*args, out=kwargs.get("out"))
        if func is torch.addmm and len(args) == 3 and args[1].dim() == 2:
            return _mm(args[1], args[2], args[0], kwargs.get("out"), kwargs.get("beta", 1), kwargs.get("alpha", 1))
        return func(*args, **kwargs)


@contextlib.contextmanager
def split_k_kernel():
    """Everything inside (this thread; kvviz's serving engine thread inherits it) uses the simulated kernel."""
    with SplitKMode():
        yield
