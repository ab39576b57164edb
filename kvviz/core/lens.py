"""The logit lens's arithmetic, shared by the views that lens hidden states (Logit lens: the cached path against
the full forward; Engine layers: two engine runs, cold vs warm, each side's captured states): a hidden state through
the model's final norm and head (Lens), its top-1, runner-up and margin (top2, argmax's tie rule), the KL between two
lens distributions in float64 (kl64), max |Δ lens logit| exactly as float64 computes it (max_abs_exact), the decision
depth - the first hidden state where two sides' top-1 differ (first_difference) - and the lens of two sides' saved
hidden states reduced a chunk of positions at a time (lens_pair: never a layer's vocabulary logits for every position
at once).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import KvvizError
from . import metrics  # LOGITS_CHUNK_BYTES read at call time (tests and benches lower it)

NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f", "final_norm")


@dataclass
class Lens:
    norm: torch.nn.Module | None  # None: the model has no final norm
    head: torch.nn.Module
    softcap: float | None
    scale: float | None

    @classmethod
    def of(cls, model) -> "Lens":
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None:
            raise KvvizError(f"{type(model).__name__} has no output head (lm_head): the lens needs a causal LM")
        base = None
        for get in (lambda: model.get_decoder(), lambda: model.base_model, lambda: model.model):
            try:
                base = get()
            except (AttributeError, TypeError, NotImplementedError):
                continue
            if base is not None and base is not model:
                break
        norm = next((getattr(base, n) for n in NORM_NAMES if isinstance(getattr(base, n, None), torch.nn.Module)),
                    None) if base is not None else None
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        cap = getattr(cfg, "final_logit_softcapping", None)
        scale = getattr(cfg, "logit_scale", None)
        return cls(norm, head, float(cap) if cap else None, float(scale) if isinstance(scale, (int, float))
                   and not isinstance(scale, bool) and scale != 1 else None)

    def __call__(self, h: torch.Tensor, normed: bool) -> torch.Tensor:
        x = h if normed or self.norm is None else self.norm(h)
        w = getattr(self.head, "weight", None)
        if isinstance(w, torch.Tensor) and x.dtype != w.dtype and x.is_floating_point():
            x = x.to(w.dtype)  # a residual kept in float32 (Mamba's residual_in_fp32): the head takes its own dtype,
            # as the model's own head call casts it
        logits = self.head(x)
        if self.scale is not None:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def top2_slow(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-1 as argmax takes it (the lowest id of a tie: the token the path itself would pick; topk may order a tie
    otherwise), the runner-up (the best of the rest: a tie's next id, margin 0) and the margin between them."""
    t1 = logits.argmax(-1, keepdim=True)
    v1 = logits.gather(-1, t1)
    if logits.shape[-1] < 2:
        return t1[..., 0], t1[..., 0], torch.zeros_like(v1[..., 0], dtype=torch.float64)
    rest = logits.scatter(-1, t1, float("-inf"))
    t2 = rest.argmax(-1, keepdim=True)
    v2 = logits.gather(-1, t2)
    del rest
    return t1[..., 0], t2[..., 0], (v1.double() - v2.double())[..., 0]


def top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """top2_slow's numbers from one topk(3) pass: where a row's three best values are strictly ordered, the top-1
    and the runner-up are unique, so topk's ids are argmax's; rows with a tie among them (or a NaN) go through
    top2_slow (its lowest-id tie rule)."""
    if logits.dim() != 2 or logits.shape[-1] < 4:
        return top2_slow(logits)
    v, t = logits.topk(3, -1)
    clear = (v[:, 0] > v[:, 1]) & (v[:, 1] > v[:, 2])
    t1, t2 = t[:, 0].clone(), t[:, 1].clone()
    margin = v[:, 0].double() - v[:, 1].double()
    if not bool(clear.all()):
        tie = torch.nonzero(~clear)[:, 0]
        a, b, m = top2_slow(logits[tie])
        t1[tie], t2[tie], margin[tie] = a, b, m
    return t1, t2, margin


def max_abs_exact(lf: torch.Tensor, lc: torch.Tensor) -> torch.Tensor:
    """Per row, max |lc - lf| exactly as float64 computes it (the repro script's number, bit for bit), from a
    float32 pass: float32's |Δ| of each element is within a relative 2^-24 of the exact one (one rounding: both
    inputs are exact in float32), so the exact maximum is among the elements within 2^-22 of float32's maximum;
    those few are recomputed in float64. Rows whose float32 maximum is not finite: float64 whole."""
    d = (lc.float() - lf.float()).abs_()
    m = d.amax(-1)
    out = torch.zeros(lf.shape[0], dtype=torch.float64, device=lf.device)
    fin = torch.isfinite(m)
    cand = (d >= (m * (1 - 2.0 ** -22)).unsqueeze(-1)) & fin.unsqueeze(-1)
    del d
    r, c = torch.nonzero(cand, as_tuple=True)
    exact = (lc[r, c].double() - lf[r, c].double()).abs()
    out.scatter_reduce_(0, r, exact, "amax", include_self=True)
    if not bool(fin.all()):
        bad = torch.nonzero(~fin)[:, 0]
        out[bad] = (lc[bad].double() - lf[bad].double()).abs().amax(-1)
    return out


def kl64(r: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """KL(softmax(r) || softmax(g)) per row in float64 (the reference way)."""
    lr, lg = torch.log_softmax(r.double(), -1), torch.log_softmax(g.double(), -1)
    return (lr.exp() * (lr - lg)).sum(-1).clamp_min(0.0)


def first_difference(top1_a, top1_b) -> tuple[int, int] | None:
    """(hidden-state row, position index) of the first row where two sides' top-1 [rows, positions] differ (the
    leftmost position of that row): the decision depth; None where they agree at every row."""
    differ = np.asarray(top1_a) != np.asarray(top1_b)
    if differ.ndim != 2 or not differ.size:
        return None
    rows = np.nonzero(differ.any(axis=1))[0]
    if not len(rows):
        return None
    r = int(rows[0])
    return r, int(np.nonzero(differ[r])[0][0])


def lens_chunk(vocab: int) -> int:
    """Positions per chunk of the lens of two sides: their lens logits and the KL's float64 temporaries of one chunk
    (LOGITS_CHUNK_BYTES of float64 each)."""
    return max(1, metrics.LOGITS_CHUNK_BYTES // (8 * max(1, vocab)))


@dataclass
class PairLens:
    """The lens of two sides' hidden states, [rows, positions] each: top-1, runner-up (token ids), margin (top-1
    minus runner-up logit) per side, and KL(a || b) of their lens distributions."""
    a: dict  # top1, top2, margin
    b: dict
    kl: list

    def depth(self) -> tuple[int, int] | None:
        return first_difference(self.a["top1"], self.b["top1"])


def lens_pair(lens: Lens, row_of, n_rows: int, n_positions: int, normed_last: bool = True) -> PairLens:
    """The lens of two sides' hidden states, one row (hidden state) at a time and a chunk of positions at a time:
    row_of(r) -> (a, b), each [positions, hidden] (the same positions on both sides). The last row is taken as
    already through the final norm when normed_last (transformers' and the engines' last hidden state): the norm is
    not applied twice. Where a chunk's rows are equal bit for bit on both sides, b's lens is a's (KL 0, the same
    top-2): the head runs once."""
    out = {k: np.zeros((n_rows, n_positions), dtype=np.float64)
           for k in ("a_top1", "a_top2", "a_margin", "b_top1", "b_top2", "b_margin", "kl")}
    width = getattr(lens.head, "out_features", None) or getattr(getattr(lens.head, "weight", None), "shape", [0])[0]
    step = lens_chunk(int(width or 1))
    for r in range(n_rows):
        ha, hb = row_of(r)
        if ha.shape != hb.shape or ha.shape[0] != n_positions:
            raise KvvizError(f"the lens got hidden states of shapes {tuple(ha.shape)} and {tuple(hb.shape)} at hidden "
                             f"state {r}, expected {n_positions} positions each")
        normed = normed_last and r == n_rows - 1
        for s in range(0, n_positions, step):
            a, b = ha[s:s + step], hb[s:s + step]
            same = torch.equal(a, b)
            la = lens(a, normed)
            lb = la if same else lens(b, normed)
            ta = top2(la)
            tb = ta if same else top2(lb)
            cols = slice(s, s + a.shape[0])
            for side, (t1, t2, m) in (("a", ta), ("b", tb)):
                out[f"{side}_top1"][r, cols] = t1.cpu().numpy()
                out[f"{side}_top2"][r, cols] = t2.cpu().numpy()
                out[f"{side}_margin"][r, cols] = m.cpu().numpy()
            if not same:
                out["kl"][r, cols] = kl64(la, lb).cpu().numpy()
            del la, lb
    ids = lambda k: out[k].astype(np.int64).tolist()  # noqa: E731
    return PairLens({"top1": ids("a_top1"), "top2": ids("a_top2"), "margin": out["a_margin"].tolist()},
                    {"top1": ids("b_top1"), "top2": ids("b_top2"), "margin": out["b_margin"].tolist()},
                    out["kl"].tolist())
