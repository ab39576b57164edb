"""Where a model's layers live: one device, or spread by accelerate (several GPUs, CPU RAM, disk offload).

`Placement("one")` is kvviz's usual loading: the whole model on the chosen device. `Placement("auto")` hands
`device_map="auto"` and `max_memory` to transformers' own `from_pretrained` (accelerate): layers fill the GPUs in
order, then CPU RAM, then disk (offloaded weights are read back layer by layer as the forward reaches them, from
the checkpoint's safetensors or from an offload folder in kvviz's cache). `Placement("spread")` is
`device_map="balanced"`: the layers split evenly over every GPU (then CPU and disk as for auto).

The numbers do not change with the placement: each module computes exactly what it computes on one device (the
tests check bit for bit on CPU with part of a tiny model forced to disk). `layer_placement(lm)` says where each
layer lives, for the memory plan and the sidebar.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..core.errors import KvvizError

PLACEMENTS = ("one", "auto", "spread")
_DEVICE_MAP = {"auto": "auto", "spread": "balanced"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.I)
_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


@dataclass(frozen=True)
class Placement:
    """How a model's layers are placed. mode: one | auto | spread. max_memory: (device, bytes) pairs, devices
    "cpu" or a GPU index ("0", "1"…; "cuda:0" is accepted), the budget accelerate fills before the next device;
    whatever fits nowhere goes to disk."""

    mode: str = "one"
    max_memory: tuple[tuple[str, int], ...] = ()

    @property
    def dispatched(self) -> bool:
        return self.mode != "one"

    @property
    def key(self) -> tuple:
        return (self.mode, self.max_memory)

    def device_map(self) -> str:
        return _DEVICE_MAP[self.mode]

    def max_memory_arg(self) -> dict | None:
        """max_memory as accelerate takes it: {0: bytes, "cpu": bytes}."""
        if not self.max_memory:
            return None
        return {(int(d) if d.isdigit() else d): n for d, n in self.max_memory}

    def label(self) -> str:
        if not self.dispatched:
            return "one device"
        mem = ", ".join(f"{d} {_human(n)}" for d, n in self.max_memory)
        return f"{self.mode} (device_map={self.device_map()}" + (f", max memory {mem})" if mem else ")")

    def to_dict(self) -> dict:
        return {"mode": self.mode, "max_memory": {d: n for d, n in self.max_memory}}


ONE = Placement()


def _human(n: int) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    m = _SIZE.match(str(text))
    if not m:
        raise KvvizError(f"cannot read the memory size {text!r}; write e.g. 20GiB, 500MB or 123456789")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def parse_max_memory(text: "str | dict | None") -> tuple[tuple[str, int], ...]:
    """'0=20GiB,1=20GiB,cpu=64GiB' (or a dict) -> (("0", bytes), ("1", bytes), ("cpu", bytes)), devices sorted."""
    if not text:
        return ()
    items = text.items() if isinstance(text, dict) else []
    if isinstance(text, str):
        for part in text.split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise KvvizError(f"--max-memory takes device=size pairs like 0=20GiB,cpu=64GiB, not {part.strip()!r}")
            d, s = part.split("=", 1)
            items.append((d, s))
    out: dict[str, int] = {}
    for d, s in items:
        d = str(d).strip().lower()
        if d.startswith("cuda:"):
            d = d[5:]
        if d != "cpu" and not d.isdigit():
            raise KvvizError(f"--max-memory device must be cpu or a GPU index (0, 1…), not {d!r}")
        if d in out:
            raise KvvizError(f"--max-memory names {d} twice")
        out[d] = s if isinstance(s, int) else parse_size(s)
    return tuple(sorted(out.items(), key=lambda kv: (kv[0] == "cpu", kv[0].zfill(4))))


def parse_placement(devices: "str | Placement | None" = None, max_memory: "str | dict | None" = None) -> Placement:
    """Check a devices choice in one line: one | auto | spread, with an optional max_memory (auto/spread only)."""
    if isinstance(devices, Placement):
        if max_memory:
            raise KvvizError("give max_memory inside the Placement, not beside it")
        return devices
    mode = (devices or "one").strip().lower()
    if mode not in PLACEMENTS:
        raise KvvizError(f"unknown devices choice {devices!r}; choose one of {', '.join(PLACEMENTS)}")
    mem = parse_max_memory(max_memory)
    if mode == "one" and mem:
        raise KvvizError("--max-memory needs --devices auto or spread (one device takes the whole model)")
    return Placement(mode, mem)


def check_placement(placement: Placement, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, in one line, placements that cannot work with this device and dtype."""
    if not placement.dispatched:
        return
    if device.type not in ("cpu", "cuda"):
        raise KvvizError(f"--devices {placement.mode} places layers on CUDA GPUs, CPU and disk; not on {device.type}")
    n_gpu = torch.cuda.device_count() if device.type == "cuda" else 0
    if placement.mode == "spread" and n_gpu < 2:
        raise KvvizError("--devices spread splits the layers over several GPUs, and this machine has "
                         f"{n_gpu}; use --devices auto (GPU, then CPU RAM, then disk)")
    for d, _ in placement.max_memory:
        if d != "cpu" and int(d) >= n_gpu:
            raise KvvizError(f"--max-memory names GPU {d}, but " +
                             (f"only {n_gpu} GPU(s) are here" if device.type == "cuda" else "the device is the CPU"))


def max_memory_for(placement: Placement, device: torch.device) -> dict | None:
    mem = placement.max_memory_arg()
    if device.type == "cpu":
        mem = dict(mem or {})
        for i in range(torch.cuda.device_count()):
            mem[i] = 0  # a CPU run keeps every layer off the GPUs
    return mem or None


def module_devices(model) -> dict[str, str]:
    """accelerate's map (module path -> "cpu" | "disk" | GPU index as str) of a dispatched model; {} otherwise."""
    dm = getattr(model, "hf_device_map", None) or {}
    return {k: (f"cuda:{v}" if isinstance(v, int) else str(v)) for k, v in dm.items()}


def where(model, path: str, default: str) -> str:
    """Where the module at `path` lives: the entry of the longest module path in the device map that holds it."""
    held = [(len(k), v) for k, v in module_devices(model).items() if k == "" or path == k or path.startswith(k + ".")]
    return max(held, key=lambda kv: kv[0])[1] if held else default


def input_device(model, default: torch.device) -> torch.device:
    """The device the model's inputs go to: that of its input embeddings (cpu when they are on disk)."""
    dm = module_devices(model)
    if not dm:
        return default
    emb = model.get_input_embeddings()
    path = next((n for n, m in model.named_modules() if m is emb), "")
    d = where(model, path, str(default))
    return torch.device("cpu" if d in ("disk", "meta") else d)


def layer_placement(lm) -> list[tuple[str, str]]:
    """(module path, device or "disk") for the embeddings, every decoder layer, and what follows them (final norm,
    output head), in the order a forward runs them. On an undispatched model everything is on lm.device.
    Row naming (kvviz.core.naming): "layer k" is the output of the k-th entry here after the embeddings."""
    model = lm.model
    default = str(lm.device)
    layers = _decoder_layers(model)
    emb = model.get_input_embeddings()
    names = {m: n for n, m in model.named_modules()}
    out: list[tuple[str, str]] = []
    if emb is not None and emb in names:
        out.append((names[emb], where(model, names[emb], default)))
    if layers is not None:
        prefix = names[layers]
        out += [(f"{prefix}.{i}", where(model, f"{prefix}.{i}", default)) for i in range(len(layers))]
    base = _base(model)
    after = []
    if base is not None and base is not model:
        after += [(f"{names[base]}.{c}", m) for c, m in base.named_children()]
    after += [(n, m) for n, m in model.named_children() if m is not base]
    for path, m in after:
        if m is emb or m is layers or not any(True for _ in m.parameters()):
            continue
        out.append((path, where(model, path, default)))
    return out


def _base(model):
    return getattr(model, getattr(model, "base_model_prefix", ""), None)


def _decoder_layers(model):
    """The ModuleList of decoder layers (the longest ModuleList of the model)."""
    best = None
    for _, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and (best is None or len(m) > len(best)):
            best = m
    return best


def placement_summary(lm) -> str:
    """One line saying where the layers live, consecutive layers on one device grouped, with kvviz's row naming
    ("layer k" is the output of module index k-1): "embeddings cpu; layers 1–2 cpu; layers 3–4 disk; model.norm,
    lm_head disk"."""
    rows = layer_placement(lm)
    if not rows:
        return ""
    n = lm.n_layers
    parts: list[tuple[str, str]] = []
    for i, (path, dev) in enumerate(rows):
        if i == 0:
            label = "embeddings"
        elif i <= n:
            label = f"layer {i}"
        else:
            label = path
        if parts and parts[-1][1] == dev and (label.startswith("layer ") == parts[-1][0].startswith("layer")):
            first = parts[-1][0]
            if label.startswith("layer "):
                start = first.split()[1].split("–")[0]
                parts[-1] = (f"layers {start}–{i}", dev)
            else:
                parts[-1] = (f"{first}, {label}", dev)
        else:
            parts.append((label, dev))
    return "; ".join(f"{label} {dev}" for label, dev in parts)


def reduce_per_layer(ref_layers, got_layers, fn) -> dict:
    """Per-layer gaps of two runs of one dispatched model, each reduced on the device that holds that layer's
    tensors; only the small reduced numbers move (to the CPU), then stack into [n_layers, …] tensors.
    fn(ref, got) -> dict of tensors (e.g. kvviz.core.metrics.hidden_divergence with its eps bound)."""
    out: dict[str, list] = {}
    for ref, got in zip(ref_layers, got_layers):
        if got.device != ref.device:
            got = got.to(ref.device)
        for k, v in fn(ref, got).items():
            out.setdefault(k, []).append(v.detach().to("cpu"))
    return {k: torch.stack(v) for k, v in out.items()}
