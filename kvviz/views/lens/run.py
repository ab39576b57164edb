"""Logit lens of both paths: each hidden state of the full forward and of the cached path through the model's final
norm and head, per layer and compared position; the layer where the two paths' top-1 first differ (the decision
depth), their margins there, the KL between the two lens distributions per layer; and the attention that moved at
the first cached position, per layer and head.

The scenario is the split's (kvviz.core.inputs.SplitConfig): the prompt's first `split` tokens are cached with
correct inputs, the rest goes through the cache (one chunk or token by token) with the position ids and mask the
user chose; the reference is one full forward. Nothing holds every layer's vocabulary logits: the full forward's
compared rows are held per layer (kvviz.core.streaming.HeldRows, [positions, hidden] each) and, as the cached path
produces each layer, both rows go through the lens and are reduced at once to the top-2 tokens, the margin and the
KL (a chunk of positions at a time in float64); only those small [layers, positions] matrices are kept.

The attention that moved: at the first cached position, each layer's attention distribution of that query in the
full forward and in the cached path's first forward, per head: max |Δp| and the key the cached path moved most
weight to. Eager attention's probabilities are read as its softmax returns them; for SDPA they are recomputed
(float64) from the very query, keys and mask the kernel is given - an observer: the kernel's own result is returned
unchanged.

Verdict: `identical` (every layer's hidden state bit for bit), else the same scenario in float64 (every hidden state's
relative gap and the final logits'): `precision` where it closes, `logic` where it stays (kvviz.core.verdict.classify).
The float64 rerun puts only the last hidden state through the lens: the head over every layer is most of the lens's
cost (the head is a fifth of SmolLM2-135M's weights, run once a layer a path), and the verdict needs none of it.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ...core.dtypes import dtype_name
from ...core.errors import KvvizError
from ...core.execution import ExecSettings, Executor, RunInfo, has_cache
from ...core.inputs import SplitConfig, build_inputs, cached_mask, check_split
from ...core import metrics  # LOGITS_CHUNK_BYTES read at call time, as core.lens and core.memory read it
from ...core.metrics import logits_rows
from ...core.lens import NORM_NAMES, Lens, first_difference  # noqa: F401  (NORM_NAMES: the repro script's)
from ...core.lens import kl64 as _kl64, max_abs_exact as _max_abs_exact, top2 as _top2  # noqa: F401
from ...core.lens import top2_slow as _top2_slow  # noqa: F401  (tests/test_lens.py's names)
from ...core.naming import layer_labels, model_type
from ...core.prompts import CAPITALS
from ...core.protocol import DEFAULT_CONTEXT, RunContext, no_progress
from ...core.streaming import HeldRows
from ...core.text import display_text
from ...core.verdict import FLOAT64_CLOSED_REL, Verdict, classify
from ...core.estimate import Timed
from ...models.compat import output_cache, takes_logits_to_keep

# what the lens keeps per path: [hidden states, positions] each
PATH_KEYS = ("top1", "top2", "margin")


@dataclass(frozen=True)
class LensConfig:
    """The split scenario the lens reads: the prompt's first `split` tokens cached, the rest through the cache."""
    ABOUT: ClassVar[str] = (
        "When does the cache's gap matter? Each layer's hidden state, of the full forward and of the cached path, "
        "goes through the model's final norm and head (a logit lens): the heatmap shows per layer and position how "
        "far the two next-token distributions are (KL), with the tokens written where the two paths' best token "
        "differs; the decision depth is the first layer where they do. Below it: at the first cached position, "
        "which heads' attention moved.")
    prompt: str = field(default=CAPITALS, metadata={"help": "The text the model reads."})
    split: int = field(default=4, metadata={
        "help": "How many of the prompt's tokens go to the cache first; the rest go through it and are compared."})
    mode: Literal["chunk", "step"] = field(default="chunk", metadata={
        "help": "The rest through the cache in one forward (chunk) or one token per forward (step)."})
    left_pad: int = field(default=0, metadata={"help": "Pad tokens put before the prompt (as in a batch)."})
    position_ids: Literal["auto", "omit"] = field(default="auto", metadata={
        "help": "auto: from the attention mask, as generate() does; omit: the model counts from the cache length "
                "(the classic left-padding bug)."})
    attention_mask: Literal["full", "new-only"] = field(default="full", metadata={
        "help": "full: past + new tokens; new-only: just the new tokens (a mistake transformers accepts silently)."})

    @property
    def scenario(self) -> SplitConfig:
        return SplitConfig(self.prompt, int(self.split), self.mode, int(self.left_pad), self.position_ids,
                           self.attention_mask)

    def validate(self) -> "LensConfig":
        self.scenario.validate()
        return self

    def workload(self):
        """The split scenario's (its forwards, the float64 rerun where the paths differ), with the lens: every hidden
        state's compared positions through the head, of both paths (two head calls: _LensSink._reduce); no proof
        (REFUSES)."""
        return replace(self.scenario.workload(), proves=False, lens=2.0)


@dataclass
class LensPaths:
    """The lens of one run of the scenario (in one dtype): [hidden states, compared positions] matrices."""
    dtype: str
    full: dict  # top1, top2 (token ids), margin (top-1 minus runner-up logit)
    cached: dict
    kl: list  # KL(full || cached) of the lens distributions
    relative: list  # max |Δ lens logit| / max |full lens logit|
    hidden: list  # the hidden state's relative gap: max |Δh| / max |h of the full forward|
    bitwise: bool  # every compared hidden state bit for bit equal
    max_abs: float  # the largest |Δ lens logit|
    head_gap: float  # (path, position) pairs where the last hidden state's lens top-1 is not the model's own next
    # token (argmax of its logits): 0 expected (the lens is the model's own final norm and head)
    lensed: str = "every"  # "every" hidden state through the lens; "last": only the last one (the float64 verdict
    # run: the head over every layer is most of the lens's cost, and the verdict needs the hidden states' gap and the
    # final logits' only); the other rows' top1/top2 are -1, their KL and lens gaps 0

    @property
    def max_relative(self) -> float:
        return float(np.max(self.relative)) if len(self.relative) else 0.0

    def depth(self) -> tuple[int, int] | None:
        """(hidden-state row, position index) of the first layer where the two top-1 differ (the leftmost position
        of that layer); None where they agree at every layer."""
        f, c = np.array(self.full["top1"]), np.array(self.cached["top1"])
        skip = len(f) - 1 if self.lensed == "last" and len(f) else 0  # only the last row went through the lens
        d = first_difference(f[skip:], c[skip:])
        return None if d is None else (d[0] + skip, d[1])

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LensResult(Timed):
    settings: dict
    model: dict
    tokens: list  # the prompt's tokens (display text)
    compared: list  # prompt positions compared (split .. n_tokens-1)
    layer_labels: list
    vocab: dict  # token id (str) -> display text, for every id the matrices name
    main: LensPaths
    float64: LensPaths | None
    path_tokens: dict  # {"full": [...], "cached": [...]}: each path's own next token (its logits' argmax) per position
    attention: dict  # at the first cached position: max_dp [layers, heads], moved_to [layers, heads] (key index)...
    verdict: str
    explanation: str
    notes: list
    elapsed_s: float

    def token(self, i: int) -> str:
        return self.vocab.get(str(int(i)), f"#{int(i)}")

    @property
    def decision(self) -> dict | None:
        """The decision depth of the run: the layer, position, both paths' top-1 and runner-up and their margins."""
        d = self.main.depth()
        if d is None:
            return None
        r, j = d
        out = {"row": r, "layer": self.layer_labels[r], "position": self.compared[j],
               "at": self.tokens[self.compared[j]]}
        for side in ("full", "cached"):
            p = getattr(self.main, side)
            out[side] = {"top1": self.token(p["top1"][r][j]), "top2": self.token(p["top2"][r][j]),
                         "margin": float(p["margin"][r][j])}
        return out

    @property
    def parting(self) -> dict | None:
        """Where the two paths' own next tokens (each path's logits' argmax) first differ: the position, both tokens
        with their last-layer margins, and the layer from which the two lens top-1 differ at every later layer of
        that position (`from_row`, `from_layer`). None where the paths predict the same tokens."""
        f_tok, c_tok = self.path_tokens["full"], self.path_tokens["cached"]
        j = next((k for k, (a, b) in enumerate(zip(f_tok, c_tok)) if a != b), None)
        if j is None:
            return None
        f, c = np.array(self.main.full["top1"])[:, j], np.array(self.main.cached["top1"])[:, j]
        r = len(f)
        while r > 0 and f[r - 1] != c[r - 1]:
            r -= 1
        out = {"position": self.compared[j], "at": self.tokens[self.compared[j]], "from_row": r,
               "from_layer": self.layer_labels[r] if r < len(f) else None}  # None: the last layer's lens agrees (head_gap)
        for side, tok in (("full", f_tok[j]), ("cached", c_tok[j])):
            p = getattr(self.main, side)
            out[side] = {"token": self.token(tok), "top2": self.token(p["top2"][-1][j]),
                         "margin": float(p["margin"][-1][j])}
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["decision"] = self.decision
        d["parting"] = self.parting
        return d


# ------------------------------------------------------------------------------------------------------------------
# The lens of both paths, streamed (the lens itself: kvviz.core.lens)


class _LensSink:
    """The cached path's sink: each hidden state, as it comes, against the held full forward's same rows, through
    the lens; only the reduced [hidden states, positions] numbers are kept."""

    def __init__(self, lens: Lens, held: HeldRows, n: int, lensed: str = "every"):
        self.lens, self.held, self.n, self.lensed = lens, held, n, lensed
        self.L = len(held)
        self.out = {k: torch.zeros(self.L, n, dtype=torch.float64) for k in
                    ("f_top1", "f_top2", "f_margin", "c_top1", "c_top2", "c_margin", "kl", "max_abs", "ref_max",
                     "h_abs", "h_max")}
        if lensed != "every":
            for k in ("f_top1", "f_top2", "c_top1", "c_top2"):
                self.out[k].fill_(-1)
        self.filled = torch.zeros(self.L, n, dtype=torch.bool)
        self.bitwise = True
        self.last_rows: dict[str, list] = {"full": [], "cached": []}  # the last layer's lens top-1 per forward

    def take(self, at: slice, select):
        def sink(i: int, h: torch.Tensor) -> None:
            if i >= self.L or self.held.layers[i] is None:
                raise KvvizError(f"the cached run returned more hidden states than the {self.L} of the reference")
            ref = self.held.layers[i][at]
            got = select(h)
            if got.shape != ref.shape:
                raise KvvizError(f"the cached run returned hidden states of shape {tuple(got.shape)} at hidden state "
                                 f"{i}, expected {tuple(ref.shape)}")
            got = got.to(ref.device)
            if self.bitwise:
                self.bitwise = torch.equal(got, ref)
            s = at.start or 0
            cols = slice(s, s + ref.shape[0])
            self.out["h_abs"][i, cols] = (got.double() - ref.double()).abs().amax(-1).cpu()
            self.out["h_max"][i, cols] = ref.double().abs().amax(-1).cpu()
            normed = i == self.L - 1  # transformers' last hidden state is after the final norm
            if not normed and self.lensed != "every":
                self.filled[i, cols] = True
                return
            # the float64 verdict rerun (lensed "last"): the lens a chunk of rows at a time ([rows, vocab] float64
            # of both paths and argmax's copy, not [compared, vocab] each); the run's own lens in one block (its
            # head over the very rows the repro script takes)
            width = getattr(self.lens.head, "out_features", None) or 1
            block = ref.shape[0] if self.lensed == "every" else max(1, metrics.LOGITS_CHUNK_BYTES // (8 * width))
            for b in range(0, ref.shape[0], block):
                self._reduce(i, ref[b:b + block], got[b:b + block], s + b, normed)
            self.filled[i, cols] = True
        return sink

    def _reduce(self, i: int, ref: torch.Tensor, got: torch.Tensor, s: int, normed: bool) -> None:
        """Rows s.. of hidden state i of both paths through the lens, reduced to top-2, margins, KL and gaps.

        Rows whose hidden states are equal bit for bit have the same lens (KL 0, no gap): the cached path's head
        runs only where some row differs, the KL (float64, a chunk of rows at a time) and the gap only on the rows
        that differ; the top-2 from one topk pass (_top2); max |Δ| from a float32 pass (_max_abs_exact: float64's
        number, bit for bit)."""
        cols = slice(s, s + ref.shape[0])
        differ = (got != ref).any(-1) if got.dim() == 2 else torch.ones(ref.shape[0], dtype=torch.bool)
        any_differ = bool(differ.any())
        lf = self.lens(ref, normed)
        lc = self.lens(got, normed) if any_differ else lf
        t1f, t2f, mf = _top2(lf)
        t1c, t2c, mc = _top2(lc) if any_differ else (t1f, t2f, mf)
        for name, (t1, t2, m) in (("f", (t1f, t2f, mf)), ("c", (t1c, t2c, mc))):
            self.out[f"{name}_top1"][i, cols] = t1.double().cpu()
            self.out[f"{name}_top2"][i, cols] = t2.double().cpu()
            self.out[f"{name}_margin"][i, cols] = m.cpu()
        if any_differ:  # (an equal row's relative lens gap is 0 whatever its size: its max |lens logit| is not taken)
            rows = torch.nonzero(differ.to(lf.device))[:, 0]
            kl = torch.zeros(len(rows), dtype=torch.float64)
            gap = torch.zeros(len(rows), dtype=torch.float64)
            size = torch.zeros(len(rows), dtype=torch.float64)
            exact32 = lf.dtype in (torch.bfloat16, torch.float16, torch.float32)
            step = logits_rows(lf)
            for a in range(0, len(rows), step):  # a chunk of the differing rows at a time in float64
                idx = rows[a:a + step]
                r, g = lf[idx], lc[idx]
                kl[a:a + len(idx)] = _kl64(r, g).cpu()
                gap[a:a + len(idx)] = (_max_abs_exact(r, g) if exact32 else
                                       (g.double() - r.double()).abs().amax(-1)).cpu()
                size[a:a + len(idx)] = r.abs().amax(-1).double().cpu()
                del r, g
            at = rows.cpu() + s
            self.out["kl"][i, at] = kl
            self.out["max_abs"][i, at] = gap
            self.out["ref_max"][i, at] = size
        if normed:
            self.last_rows["full"].append(t1f.cpu())  # _top2's top-1 is argmax's (its lowest-id tie rule)
            self.last_rows["cached"].append(t1c.cpu())

    def stepping(self, select):
        j, last = -1, None

        def sink(i: int, h: torch.Tensor) -> None:
            nonlocal j, last
            if last is None or i <= last:
                j += 1
            last = i
            self.take(slice(j, j + 1), select)(i, h)
        return sink

    def paths(self, dtype: str, head_gap: float) -> LensPaths:
        if not bool(self.filled.all()):
            raise KvvizError(f"the cached run gave the lens {int(self.filled.sum())} of {self.filled.numel()} "
                             "(hidden state, position) pairs")
        o = self.out
        ids = lambda t: t.long().tolist()  # noqa: E731
        tiny = torch.finfo(torch.float64).tiny
        rel = o["max_abs"] / o["ref_max"].clamp_min(tiny)
        hidden = o["h_abs"] / o["h_max"].clamp_min(tiny)
        return LensPaths(dtype, {"top1": ids(o["f_top1"]), "top2": ids(o["f_top2"]), "margin": o["f_margin"].tolist()},
                         {"top1": ids(o["c_top1"]), "top2": ids(o["c_top2"]), "margin": o["c_margin"].tolist()},
                         o["kl"].tolist(), rel.tolist(), hidden.tolist(), self.bitwise, float(o["max_abs"].max()),
                         head_gap, self.lensed)


# ------------------------------------------------------------------------------------------------------------------
# The attention of one query row, per layer: eager's softmax as it returns it, SDPA's recomputed from its inputs


class _AttentionRow(TorchFunctionMode):
    """While active, each attention call's probabilities for query row `row` of batch row 0: [heads, keys] float64,
    one entry per call (per layer, in order). An observer: every call returns what it would have returned."""

    SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax, torch.nn.functional.softmax}

    def __init__(self, row: int, heads: int | None = None):
        super().__init__()
        self.row, self.heads, self.rows, self.kinds = row, heads, [], set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            if func is F.scaled_dot_product_attention:
                self.rows.append(_sdpa_row(self.row, self.heads, *args, **kwargs))
                self.kinds.add("sdpa")
            elif func in self.SOFTMAX and isinstance(out, torch.Tensor) and out.dim() == 4 and self.row < out.shape[-2]:
                dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
                if dim in (-1, 3):
                    # a copy: a view (float64's .double() is one) kept every layer's [B, H, q, k] alive
                    self.rows.append(out[0, :, self.row].to(torch.float64, copy=True))
                    self.kinds.add("eager")
        except (IndexError, RuntimeError, TypeError):  # a call of another shape: not an attention row
            pass
        return out


def _sdpa_row(row, heads, query, key, value=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, **_):
    if heads and query.shape[1] != heads and query.shape[1] * query.shape[2] == heads and row == 0:
        # one query token with grouped keys, packed as [B, kv heads, group, D] (transformers' pack_gqa): head
        # g * group + r is row r of kv head g
        q = query[0].reshape(heads, query.shape[-1]).double()
        if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] > 1:
            attn_mask = attn_mask.reshape(attn_mask.shape[0], heads, 1, attn_mask.shape[-1])
        row = 0
    else:
        q = query[0, :, row].double()  # [Hq, D]
    k = key[0].double()  # [Hkv, S, D]
    if k.shape[0] != q.shape[0]:
        k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
    s = (k @ q.unsqueeze(-1)).squeeze(-1) * (scale if scale is not None else q.shape[-1] ** -0.5)  # [Hq, S]
    if attn_mask is not None:
        m = attn_mask
        while m.dim() < 4:
            m = m.unsqueeze(0)
        m = m[0, :, row if m.shape[-2] > 1 else 0]  # [1 or Hq, S]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    if is_causal:
        s[:, row + 1:] = float("-inf")
    return torch.softmax(s, -1)


def _attention_moved(full: list, cached: list, a0: int, n_rest: int, pad: int, total: int) -> dict:
    """Per layer and head: max |Δp| between the full forward's row a0 and the cached path's first query, the key
    the cached path moved most weight to (prompt position, -1 for a pad key) and its Δp."""
    L = min(len(full), len(cached))
    max_dp, to_key, to_dp = [], [], []
    for f, c in zip(full[:L], cached[:L]):
        S_f, S_c = f.shape[-1], c.shape[-1]
        own_c = a0 if S_c == total else S_c - n_rest  # a static cache's keys: all slots; a sliding layer's: the last
        # cached key j sits at absolute position a0 - (own_c - j); keys after the query hold no weight either way
        lo = max(0, own_c - a0)
        idx = torch.arange(lo, min(S_c, own_c + 1))
        absolute = a0 - (own_c - idx)
        keep = absolute < S_f
        idx, absolute = idx[keep], absolute[keep]
        d = c[:, idx] - f[:, absolute]
        outside = (f.sum(-1) - f[:, absolute].sum(-1)).abs()  # the full row's weight on keys the cache no longer holds
        md = torch.maximum(d.abs().amax(-1), outside)
        best = d.argmax(-1)
        max_dp.append(md.tolist())
        to_key.append([int(absolute[b]) - pad for b in best.tolist()])
        to_dp.append(d.gather(-1, best.unsqueeze(-1)).squeeze(-1).tolist())
    return {"max_dp": max_dp, "to_key": to_key, "to_dp": to_dp}


# ------------------------------------------------------------------------------------------------------------------
# The run


def _run(lm, cfg: SplitConfig, settings: ExecSettings, progress, attention: bool, lensed: str = "every"):
    inp = build_inputs(lm, cfg.prompt, cfg.left_pad)
    check_split(inp.n_tokens, cfg.split)
    a0 = inp.pad + cfg.split
    n = inp.total - a0
    lens = Lens.of(lm.model)
    keep = n if takes_logits_to_keep(lm.model) else None
    ex = Executor(lm, settings, max_len=inp.total)
    rows_f: list = []
    rows_c: list = []
    with ex.session():
        progress(0.1, "Prefix forward…")
        pre = ex.forward(inp.ids[:, :a0], inp.mask[:, :a0], inp.positions[:, :a0], hidden=False,
                         logits_to_keep=1 if keep else None)
        if not has_cache(pre):
            raise KvvizError(f"{lm.name} returns no cache (a bidirectional model): there is no cached path to lens")
        progress(0.3, "Full forward without cache…")
        held = HeldRows(lambda h: h[0, a0:])
        heads = getattr(lm.text_config, "num_attention_heads", None)
        watch = _AttentionRow(a0, heads) if attention else None
        with (watch if watch is not None else contextlib.nullcontext()):
            full = ex.forward(inp.ids, inp.mask, inp.positions, use_cache=False, hidden=held, logits_to_keep=keep)
        rows_f = watch.rows if watch is not None else []
        kinds = set(watch.kinds) if watch is not None else set()
        full_tok = full.logits[0, -n:].argmax(-1).cpu()
        del full  # its logits [n, vocab] freed before the cached path (a view of them kept them alive)
        sink = _LensSink(lens, held, n, lensed)
        rest = inp.ids[:, a0:]
        mask_of = (lambda s, e: cached_mask(cfg.attention_mask, inp, a0 + s, a0 + e))
        positions_of = (lambda s, e: inp.positions[:, a0 + s:a0 + e]) if cfg.position_ids == "auto" else None
        one = cfg.mode == "step"
        hid = sink.stepping(lambda h: h[0, -1:]) if one else sink.take(slice(None), lambda h: h[0])
        cached_tok, head_gap = [], 0.0
        progress(0.5, "Rest through the cache, the lens layer by layer…")
        steps = ex.feed(rest, output_cache(pre), one_by_one=one, mask_of=mask_of, positions_of=positions_of,
                        hidden=hid)
        first = True
        while True:
            watch = _AttentionRow(0, heads) if attention and first else None
            with (watch if watch is not None else contextlib.nullcontext()):
                got = next(steps, None)
            if got is None:
                break
            s, e, out = got
            if watch is not None:
                rows_c = watch.rows
                kinds |= watch.kinds
            first = False
            cached_tok.append(out.logits[0, -(e - s):].argmax(-1).cpu())
            del out
        cached_tok = torch.cat(cached_tok)
        lens_f, lens_c = torch.cat(sink.last_rows["full"]), torch.cat(sink.last_rows["cached"])
        head_gap = float(((lens_f != full_tok).sum() + (lens_c != cached_tok).sum()).item())
        paths = sink.paths(dtype_name(lm.dtype), head_gap)
    moved = _attention_moved(rows_f, rows_c, a0, n if not one else 1, inp.pad, inp.total) \
        if rows_f and rows_c else None
    return inp, paths, {"full": full_tok.tolist(), "cached": cached_tok.tolist()}, moved, sorted(kinds)


def lens_labels(lm, n: int) -> list[str]:
    """The rows' labels (kvviz.core.naming.layer_labels): embeddings, layer 1..N (the last after the final norm); for
    state-space models (naming.AFTER_BLOCKS) layer 1..N and the final norm's output."""
    return layer_labels(n, model_type(lm))


REFUSES = {"prove": "the lens has no invariant-mode proof rerun (run Split point for the proof)"}


def run_lens(lm, cfg: LensConfig, progress=None, settings: ExecSettings | None = None,
             reference=None, on_phase=None) -> LensResult:
    progress = progress or no_progress
    settings = settings or ExecSettings()  # validated once, by its RunContext
    t0 = time.perf_counter()
    cfg.validate()
    sc = cfg.scenario
    inp, main, path_tokens, moved, kinds = _run(lm, sc, settings, lambda f, m: progress(0.5 * f, m), True)
    notes = list(lm.warnings)
    f64 = None
    if not main.bitwise:
        if lm.dtype == torch.float64:
            f64 = main
        else:
            if on_phase is not None:  # the run's phases, as its estimate names them (RunContext.on_phase)
                on_phase("float64")
            progress(0.5, "float64: the same scenario for the verdict…")
            ref = reference or lm.reference()
            _, f64, _, _, _ = _run(ref, sc, settings.with_(compile="off"),
                                   lambda f, m: progress(0.5 + 0.5 * f, f"float64: {m}"), False, lensed="last")
    if main.head_gap:
        notes.append(f"The lens of the last hidden state gave another top-1 than the model's own logits at "
                     f"{int(main.head_gap)} (path, position) pairs: this model's head does more than final norm + "
                     "lm_head, and the lens does not reproduce it exactly.")
    vocab_ids = set()
    for p in (main, f64):
        if p is not None:
            for side in (p.full, p.cached):
                for k in ("top1", "top2"):
                    vocab_ids.update(int(i) for row in side[k] for i in row if i >= 0)
    vocab_ids.update(path_tokens["full"] + path_tokens["cached"])
    vocab = {str(i): display_text(lm.tokenizer, [i]) for i in sorted(vocab_ids)}
    attention = {"position": sc.split, "token": inp.token_texts[sc.split], "kernels": kinds}
    if moved is None:
        attention["note"] = ("no attention probabilities were seen (the model's attention calls neither SDPA nor a "
                             "softmax over keys, or has no attention layers)")
    else:
        attention.update(moved)
        if len(moved["max_dp"]) != lm.n_layers:
            attention["note"] = (f"attention seen in {len(moved['max_dp'])} calls for {lm.n_layers} layers: rows are "
                                 "attention calls in order")
    res = LensResult(settings={**RunInfo.of(lm, settings).to_dict(), **asdict(sc)}, model=lm.summary(),
                     tokens=inp.token_texts, compared=list(range(sc.split, inp.n_tokens)),
                     layer_labels=lens_labels(lm, len(main.kl)), vocab=vocab, main=main, float64=f64,
                     path_tokens=path_tokens, attention=attention, verdict="", explanation="", notes=notes,
                     elapsed_s=0.0)
    res.verdict, res.explanation = verdict_for(res)
    res.elapsed_s = time.perf_counter() - t0
    progress(1.0, "Done")
    return res


def most_moved(res: LensResult) -> dict | None:
    """The head whose attention moved most at the first cached position."""
    a = res.attention
    if not a.get("max_dp"):
        return None
    m = np.array(a["max_dp"])
    layer, head = np.unravel_index(int(np.argmax(m)), m.shape)
    key = a["to_key"][layer][head]
    return {"layer": int(layer) + 1, "head": int(head), "max_dp": float(m[layer, head]),
            "to_key": int(key), "to_token": res.tokens[key] if 0 <= key < len(res.tokens) else "⟨pad⟩",
            "to_dp": float(a["to_dp"][layer][head])}


def verdict_for(res: LensResult) -> tuple[str, str]:
    main, f64 = res.main, res.float64
    if main.bitwise:
        return Verdict.IDENTICAL.value, ("Identical, bit for bit: every layer's hidden state of the cached path is "
                                         "the full forward's, so the lens agrees at every layer and position.")
    # float64: every hidden state's relative gap and the lens logits' (every layer's where the run was float64, the
    # final logits' in the float64 rerun)
    gap64 = max(f64.max_relative, float(np.max(f64.hidden)) if len(f64.hidden) else 0.0) if f64 is not None else None
    v = classify(False, gap64)
    dec = res.decision
    d64 = None
    if f64 is not None:
        beyond = np.nonzero((np.array(f64.hidden) > FLOAT64_CLOSED_REL).any(axis=1))[0] if len(f64.hidden) else []
        d64 = (int(beyond[0]), 0) if len(beyond) else f64.depth()
    if dec is None:
        where = (f"the two paths' lens top-1 agree at every layer and position (largest KL "
                 f"{max(max(r) for r in main.kl):.3g})")
    else:
        f, c = dec["full"], dec["cached"]
        def says(p: dict) -> str:
            if p["margin"] == 0:  # an exact tie: argmax takes the lower token id
                return f"'{p['top1']}' tied with '{p['top2']}'"
            return f"'{p['top1']}' by {p['margin']:.3g} over '{p['top2']}'"
        where = (f"the two paths' top-1 first differ at {dec['layer']} (decision depth), position {dec['position']} "
                 f"('{dec['at']}'): the full forward's lens says {says(f)}, the cached path's {says(c)}")
    part = res.parting
    if part is not None:
        pf, pc = part["full"], part["cached"]

        def own(p: dict) -> str:
            how = f"tied with '{p['top2']}'" if p["margin"] == 0 else f"by {p['margin']:.3g} over '{p['top2']}'"
            return f"'{p['token']}' ({how})"
        where += (f". The paths' own next tokens first part at position {part['position']} ('{part['at']}'): the "
                  f"full forward {own(pf)}, the cached path {own(pc)}" + (
                      f"; there the lens top-1 differ from {part['from_layer']} on" if part["from_layer"] else ""))
    moved = most_moved(res)
    head = (f" At the first cached position the attention of layer {moved['layer']} head {moved['head']} moved most "
            f"(max |Δp| {moved['max_dp']:.3g}, most towards '{moved['to_token']}')." if moved else "")
    if v == Verdict.PRECISION:
        return v.value, (f"Precision: in {main.dtype} {where}. Rerun in float64 the hidden states and the "
                         f"logits differ by at most {gap64:.3g} of their size (≤ {FLOAT64_CLOSED_REL:g}): rounding, "
                         "not a bug." + head)
    if d64 is not None and f64 is not main:
        again = f" In float64 they still first differ at {res.layer_labels[d64[0]]}."
    else:
        again = ""
    return v.value, (f"Logic: in {main.dtype} {where}; the hidden states and the logits still differ by {gap64:.3g} "
                     f"of their size in float64, where rounding could explain at most ~1e-12.{again}" + head)


def run(lm, config: LensConfig, ctx: RunContext = DEFAULT_CONTEXT) -> LensResult:
    """The view's run (kvviz.core.protocol)."""
    with ctx.running(REFUSES) as progress:
        return run_lens(lm, config, progress, settings=ctx.settings, reference=ctx.reference, on_phase=ctx.on_phase)
