"""How long a run will take, from what this machine measured (issue 53.1).

A run is costed phase by phase (`Estimate`: typed `Phase`s, name and seconds):
  load      loading the model (only where it is not loaded yet: the CLI's --plan)
  run       the view's own forwards: full forwards over the input, cached decode steps, steps that rerun the whole
            sequence without a cache (greedy's no-cache path: quadratic in the new tokens, cubic where attention is)
  float64   the float64 rerun that decides a verdict (a run whose cached path differs), or a float64 path
  proof     the invariant-mode rerun that proves a precision verdict

The unit costs (`Pace`) are measured, never assumed: on first use for a model shape, dtype, device and thread count,
`calibrate` times short forwards of the loaded model at three lengths (1, 256 and 1,024 tokens: the fixed cost of a
call, the per-token cost and the quadratic part of attention - measured, so a long prompt is not priced as a short
one scaled) and, where a proof may run, two forwards in invariant mode. The pace is kept in a JSON file in kvviz's
cache dir (`estimates.json`; no pickle) and refined by every finished run: each phase's measured seconds against its
estimate give that view's correction for the phase (`record`), so the next run of the view starts from what the last
one did. What the run computes comes from its typed workload (kvviz.core.inputs.Workload: forwards, decode steps,
full-sequence steps, float64 paths, the float64 rerun, the proof, the dtypes its work runs in, the model copies it
loads or casts, the hidden states it puts through a logit lens) - never from a view's name. Calibration measures,
besides the forwards, what those cost on this model here (`measure_extras`): each dtype's matmul pace against the
model's own, one row through the model's head, an in-memory copy of its weights, and its own load (LoadedModel.load_s)
per GB - a float64 twin or another dtype's copy is priced from the model's own size at that rate.

Phases that run only when the paths differ (the float64 rerun of a split, the invariant proof) are "may happen"
(`Phase.maybe`): the estimate quotes the certain part and the possible part apart ("about 4 s, up to 10 s if the
paths differ"), and a run is compared with the phases that actually ran (`Estimate.ran_s`).
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .dtypes import DTYPE_NAMES, dtype_name, parse_dtype, resolve_device, supports_dtype
from .inputs import Workload
from .execution import DEFAULT_SETTINGS, Executor
from ..models.loading import cache_dir, parse_spec

# tokens: the call's fixed cost, then two lengths for the linear and quadratic part (1,024, not 256: the quadratic part
# measured at 64/256 tokens came out 0 or 3e-7 s/token^2 on two calibrations of one model, and a 3,680-token split
# was priced 0.4x-1.6x its time; at 256/1,024 tokens it is stable within 30 %)
CALIBRATION_LENGTHS = (1, 256, 1024)
INVARIANT_LENGTHS = (8, 32)  # invariant mode's fixed-order kernels are slow: two short lengths
STORE_NAME = "estimates.json"
PHASES = ("load", "run", "float64", "proof")  # a run's phases, in their order (RunContext.on_phase names them)
# Before a run has refined it, what a float64 rerun costs against the run in its own dtype (CPU float64 matmuls run
# at about half float32's rate; bfloat16/float16 on a CPU without native kernels about as slow as float64)
FLOAT64_PRIOR = {"float32": 2.0, "bfloat16": 1.2, "float16": 1.2, "float64": 1.0}
LOAD_PRIOR_S_PER_GB = 4.0  # a model not measured yet: seconds to load a GB of weights (refined by the first load)
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Phase:
    name: str  # "load", "run", "float64", "proof"
    seconds: float
    maybe: bool = False  # runs only where the paths differ (a split's float64 rerun, the invariant proof)


@dataclass(frozen=True)
class Estimate:
    """A run's estimate, phase by phase. `measured`: from this machine's calibration (False: nothing measured yet for
    this model here - the first run calibrates); `basis`: one line on what it is from."""
    phases: tuple[Phase, ...]
    measured: bool = True
    basis: str = ""
    fix: dict = field(default_factory=dict, compare=False)  # the per-phase corrections (Pace.fix) it was made with

    @property
    def total_s(self) -> float:
        """Every phase, the "may happen" ones included: the most the run should take."""
        return sum(p.seconds for p in self.phases)

    @property
    def certain_s(self) -> float:
        """The phases that run whatever the numbers (without the "may happen" ones)."""
        return sum(p.seconds for p in self.phases if not p.maybe)

    def ran_s(self, ran) -> float:
        """The estimate of the phases that actually ran: the certain ones and the "may happen" ones named in `ran`
        (a run's measured phases) - what a run's seconds are compared with."""
        return sum(p.seconds for p in self.phases if not p.maybe or p.name in ran)

    def span(self, load: bool = True) -> tuple[float, float]:
        """(seconds of the phases that run whatever the numbers, seconds with the may-happen ones too); load: loading
        counted."""
        ph = [p for p in self.phases if load or p.name != "load"]
        return sum(p.seconds for p in ph if not p.maybe), sum(p.seconds for p in ph)

    def about(self, load: bool = True) -> str:
        """"about 4 s" or "about 4 s, up to 10 s if the paths differ" (load: loading counted)."""
        certain, upper = self.span(load)
        if duration(upper) != duration(certain):
            return f"about {duration(certain)}, up to {duration(upper)} if the paths differ"
        return f"about {duration(upper)}"

    @property
    def run_s(self) -> float:
        """Seconds of the run itself (every phase but loading): what its progress bar spans."""
        return sum(p.seconds for p in self.phases if p.name != "load")

    def seconds(self, name: str) -> float:
        return sum(p.seconds for p in self.phases if p.name == name)

    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.phases)

    def without(self, *names: str) -> "Estimate":
        return Estimate(tuple(p for p in self.phases if p.name not in names), self.measured, self.basis, self.fix)

    def bar(self) -> dict[str, tuple[float, float]]:
        """Each run phase's span of the progress bar (start, end), in proportion to its estimate (loading is before
        the bar)."""
        total = self.run_s
        out, at = {}, 0.0
        run = [p for p in self.phases if p.name != "load"]
        for p in run:
            share = p.seconds / total if total > 0 else 1.0 / len(run)
            out[p.name] = (at, min(1.0, at + share))
            at += share
        if run:
            out[run[-1].name] = (out[run[-1].name][0], 1.0)
        return out

    def after(self, name: str) -> float:
        """Seconds of the run phases after `name` (an unknown name: all of them)."""
        names = [p.name for p in self.phases if p.name != "load"]
        if name not in names:
            return self.run_s
        return sum(p.seconds for p in self.phases if p.name != "load" and names.index(p.name) > names.index(name))

    def to_dict(self) -> dict:
        return {"estimate_s": self.total_s, "certain_s": self.certain_s,
                "phases": {p.name: p.seconds for p in self.phases},
                "maybe": [p.name for p in self.phases if p.maybe], "measured": self.measured, "basis": self.basis}

    def parts(self, load: bool = True) -> str:
        """"run 40 s; if they differ: float64 rerun 1 min, invariant proof 1 min" (phases under half a second left
        out; "" for a run of one phase)."""
        ph = [p for p in self.phases if load or p.name != "load"]
        if len(ph) < 2:
            return ""

        def words(group) -> str:
            return ", ".join(f"{PHASE_WORDS.get(p.name, p.name)} {duration(p.seconds)}" for p in group
                             if p.seconds >= 0.5)
        sure, maybe = words(p for p in ph if not p.maybe), words(p for p in ph if p.maybe)
        return "; ".join(x for x in (sure, f"if they differ: {maybe}" if maybe else "") if x)

    def line(self) -> str:
        """One line: "about 40 s, up to 3 min if the paths differ (run 40 s; if they differ: float64 rerun 1 min,
        invariant proof 1 min), from this machine's measured pace"."""
        parts = self.parts()
        return self.about() + (f" ({parts})" if parts else "") + (f", {self.basis}" if self.basis else "")


PHASE_WORDS = {"load": "loading", "run": "run", "float64": "float64 rerun", "proof": "invariant proof"}


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


@dataclass(frozen=True)
class Timings:
    """What a run was estimated to take and what it took (seconds); a Result carries it (`Timed.timings`) and every
    JSON export writes both (`estimate_s`, `elapsed_s`)."""
    estimate_s: float | None
    elapsed_s: float | None
    phases: dict = field(default_factory=dict)  # measured seconds by phase name (the run's own report)

    def to_dict(self) -> dict:
        return {"estimate_s": self.estimate_s, "elapsed_s": self.elapsed_s}


@dataclass
class Timed:
    """A result's timings as a typed field (kw-only, so a result dataclass keeps its own field order)."""
    timings: Timings | None = field(default=None, kw_only=True, compare=False, repr=False)

    def timed(self, timings: Timings) -> "Timed":
        """This result with its run's timings (the protocol's runner, the CLI: who timed the run); returns it."""
        self.timings = timings
        return self

    def timings_dict(self) -> dict:
        """{"estimate_s", "elapsed_s"} for the JSON export: the run's timings, else the result's own elapsed_s."""
        if self.timings is not None:
            return self.timings.to_dict()
        own = getattr(self, "elapsed_s", None)
        return {"estimate_s": None, "elapsed_s": float(own) if isinstance(own, (int, float)) else None}


# ------------------------------------------------------------------------------------------------------------------
# The measured pace of one model shape, dtype, device and thread count


@dataclass
class Pace:
    """Seconds for one forward of n tokens: c0 + a·n + b·n² (c0: the call's fixed cost, b: attention's quadratic
    part); one cached decode step at context n: c0 + a + 2·b·n. `inv`: the same three for invariant mode (None: not
    measured). `load_s`: the last load's seconds. `fix`: per view and phase, measured/estimated of the last runs.
    Measured beside them (measure_extras; 0 / empty / None: not measured): `params` (the model's parameters),
    `layers` (its hidden states: embeddings + one per layer), `rates` (a forward in each dtype against one in the
    model's own, from a matmul of its hidden size), `head0` and `head` (seconds of a call through its head and a
    float64 log-softmax - a logit lens - and of each row in it: a call reads the whole head), `load_gb_s` (seconds a GB of its weights took to load), `copy_gb_s` (seconds to
    copy a GB of its weights in memory into another dtype, read and written counted)."""
    c0: float
    a: float
    b: float
    inv: tuple[float, float, float] | None = None
    load_s: float | None = None
    fix: dict = field(default_factory=dict)
    params: int = 0
    layers: int = 0
    rates: dict = field(default_factory=dict)
    head: float | None = None
    head0: float | None = None
    load_gb_s: float | None = None
    copy_gb_s: float | None = None

    def forward(self, n: float, invariant: bool = False) -> float:
        c0, a, b = self.inv if invariant and self.inv else (self.c0, self.a, self.b)
        return c0 + a * n + b * n * n

    def step(self, n: float, invariant: bool = False) -> float:
        c0, a, b = self.inv if invariant and self.inv else (self.c0, self.a, self.b)
        return c0 + a + 2 * b * n


def fit(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """(c0, a, b) of t = c0 + a·n + b·n² through three (n, seconds) points, none negative: where noise at short
    lengths makes one so, it is set to 0 and the others refit through the longer points."""
    (n1, t1), (n2, t2), (n3, t3) = sorted(points)[:3]
    # divided differences: exact through the three points
    d12, d23 = (t2 - t1) / (n2 - n1), (t3 - t2) / (n3 - n2)
    b = (d23 - d12) / (n3 - n1)
    a = d12 - b * (n1 + n2)
    c0 = t1 - a * n1 - b * n1 * n1
    if b < 0:  # no quadratic part measured: a line through the first and last point
        b = 0.0
        a = (t3 - t1) / (n3 - n1)
        c0 = t1 - a * n1
    if a < 0:  # no linear part measured: c0 + b n² through the first and last point
        a = 0.0
        b = max(0.0, (t3 - t1) / (n3 * n3 - n1 * n1))
        c0 = t1 - b * n1 * n1
    return max(0.0, c0), a, b


def fit2(points: list[tuple[int, float]], c0: float) -> tuple[float, float, float]:
    """(c0, a, b) through two (n, seconds) points above a known fixed cost."""
    (n2, t2), (n3, t3) = sorted(points)[:2]
    return fit([(1, c0), (n2, t2), (n3, t3)])


def key_of(spec, dtype, device, threads: int | None = None) -> str:
    """The store's key: the model (its kind and reference: one shape), dtype, device and thread count."""
    ms = parse_spec(spec)
    dt = str(dtype).replace("torch.", "")
    if isinstance(device, str) or device is None:
        try:
            device = resolve_device(device)
        except Exception:  # noqa: BLE001 - a device this machine lacks: the run says so in its own line
            pass
    dev = str(getattr(device, "type", device) or "cpu")
    return f"{ms.kind}:{ms.ref}|{dt}|{dev}|threads={threads or torch.get_num_threads()}"


def key_of_model(lm) -> str:
    return key_of(lm.spec, lm.dtype, lm.device)


def store_path() -> Path:
    return cache_dir() / STORE_NAME


def _read() -> dict:
    try:
        d = json.loads(store_path().read_text(encoding="utf-8"))
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(d: dict) -> None:
    path = store_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(d, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:  # a read-only cache: the estimate is still made, only not kept
        pass


def load_pace(key: str) -> Pace | None:
    d = _read().get(key)
    if not isinstance(d, dict):
        return None
    try:
        inv = d.get("inv")

        def opt(name):
            return None if d.get(name) is None else float(d[name])
        return Pace(float(d["c0"]), float(d["a"]), float(d["b"]), tuple(map(float, inv)) if inv else None,
                    d.get("load_s"), dict(d.get("fix") or {}), int(d.get("params") or 0), int(d.get("layers") or 0),
                    {str(k): float(v) for k, v in (d.get("rates") or {}).items()}, opt("head"), opt("head0"),
                    opt("load_gb_s"),
                    opt("copy_gb_s"))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def save_pace(key: str, pace: Pace) -> None:
    with _LOCK:
        d = _read()
        d[key] = asdict(pace)
        _write(d)


def _timed(fn, repeat: int = 1) -> float:
    """The median of `repeat` timed calls: a run meets the machine as it is (the best of a few, on a shared machine,
    priced every later call at its luckiest)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def calibrate(lm, invariant: bool = False, clock_forward=None, extras=None) -> Pace:
    """The pace of `lm` on this machine, measured now (or read from the store when measured before; invariant mode
    measured too when asked and not yet). clock_forward(n, invariant) -> seconds replaces the timed forward, and
    extras(lm) -> dict (measure_extras' fields) the timed extras (tests)."""
    key = key_of_model(lm)
    pace = load_pace(key)
    if pace is not None and (not invariant or pace.inv is not None) and pace.params:
        return pace
    timed = clock_forward or (lambda n, inv: _time_forward(lm, n, inv))
    if pace is None:
        points = [(n, timed(n, False)) for n in calibration_lengths(lm)]
        pace = Pace(*fit(points))
    if invariant and pace.inv is None:
        pace.inv = fit2([(n, timed(n, True)) for n in INVARIANT_LENGTHS], pace.c0)
    if not pace.params:
        for k, v in (extras or measure_extras)(lm).items():
            setattr(pace, k, v)
    save_pace(key, pace)
    return pace


def calibration_lengths(lm) -> list[int]:
    """CALIBRATION_LENGTHS within the model's context (three distinct lengths, fewer tokens for a short context)."""
    limit = max(3, int(getattr(lm.config, "max_position_embeddings", None) or 4096))
    ns = sorted({max(1, min(n, limit)) for n in CALIBRATION_LENGTHS})
    return ns if len(ns) == 3 else [1, max(2, limit // 4), limit]


def _bytes(dtype) -> int:
    return torch.empty((), dtype=parse_dtype(str(dtype).replace("torch.", ""))).element_size()


def measure_extras(lm) -> dict:
    """What a run costs besides its forwards, measured on this model here: Pace's params, layers, rates, head,
    load_gb_s and copy_gb_s (each a fraction of a second: one matmul per dtype, 32 rows through the head, up to
    64 MB of the weights copied)."""
    model, dev = lm.model, lm.device
    params = sum(p.numel() for p in model.parameters())
    own = dtype_name(lm.dtype)
    gb = params * _bytes(own) / 1e9
    cfg = getattr(lm, "text_config", None) or model.config
    hidden = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "d_model", 0) or 512)
    rates, times = {}, {}
    with torch.inference_mode():
        mats = {}
        for name in DTYPE_NAMES:
            dt = parse_dtype(name)
            if not supports_dtype(dev, dt):
                continue
            try:
                x = torch.randn(256, hidden, device=dev).to(dt)
                w = torch.randn(hidden, 4 * hidden, device=dev).to(dt)
                x @ w  # warm up
                mats[name] = (x, w)
            except RuntimeError:  # a dtype this device cannot multiply: priced by the prior
                continue
        # the dtypes in turn, five rounds, each dtype's median: a shared machine's load falls on all of them alike
        for _ in range(5):
            for name, (x, w) in mats.items():
                times.setdefault(name, []).append(_timed(lambda: x @ w))
        times = {d: sorted(t)[len(t) // 2] for d, t in times.items()}
        base = times.get(own)
        if base:
            rates = {d: t / base for d, t in times.items()}
        head = head0 = None
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        weight = getattr(out, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.device.type != "meta" \
                and weight.is_floating_point():
            rows = torch.randn(32, weight.shape[1], device=weight.device).to(weight.dtype)
            try:  # a call reads the whole head (its fixed part), then each row: 1 and 32 rows, in turn
                torch.log_softmax((rows @ weight.T).double(), -1)  # warm up
                t1, t32 = [], []
                for _ in range(3):
                    t1.append(_timed(lambda: torch.log_softmax((rows[:1] @ weight.T).double(), -1)))
                    t32.append(_timed(lambda: torch.log_softmax((rows @ weight.T).double(), -1)))
                t1, t32 = sorted(t1)[1], sorted(t32)[1]
                per_row = max(0.0, t32 - t1) / 31
                head, head0 = per_row, max(0.0, t1 - per_row)
            except RuntimeError:  # a head that is not a plain matrix (quantized): no lens price
                head = None
        moved, t_copy = 0, 0.0
        for p in model.parameters():
            if p.device.type == "meta":
                continue
            t0 = time.perf_counter()
            p.detach().to(torch.float64, copy=True)
            t_copy += time.perf_counter() - t0
            moved += p.numel() * (p.element_size() + 8)
            if moved > 64e6:
                break
    load_s = getattr(lm, "load_s", None)
    try:
        layers = int(lm.n_layers) + 1
    except (AttributeError, TypeError, ValueError):
        layers = 0
    return {"params": int(params), "layers": layers, "rates": rates, "head": head, "head0": head0,
            "load_gb_s": load_s / gb if load_s and gb > 0 else None,
            "copy_gb_s": t_copy / (moved / 1e9) if moved else None}


def _time_forward(lm, n: int, invariant: bool) -> float:
    """Seconds of one forward of n tokens (no cache, hidden states kept as the views keep them), the median of a
    few for a short one."""
    limit = getattr(lm.config, "max_position_embeddings", None) or 4096
    n = max(1, min(int(n), int(limit)))
    vocab = int(getattr(lm.config, "vocab_size", 100) or 100)
    ids = (torch.arange(n, dtype=torch.long).reshape(1, n) * 7919 + 3) % max(2, vocab - 1)
    ex = Executor(lm, DEFAULT_SETTINGS.with_(invariant=invariant, compile="off"))
    with ex.session():
        ex.forward(ids[:, : min(n, 8)], use_cache=False)  # warm up (first-call allocations)
        return _timed(lambda: ex.forward(ids, use_cache=False), repeat=3 if n <= 64 else 1)  # as views run: hidden states kept


# ------------------------------------------------------------------------------------------------------------------
# The estimate of a workload


def work_seconds(pace: Pace, w: Workload, tokens: int, invariant: bool = False) -> float:
    """Seconds of the view's own computation (its forwards and steps) at `tokens` input tokens."""
    n = max(1, int(tokens))
    s = float(w.forwards) * pace.forward(n, invariant)
    if w.calls is not None and w.calls > w.forwards:  # the calls beyond the forwards: their fixed cost
        s += (float(w.calls) - float(w.forwards)) * pace.forward(0, invariant)
    steps = int(w.new_tokens or 0)
    if w.steps_after_split and isinstance(w.split, int):
        steps = max(0, n - int(w.split))
        s += w.decode_paths * sum(pace.step(int(w.split) + i, invariant) for i in range(steps))
    elif steps:
        s += w.decode_paths * sum(pace.step(n + i, invariant) for i in range(steps))
        s += w.full_paths * sum(pace.forward(n + i, invariant) for i in range(steps))
    return s


def rate(pace: Pace, dtype: str, own: str) -> float:
    """A forward in `dtype` against one in the model's own dtype `own`: measured (Pace.rates), else the prior."""
    dtype, own = str(dtype).replace("torch.", ""), str(own).replace("torch.", "")
    if dtype == own:
        return 1.0
    if dtype in pace.rates and own in pace.rates:
        return pace.rates[dtype] / (pace.rates[own] or 1.0)
    if dtype == "float64":
        return FLOAT64_PRIOR.get(own, 2.0)
    return FLOAT64_PRIOR.get(own, 2.0) / FLOAT64_PRIOR.get(dtype, 2.0)


def scaled(pace: Pace, r: float) -> Pace:
    """The pace in a dtype `r` times as slow as the model's own, the call's fixed cost included: a short call's time
    is mostly reading every weight once, which the dtype changes as it changes the matmuls (the split default's
    float64 rerun took 2.5x the estimate that kept it: 2026-12-08)."""
    inv = (pace.inv[0] * r, pace.inv[1] * r, pace.inv[2] * r) if pace.inv else None
    return Pace(pace.c0 * r, pace.a * r, pace.b * r, inv)


def copy_seconds(pace: Pace, copy: str, own: str) -> float:
    """Loading the model again as `copy` ("float64", "bfloat16", "@eager", "float64@eager"): its checkpoint read again
    (from the page cache) and written in that dtype, priced as that memory traffic at the measured copy rate (as a
    cast: `cast_seconds`). Not at the first load's rate: the first load also imports the model's code and reads its
    tokenizer, which priced the default model's float64 twin at 5x its 1.2 s (bench/estimate_bench.py, 2026-12-08).
    The first load's rate where no copy rate was measured; 0 where nothing was."""
    dtype = copy.split("@")[0] or own
    if pace.params and pace.copy_gb_s:
        return cast_seconds(pace, dtype, own)
    if not pace.params or not pace.load_gb_s:
        return 0.0
    return pace.load_gb_s * pace.params * _bytes(dtype) / 1e9


def cast_seconds(pace: Pace, dtype: str, own: str) -> float:
    """An in-memory copy of the weights cast to `dtype` (a deep copy in the model's dtype, then .to(dtype); a
    quantized copy is priced as one in the model's dtype) at the measured copy rate."""
    if not pace.params or not pace.copy_gb_s:
        return 0.0
    try:
        d = _bytes(dtype)
    except Exception:  # noqa: BLE001 - "int8", "int4": a quantized copy, read from the model's own dtype
        d = _bytes(own)
    return pace.copy_gb_s * pace.params * (3 * _bytes(own) + d) / 1e9


def estimate(pace: Pace | None, w: Workload, tokens: int, *, view: str = "", dtype: str = "float32",
             invariant: bool = False, load_s: float | None = None, measured: bool = True,
             loaded=None) -> Estimate:
    """The phases of a run of workload `w` over `tokens` input tokens at `pace` (the run's, float64 rerun's and
    proof's), each corrected by what the last runs of `view` measured against their estimates (Pace.fix).
    loaded(copy) -> bool: whether a copy the workload names is loaded already (None: none is)."""
    if pace is None:
        raise ValueError("no pace: calibrate first (kvviz.core.estimate.calibrate) or use prior()")
    own = str(dtype).replace("torch.", "")
    phases = []
    if load_s:
        phases.append(Phase("load", float(load_s)))
    fix = dict(pace.fix.get(view, {})) if view else {}
    fix.setdefault("proof", 1.0 if pace.inv is not None else 3.0)
    n = max(1, int(tokens))
    dtypes = [str(d).replace("torch.", "") for d in w.run_dtypes]
    run = sum(work_seconds(scaled(pace, rate(pace, d, own)), w, tokens, invariant) for d in dtypes) if dtypes \
        else work_seconds(pace, w, tokens, invariant)
    if w.lens and pace.head is not None and pace.layers:
        compared = max(1, n - int(w.split)) if isinstance(w.split, int) and not isinstance(w.split, bool) else n
        run += w.lens * pace.layers * ((pace.head0 or 0.0) + compared * pace.head)
    twin = 0.0  # the float64 twin, loaded when the float64 rerun starts
    maybe64 = bool(w.float64_rerun and not w.float64_certain)
    for c in dict.fromkeys(w.copies):
        d = c.split("@")[0] or own
        if (d == own and "@" not in c) or (loaded is not None and loaded(c)):
            continue
        if c == "float64" and maybe64:
            twin += copy_seconds(pace, c, own)
        else:
            run += copy_seconds(pace, c, own)
    run += sum(cast_seconds(pace, d, own) for d in w.casts)
    phases.append(Phase("run", run * fix.get("run", 1.0)))
    p64 = scaled(pace, rate(pace, "float64", own))
    if w.float64_paths and w.new_tokens:
        f64 = w.float64_paths * sum(p64.forward(n + i) for i in range(int(w.new_tokens)))
        phases.append(Phase("float64", f64 * fix.get("float64", 1.0)))
    elif (w.float64_rerun or w.float64_certain) and own != "float64":
        phases.append(Phase("float64", (work_seconds(p64, w, tokens) + twin) * fix.get("float64", 1.0),
                            maybe=maybe64))
    if w.prove and w.proves and not invariant:
        inv = sum(work_seconds(scaled(pace, rate(pace, d, own)), w, tokens, invariant=pace.inv is not None)
                  for d in dtypes if d != "float64") if dtypes else \
            work_seconds(pace, w, tokens, invariant=pace.inv is not None)
        phases.append(Phase("proof", inv * fix["proof"], maybe=True))
    basis = "from this machine's measured pace" if measured else "not measured on this machine yet (a first guess)"
    return Estimate(tuple(phases), measured, basis, fix)


def record(key: str, view: str, est: Estimate, measured: dict[str, float]) -> None:
    """Refine the pace by a finished run: per phase, measured against the uncorrected estimate (the estimate's own
    corrections, `Estimate.fix`, taken out: another run may have refined the store since this one started), kept as
    the geometric mean with what the store holds, so the next run of `view` on this model starts from what this one
    did. measured: seconds by phase name. A run that waited for another or shared the machine with another run on the
    model must not be recorded (the caller knows: pages/runner)."""
    pace = load_pace(key)
    if pace is None:
        return
    fix = dict(pace.fix.get(view, {}))
    for p in est.phases:
        got = measured.get(p.name)
        if got is None or p.seconds <= 0 or got <= 0:
            continue
        if p.name == "load":
            pace.load_s = float(got)
            continue
        used = est.fix.get(p.name, 1.0) or 1.0
        ratio = got / (p.seconds / used)  # against the uncorrected estimate
        fix[p.name] = math.sqrt(fix[p.name] * ratio) if p.name in fix else ratio
    pace.fix[view] = fix
    save_pace(key, pace)


def prior(w: Workload, tokens: int, params: int, *, dtype: str = "float32", invariant: bool = False,
          load_bytes: int = 0) -> Estimate:
    """An estimate before anything was measured for this model here (the CLI's --plan of a first run): a forward
    as 2 flops per parameter per token at 5 Gflop/s, loading at LOAD_PRIOR_S_PER_GB. Said as a first guess."""
    a = 2.0 * max(params, 1) / 5e9
    pace = Pace(0.01, a, 0.0, params=int(params or 0), load_gb_s=LOAD_PRIOR_S_PER_GB)
    load = load_bytes / 1e9 * LOAD_PRIOR_S_PER_GB if load_bytes else None
    return estimate(pace, w, tokens, dtype=dtype, invariant=invariant, load_s=load, measured=False)


def for_model(lm, w: Workload, tokens: int, view: str = "", invariant: bool = False) -> Estimate:
    """The estimate for a run on the loaded model `lm` (calibrated now where this machine has not measured it)."""
    proof = bool(w.prove and w.proves and not invariant)
    pace = calibrate(lm, invariant=proof)

    def loaded(copy: str) -> bool:  # a twin or another attention's copy loaded already costs nothing
        dtype, _, attention = copy.partition("@")
        try:
            return lm.has_copy(dtype or None, attention or None)
        except Exception:  # noqa: BLE001 - a copy this model cannot have (a dtype its device lacks): not loaded
            return False
    return estimate(pace, w, tokens, view=view, dtype=str(lm.dtype), invariant=invariant, loaded=loaded)


def for_plan(spec, dtype: str, device, w: Workload, tokens: int, view: str = "", invariant: bool = False,
             params: int = 0, load_bytes: int = 0) -> Estimate:
    """The estimate before loading (the CLI's --plan): from the stored pace where this machine measured the model,
    else a first guess from its size."""
    pace = load_pace(key_of(spec, dtype, device))
    if pace is None:
        return prior(w, tokens, params, dtype=dtype, invariant=invariant, load_bytes=load_bytes)
    return estimate(pace, w, tokens, view=view, dtype=dtype, invariant=invariant, load_s=pace.load_s)


def tokens_of(lm, w: Workload) -> int:
    """The input tokens of workload `w` for the loaded model's tokenizer (the longest text, its continuation, its
    left padding; a workload that names its token count: that), without the new tokens (the estimate adds them)."""
    if w.tokens:
        return max(1, int(w.tokens) - int(w.new_tokens or 0))
    tok = lm.tokenizer

    def count(text: str) -> int:
        try:
            return len(tok(text)["input_ids"])
        except Exception:  # noqa: BLE001 - a tokenizer that cannot say: a bound (UTF-8 bytes + 2)
            return len(text.encode("utf-8")) + 2

    n = max([count(t) for t in w.texts if t] or [32])
    if w.continuations:
        n += max(count(c) for c in w.continuations)
    return n + int(w.left_pad or 0)


class PhaseClock:
    """Times a run's phases as it names them (RunContext.on_phase): measured() -> seconds by phase name. clock:
    time.perf_counter (a test's fake clock)."""

    def __init__(self, clock=time.perf_counter, t0: float | None = None):
        self.clock = clock
        self.t0 = clock() if t0 is None else t0
        self.marks: list[tuple[str, float]] = []

    def __call__(self, name: str) -> None:
        self.marks.append((name, self.clock()))

    def measured(self) -> dict[str, float]:
        end = self.clock()
        marks = self.marks or [("run", self.t0)]
        out: dict[str, float] = {}
        for (name, t), nxt in zip(marks, [m[1] for m in marks[1:]] + [end]):
            out[name] = out.get(name, 0.0) + (nxt - t)
        if self.marks:  # before the first named phase: part of the run
            out["run"] = out.get("run", 0.0) + (self.marks[0][1] - self.t0)
        return out
