"""Divergence metrics, computed on the device where the tensors live; only small matrices go to the host.

All differences are taken in float64 (exact for inputs of lower precision), so the measurement adds no error.
"""
from __future__ import annotations

import torch

from .float64 import RELEASE_MIN_BYTES, release_freed_memory

HIDDEN_METRICS = {
    "max_abs": "max |Δ| over the hidden dimension",
    "mean_abs": "mean |Δ| over the hidden dimension",
    "relative": "max |Δ| / max |reference|",
    "cosine": "cosine distance 1 − cos(reference, cached)",
    "eps_units": "relative gap in units of the dtype's machine epsilon",
}


def hidden_divergence(ref: torch.Tensor, got: torch.Tensor, eps: float) -> dict[str, torch.Tensor]:
    """ref, got: [..., n_positions, hidden]. Returns metric -> [..., n_positions] (float64, on the device)."""
    r = ref.to(torch.float64)
    g = got.to(torch.float64)
    diff = (g - r).abs()
    max_abs = diff.amax(-1)
    ref_max = r.abs().amax(-1)
    relative = torch.where(ref_max > 0, max_abs / ref_max.clamp_min(torch.finfo(torch.float64).tiny),
                           torch.where(max_abs > 0, torch.full_like(max_abs, float("inf")), torch.zeros_like(max_abs)))
    num = (r * g).sum(-1)
    den = r.norm(dim=-1) * g.norm(dim=-1)
    cos = torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float64).tiny), torch.ones_like(num))
    cosine = (1.0 - cos).clamp_min(0.0)
    cosine = torch.where(max_abs == 0, torch.zeros_like(cosine), cosine)
    return {"max_abs": max_abs, "mean_abs": diff.mean(-1), "relative": relative, "cosine": cosine,
            "eps_units": relative / eps}


LOGITS_CHUNK_BYTES = 64 * 1024 ** 2  # float64 working set of one chunk of positions in logits_divergence


def max_abs_gap(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(max |got - ref|, max |ref|) in float64 over two tensors of one shape, in chunks of LOGITS_CHUNK_BYTES of
    float64 (a module's output over a 262k vocabulary is not upcast whole, twice). The same maxima as upcasting
    whole: each element's difference is computed the same way."""
    a, b = ref.reshape(-1), got.reshape(-1)
    step = max(1, LOGITS_CHUNK_BYTES // 8)
    gap = size = 0.0
    for i in range(0, a.numel(), step):
        x = a[i:i + step].double()
        gap = max(gap, float((b[i:i + step].double() - x).abs_().max()))
        size = max(size, float(x.abs_().max()))
        del x
    return gap, size


def logits_rows(logits: torch.Tensor) -> int:
    """Positions per chunk when logits [positions, vocab] are reduced in float64 (LOGITS_CHUNK_BYTES a chunk)."""
    return max(1, LOGITS_CHUNK_BYTES // (8 * max(1, logits.shape[-1])))


def logits_divergence(ref: torch.Tensor, got: torch.Tensor) -> dict[str, torch.Tensor]:
    """ref, got: [n_positions, vocab]. Per position: max |Δ|, KL(ref || got), argmax agreement, top-5 overlap.

    Computed in chunks of positions (each position's numbers depend on its row only), so a large vocabulary costs
    one chunk's float64 temporaries, not n_positions × vocab × 8 bytes several times over. A large float64
    comparison (the float64 reference's) starts with the heap's freed blocks given back (its forwards left them:
    kvviz.core.float64.released_between_layers)."""
    if ref.dtype == torch.float64 and ref.device.type == "cpu" and ref.numel() * 8 >= RELEASE_MIN_BYTES:
        release_freed_memory()
    rows = logits_rows(ref)
    if ref.dim() != 2 or ref.shape[0] <= rows:
        return _logits_divergence(ref, got)
    parts = [_logits_divergence(ref[i:i + rows], got[i:i + rows]) for i in range(0, ref.shape[0], rows)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _logits_divergence(ref: torch.Tensor, got: torch.Tensor) -> dict[str, torch.Tensor]:
    r = ref.to(torch.float64)
    g = got.to(torch.float64)
    lr = torch.log_softmax(r, -1)
    lg = torch.log_softmax(g, -1)
    kl = (lr.exp() * (lr - lg)).sum(-1).clamp_min(0.0)
    k = min(5, r.shape[-1])
    tr = r.topk(k, -1).indices
    tg = g.topk(k, -1).indices
    overlap = (tr.unsqueeze(-1) == tg.unsqueeze(-2)).any(-1).sum(-1)
    return {"max_abs": (g - r).abs().amax(-1), "kl": kl, "argmax_agree": r.argmax(-1) == g.argmax(-1),
            "top5_overlap": overlap, "ref_top1": r.argmax(-1), "got_top1": g.argmax(-1)}


_DESCRIBE_ROWS = ("mean", "std", "min", "25%", "50%", "75%", "max")


def describe(x: torch.Tensor) -> torch.Tensor:
    """pandas' Series.describe() without count (sample std, linear quantiles), computed on the device."""
    x = x.to(torch.float64).flatten()
    q = torch.quantile(x, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64, device=x.device))
    std = x.std(unbiased=True) if x.numel() > 1 else torch.zeros((), dtype=torch.float64, device=x.device)
    return torch.stack([x.mean(), std, x.min(), q[0], q[1], q[2], x.max()])


def describe_table(without: torch.Tensor, with_: torch.Tensor) -> dict[str, dict[str, float]]:
    """The describe() table of logits without past, with past, |Δ|, and relative Δ."""
    d_without = describe(without)
    d_with = describe(with_)
    d_abs = describe((with_.to(torch.float64) - without.to(torch.float64)).abs())
    rel = d_abs / d_without.abs()
    cols = {"without past": d_without, "with past": d_with, "absolute Δ": d_abs, "relative Δ": rel}
    return {name: dict(zip(_DESCRIBE_ROWS, v.cpu().tolist())) for name, v in cols.items()}


def tensor_diff(ref: torch.Tensor, got: torch.Tensor) -> tuple[int, int, float]:
    """(elements that differ, elements compared, max |Δ|) of two equally shaped tensors."""
    if ref.numel() == 0:
        return 0, 0, 0.0
    neq = int((ref != got).sum().item())
    max_abs = float((got.to(torch.float64) - ref.to(torch.float64)).abs().max().item())
    return neq, ref.numel(), max_abs


def first_divergence(a: "list[int]", b: "list[int]") -> int | None:
    """The first step at which two token sequences differ; when one is a prefix of the other and they differ in
    length, the length of the shorter (one stopped there, the other went on); None when they are the same. Every
    view that compares decoded tokens uses this one."""
    for t, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return t
    return None if len(a) == len(b) else min(len(a), len(b))
