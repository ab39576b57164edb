"""Memory plans: what a run will hold, against what the device has free, before anything is loaded.

`plan_run(spec, dtype, device, view, tokens=..)` reads the model's shape from its files (config.json and the
safetensors headers, or the GGUF header; nothing is loaded) and estimates, in bytes:

* weights     the model in the run's dtype;
* reference   the float64 reference: a full twin (8 bytes a parameter) or the streamed reference (the largest
              tensor in float64, plus that tensor read from the checkpoint where the run's dtype rounds it);
* activations one forward's working set and the hidden states / logits a view keeps while it compares them;
* cache       the KV cache of the longest sequence (the run's dtype and float64);
* kept        the results the view holds (per-layer, per-position metrics);
* runtime     the Python/torch process itself on the CPU (measured when this module is imported, plus what a run
              adds to it: `process_runtime_bytes`); on CUDA the cuBLAS/cuBLASLt workspaces torch takes from
              its caching allocator (counted in `max_memory_allocated`).

against what is free: CUDA `torch.cuda.mem_get_info`; CPU: MemAvailable, lowered by a cgroup memory limit and by
RLIMIT_AS (address space left). A run whose total is over what is free is refused in one line naming what to lower
(`MemoryPlan.refusal()`), before loading. Every JSON result carries the plan under `memory_plan`, with the measured
peak beside the estimate (`measured_peak`).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import transformers
from huggingface_hub import snapshot_download

from .errors import KvvizError
from .inputs import MAX_PROMPT_CHARS, Workload  # noqa: F401 - Workload is part of this module's API
from .float64 import PROBE_SLAB, REFERENCE_CHUNK_BYTES, gives_freed_memory_back
from .dtypes import dtype_name, exact_in, parse_dtype, resolve_device
from . import metrics  # LOGITS_CHUNK_BYTES read at call time (tests and benches lower it)
from ..models.loading import converted_gguf_folder, default_gguf_path, parse_spec, tiny_folder

GB = 1024 ** 3
TWIN_MAX_BYTES = int(1.5 * GB)  # a full float64 twin up to this size is kept when memory allows (it runs faster)
# The process itself on the CPU: what it held when this module was imported (measured), plus RUNTIME_GROWTH for what
# a run adds besides the parts the plan models (model code, tokenizer library, allocator arenas and thread pools):
# 0.18-0.45 GB measured (docs/benchmarks.md): the largest of them (0.5 GiB planned the default model's float32
# greedy 1.28x its peak). RUNTIME_BYTES where the process's size cannot be read.
RUNTIME_BYTES = int(0.8 * GB)
RUNTIME_GROWTH = int(0.45 * GB)
# Of RUNTIME_GROWTH, what the process has grown by while the model loads (before any forward, the run's arenas and
# thread pools): measured 0.10 GiB (Gemma 3 270M's float32 checkpoint loaded in bfloat16: VmHWM 1.84 GiB = 0.24 at
# import + 1.0 read + 0.5 converted + 0.10) and 0.14 GiB (the default model, 1.13 GiB in bfloat16)
LOAD_GROWTH = int(0.25 * GB)
# cuBLAS and cuBLASLt workspaces on a GPU (32 MiB each on Hopper), taken from torch's caching allocator
CUDA_RUNTIME_BYTES = 64 * 1024 ** 2
# the tokenizer's tables (tokenizers' vocabulary, merges and caches), resident on the CPU: about 10 times its files
# (Gemma 3's 33 MB tokenizer.json: 0.32 GB), or, where there are no files yet (a GGUF not converted), 1.2 KB a
# vocabulary entry (0.31 GB for those 262k entries); measured with tokenizers on Linux
TOKENIZER_FILE_FACTOR = 10
TOKENIZER_BYTES_PER_ENTRY = 1200
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "spiece.model", "vocab.txt")
BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}



# ----------------------------------------------------------------------------------------------------------------
# The model's shape, from its files


@dataclass
class ModelShape:
    params: int
    layers: int
    hidden: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    largest: int  # elements of the largest tensor
    checkpoint_dtype: str | None = None
    sliding_window: int | None = None
    source: str = ""
    tokenizer_bytes: int = 0  # its tokenizer's tables, resident (TOKENIZER_FILE_FACTOR)

    @classmethod
    def from_config(cls, cfg: dict, params: int | None = None, largest: int | None = None,
                    checkpoint_dtype: str | None = None, source: str = "") -> "ModelShape":
        cfg = cfg.get("text_config") or cfg
        L = int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or 0)
        h = int(cfg.get("hidden_size") or cfg.get("n_embd") or 0)
        v = int(cfg.get("vocab_size") or 0)
        heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 1)
        kv = int(cfg.get("num_key_value_heads") or heads)
        hd = int(cfg.get("head_dim") or (h // heads if heads else 0))
        inter = int(cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * h)
        if params is None:  # no headers: the usual decoder count
            params = L * (h * hd * (heads + 2 * kv) + heads * hd * h + 3 * h * inter) + v * h * (
                1 if cfg.get("tie_word_embeddings", True) else 2)
        return cls(params=int(params), layers=L, hidden=h, vocab=v, intermediate=inter, heads=heads, kv_heads=kv,
                   head_dim=hd, largest=int(largest or max(v * h, inter * h)), checkpoint_dtype=checkpoint_dtype,
                   sliding_window=cfg.get("sliding_window"), source=source)


def _safetensors_stats(folder: Path) -> tuple[int, int, str | None] | None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    n, largest, dtypes = 0, 0, {}
    for f in files:
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            k = math.prod(meta["shape"])
            n += k
            largest = max(largest, k)
            dt = _ST_DTYPES.get(meta["dtype"])
            if dt:
                dtypes[dt] = dtypes.get(dt, 0) + k
    return n, largest, (max(dtypes, key=dtypes.get) if dtypes else None)


def shape_of_folder(folder: Path) -> ModelShape | None:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None  # loading says what is wrong with the folder
    shape = ModelShape.from_config(cfg, *(_safetensors_stats(folder) or ()), source=str(folder))
    shape.tokenizer_bytes = TOKENIZER_FILE_FACTOR * sum((folder / f).stat().st_size for f in TOKENIZER_FILES
                                                        if (folder / f).is_file())
    return shape


def _shape_of_gguf(path: Path) -> ModelShape:
    import gguf  # here, not at the top: 0.35-0.5 s of `import kvviz`'s ~4 s, and only GGUF files need it

    r = gguf.GGUFReader(str(path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def num(key, default=0):
        f = r.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else default

    n = sum(int(t.n_elements) for t in r.tensors)
    largest = max(int(t.n_elements) for t in r.tensors)
    vocab_field = r.fields.get("tokenizer.ggml.tokens")
    cfg = dict(num_hidden_layers=num("block_count"), hidden_size=num("embedding_length"),
               intermediate_size=num("feed_forward_length"), num_attention_heads=num("attention.head_count", 1),
               num_key_value_heads=num("attention.head_count_kv") or None,
               vocab_size=len(vocab_field.data) if vocab_field is not None else 0)
    shape = ModelShape.from_config(cfg, n, largest, "float32", source=str(path))
    shape.tokenizer_bytes = TOKENIZER_BYTES_PER_ENTRY * shape.vocab
    return shape


def model_shape(spec) -> ModelShape | None:
    """The shape of the model a spec names, from its files only (None: a hub model not in the local cache)."""
    ms = parse_spec(spec)
    try:
        if ms.kind == "tiny":
            return shape_of_folder(tiny_folder(ms.ref))
        if ms.kind == "folder":
            return shape_of_folder(Path(ms.ref))
        if ms.kind in ("default", "gguf"):
            path = default_gguf_path() if ms.kind == "default" else Path(ms.ref)
            converted = converted_gguf_folder(path)  # this very file's conversion (another version's is not it)
            if (converted / "kvviz.json").is_file():
                return shape_of_folder(converted)
            return _shape_of_gguf(path)
        # a hub id: only what is already in the local cache
        return shape_of_folder(Path(snapshot_download(ms.ref, local_files_only=True)))
    except Exception:  # noqa: BLE001 - unreadable files, a hub model not cached: loading reports them in its own words
        return None


# ----------------------------------------------------------------------------------------------------------------
# What is free


def _cgroup_free() -> int | None:
    for limit_f, used_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                            ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                             "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = Path(limit_f).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                return None
            return int(raw) - int(Path(used_f).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def _address_space_left() -> int | None:
    try:
        import resource  # POSIX only: no address-space limit to read elsewhere (Windows)
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    size = _status_bytes("VmSize")
    return soft if size is None else soft - size


def free_bytes(device: "torch.device | str") -> tuple[int | None, str]:
    """(bytes free for this run, where the number comes from)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free), "torch.cuda.mem_get_info"
    found = [(n, src) for n, src in ((_proc_bytes("/proc/meminfo", "MemAvailable"), "MemAvailable"),
                                     (_cgroup_free(), "cgroup memory limit"),
                                     (_address_space_left(), "RLIMIT_AS (address space left)")) if n is not None]
    return min(found) if found else (None, "unknown")


def measured_peak(device: "torch.device | str") -> int | None:
    """Peak memory measured so far: CUDA max allocated on a GPU, peak RSS of this process on the CPU (None where
    neither /proc nor `resource` can say)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    return _peak_rss()


def reset_peak(device: "torch.device | str") -> int | None:
    """Start measuring a run's peak afresh in a process that ran other work before (a page in the app's server):
    CUDA's peak statistics, or on Linux the process's peak RSS (writing 5 to /proc/self/clear_refs). Returns what
    the process holds now (the baseline the run's own peak is measured above), None where the peak cannot be reset."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        return int(torch.cuda.memory_allocated(dev))
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return None
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int | None:
    """A size field of /proc/self/status (VmRSS, VmHWM) in bytes; None where there is no such file."""
    return _proc_bytes("/proc/self/status", field)


def _proc_bytes(path: str, field: str) -> int | None:
    """A "field: N kB" line of a /proc file in bytes; None where there is no such file or line."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


_PROCESS_AT_IMPORT = _status_bytes("VmRSS")


def process_runtime_bytes() -> int:
    """The plan's runtime part on the CPU: this process as it was when kvviz.core.memory was imported, plus what a run
    adds to it besides the model (RUNTIME_GROWTH); RUNTIME_BYTES where /proc/self/status cannot be read."""
    return RUNTIME_BYTES if _PROCESS_AT_IMPORT is None else _PROCESS_AT_IMPORT + RUNTIME_GROWTH


def _peak_rss() -> int | None:
    """This process's peak RSS: VmHWM of /proc/self/status where there is one (it starts afresh at exec), else
    ru_maxrss (on Linux ru_maxrss also counts the forking parent's pages before exec: a run started from a big
    process would report the parent's size)."""
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    try:
        import resource  # POSIX only
    except ImportError:
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ----------------------------------------------------------------------------------------------------------------
# The plan


@dataclass
class MemoryPlan:
    model: str
    view: str
    dtype: str
    device: str
    tokens: int
    batch: int
    weights: int
    reference: str
    reference_bytes: int
    activations: int
    cache: int
    kept: int
    runtime: int
    available: int | None
    available_from: str
    extra_models: int = 0  # other dtypes' copies (the dtype sweep)
    measured_peak: int | None = None
    notes: list[str] = field(default_factory=list)
    # where the run shared its process with earlier work (a page in the app's server): what the process held when
    # the run started (its models, earlier results); the plan then allows that plus the run's parts
    peak_baseline: int | None = None
    # the parts of a run that reruns in float64 only where its cached path differs from the full forward (Split
    # point: kvviz.views.split.run.run_split), for a run where they came out bit for bit equal: no float64 phase.
    # The plan before the run counts the rerun (it may happen); `settle` applies these after a run that had none.
    if_identical: dict | None = None
    # the parts of a study whose prompts parted but that ran no invariant-mode proof (--no-proof): the proof's phase
    # dropped (`settle`, by the result's proof_s; not for a study run in invariant mode throughout, whose first
    # forward probes the kernels)
    if_unproved: dict | None = None

    @property
    def total(self) -> int:
        return (self.weights + self.extra_models + self.reference_bytes + self.activations + self.cache + self.kept
                + self.runtime)

    @property
    def fits(self) -> bool:
        return self.available is None or self.total <= self.available

    def parts(self) -> dict[str, int]:
        return {"weights": self.weights, "other dtypes": self.extra_models,
                f"float64 reference ({self.reference})": self.reference_bytes, "activations": self.activations,
                "KV cache": self.cache, "kept results": self.kept, "runtime": self.runtime}

    def advice(self) -> str:
        """What to lower, biggest part first."""
        parts = {k: v for k, v in self.parts().items() if k != "runtime"}  # the process itself: nothing to lower
        big = max(parts, key=parts.get)
        if big in ("activations", "KV cache", "kept results"):
            what = "fewer tokens (a shorter prompt or fewer new tokens)" + (
                ", fewer prompts" if profile(self.view).many_prompts else "") + (", a smaller batch" if self.batch > 1 else "")
        elif big == "other dtypes":
            what = "fewer dtypes"
        else:
            what = "a 16-bit dtype or a smaller model"
        return what + ("" if self.device.startswith("cuda") else ", or a device with more memory")

    def refusal(self) -> str:
        parts = ", ".join(f"{k} {_gb(v)}" for k, v in self.parts().items() if v)
        return (f"this {self.view} run needs about {_gb(self.total)} ({parts}) but only "
                f"{_gb(self.available)} is free on {self.device} ({self.available_from}); lower: {self.advice()}")

    def lines(self) -> list[str]:
        out = [f"memory plan: {self.view} on {self.model}, {self.dtype} on {self.device}, {self.tokens} tokens"
               + (f" × batch {self.batch}" if self.batch > 1 else "")]
        out += [f"  {k:<32}{_gb(v):>10}" for k, v in self.parts().items() if v]
        out.append(f"  {'total':<32}{_gb(self.total):>10}")
        out.append(f"  {'free (' + self.available_from + ')':<32}{_gb(self.available):>10}")
        if self.measured_peak is not None:
            out.append(f"  {'measured peak':<32}{_gb(self.measured_peak):>10}")
        out.append("  fits" if self.fits else "  does NOT fit: lower " + self.advice())
        out += [f"  note: {n}" for n in self.notes]
        over = self.over_plan()
        if over:
            out.append("  " + over)
        return out

    def allowed(self) -> int:
        """What the measured peak may reach: the plan's total; in a process that held more than the plan's runtime
        before the run (peak_baseline), that plus the run's own parts."""
        if self.peak_baseline is None:
            return self.total
        return max(self.total, self.peak_baseline + self.total - self.runtime)

    def over_plan(self) -> str | None:
        """One line for the user where the run's measured peak exceeded its plan (what it means for them, what to
        do), else None: nothing is said where the plan bounded the run."""
        if self.measured_peak is None or self.measured_peak <= self.allowed() + over_plan_slack(self.allowed()):
            return None
        peak, allowed = self.measured_peak, self.allowed()
        where = "GPU memory" if self.device.startswith("cuda") else "memory"
        held = "" if allowed == self.total else f" (with the {_gb(self.peak_baseline)} this app held before it)"
        return (f"memory: this run peaked at {_gb(peak)} of {where}, {100 * (peak / max(allowed, 1) - 1):.0f} % over "
                f"its plan of {_gb(allowed)}{held}. The result is not affected; but kvviz checks that a run fits "
                f"before starting it, and for this {self.view} run ({self.dtype}, {self.tokens} tokens) it guessed "
                f"low, so a longer one could run out of memory instead of being refused: keep about "
                f"{_gb(peak - allowed)} more free than the plan says for runs like it.")

    def settle(self, result) -> "MemoryPlan":
        """After the run: a run that reruns in float64 only where its cached path differs from the full forward
        (`if_identical`) and whose result has no float64 rerun (`result.float64` is None: the paths were bit for
        bit equal) is planned without that phase."""
        if self.if_identical is not None and result is not None and (
                getattr(result, "float64", True) is None or getattr(result, "reference_ran", True) is False):
            for part, value in self.if_identical.items():
                setattr(self, part, value)
            self.if_identical = None
            self.notes.append("no float64 rerun: " + profile(self.view).no_rerun)
        elif self.if_unproved is not None and result is not None and getattr(result, "proof_s", 0) is None and \
                not getattr(getattr(getattr(result, "settings", None), "execution", None), "invariant", False):
            for part, value in self.if_unproved.items():  # --no-proof: the probes' transient never came
                setattr(self, part, value)
            self.notes.append("no invariant-mode proof ran")
        if result is not None:
            self.if_unproved = None
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(total=self.total, fits=self.fits, total_gib=round(self.total / GB, 3),
                 measured_peak_gib=None if self.measured_peak is None else round(self.measured_peak / GB, 3),
                 over_plan=self.over_plan())
        return d

    def with_peak(self, result=None) -> "MemoryPlan":
        """The measured peak, after the run; with its result, the plan settled first (`settle`)."""
        self.settle(result)
        self.measured_peak = measured_peak(self.device)
        return self


def over_plan_slack(allowed: int) -> int:
    """How far a measured peak may pass its plan before the over-plan line speaks: the larger of 32 MiB and 1 % (a
    peak RSS moves by pages and allocator arenas between runs; a plan that is really low misses by far more)."""
    return max(32 * 1024 ** 2, allowed // 100)


def _gb(n: int | None) -> str:
    if n is None:
        return "unknown"
    return f"{n / GB:.2f} GiB" if n >= 0.01 * GB else f"{n / 1024 ** 2:.1f} MiB"


def stream_keep_bytes(params: int) -> int:
    """How many bytes of upcast weights the streamed reference keeps for the rest of a run: all of them for a model
    whose float64 copy is small (<= TWIN_MAX_BYTES: each weight is then upcast once a run instead of once a forward,
    as fast as the twin), none for a larger one (the point of streaming: no float64 copy of a big model)."""
    return 8 * params if 8 * params <= TWIN_MAX_BYTES else 0


def reference_bytes(shape: ModelShape, dtype: str, strategy: str) -> int:
    if dtype == "float64":
        return 0
    if strategy == "twin":
        return 8 * shape.params
    if stream_keep_bytes(shape.params):
        return stream_keep_bytes(shape.params)

    # the largest tensor in float64 (a big head is applied in slices of REFERENCE_CHUNK_BYTES), plus, where the run's dtype
    # rounds the checkpoint, what is read of it from the checkpoint in its own dtype: one slice of rows (an embedding
    # reads only the looked-up rows; kvviz.core.reference.CheckpointReader reads into memory, the file is not mapped)
    biggest = min(8 * shape.largest, REFERENCE_CHUNK_BYTES + 8 * max(shape.hidden, 1) * 2)
    read = min(shape.largest, REFERENCE_CHUNK_BYTES // 8 + max(shape.hidden, 1)) * BYTES.get(
        shape.checkpoint_dtype or dtype, 4)

    lossy = shape.checkpoint_dtype and not exact_in(parse_dtype(shape.checkpoint_dtype), parse_dtype(dtype))
    return biggest + (read if lossy else 0)


@dataclass(frozen=True)
class MemoryProfile:
    """What kvviz.core.memory counts for a run of a view besides the weights: the generic traits of its forwards (the
    fields), and the view's own knowledge where it holds something of its own. A view declares its profile in its
    entry (View(memory=...)); a view whose runs hold more than a forward and its reference subclasses this class in
    its own folder (kvviz/views/<view>/memory.py: Padding and batching's batch grid, Serving's engine calls, the
    bisector's record, the card's window) and overrides the methods below; this module keeps the arithmetic
    (working_bytes, cache_bytes, decoding_bytes, paged_study_bytes, ...) and the plan (plan_workload, plan_shape)."""
    forwards: int = 1  # forwards' worth of (all hidden states + logits) kept when hidden states are not streamed
    streamed_hidden: bool = True  # hidden states handed over layer by layer (kvviz.core.streaming)
    reference: bool = True  # runs the float64 reference (below float64)
    float64_only: bool = False  # every run is on the float64 reference (the model in its dtype does not run)
    batch: int = 1  # rows in a batch
    batch_from_workload: bool = False  # the batch and token count are the run's own (the cache sizes)
    compared_after_split: bool = False  # compares only the positions after the split point
    weight_copies: bool = False  # quantizing weights deep-copies the model first
    many_prompts: bool = False  # runs a set of prompts (fewer prompts is a way to fit)
    # proves a precision verdict by rerunning in invariant mode, whose first forward probes the kernels
    # (invariant_probe_bytes): never declared, derived by the registry (kvviz.views.memory_profile) from the view's
    # float64 reference and its run's refusals (a view that runs the reference and does not refuse "prove")
    proves: bool = False

    # why a settled plan has no float64 rerun (MemoryPlan.settle)
    no_rerun: ClassVar[str] = "the cached path equalled the full forward bit for bit"

    @property
    def float64_run_is_reference(self) -> bool:
        """A float64 run is its own reference: it computes only the compared positions' logits (Split point)."""
        return self.compared_after_split

    @property
    def reruns_where_parted(self) -> bool:
        """It reruns in float64 only where its cached path is not bit for bit the full forward
        (kvviz.views.split.run.run_split: `main.has_cache and not main.identical`): the plan counts the rerun, and
        `settle` drops it after a run that had none."""
        return self.compared_after_split and not self.many_prompts

    @property
    def probes_in_first_forward(self) -> bool:
        """Its invariant-mode run probes the head's kernels in its first forward (Split point's: the prefix, one row
        of logits), before the full forward's logits exist: the probes are a phase of their own."""
        return self.reruns_where_parted

    @property
    def streamed_head_apart(self) -> bool:
        """The streamed reference's slices (the head's) are held after the last layer's working set was freed: the
        float64 phase holds the larger of them, not both."""
        return True

    def sizes(self, spec, w: Workload, tokens: int, batch: int, compared: int | None) -> tuple[int, int, int | None]:
        """The workload's longest sequence, batch and compared positions as this view runs them (plan_workload)."""
        return tokens, batch, compared

    def decoding(self, w: Workload) -> tuple[int | None, bool | None, int | None]:
        """(tokens each run decodes, whether the float64 reference decodes too, the decoding runs) of a view that
        decodes token by token (Decoding); all None for one that does not."""
        return None, None, None

    def engine(self, w: Workload) -> "PagedCalls | None":
        """The calls to a paged engine in kvviz's process of a study (paged_study_bytes); None: no such engine."""
        return None

    def caches(self, shape: "ModelShape", dtype: str, tokens: int, batch: int, reference: bool,
               reference_decodes: bool, run_only: int) -> "tuple[int, dict | None] | None":
        """(KV cache, the plan's parts where no float64 rerun came) of a view that holds its caches its own way;
        None: the run's cache and a spare copy, in its dtype and in float64 (cache_bytes)."""
        return None

    def activations(self, shape: "ModelShape", dtype: str, tokens: int, batch: int, reference: bool,
                    compared: int | None = None, steps: int | None = None, reference_decodes: bool = True,
                    runs: int | None = None, attention: str = "sdpa", device: str = "cpu") -> int:
        """The most its run holds at once besides weights and caches (activation_bytes); by default one forward at a
        time and what it keeps of its forwards (forward_bytes)."""
        return forward_bytes(self, shape, dtype, tokens, batch, reference, compared, attention, device)


@dataclass(frozen=True)
class Decoding(MemoryProfile):
    """A view that decodes token by token (kvviz.core.loops.decode): one forward's logits (every position's) at a
    time, each step's last row kept; `decoded_runs` runs' rows are kept at once (greedy: its default paths, or the
    paths a run names; reuse: its ways per continuation). decoding_bytes."""
    decoded_runs: int = 1
    # the float64 reference decodes (a full forward a step) only when the run's paths include this one; otherwise
    # it replays single steps, the last position's logits only (greedy); None: it decodes like the run (reuse)
    reference_decodes_with: str | None = None
    # KV caches of the longest sequence held at once, the run's and the float64 reference's never together (greedy:
    # one path's; reuse: the prefix's, the shared one and a continuation's); 0: the run's and a spare copy, in both
    cache_copies: int = 0

    no_rerun: ClassVar[str] = "no two paths parted, so none was replayed in float64"

    def decoding(self, w: Workload) -> tuple[int | None, bool | None, int | None]:
        steps = max(1, int(w.new_tokens or 0)) * max(1, len(w.continuations))  # every continuation's (reuse)
        reference_decodes = self.reference_decodes_with is None or self.reference_decodes_with in w.paths
        return steps, reference_decodes, (len(set(w.paths)) if w.paths else None)

    def caches(self, shape, dtype, tokens, batch, reference, reference_decodes, run_only):
        if not self.cache_copies:
            return None
        # its caches one phase at a time: the run's, then the float64 reference's
        per = 2 * shape.layers * shape.kv_heads * shape.head_dim * tokens * batch
        cache = self.cache_copies * per * max(BYTES[dtype], 8 if reference else 0)
        if_identical = None
        if reference and not reference_decodes:
            # Greedy paths without a float64 path builds its float64 reference only to replay a parting for its
            # verdict (kvviz.views.greedy.run: GreedyResult.reference_ran); `settle` drops it after a run without one
            if_identical = dict(reference="not run", reference_bytes=0, cache=self.cache_copies * per * BYTES[dtype],
                                activations=run_only)
        return cache, if_identical

    def activations(self, shape, dtype, tokens, batch, reference, compared=None, steps=None, reference_decodes=True,
                    runs=None, attention="sdpa", device="cpu") -> int:
        return decoding_bytes(shape, dtype, tokens, runs or self.decoded_runs, steps, reference, reference_decodes)


def _twin_or_streamed(params: int, free: int | None, others: int = 0) -> str:
    """'twin' where a float64 copy is small and fits easily beside the rest, 'streamed' otherwise."""
    twin = 8 * params
    if twin > TWIN_MAX_BYTES:
        return "streamed"
    return "twin" if free is None or twin + others <= free // 2 else "streamed"


# name -> MemoryProfile: the view registry's lookup, registered by kvviz/__init__.py (memory never imports the views)
_profiles = None


def register_profiles(lookup) -> None:
    """Where the plan finds a view's MemoryProfile by its name (kvviz.views.memory_profile)."""
    global _profiles
    _profiles = lookup


def profile(view: str) -> "MemoryProfile":
    """What the plan counts for a view: its registry entry's MemoryProfile (kvviz/views/<view>/__init__.py)."""
    if _profiles is None:
        raise KvvizError("no view registry: import kvviz (it registers the views' memory profiles)")
    return _profiles(view)


# float64 temporaries of one chunk of positions in kvviz.core.metrics.logits_divergence (both inputs upcast, two
# log-softmaxes, exp, difference, product), each LOGITS_CHUNK_BYTES; float64 inputs are not copied (two fewer)
LOGITS_TEMPORARIES = 7


def comparison_temporaries(width: int, rows_bytes: int) -> int:
    """The float64 temporaries of logits_divergence over logits of `width` bytes per number whose compared rows take
    `rows_bytes` in float64: one chunk of LOGITS_CHUNK_BYTES at a time (or all the rows where they are less)."""
    return (LOGITS_TEMPORARIES - (2 if width == 8 else 0)) * min(metrics.LOGITS_CHUNK_BYTES, rows_bytes)
# float64 full-forward logits over this are computed a chunk of rows at a time (kvviz.views.split.run uses REFERENCE_LOGITS_BYTES)
REFERENCE_LOGITS_BYTES = 128 * 1024 ** 2


def activation_bytes(shape: ModelShape, dtype: str, tokens: int, batch: int, view: str, reference: bool,
                     compared: int | None = None, steps: int | None = None, reference_decodes: bool = True,
                     runs: int | None = None, attention: str = "sdpa", device: str = "cpu") -> int:
    """The most a run holds at once besides weights and caches: the largest of its phases (the run in its own
    dtype; its float64 reference), each one forward's working set plus what the view keeps of its forwards, as the
    views hold them now:

    * the run in its dtype: the user's full forward with every position's logits and the compared rows copied out
      of them, or, later, the compared rows' logits of both paths and the float64 temporaries of one chunk of the
      logits comparison (the full logits are freed by then); and the hidden states (one path's compared rows and two
      layers where they are reduced layer by layer; every layer of two forwards otherwise);
    * float64: only the compared positions' logits (logits_to_keep; prefixes keep one row), for both paths, and
      the same comparison temporaries - or, where the reference is compared token by token (the cache-safety
      card's window check), stepwise_reference_bytes; the streamed reference's weight slices are in
      `reference_bytes`.

    A view that holds its own (decoding views, the padding grid, the bisector) says so in its profile
    (MemoryProfile.activations: decoding_bytes, kvviz/views/padding/memory.py, kvviz/views/bisect/memory.py).

    compared: positions compared (split: the tokens after the split point); None: every token. steps: tokens each
    decoding run decodes (None: every token, a bound); reference_decodes: the float64 reference decodes too (greedy's
    float64 path) rather than replaying single steps; runs: the decoding runs (greedy's paths; None: the view's
    default). attention, device: the attention kernel's score workspace (score_bytes; Split point's phases)."""
    return profile(view).activations(shape, dtype, tokens, batch, reference, compared, steps, reference_decodes, runs,
                                     attention, device)


def forward_bytes(prof: MemoryProfile, shape: ModelShape, dtype: str, tokens: int, batch: int, reference: bool,
                  compared: int | None = None, attention: str = "sdpa", device: str = "cpu") -> int:
    """activation_bytes of a view that runs forwards and compares them (the default MemoryProfile.activations)."""
    b = BYTES[dtype]
    T, B, V = tokens, batch, shape.vocab
    n = max(1, min(compared or T, T))

    def temps(width: int) -> int:  # one chunk of the comparison's float64 temporaries
        return comparison_temporaries(width, B * n * V * 8)

    def working(width: int) -> int:  # one layer of one forward: MLP and attention scores
        return working_bytes(shape, width, T, B, attention, device)

    def hidden(width: int) -> int:
        return hidden_bytes(prof, shape, width, T, B, n)

    logits64 = 2 * B * n * V * 8
    if device.startswith("cpu") and gives_freed_memory_back():
        # the second path's forward beside the first path's logits, then the comparison (no forward's working set
        # left by then: a long float64 forward's freed blocks are given back between its layers,
        # kvviz.core.float64.released_between_layers)
        ref = max(working(8) + B * n * V * 8, logits64 + temps(8)) + hidden(8)
    else:  # CUDA's caching allocator keeps a forward's freed blocks reserved, and an allocator that cannot give them
        # back (not glibc) keeps them in the process: a forward's working set stays beside the comparison
        ref = working(8) + logits64 + temps(8) + hidden(8)
    if dtype == "float64" and prof.float64_run_is_reference:
        run = ref  # a float64 run is its own reference: only the compared positions' logits (kvviz.views.split.run)
    else:  # the full forward (its working set, every position's logits, the compared rows copied out of them),
        # then the comparison (no forward's working set left by then)
        run = max(working(b) + B * T * V * b + B * n * V * b, 2 * B * n * V * b + temps(b)) + hidden(b)
    if prof.float64_only:  # every run of the view is on the float64 reference (a float64 run: the model itself)
        return int(ref) if reference or dtype == "float64" else 0
    if not reference:
        return int(run)
    return int(max(run, ref))


def hidden_bytes(prof: MemoryProfile, shape: ModelShape, width: int, tokens: int, batch: int, compared: int) -> int:
    """The hidden states a run keeps: one path's compared rows and two layers where they are reduced layer by layer
    (streamed_hidden), else every layer of its forwards."""
    T, B, H, L = tokens, batch, shape.hidden, shape.layers
    if prof.streamed_hidden:
        return B * compared * (L + 1) * H * width + 2 * B * T * H * width
    return prof.forwards * B * T * (L + 1) * H * width


def stepwise_reference_bytes(shape: ModelShape, tokens: int, compared: int, batch: int = 1) -> int:
    """What the float64 reference compared token by token holds besides one forward's working set and the hidden
    states (kvviz.views.split.run: the cache-safety card's window check):

    * its logits: the last chunk of compared rows (from the full forward) and the chunk being compared (each chunk a
      forward over the sequence so far with logits_to_keep rows; REFERENCE_LOGITS_BYTES, or all n rows where they
      fit), beside one step's row and the comparison's float64 temporaries of that one row;
    * the allocator's residue of the full forward before the step loop: its working set and one chunk of logits rows
      stay in the process (freed, not given back; `malloc_trim` returns a tenth of it), so the step loop's
      forwards are allocated beside them (measured: docs/benchmarks.md, "The card phase by phase")."""
    V, B = shape.vocab, batch
    chunk = min(REFERENCE_LOGITS_BYTES, B * compared * V * 8)
    row = B * V * 8
    logits = 2 * chunk + row + comparison_temporaries(8, row)
    residue = working_bytes(shape, 8, tokens, B) + chunk
    return int(logits + residue)


def score_bytes(width: int, attention: str = "sdpa", device: str = "cpu") -> int:
    """Bytes held at once per element of one layer's attention scores [batch, heads, q, k] (an element of the
    causal mask [batch, 1, q, k] comes on top where they are materialised: attention_bytes):

    * eager attention (transformers' eager_attention_forward) materialises the scores, their masked copy, a
      float32 softmax and its cast back, beside the causal mask: 2.5 score tensors (at least float32; measured op by
      op: tests/test_memory_views.py);
    * SDPA's math fallback (CUDA in float64: no fused kernel for it) the scores and their softmax: 2 * width;
    * a fused SDPA kernel (the CPU's flash kernel in any dtype, CUDA's in 16/32-bit) holds none; the plan keeps one
      score tensor (at least float32) as the bound for a kernel it cannot see."""
    if attention == "eager":
        return 5 * max(width, 4) // 2
    if device.startswith("cuda") and width == 8:
        return 2 * width
    return max(width, 4)


def attention_bytes(shape: ModelShape, width: int, tokens: int, batch: int = 1, attention: str = "sdpa",
                    device: str = "cpu") -> int:
    """One layer's attention scores over `tokens` queries and keys (score_bytes an element), and where they are
    materialised (eager, SDPA's math fallback) the causal mask beside them in the forward's dtype."""
    T, B = tokens, batch
    per = score_bytes(width, attention, device)
    mask = B * T * T * width if attention != "eager" and per > max(width, 4) else 0  # eager's: in its 2.5 tensors
    return B * shape.heads * T * T * per + mask


def working_bytes(shape: ModelShape, width: int, tokens: int, batch: int = 1, attention: str = "sdpa",
                  device: str = "cpu") -> int:
    """One layer of one forward over `tokens` positions: its MLP and attention working set, and the attention
    scores against every key (attention_bytes: what the attention kernel materialises)."""
    T, B = tokens, batch
    return B * T * (3 * shape.intermediate + 4 * shape.hidden) * width + attention_bytes(shape, width, T, B,
                                                                                        attention, device)


def head_slice_bytes(shape: ModelShape, rows: int) -> int:
    """The streamed float64 reference applies a head over REFERENCE_CHUNK_BYTES in slices of output features: the
    output of one slice over `rows` positions, beside the logits it is copied into (kvviz.core.reference)."""
    if 8 * shape.vocab * shape.hidden <= REFERENCE_CHUNK_BYTES:
        return 0
    return rows * max(1, REFERENCE_CHUNK_BYTES // (8 * max(shape.hidden, 1))) * 8


def decoding_bytes(shape: ModelShape, dtype: str, tokens: int, runs: int, steps: int | None, reference: bool,
                   reference_decodes: bool = True) -> int:
    """A view that decodes token by token (greedy paths, prompt-cache reuse; kvviz.core.loops.decode), for `runs` runs
    of `steps` tokens, the largest of its phases:

    * decoding: one forward at a time over the sequence so far, with every position's logits (the user's forward;
      the last call's are freed before the next call), beside the step rows kept so far (each step's last row);
    * comparing: every run's step rows, in the run's dtype and upcast to float64 (their log-softmaxes, kept), and
      one comparison's float64 temporaries (both sides upcast, difference, exp, product);
    * the float64 reference, beside those rows: it decodes the same way (reference_decodes) or replays single
      steps with the last position's logits only (greedy's verdicts)."""
    b, T, V = BYTES[dtype], tokens, shape.vocab
    k = max(1, min(T, T if steps is None else steps))
    rows = runs * k * V  # every run's step rows
    decoding = working_bytes(shape, b, T) + T * V * b + rows * b
    comparing = rows * (b + 8) + 5 * k * V * 8
    if not reference:
        return int(max(decoding, comparing))
    full = T if reference_decodes else 1
    ref = rows * (b + 8) + working_bytes(shape, 8, T) + full * V * 8 + head_slice_bytes(shape, full)
    return int(max(decoding, comparing, ref))


def fits_beside(lm, view: str, tokens: int, compared: int | None = None) -> bool:
    """Whether a run of `view` on the loaded model `lm` fits in what is free now, beside the model (an optional step
    of another run, e.g. the bisector a split runs where its proof fails: it runs only where it fits)."""
    cfg = lm.model.config.get_text_config().to_dict()
    sizes = [p.numel() for p in lm.model.parameters()]
    shape = ModelShape.from_config(cfg, sum(sizes), max(sizes))
    dt = dtype_name(lm.dtype)
    need = activation_bytes(shape, dt, tokens, 1, view, False, compared) + cache_bytes(shape, dt, tokens, 1, False)
    free, _ = free_bytes(lm.device)
    return free is None or need <= free


def cache_bytes(shape: ModelShape, dtype: str, tokens: int, batch: int, reference: bool) -> int:
    per = 2 * shape.layers * shape.kv_heads * shape.head_dim * tokens * batch
    return int(per * BYTES[dtype] * 2 + (per * 8 * 2 if reference else 0))  # the cached path and a spare copy


# transformers' continuous batching as kvviz drives it: kvviz.engines.serving.TransformersEngine sizes each call's
# engine with paged_blocks and paged_batch_tokens, and the plan counts what those sizes allocate (paged_call_bytes)
PAGE_SIZE = 8  # tokens per cache page where the run names none


def paged_blocks(longest: int, requests: int, page_size: int) -> int:
    """Cache pages one engine call asks for: the longest request (prompt and new tokens) in whole pages and one
    more, for every request and two spare, and 8 more."""
    return (-(-longest // page_size) + 1) * (requests + 2) + 8


def paged_batch_tokens(longest: int, in_flight: int) -> int:
    """The most tokens one batch of the engine takes (its max_batch_tokens): every request in flight at its
    longest, at least 64."""
    return max(64, in_flight * longest)


def paged_call_bytes(shape: ModelShape, width: int, longest: int, requests: int, in_flight: int,
                     page_size: int, attention: str = "sdpa", device: str = "cpu") -> tuple[int, int]:
    """(paged cache, the rest) one engine call holds at once, the model in `width` bytes a number (transformers
    5.2x's PagedAttentionCache and ContinuousBatchingIOs, allocated when the call starts, freed when it ends):

    * the cache: paged_blocks pages of page_size tokens, K and V of every layer (kv_heads x head_dim), and the two
      spare ("trash") pages it keeps in front;
    * the attention mask [max_batch_tokens, cache tokens + max_batch_tokens] in the model's dtype (sdpa and eager
      need it; one for full attention and one for sliding-window layers), beside the read/write indices (int64);
    * one batch's forward over every request in flight at its longest: its MLP and projections' working set, the
      attention scores only where they are materialised (eager: paged|eager; CUDA's float64 math kernel: score_bytes)
      - the engine always passes its mask, and SDPA's fused kernels take one (bench/memory_bench.py serving); the K
      and V read back from the cache and
      repeated to every head; the logits of the last rows (logits_to_keep) in the model's dtype, their float32 copy
      (float64 kept: KeepFloat64) and kvviz's float64 copy of the sampled rows."""
    L, kv, hd, V = shape.layers, shape.kv_heads, shape.head_dim, shape.vocab
    blocks = paged_blocks(longest, requests, page_size)
    cache = (blocks + 2) * page_size * L * 2 * kv * hd * width
    M = paged_batch_tokens(longest, in_flight)
    read = blocks * page_size
    masks = (2 if shape.sliding_window else 1) * M * (read + M) * width + (read + 2 * M) * 8
    rows = min(requests, in_flight)
    q = rows * longest  # one batch's tokens: every request in flight at its longest
    materialised = attention == "eager" or score_bytes(width, attention, device) > max(width, 4)
    scores = attention_bytes(shape, width, q, 1, attention, device) if materialised else 0
    forward = (q * (3 * shape.intermediate + 4 * shape.hidden + (2 * shape.heads + kv) * hd) * width + scores
               + rows * V * (width + max(width, 4) + 8))
    return int(cache), int(masks + forward)


# kvviz.core.invariant's first run in a process probes the kernels of each weight's shape (linear_block): a copy of
# the weight's shape and dtype (its float64 values built PROBE_SLAB numbers at a time: two float64 slabs), the probe's
# rows (up to 256) times it held about three times over, and what the BLAS and the allocator keep around those first
# calls (PROBE_FIXED). The largest weight (the head) sets the transient (measured by shape: tests/test_memory_views.py).
# PROBE_FIXED: 131-171 MiB measured on a 16384 x 512 head (160 MiB planned at 64 MiB) over 12 processes on an AMD EPYC,
# 168 MiB in CI (the whole transient, the fixed part and the head's): 112 MiB keeps every one under the plan (208 MiB);
# the transient measured as low as 104 MiB in a loaded suite run.
PROBE_ROWS = 3 * 256
PROBE_FIXED = 112 * 1024 ** 2


def invariant_probe_bytes(shape: ModelShape, width: int) -> int:
    """The transient of invariant mode's kernel probes on the largest weight, the model in `width` bytes a number."""
    outputs = max(shape.vocab, shape.intermediate, shape.hidden)
    return (shape.largest * width + PROBE_ROWS * outputs * width + 2 * 8 * min(shape.largest, PROBE_SLAB)
            + PROBE_FIXED)


def paged_study_bytes(shape: ModelShape, dtype: str, tokens: int, steps: int | None,
                      calls: tuple[tuple[int, int], ...], replays: tuple[tuple[int, int], ...], page_size: int,
                      reference: bool, attention: str = "sdpa", device: str = "cpu",
                      proof: bool = False) -> tuple[int, int]:
    """(cache, activations) of a study through a paged engine (the calls its view declares: MemoryProfile.engine): the
    largest of its phases, one at a time (each engine call makes and destroys its own engine):

    * kvviz's reference of each prompt: greedy without cache, a full forward a step (decoding_bytes, one run);
    * each engine call (requests, requests in flight) in the run's dtype (paged_call_bytes);
    * where the float64 reference runs: a full forward over the sequence in float64 (the first divergence replayed,
      every position's logits), then the engine call of that one prompt (`replays`) on the float64 model, with
      every step's scores kept in float64 (at long prompts in batches this phase is the study's peak);
    * where the proof runs (`proof`: the parting conditions rerun in invariant mode, the reference first): the first
      invariant-mode forward's kernel probes (invariant_probe_bytes) within kvviz's reference loop; the engine calls
      in invariant mode hold what they hold in the run.

    Each engine call runs in the engine's own thread, beside the residue of the full forward before it (its working
    set, freed by kvviz's thread and kept by that thread's allocator arena; the engine's thread allocates from its
    own, as stepwise_reference_bytes counts for the card's step loop; bench/memory_bench.py serving)."""
    b, T, V = BYTES[dtype], tokens, shape.vocab
    n = max(1, min(T, T if steps is None else steps))
    residue = working_bytes(shape, b, T, 1, attention, device)
    phases = [(0, decoding_bytes(shape, dtype, T, 1, n, False))]
    phases += [(c, rest + residue) for c, rest in (paged_call_bytes(shape, b, T, r, k, page_size, attention, device)
                                                   for r, k in calls)]
    if reference:
        residue = working_bytes(shape, 8, T, 1, attention, device)
        phases.append((0, residue + T * V * 8 + head_slice_bytes(shape, T)))
        for r, k in replays:
            cache, rest = paged_call_bytes(shape, 8, T, r, k, page_size, attention, device)
            phases.append((cache, rest + residue + (n + 1) * V * 8))
        if proof:
            phases.append((0, invariant_probe_bytes(shape, b) + decoding_bytes(shape, dtype, T, 1, n, False)))
    return max(phases, key=sum)


def plan_run(spec, dtype: str, device, view: str, tokens: int = 32, batch: int = 1,
             dtypes: tuple[str, ...] = (), reference: str | None = None, compared: int | None = None,
             copies: int = 0, steps: int | None = None, reference_decodes: bool = True,
             runs: int | None = None, attention: str = "sdpa", engine: "PagedCalls | None" = None,
             invariant: bool = False, prove: bool = True) -> MemoryPlan:
    """The memory plan of one run, from the model's files (nothing loaded). compared: positions compared (split:
    the tokens after the split point; None: every token). copies: extra copies of the loaded model the run makes
    (weight quantization deep-copies the model before quantizing it). steps, reference_decodes, runs: a decoding
    view's (activation_bytes). engine: a study's paged engine calls (paged_study_bytes). invariant: the run is in
    invariant mode throughout (its first forward probes the kernels: plan_shape)."""
    ms = parse_spec(spec)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    free, src = free_bytes(dev)
    return plan_shape(model_shape(ms), ms.display, dtype, str(dev), view, tokens, batch, dtypes, reference, free,
                      src, compared, copies, steps, reference_decodes, runs, attention, engine, invariant, prove)


def plan_shape(shape: ModelShape | None, name: str, dtype: str, device: str, view: str, tokens: int, batch: int = 1,
               dtypes: tuple[str, ...] = (), reference: str | None = None, free: int | None = None,
               free_from: str = "given", compared: int | None = None, copies: int = 0, steps: int | None = None,
               reference_decodes: bool = True, runs: int | None = None, attention: str = "sdpa",
               engine: "PagedCalls | None" = None, invariant: bool = False, prove: bool = True) -> MemoryPlan:
    """The plan of a run of a model of this shape, against `free` bytes. attention: the kernel the model runs
    ('sdpa', kvviz's default, or 'eager': its score workspace, score_bytes). engine: a study's calls to a paged
    engine in this process (paged_study_bytes: its cache and activations replace the view's own).

    A view with a float64 reference (below float64) proves a precision verdict by rerunning in invariant mode (by
    default; `prove` False, --no-proof: never), and a run in invariant mode (`invariant`) runs so throughout: the first
    invariant-mode forward probes the kernels of each weight's shape (invariant_probe_bytes), a phase of the run in
    its own dtype. The proof's phase is dropped from the plan after a run that ran none (`settle`)."""
    dt = dtype_name(parse_dtype(dtype))
    notes = []
    runtime = (process_runtime_bytes() if device.startswith("cpu") else CUDA_RUNTIME_BYTES if device.startswith("cuda")
               else 0)
    if shape is not None and device.startswith("cpu"):
        runtime += shape.tokenizer_bytes
    if shape is None:
        notes.append("the model's files are not here yet (hub): its weights are not in the estimate")
        return MemoryPlan(name, view, dt, device, tokens, batch, 0, "unknown", 0, 0, 0, 0, runtime, free,
                          free_from, notes=notes)
    weights = shape.params * BYTES[dt]
    others = sum(shape.params * BYTES[d] for d in {dtype_name(parse_dtype(x)) for x in dtypes} - {dt, "float64"})
    if copies:
        others += copies * weights
        notes.append("a copy of the model for weight quantization (deep-copied, then quantized)")
    prof = profile(view)
    uses_ref = dt != "float64" and prof.reference
    strategy = (reference or os.environ.get("KVVIZ_REFERENCE") or "auto").lower()
    if strategy == "auto":
        strategy = _twin_or_streamed(shape.params, free, weights + others)
    if not uses_ref:
        strategy = "none"
    ref = reference_bytes(shape, dt, strategy) if uses_ref else 0
    if strategy == "streamed" and not stream_keep_bytes(shape.params) and prof.streamed_head_apart:
        # the streamed reference's slices (the head's, the largest) are held while it applies that one operation,
        # after the last layer's working set was freed: the two are never held at once, so the float64 phase holds
        # the larger of them, not both (the padding grid's phases are not built on one working set: left as is)
        ref -= min(ref, working_bytes(shape, 8, tokens, attention=attention, device=device))
    acts = activation_bytes(shape, dt, tokens, batch, view, uses_ref, compared, steps, reference_decodes, runs,
                            attention, device)
    # Loading on the CPU holds the checkpoint's tensors as read (its dtype) beside the copies it converts them to,
    # before any forward runs: the float64 twin always, and the model where its dtype is not the checkpoint's (a
    # tensor in its own dtype is the file's page, no copy); measured: docs/benchmarks.md. Not counted for a view that
    # runs only its float64 reference (the card: no such transient measured, tests/test_memory_views.py; why is not
    # known yet). Each load is a phase of its own: the activations are raised where the total would not cover it
    # (`_loading`)
    read = shape.params * BYTES.get(shape.checkpoint_dtype or dt, 4) if device.startswith("cpu") else 0
    float64_only = prof.float64_only  # no cache in the run's dtype: only the float64 reference's
    ckpt = BYTES.get(shape.checkpoint_dtype or dt, 4)
    load = read if ckpt < BYTES[dt] or (ckpt > BYTES[dt] and not float64_only) else 0
    cache = cache_bytes(shape, "float64" if float64_only else dt, tokens, batch, uses_ref and not float64_only)
    proves = prof.proves and prove  # this run proves a precision verdict (its view can; not told not to)
    if_identical = if_unproved = None
    run_only = activation_bytes(shape, dt, tokens, batch, view, False, compared, steps, reference_decodes, runs,
                                attention, device)  # the activations without the float64 reference
    if uses_ref and prof.reruns_where_parted:
        # Split point reruns in float64 only where the cached path is not bit for bit the full forward
        # (kvviz.views.split.run.run_split: `main.has_cache and not main.identical`); known only once the run
        # compared them, so the plan counts the rerun and `settle` drops it after a run that had none
        if_identical = dict(reference="not run", reference_bytes=0, cache=cache_bytes(shape, dt, tokens, batch, False),
                            activations=run_only)
    own = prof.caches(shape, dt, tokens, batch, uses_ref, reference_decodes, run_only)
    if own is not None:  # the view holds its caches its own way (a decoding view: one phase at a time)
        cache, if_identical = own
    if engine is not None:  # a paged engine's calls, one at a time; the float64 reference only where a prompt parts
        def study(f64: bool, proof: bool) -> tuple[int, int]:
            return paged_study_bytes(shape, dt, tokens, steps, engine.calls, engine.replays, engine.page_size, f64,
                                     attention, device, proof)

        cache, acts = study(uses_ref, (uses_ref and proves) or invariant)
        if uses_ref:
            c0, a0 = study(False, invariant)
            if_identical = dict(reference="not run", reference_bytes=0, cache=c0, activations=a0)
            if proves and not invariant:
                c1, a1 = study(True, False)
                if_unproved = dict(cache=c1, activations=a1)
    elif invariant or (uses_ref and proves):  # the proof's kernel probes (above)
        if not invariant:
            if_unproved = dict(cache=cache, activations=acts)
        probe = invariant_probe_bytes(shape, BYTES[dt])
        if prof.probes_in_first_forward:
            # Split point's invariant-mode run (the proof's rerun, or the run itself in invariant mode) probes the
            # head's kernels in its first forward: the prefix, one row of logits (kvviz.views.split.run._run), before
            # the full forward's logits exist; its later forwards hold what the run holds (run_only). The proof runs
            # after the float64 rerun, which has freed its float64 cache and the streamed reference's slices by
            # then: those parts of the plan are not held beside the probes (a twin or kept upcast weights stay)
            probing = probe + working_bytes(shape, BYTES[dt], tokens, batch, attention, device) + \
                batch * shape.vocab * BYTES[dt]
            if invariant and if_identical is not None:  # identical in invariant mode: no rerun, the probes stay
                if_identical["activations"] = max(if_identical["activations"], probing)
            if not invariant and uses_ref:
                f64_cache = cache - cache_bytes(shape, dt, tokens, batch, False)
                released = ref if strategy == "streamed" and not stream_keep_bytes(shape.params) else 0
                probing -= min(probing, f64_cache + released)
            acts = max(acts, run_only, probing)
            notes.append("phases one after another: the run, " + ("" if invariant else "its float64 rerun, ") +
                         "the invariant-mode kernel probes (their own forward); the largest is planned, not the sum")
        else:
            if invariant and if_identical is not None:  # identical in invariant mode: no rerun, the probes stay
                if_identical["activations"] = max(if_identical["activations"], run_only + probe)
            acts = max(acts, run_only + probe)
    kept = 8 * (shape.layers + 1) * tokens * batch * 8  # per-layer, per-position metrics, a few of them

    # the model's own load comes first, before the run has grown the process by all of RUNTIME_GROWTH (the float64
    # twin loads later, after the run: its phase keeps the whole runtime)
    early = RUNTIME_GROWTH - LOAD_GROWTH if device.startswith("cpu") and _PROCESS_AT_IMPORT is not None else 0

    def _loading(acts: int, ref: int, cache: int) -> int:  # the activations, at least what the loads add
        return max(acts, load - early - ref - cache - kept,
                   (read - cache - kept) if strategy == "twin" and ref else 0)

    acts = _loading(acts, ref, cache)
    if if_identical is not None:
        if_identical["activations"] = _loading(if_identical["activations"], 0, if_identical["cache"])
    if if_unproved is not None:
        if_unproved["activations"] = _loading(if_unproved["activations"], ref, if_unproved["cache"])
    if strategy == "streamed":
        notes.append("float64 reference streamed: the loaded weights upcast one operation at a time")
    return MemoryPlan(name, view, dt, device, tokens, batch, weights, strategy, ref, acts, cache, kept,
                      runtime, free, free_from, extra_models=others, notes=notes, if_identical=if_identical,
                      if_unproved=if_unproved)


# Public shapes for the "what fits where" table (docs/memory.md): Llama 3.2 1B, Llama 3.1 8B, Llama 3.1 70B.
KNOWN_SHAPES = {
    "Llama-3.2-1B": ModelShape(params=1_235_814_400, layers=16, hidden=2048, vocab=128256, intermediate=8192,
                               heads=32, kv_heads=8, head_dim=64, largest=128256 * 2048, checkpoint_dtype="bfloat16"),
    "Llama-3.1-8B": ModelShape(params=8_030_261_248, layers=32, hidden=4096, vocab=128256, intermediate=14336,
                               heads=32, kv_heads=8, head_dim=128, largest=128256 * 4096,
                               checkpoint_dtype="bfloat16"),
    "Llama-3.1-70B": ModelShape(params=70_553_706_496, layers=80, hidden=8192, vocab=128256, intermediate=28672,
                                heads=64, kv_heads=8, head_dim=128, largest=128256 * 8192,
                                checkpoint_dtype="bfloat16"),
}


def fits_table(gpus_gb=(24, 48, 80), dtypes=("bfloat16", "float32"), view: str | None = None,
               tokens: int = 512) -> str:
    """Markdown: which model fits which GPU for a verdict (the run plus its float64 reference), streamed reference
    against the full float64 twin, computed by the same plan code as every run. view: the first registered view
    (Split point) unless named."""
    view = view or "split"
    head = ["model", "dtype", "reference"] + [f"{g} GB GPU" for g in gpus_gb]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, shape in KNOWN_SHAPES.items():
        for dt in dtypes:
            for strategy in ("streamed", "twin"):
                cells = []
                for g in gpus_gb:
                    p = plan_shape(shape, name, dt, "cuda", view, tokens, reference=strategy, free=g * 10 ** 9)
                    cells.append(f"{'yes' if p.fits else 'no'} ({p.total / 10 ** 9:.1f} GB)")
                rows.append(f"| {name} | {dt} | {strategy} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def choose_reference(lm) -> str:
    """For a loaded model: 'twin' where a float64 copy of the model is small and fits easily, else 'streamed'."""
    return _twin_or_streamed(sum(p.numel() for p in lm.model.parameters()), free_bytes(lm.device)[0])


class NoPlan(Exception):
    """No plan: the run's own input checks will say what is wrong."""


def check_fits(plan: MemoryPlan) -> MemoryPlan:
    """Raise KvvizError (one line) when the run cannot fit."""
    if not plan.fits:
        raise KvvizError(plan.refusal())
    return plan


# ----------------------------------------------------------------------------------------------------------------
# From command-line arguments (the CLI's --plan and its refusal before loading)


def tokens_of_text(spec, text: str) -> int:
    """Tokens of `text` for the model's tokenizer when its files are here (a folder; a GGUF file already converted
    once; a hub model in the local cache), else a bound (UTF-8 bytes + 2)."""
    shape = model_shape(spec)  # gguf: once converted; hub: in the local cache
    folder = Path(shape.source) if shape is not None and shape.source else None
    if folder is not None and folder.is_dir():
        try:
            tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
            return len(tok(text)["input_ids"])
        except Exception:  # noqa: BLE001 - fall back to the bound
            pass
    return len(text.encode("utf-8")) + 2


@dataclass(frozen=True)
class PagedCalls:
    """A study's calls to a paged engine: (requests, requests in flight) of each call of a run, and of the one-prompt
    call the float64 reference replays where a prompt parts; the tokens a page holds."""
    calls: tuple[tuple[int, int], ...]
    replays: tuple[tuple[int, int], ...]
    page_size: int


def plan_workload(spec, dtype: str, device, view: str, w: Workload, invariant: bool = False) -> MemoryPlan:
    """The one memory-plan builder: the CLI (kvviz.io.clirun.plan_for_args) and the pages (pages/memory_plan.py) both
    call it. invariant: the run is in invariant mode (the sidebar's toggle, --invariant); a workload that will not
    prove (`w.prove` False) has no proof phase."""
    prof = profile(view)
    if any(len(t) > MAX_PROMPT_CHARS for t in w.texts):
        raise NoPlan()
    tokens = max([tokens_of_text(spec, t) for t in w.texts if t] or [32])
    if w.continuations:
        tokens += max(tokens_of_text(spec, c) for c in w.continuations)
    tokens += int(w.left_pad or 0) + int(w.new_tokens or 0)
    batch = prof.batch
    if prof.batch_from_workload:
        tokens = int(w.tokens) if w.tokens else tokens
        batch = int(w.batch or 1)
    compared = tokens - int(w.split) if prof.compared_after_split and isinstance(w.split, int) and \
        not isinstance(w.split, bool) and w.split > 0 else None
    tokens, batch, compared = prof.sizes(spec, w, tokens, batch, compared)  # as the view runs them
    copies = int(prof.weight_copies and str(w.weights or "none") != "none")
    if w.dtypes:
        dtype = w.dtypes[0]
    steps, reference_decodes, runs = prof.decoding(w)  # a view that decodes: each run decodes the new tokens
    engine = prof.engine(w)
    if engine is not None:  # each request decodes the new tokens
        steps = max(1, int(w.new_tokens or 0))
    return plan_run(spec, dtype, device, view, max(tokens, 1), batch, w.dtypes, compared=compared, copies=copies,
                    steps=steps, reference_decodes=reference_decodes is not False,
                    runs=runs,
                    attention=attention_kernel(w.attention), engine=engine, invariant=bool(invariant),
                    prove=bool(w.prove))


def attention_kernel(requested) -> str:
    """What the plan counts for an attention request: 'eager' where any requested implementation is eager (the
    matrix's list: its largest), else 'sdpa' (transformers' default for 'auto'; fused kernels hold less)."""
    names = [a.strip() for a in str(requested or "auto").split(",")]
    return "eager" if "eager" in names else "sdpa"


def attach(result, plan: MemoryPlan) -> None:
    """Give `result` its plan, with the peak measured now, as its `memory_plan` attribute: the JSON export and
    `--json` write it beside the result (kvviz.io.export.result_dict)."""
    plan.with_peak(result)
    result.memory_plan = plan
