"""The bisector: where does a cached run first differ from the full forward?

Both runs of a split scenario are hooked; every submodule's output is recorded for the compared tokens (the full
forward's positions [k, L), the cached run's rest, one chunk or step by step), and the modules are walked in the
order the full forward ran them. The first module whose output differs is named - its kind (embedding, q/k/v
projection, rotary, attention, attention output, norm, MLP, lm_head), its layer and the size of the gap. In
invariant mode a surviving gap is logic and this says where it starts; in normal mode it shows where rounding
first creeps in.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch

from .errors import KvvizError
from .execution import DEFAULT_SETTINGS, ExecSettings, Executor, has_cache
from .inputs import build_inputs
from .loading import LoadedModel
from .naming import module_label
from .split import SplitConfig, _mask, check_split

_KINDS = (  # (pattern on the module's own name, kind) - first match wins
    (r"(embed_tokens|wte|wpe|embed_in|word_embeddings|position_embeddings|embeddings)$", "embedding"),
    (r"rotary_emb$", "rotary"),
    (r"(q_proj|k_proj|v_proj|c_attn|query_key_value|query|key|value)$", "q/k/v projection"),
    (r"(o_proj|dense|out_proj)$", "attention output"),
    (r"(self_attn|attn|attention)$", "attention"),
    (r"(c_proj)$", "projection"),
    (r"(norm|layernorm|ln_\w+|ln_f|final_layer_norm|input_layernorm|post_attention_layernorm|"
     r"pre_feedforward_layernorm|post_feedforward_layernorm)$", "norm"),
    (r"(mlp|feed_forward|ffn)$", "MLP"),
    (r"(gate_proj|up_proj|down_proj|c_fc|dense_h_to_4h|dense_4h_to_h|act_fn|act)$", "MLP part"),
    (r"(lm_head|embed_out)$", "lm_head"),
)


def module_kind(name: str) -> str:
    last = name.rsplit(".", 1)[-1]
    for pattern, kind in _KINDS:
        if re.search(pattern, last):
            if kind == "projection":
                return "attention output" if ".attn." in f".{name}." or "attn" in name else "MLP part"
            return kind
    return "other"


def module_layer(name: str) -> int | None:
    m = re.search(r"\.(layers|h|layer)\.(\d+)\.", f".{name}.")
    return int(m.group(2)) if m else None


@dataclass
class ModuleGap:
    name: str
    kind: str
    layer: int | None
    max_abs: float
    relative: float
    input_differs: bool = False  # its input already differed although every module before it agreed


@dataclass
class BisectResult:
    settings: dict
    first: ModuleGap | None  # the first module whose output differs (None: nothing differs)
    modules: list[ModuleGap] = field(default_factory=list)  # every compared module, in execution order
    explanation: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class _Recorder:
    """Forward hooks on every named submodule: outputs per call, in the order modules first ran."""

    def __init__(self, model):
        self.model, self.order, self.outputs, self.inputs, self.handles = model, [], {}, {}, []

    def __enter__(self):
        for name, mod in self.model.named_modules():
            if name:
                self.handles.append(mod.register_forward_hook(self._hook(name)))
        return self

    def _hook(self, name):
        def hook(mod, args, out):
            t = _first_tensor(out)
            if t is not None and t.dim() >= 2:
                if name not in self.outputs:
                    self.order.append(name)
                self.outputs.setdefault(name, []).append(t.detach().clone())
                x = args[0] if args and isinstance(args[0], torch.Tensor) else None
                self.inputs.setdefault(name, []).append(None if x is None else x.detach().clone())
        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _seq_slice(t: torch.Tensor, total: int, start: int, n: int) -> torch.Tensor | None:
    """The compared positions of a full-forward output: the sequence axis is the one of length `total`."""
    for dim in (1, 2, 0):
        if t.dim() > dim and t.shape[dim] == total:
            return t.narrow(dim, start, n), dim
    return None, None


def _gap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - b.double()).abs()
    ref = a.double().abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    mx = float(d.max()) if d.numel() else 0.0
    return mx, mx / float(ref)


def run_bisect(lm: LoadedModel, cfg: SplitConfig, settings: ExecSettings | None = None) -> BisectResult:
    """Hook the full forward and the cached run of `cfg` and name the first module whose output differs."""
    settings = (settings or DEFAULT_SETTINGS).validate()
    cfg.validate()
    inp = build_inputs(lm, cfg.prompt, cfg.left_pad)
    check_split(inp.n_tokens, cfg.split)
    a0, n = inp.pad + cfg.split, inp.total - inp.pad - cfg.split
    ex = Executor(lm, settings, max_len=inp.total)
    with ex.session():
        pre = ex.forward(inp.ids[:, :a0], inp.mask[:, :a0], inp.positions[:, :a0], hidden=False)
        if not has_cache(pre):
            raise KvvizError(f"{lm.name} returns no cache (a bidirectional model): there is no cached run to bisect")
        with _Recorder(lm.model) as full:
            ex.forward(inp.ids, inp.mask, inp.positions, hidden=False)
        with _Recorder(lm.model) as cached:
            _cached_rest(ex, cfg, inp, a0, pre.past_key_values)
    return _compare(full, cached, inp.total, a0, n, cfg, settings, lm)


def _cached_rest(ex: Executor, cfg: SplitConfig, inp, a0: int, past) -> None:
    pos = (lambda s, e: inp.positions[:, s:e] if cfg.position_ids == "auto" else None)
    if cfg.mode == "chunk":
        ex.forward(inp.ids[:, a0:], _mask(cfg, inp, a0, inp.total), pos(a0, inp.total), past, hidden=False)
        return
    cache = past
    for a in range(a0, inp.total):
        cache = ex.forward(inp.ids[:, a:a + 1], _mask(cfg, inp, a, a + 1), pos(a, a + 1), cache,
                           hidden=False).past_key_values


def _input_differs(full: _Recorder, cached: _Recorder, name: str, total: int, a0: int, n: int) -> bool:
    fx, cx = full.inputs.get(name, [None])[0], cached.inputs.get(name, [None])
    if fx is None or any(c is None for c in cx):
        return False
    ref, dim = _seq_slice(fx, total, a0, n)
    if ref is None:
        return False
    got = torch.cat(cx, dim=dim) if len(cx) > 1 else cx[0]
    return got.shape == ref.shape and not torch.equal(got, ref)


def _compare(full: _Recorder, cached: _Recorder, total: int, a0: int, n: int, cfg, settings, lm) -> BisectResult:
    gaps: list[ModuleGap] = []
    for name in full.order:
        if name not in cached.outputs:
            continue
        ref, dim = _seq_slice(full.outputs[name][0], total, a0, n)
        if ref is None:
            continue
        got = torch.cat(cached.outputs[name], dim=dim) if len(cached.outputs[name]) > 1 else cached.outputs[name][0]
        if got.shape != ref.shape:
            continue
        mx, rel = _gap(ref, got)
        gaps.append(ModuleGap(name, module_kind(name), module_layer(name), mx, rel,
                              _input_differs(full, cached, name, total, a0, n)))
    first = next((g for g in gaps if g.max_abs > 0), None)
    if first is not None and first.input_differs and first.kind == "attention output":
        # the op between the last agreeing module and this one is not a module: the attention itself
        first = ModuleGap(first.name.rsplit(".", 1)[0], "attention weights / weighted sum", first.layer,
                          first.max_abs, first.relative, True)
    if first is None:
        text = "Every hooked module gives the same bits in the cached run as in the full forward."
    else:
        where = module_label(first.name)  # kvviz.naming: "layer 2 (model.layers.1.self_attn)"
        what = ("the attention computation itself (scores, softmax, weighted sum - not a module of its own)"
                if first.kind.startswith("attention weights") else first.kind)
        text = (f"The first difference is in {where}, {what}: max |Δ| {first.max_abs:.3g} ({first.relative:.3g} "
                f"of its size). Everything computed before it is bit-identical.")
    return BisectResult(settings={"prompt": cfg.prompt, "split": cfg.split, "mode": cfg.mode,
                                  "left_pad": cfg.left_pad, "position_ids": cfg.position_ids,
                                  "attention_mask": cfg.attention_mask, "model": lm.name,
                                  "dtype": str(lm.dtype).removeprefix("torch."),
                                  "execution": settings.to_dict()},
                        first=first, modules=gaps, explanation=text)
