"""The bisector: where does a cached run first differ from the full forward?

Both runs of a split scenario are hooked; every submodule's output is recorded for the compared tokens (the full
forward's positions [k, L), the cached run's rest, one chunk or step by step), and the modules are walked in the
order the full forward ran them. The first module whose output differs is named - its kind (embedding, q/k/v
projection, rotary, attention, attention output, norm, MLP, lm_head), its layer and the size of the gap. In
invariant mode a surviving gap is logic and this says where it starts; in normal mode it shows where rounding
first creeps in.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import torch
from torch.overrides import TorchFunctionMode

from ...models.compat import output_cache, takes_logits_to_keep
from ...core.capture import Capture
from ...core.errors import KvvizError
from ...core.execution import DEFAULT_SETTINGS, ExecSettings, Executor, Settings, has_cache
from ...core.inputs import SplitConfig, build_inputs, cached_mask, check_split
from ...models.loading import LoadedModel
from ...core.protocol import DEFAULT_CONTEXT, RunContext
from ...core.metrics import max_abs_gap
from ...core.naming import module_label
from ...core.verdict import Finding
from ...core.estimate import Timed

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
    m = re.search(r"\.(layers|h|layer|blocks|block)\.(\d+)\.", f".{name}.")
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
class OpGap:
    """The first torch op whose output differs between the full forward and the cached run."""
    op: str  # e.g. "matmul", "softmax", "linear"
    module: str  # module path of the innermost module running it, e.g. "model.layers.0.self_attn"
    layer: str  # the layer naming rule: "layer 1 (model.layers.0)", "embeddings", "outside the layers"
    index: int  # its index among that module call's ops
    shapes: list  # input tensor shapes (full forward)
    dtypes: list  # input dtypes
    out_shape: list
    out_dtype: str
    max_abs: float
    relative: float
    ops_compared: int = 0  # ops compared before (and including) it
    text: str = ""


@dataclass(frozen=True)
class BisectSettings(Settings):
    prompt: str = ""
    split: int = 0
    mode: str = "chunk"
    left_pad: int = 0
    position_ids: str = "auto"
    attention_mask: str = "full"
    model: str = ""
    dtype: str = ""
    execution: ExecSettings = DEFAULT_SETTINGS


@dataclass
class BisectResult(Timed):
    settings: BisectSettings
    first: ModuleGap | None  # the first module whose output differs (None: nothing differs)
    modules: list[ModuleGap] = field(default_factory=list)  # every compared module, in execution order
    explanation: str = ""
    first_op: OpGap | None = None  # the first torch op whose output differs (None: none, or not traced)
    ops_compared: int = 0  # torch ops of the cached run compared with the full forward's (0: ops not traced)

    def to_dict(self) -> dict:
        return {**asdict(self), "settings": self.settings.to_dict()}

    def finding(self) -> Finding | None:
        """What it found first, typed (kvviz.core.verdict.Finding): the first differing module and, where the op trace
        lines one up, its first differing op. None: nothing differs at module level."""
        first, op = self.first, self.first_op
        if first is None:
            return None
        return Finding(module=first.name, kind=first.kind, layer=first.layer, max_abs=first.max_abs,
                       relative=first.relative, op=op.op if op else None, shapes=list(op.shapes) if op else [])


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class _Recorder:
    """Forward hooks on every named submodule, in the order modules first ran.

    Full forward (`ref` None): keeps, of each module's first call, only the compared positions of its output and
    of its input (the sequence axis is the one of length `total`) - never every module's whole output: a real
    model's head alone is positions × vocabulary × 8 bytes in float64 (1.5 GB for Gemma 3 on 721 tokens).
    Cached run (`ref` the full forward's recorder): each call's output and input are compared with the same
    positions of the full forward's as they come (the calls of a module cover the compared positions in order: one
    chunk, or one position a step) and only the gap is kept."""

    def __init__(self, model, total: int, a0: int, n: int, ref: "_Recorder | None" = None):
        self.model, self.total, self.a0, self.n, self.ref = model, total, a0, n, ref
        self.order: list[str] = []
        self.outputs: dict[str, tuple[int, torch.Tensor] | None] = {}  # full: name -> (seq axis, compared rows)
        self.inputs: dict[str, tuple[int, torch.Tensor] | None] = {}
        self.acc: dict[str, dict] = {}  # cached: name -> the gap so far
        self._capture = Capture(model)

    def __enter__(self):
        self._capture.on_output([(name, mod) for name, mod in self.model.named_modules() if name], self._hook)
        return self

    def _rows(self, t: torch.Tensor | None) -> tuple[int, torch.Tensor] | None:
        if t is None:
            return None
        sl, dim = _seq_slice(t, self.total, self.a0, self.n)
        return None if sl is None else (dim, sl.detach().clone())

    def _hook(self, name, mod, args, out):
        t = _first_tensor(out)
        if t is None or t.dim() < 2:
            return
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if self.ref is None:
            if name not in self.outputs:  # only a module's first call is compared
                self.order.append(name)
                self.outputs[name] = self._rows(t)
                self.inputs[name] = self._rows(x)
            return
        e = self.acc.setdefault(name, {"off": 0, "max_abs": 0.0, "ref_max": 0.0, "ok": True, "in_off": 0,
                                       "in_ok": True, "in_differs": False})
        want = self.ref.outputs.get(name)
        if want is None or not e["ok"]:
            e["ok"] = False
            return
        part = _part(want, t, e["off"])
        if part is None:
            e["ok"] = False
            return
        got = t.detach()
        gap, size = max_abs_gap(part, got)  # in float64 chunks: the head's output is rows × vocabulary
        e["max_abs"], e["ref_max"] = max(e["max_abs"], gap), max(e["ref_max"], size)
        e["off"] += got.shape[want[0]]
        wx = self.ref.inputs.get(name)
        xpart = _part(wx, x, e["in_off"]) if wx is not None and x is not None else None
        if xpart is None:
            e["in_ok"] = False
        elif e["in_ok"]:
            e["in_differs"] = e["in_differs"] or not torch.equal(x.detach(), xpart)
            e["in_off"] += x.shape[wx[0]]

    def gap(self, name: str) -> tuple[float, float, bool] | None:
        """Cached run: (max |Δ|, relative, input differs) of `name` over every compared position, or None where
        its calls do not line up with the full forward's compared positions."""
        e, want = self.acc.get(name), self.ref.outputs.get(name) if self.ref is not None else None
        if e is None or want is None or not e["ok"] or e["off"] != want[1].shape[want[0]]:
            return None
        wx = self.ref.inputs.get(name)
        differs = bool(e["in_ok"] and wx is not None and e["in_off"] == wx[1].shape[wx[0]] and e["in_differs"])
        mx = e["max_abs"]
        return mx, mx / max(e["ref_max"], torch.finfo(torch.float64).tiny), differs

    def __exit__(self, *exc):
        self._capture.remove()


def _part(want: tuple[int, torch.Tensor], t: torch.Tensor, off: int) -> torch.Tensor | None:
    """The full forward's rows a cached call's `t` is compared with: from position `off` on, as many as `t` has;
    None where the shapes do not line up."""
    dim, w = want
    if t.dim() != w.dim() or off + t.shape[dim] > w.shape[dim]:
        return None
    part = w.narrow(dim, off, t.shape[dim])
    return part if part.shape == t.shape else None


def _seq_slice(t: torch.Tensor, total: int, start: int, n: int) -> torch.Tensor | None:
    """The compared positions of a full-forward output: the sequence axis is the one of length `total`."""
    for dim in (1, 2, 0):
        if t.dim() > dim and t.shape[dim] == total:
            return t.narrow(dim, start, n), dim
    return None, None


def run_bisect(lm: LoadedModel, cfg: SplitConfig, settings: ExecSettings | None = None,
               ops: bool = True, progress: Callable[[float, str], None] | None = None) -> BisectResult:
    """Hook the full forward and the cached run of `cfg` and name the first module whose output differs; with
    ops, also trace both runs op by op (a TorchFunctionMode) and name the first torch op whose output differs.
    progress(fraction, message) is called before each of the runs (an invariant-mode bisect of a long prompt on a
    real model takes minutes: it must never look like a run that ended silently)."""
    settings = settings or DEFAULT_SETTINGS  # validated once, by its RunContext
    cfg.validate()
    say = progress or (lambda frac, msg: None)
    mode = "invariant mode" if settings.invariant else "normal mode"
    inp = build_inputs(lm, cfg.prompt, cfg.left_pad)
    check_split(inp.n_tokens, cfg.split)
    a0, n = inp.pad + cfg.split, inp.total - inp.pad - cfg.split
    ex = Executor(lm, settings, max_len=inp.total)
    with ex.session():
        say(0.0, f"Bisecting in {mode}: prefix forward ({a0} tokens)…")
        # the prefix's logits are never compared: one row, not [a0, vocabulary] (1.26 GB on a 262k vocabulary)
        pre = ex.forward(inp.ids[:, :a0], inp.mask[:, :a0], inp.positions[:, :a0], hidden=False,
                         logits_to_keep=1 if takes_logits_to_keep(lm.model) else None)
        if not has_cache(pre):
            raise KvvizError(f"{lm.name} returns no cache (a bidirectional model): there is no cached run to bisect")
        past = output_cache(pre)
        del pre
        say(0.15, f"Full forward ({inp.total} tokens), every module hooked…")
        with _Recorder(lm.model, inp.total, a0, n) as full:
            ex.forward(inp.ids, inp.mask, inp.positions, hidden=False)
        if ops:  # the cache is grown by the cached run: keep a copy for the op trace

            past_for_ops = copy.deepcopy(past)
        say(0.4, f"Rest through the cache ({n} tokens, {cfg.mode}), every module compared as it comes…")
        with _Recorder(lm.model, inp.total, a0, n, ref=full) as cached:
            _cached_rest(ex, cfg, inp, a0, past)
        del past
        say(0.5, "Comparing the modules…")
        res = _compare(full, cached, cfg, settings, lm)
        del full, cached  # the module rows are reduced to gaps before the op trace records its own
        trace = _trace_ops(ex, lm, cfg, inp, a0, n, past_for_ops, say) if ops else None
    res.first_op = None if trace is None else trace.first
    res.ops_compared = 0 if trace is None else trace.compared
    res.explanation = _explain(res, settings, ops)
    say(1.0, "Done")
    return res


def made_inside(first: ModuleGap | None) -> str:
    """When the first differing module's input already differs although every hooked module before it agrees, the
    difference was made by ops of its parent module that no hook sees and the op trace cannot line up (their shapes
    differ between the two runs): say so and where."""
    if first is None or not first.input_differs or first.kind.startswith("attention weights") or "." not in first.name:
        return ""
    parent = first.name.rsplit(".", 1)[0]
    return (f"Its input already differs: the difference is made inside {parent} by ops whose shapes differ between "
            f"the full forward and the cached run (a chunked scan whose chunks start at each call's first token, a "
            f"convolution over the cached state - the model's own chunk algorithm), which the op trace cannot line "
            f"up.")


def _explain(res: BisectResult, settings: ExecSettings, ops: bool) -> str:
    """The bisector's finding in words: where the first difference is, or - said plainly - that there is none."""
    mode = "In invariant mode" if settings.invariant else "In normal mode"
    first, op = res.first, res.first_op
    if first is None and op is None:
        same = (f"{mode} every hooked module ({len(res.modules)} compared) gives the same bits in the cached run "
                f"as in the full forward")
        if not ops:
            return f"{same} (ops not traced)."
        if res.ops_compared == 0:
            return f"{same}; no torch op could be lined up between the two runs, so ops were not compared."
        return (f"{mode} nothing differs: every torch op agrees bit for bit between the cached run and the full "
                f"forward ({res.ops_compared} ops compared on the compared positions), and so does every hooked "
                f"module ({len(res.modules)} compared).")
    if first is None:  # an op differs inside a module whose output came out equal
        return (f"{mode} every hooked module's output agrees bit for bit, but an op inside one does not. {op.text}")
    text = f"The first difference is in {res.finding().describe()}. Everything computed before it is bit-identical."
    made = made_inside(first)
    if made:
        text += f" {made}"
    if op is not None:
        return f"{text} {op.text}"
    if ops:
        return (f"{text} No single traced op differs on the compared positions ({res.ops_compared} compared; the "
                f"difference comes from shapes the op trace does not line up, e.g. a sliding-window cache's keys).")
    return text


def _cached_rest(ex: Executor, cfg: SplitConfig, inp, a0: int, past) -> None:
    positions_of = (lambda s, e: inp.positions[:, a0 + s:a0 + e]) if cfg.position_ids == "auto" else None
    for _ in ex.feed(inp.ids[:, a0:], past, one_by_one=cfg.mode != "chunk", hidden=False,
                     mask_of=lambda s, e: cached_mask(cfg.attention_mask, inp, a0 + s, a0 + e), positions_of=positions_of):
        pass


def _compare(full: _Recorder, cached: _Recorder, cfg, settings, lm) -> BisectResult:
    gaps: list[ModuleGap] = []
    for name in full.order:
        g = cached.gap(name)
        if g is None:
            continue
        mx, rel, input_differs = g
        gaps.append(ModuleGap(name, module_kind(name), module_layer(name), mx, rel, input_differs))
    first = next((g for g in gaps if g.max_abs > 0), None)
    if first is not None and first.input_differs and first.kind == "attention output":
        # the op between the last agreeing module and this one is not a module: the attention itself
        first = ModuleGap(first.name.rsplit(".", 1)[0], "attention weights / weighted sum", first.layer,
                          first.max_abs, first.relative, True)
    split = {f.name: getattr(cfg, f.name) for f in fields(SplitConfig)}  # the split as its config names it
    return BisectResult(settings=BisectSettings(**split, model=lm.name, dtype=str(lm.dtype).removeprefix("torch."),
                                                execution=settings), first=first, modules=gaps)


# ---- the op trace ------------------------------------------------------------------------------------------------

_SKIP_OPS = {"__get__", "__getitem__", "size", "dim", "__len__", "stride", "is_floating_point", "numel",
             "data_ptr", "__bool__", "item", "tolist", "__format__", "__repr__", "is_contiguous", "element_size",
             "__setitem__", "to", "contiguous", "detach", "clone", "view", "reshape", "transpose", "permute",
             "expand", "unsqueeze", "squeeze", "flatten", "narrow", "select", "split", "chunk", "unbind", "t",
             "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "all", "any", "eq", "ne", "type_as"}


def layer_name(module: str) -> str:
    """The layer naming rule (kvviz.core.naming): "layer k (model.layers.{k-1}…)" for a module inside decoder layer k-1,
    "embeddings (…)" for the embedding."""
    if module_kind(module) == "embedding":
        return f"embeddings ({module})"
    return module_label(module)


class _OpTrace:
    """A TorchFunctionMode recording every op's first tensor output, keyed by (module path, module call, op index
    in it). Full run (mode "record"): keeps only the compared positions of each output. Cached run (mode
    "compare"): compares each output with the full run's on the fly and keeps the first that differs."""

    def __init__(self, model, total: int, a0: int, n: int, compare_with: dict | None = None):
        self.model, self.total, self.a0, self.n = model, total, a0, n
        self.stack: list[str] = []
        self.calls: dict[str, int] = {}
        self.counters: dict[tuple, int] = {}
        self.record: dict = {} if compare_with is None else compare_with
        self.compare = compare_with is not None
        self.first: OpGap | None = None
        self.compared = 0
        self._capture = Capture(model)
        trace = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                try:
                    trace.on_op(func, args, out)
                except Exception:  # noqa: BLE001 - the trace never breaks the run
                    pass
                return out

        self.mode = Mode()

    def __enter__(self):
        modules = list(self.model.named_modules())  # the model itself too (name "")
        self._capture.on_input(modules, self._pre).on_output(modules, self._post)
        try:
            self.mode.__enter__()
        except BaseException:
            self._capture.remove()
            raise
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self._capture.remove()

    def _pre(self, name, mod, args):
        self.stack.append(name)
        self.calls[name] = self.calls.get(name, 0) + 1

    def _post(self, name, mod, args, out):
        if self.stack:
            self.stack.pop()

    def on_op(self, func, args, out):
        name = getattr(func, "__name__", None) or str(func)
        if name in _SKIP_OPS or self.first is not None:
            return
        t = _first_tensor(out)
        if t is None or not t.is_floating_point() or t.dim() < 2:
            return
        module = self.stack[-1] if self.stack else ""
        call = self.calls.get(module, 0)
        key = (module, call, name)
        idx = self.counters.get(key, 0)
        self.counters[key] = idx + 1
        full_key = (module, call, name, idx)
        if not self.compare:  # the compared positions of the first axis of length `total`
            dim = next((d for d in range(t.dim()) if t.shape[d] == self.total), None)
            if dim is not None and full_key not in self.record:
                ins = [a for a in args if isinstance(a, torch.Tensor)]
                rows = t.narrow(dim, self.a0, self.n).detach().clone()
                self.record[full_key] = ((dim, rows), [list(a.shape) for a in ins],
                                         [str(a.dtype).removeprefix("torch.") for a in ins])
            return
        ref = self.record.get(full_key)
        if ref is None:
            return
        (dim, want), shapes, dtypes = ref
        if t.dim() <= dim or t.shape[dim] != self.n:
            return
        got = t.detach()
        if got.shape != want.shape:
            return
        self.compared += 1
        if torch.equal(got, want):
            return
        mx, size = max_abs_gap(want, got)
        rel = mx / max(size, torch.finfo(torch.float64).tiny)
        where = layer_name(module)
        self.first = OpGap(name, module, where, idx, shapes, dtypes, list(want.shape),
                           str(want.dtype).removeprefix("torch."), mx, rel, self.compared)
        self.first.text = (f"The first differing torch op is {name} #{idx} in {where}: inputs {shapes} "
                           f"({', '.join(dict.fromkeys(dtypes))}), output {list(want.shape)} {self.first.out_dtype} on "
                           f"the compared positions, max |Δ| {mx:.3g} ({rel:.3g} of its size); the "
                           f"{self.compared - 1} ops compared before it agree bit for bit.")


def _trace_ops(ex: Executor, lm: LoadedModel, cfg: SplitConfig, inp, a0: int, n: int, past, say) -> "_OpTrace":
    """Both runs again under the op trace; step mode compares the first cached step (position a0) only. Returns the
    cached run's trace: its first differing op (None: none) and how many ops it compared."""
    steps = n if cfg.mode == "chunk" else 1
    say(0.55, f"Op trace: full forward ({inp.total} tokens), every torch op recorded…")
    full = _OpTrace(lm.model, inp.total, a0, steps)
    with full:
        ex.forward(inp.ids, inp.mask, inp.positions, hidden=False)
    say(0.85, f"Op trace: cached run ({steps} tokens), every torch op compared…")
    cached = _OpTrace(lm.model, inp.total, a0, steps, compare_with=full.record)
    pos = inp.positions[:, a0:a0 + steps] if cfg.position_ids == "auto" else None
    with cached:
        ex.forward(inp.ids[:, a0:a0 + steps], cached_mask(cfg.attention_mask, inp, a0, a0 + steps), pos, past, hidden=False)
    return cached


@dataclass(frozen=True)
class BisectConfig(SplitConfig):
    """A split to bisect; ops: also trace both runs op by op."""
    ops: bool = True


# what its run cannot honour (kvviz.core.protocol.RunContext.running; the CLI refuses the matching flag)
REFUSES = {'prove': 'the bisector runs no proof rerun'}


def run(lm: LoadedModel, config: SplitConfig, ctx: RunContext = DEFAULT_CONTEXT) -> BisectResult:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    with ctx.running(REFUSES) as progress:
        return run_bisect(lm, config, ctx.settings, ops=getattr(config, "ops", True), progress=progress)
