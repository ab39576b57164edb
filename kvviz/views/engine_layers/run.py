"""Inside the engine: two runs of one prompt through vLLM or llama.cpp, compared hidden state by hidden state.

A pair of conditions that can part (issue 41):
  warm   cold (the prefix cache emptied, the prompt alone) vs warm (the cache emptied, a warmer - the shared
         prefix, or the identical prompt - then the prompt: its full blocks come from the cache);
  batch  alone (cold) vs the prompt in flight with k-1 neighbours (cold, each its own cache salt);
  tp     tensor parallel 1 vs N: two engines, the prompt alone and cold in each.
vLLM's worker captures the hidden states of both runs (kvviz/engines/vllm_worker.py, LayerCapture: hooks on every
decoder layer and the final norm; the embeddings, the residual stream after layers 1 … L-1, the final norm's output,
as transformers' output_hidden_states) and reduces them there, per layer × token: A against B on the positions both
computed with the same input tokens, and each side against kvviz's float64 reference of the same weights on that
side's own tokens (kvviz writes the reference's states to a safetensors file the worker reads). Only the per layer ×
token numbers travel as JSON.

llama.cpp (the warm pair only; kvviz/engines/llamacpp_worker.py): its eval callback reads the token-embedding lookup
and the tensors llama.cpp's graph names l_out-<i> and result_norm - the same rows - on the GGUF itself; the float64
reference is the GGUF dequantized, and kvviz writes it as an .npz (the llama.cpp environment has numpy, not
safetensors). kvviz cannot run llama.cpp's 8-bit activations, so its bound is the Serving view's for them at every
row: K_GROWTH["q8"] · u(q8) relative.

Rounding, per layer: kvviz runs the same tokens in the engine's dtype (its own kernels, the same weights); that
run's relative gap from float64 at a layer (max over tokens) is what this dtype's rounding does there, and the
engine's rounding bound is C_OWN (16, the Serving view's constant) times it, never under 2^4 · u. Between the two
runs: the first layer where they differ at all (bit for bit), and the first where they differ beyond the bound.

The logit lens of both sides (issue 54.3): each side's captured states are saved by the engine's worker (vLLM:
safetensors in the model's dtype; llama.cpp: .npz in float32) and read here one hidden state at a time; each row goes
through the LOCAL model's final norm and head (kvviz.core.lens, the Logit lens view's arithmetic; the last row is
already the final norm's output, so only the head) a chunk of positions at a time, reduced at once to each side's
top-1, runner-up and margin and the KL between the two sides' lens distributions, on the positions A and B both
computed with the same inputs. The decision depth is the first hidden state where the two sides' top-1 differ. The
last row's top-1 is checked against each side's own generated tokens (head_gap: 0 where the local head reproduces the
engine's). The lens informs; it does not change the verdict.

The verdict (_judge, issue 53): A and B bit for bit equal is identical - what the pair changes changed nothing -
whatever each side's distance from float64 (that is about the kernels both runs share); both sides within the bound
of float64 at every layer is precision; logic only where A and B differ beyond the bound AND a side leaves the bound
of float64; a side past the bound without that is undecided (the bound is a heuristic on torch's kernels, an engine's
may round more), never logic, and the sentence names the step that decides it. The verdict box is the worst of that
and every prompt's verdict at its outputs (combine), each named by what it compares.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...core.errors import KvvizError
from ...core.memory import Workload
from ...core.execution import DEFAULT_SETTINGS, ExecSettings, Executor, RunInfo
from ...core.protocol import DEFAULT_CONTEXT, no_progress, Progress, RunContext
from ...core.inputs import check_context, encode
from ...core.metrics import first_divergence, hidden_divergence
from ...core.lens import Lens, first_difference, lens_pair
from ...core.naming import layer_labels
from ...core.text import display_text, display_tokens
from ...core.estimate import Timed
from ...core.verdict import Verdict, classify_bounded, severity, worst
from ...engines import registry
from ...engines.base import Engine
from ...engines.verdict import C_OWN, K_GROWTH, UNIT_ROUNDOFF, judge, margin_at, path_distance, reference_logprobs, \
    rounding_scale

PAIRS = {"warm": ("cold", "warm"), "batch": ("alone", "batch"), "tp": ("tp 1", "tp N")}
ENGINES = registry.capturing()  # the engines that capture layers (kvviz.engines.registry; the page's choices)
METRICS = ("relative", "eps_units", "max_abs")
MAX_NEW_TOKENS = 64
QUANTIZED_BOUND = K_GROWTH["q8"] * UNIT_ROUNDOFF["q8"]  # relative, every row: 8-bit activations (kvviz cannot run them)



@dataclass
class EngineLayersConfig:
    prompt: str
    pair: str = "warm"
    prefix: str = ""  # put before the prompt; for "warm" the warmer is the prefix alone (else the identical prompt)
    max_new_tokens: int = 8
    batch_size: int = 4  # "batch": the prompt and k-1 built-in neighbours in flight together
    others: int = 0  # built-in prompts also run on both sides, compared at their outputs (distinct completions)
    tensor_parallel_size: int = 3  # "tp": TP 1 against this; "warm"/"batch": the engine's TP size is 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # mp | ray | uni | external_launcher (vLLM's), None: its default
    engine: str = ENGINES[0]

    def validate(self) -> None:
        if self.engine not in registry.capturing():
            raise KvvizError(f"unknown engine '{self.engine}'; choose one of {', '.join(registry.capturing())}")
        if self.pair not in PAIRS:
            raise KvvizError(f"unknown pair '{self.pair}'; choose one of {', '.join(PAIRS)}")
        if self.pair not in registry.get(self.engine).capture_pairs:
            raise KvvizError(registry.get(self.engine).capture_refused)
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise KvvizError("the prompt is empty; type some text to compare")
        for name, lo, hi in (("max_new_tokens", 1, MAX_NEW_TOKENS), ("batch_size", 2, 64), ("others", 0, 100),
                             ("tensor_parallel_size", 1, 64), ("pipeline_parallel_size", 1, 64)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise KvvizError(f"{name.replace('_', ' ')} must be a whole number from {lo} to {hi}, not {v!r}")
        if self.pair == "tp" and self.tensor_parallel_size < 2:
            raise KvvizError("the tp pair compares tensor parallel 1 with N: give a tensor parallel size of 2 or more")
        if self.pipeline_parallel_size != 1:
            raise KvvizError("layer capture needs every decoder layer in one process: pipeline parallelism splits "
                             "them over processes (run it through `kvviz serving`, or use tensor parallelism here)")
        if self.distributed_executor_backend not in (None, "", "mp", "ray", "uni", "external_launcher"):
            raise KvvizError(f"unknown distributed executor backend '{self.distributed_executor_backend}'; vLLM's are "
                             "mp, ray, uni, external_launcher")

    def workload(self) -> Workload:
        """What kvviz's process holds, for the memory plan: the float64 reference of the prompt after its prefix."""
        return Workload(texts=(self.prefix + self.prompt,), new_tokens=int(self.max_new_tokens))


def check_parallel(lm, tp: int) -> None:
    """Refuse in one line a tensor parallel size the model's heads do not divide (vLLM would refuse it at start)."""
    cfg = getattr(lm, "text_config", None) or lm.model.config
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads and heads % tp:
        raise KvvizError(f"tensor parallel size {tp} does not divide the model's {heads} attention heads: vLLM splits "
                         f"heads across ranks (try {', '.join(str(d) for d in range(1, heads + 1) if heads % d == 0)})")
    if kv and kv % tp and tp % kv:
        raise KvvizError(f"tensor parallel size {tp} and the model's {kv} key/value heads neither divide the other: "
                         "vLLM cannot split or replicate them")


@dataclass
class Side:
    """One engine run of the prompt: its tokens, where the engine took tokens from its cache, and its hidden states
    against kvviz's float64 reference on its own tokens (metric -> [rows, positions])."""

    label: str
    tokens: list[int]
    cached_tokens: int
    positions: list[int]
    reference: dict[str, np.ndarray]
    first_logic: int | None  # the first row beyond the rounding bound (None: within it everywhere)
    seconds: float

    def to_dict(self) -> dict:
        d = asdict(self)
        d["reference"] = {k: np.asarray(v).tolist() for k, v in self.reference.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Side":
        d = dict(d)
        d["reference"] = {k: np.asarray(v, dtype=float) for k, v in d["reference"].items()}
        return cls(**d)


@dataclass
class EngineLens:
    """The logit lens of both sides: each side's captured hidden states through the local model's final norm and
    head, [rows, positions] on the positions A and B both computed with the same inputs (the result's `positions`)."""
    positions: list[int]
    a: dict  # top1, top2 (token ids), margin (top-1 minus runner-up logit)
    b: dict
    kl: list  # KL(A || B) of the two lens distributions
    vocab: dict  # token id (str) -> display text, for every id the matrices name
    head_gap: dict  # side label -> generated positions where the last row's lens top-1 is not the engine's own token
    checked: int  # the generated positions that check covers (per side)

    def depth(self) -> tuple[int, int] | None:
        """(row, position index) of the first hidden state where the two sides' top-1 differ; None: they agree."""
        return first_difference(self.a["top1"], self.b["top1"])

    def token(self, i: int) -> str:
        return self.vocab.get(str(int(i)), f"#{int(i)}")

    @property
    def max_kl(self) -> float:
        return float(np.max(self.kl)) if np.size(self.kl) else 0.0

    @classmethod
    def from_dict(cls, d: dict) -> "EngineLens":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass
class EngineLayersResult(Timed):
    settings: dict  # the run (model, dtype, device) and the config
    engine: dict  # name, version, settings (per side where the sides ran on two engines)
    tokens: list[str]  # the prompt's tokens and side A's, as text (labels)
    token_ids: list[int]
    prompt_len: int
    layer_labels: list[str]
    a: Side
    b: Side
    positions: list[int]  # compared A against B (both computed, the same input tokens)
    gaps: dict[str, np.ndarray]  # A against B: metric -> [rows, positions]
    own: list[float]  # kvviz's own run in the engine's dtype against float64, per row (relative, max over tokens)
    bound: list[float]  # the rounding bound per row (relative)
    first_differing: int | None  # the first row where A and B differ at all
    first_beyond: int | None  # the first row where they differ beyond the rounding bound
    first_divergence: int | None  # the first generated step where their tokens differ
    verdict: str
    explanation: str
    elapsed_s: float
    notes: list[str] = field(default_factory=list)
    prompts: list[dict] = field(default_factory=list)  # per prompt (the first is the captured one): its outputs
    # the captured prompt's layers, A vs B (verdict: the worst of it and every prompt's at its outputs - combine())
    layers_verdict: str | None = None
    lens: EngineLens | None = None  # the logit lens of both sides (None: absent, lens_absent says why)
    lens_absent: str | None = None

    @property
    def labels(self) -> tuple[str, str]:
        return self.a.label, self.b.label

    @property
    def decision(self) -> dict | None:
        """The lens's decision depth: the hidden state and position where the two sides' top-1 first differ, and
        each side's top-1, runner-up and margin there (keys "a" and "b", each with its label)."""
        lens = self.lens
        d = lens.depth() if lens is not None else None
        if d is None:
            return None
        r, j = d
        p = lens.positions[j]
        out = {"row": r, "layer": self.layer_labels[r], "position": p,
               "at": self.tokens[p] if p < len(self.tokens) else str(p)}
        for side, label in (("a", self.a.label), ("b", self.b.label)):
            s = getattr(lens, side)
            out[side] = {"label": label, "top1": lens.token(s["top1"][r][j]), "top2": lens.token(s["top2"][r][j]),
                         "margin": float(s["margin"][r][j])}
        return out

    def lens_line(self) -> str:
        """The lens's sentence in the verdict text, from its numbers: the decision depth or that the two sides'
        top-1 agree at every layer; why it is absent where it is."""
        a, b = self.labels
        if self.lens is None:
            return f"No logit lens: {self.lens_absent}." if self.lens_absent else ""
        what = "Logit lens (the local model's final norm and head on each side's captured states): "
        dec = self.decision
        if dec is None:
            text = (f"{what}the two sides' top-1 agree at every layer and position (largest KL "
                    f"{self.lens.max_kl:.3g}).")
        else:
            def says(s: dict) -> str:
                if s["margin"] == 0:
                    return f"'{s['top1']}' tied with '{s['top2']}'"
                return f"'{s['top1']}' by {s['margin']:.3g} over '{s['top2']}'"
            text = (f"{what}{a} and {b}'s top-1 first differ at {dec['layer']} (decision depth), position "
                    f"{dec['position']} ('{dec['at']}'): {a} says {says(dec['a'])}, {b} {says(dec['b'])}.")
        gaps = {k: v for k, v in self.lens.head_gap.items() if v}
        if gaps:
            text += (" The last layer's lens top-1 is not the engine's own next token at "
                     + ", ".join(f"{v} of {self.lens.checked} generated positions of {k}" for k, v in gaps.items())
                     + " (the engine's head rounds differently from the local model's).")
        return text

    def row_label(self, row: int | None) -> str:
        return "none" if row is None else self.layer_labels[row]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["a"], d["b"] = self.a.to_dict(), self.b.to_dict()
        d["gaps"] = {k: np.asarray(v).tolist() for k, v in self.gaps.items()}
        d["decision"] = self.decision
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineLayersResult":
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        d["a"], d["b"] = Side.from_dict(d["a"]), Side.from_dict(d["b"])
        d["gaps"] = {k: np.asarray(v, dtype=float) for k, v in d["gaps"].items()}
        if d.get("lens") is not None:
            d["lens"] = EngineLens.from_dict(d["lens"])
        return cls(**d)

    def parting_line(self) -> str:
        """How many prompts part at their outputs, and their verdicts."""
        parted = [p for p in self.prompts if p["distinct"] > 1]
        counts = Counter(p["verdict"] for p in self.prompts)
        a, b = self.labels
        return (f"{len(parted)} of {len(self.prompts)} prompts give 2 distinct completions over {a} and {b}"
                + (f" (verdicts at the outputs, {a} vs {b} with each against float64 on its own tokens: "
                   f"{', '.join(f'{v}: {c}' for v, c in sorted(counts.items()))})" if counts else ""))

    def engine_dtype(self) -> str:
        """What the engine computed in: llama.cpp's 8-bit activations × its GGUF's weights, else the model's dtype
        (without the engine's name, which every title and line names already)."""
        name = self.engine.get("name")
        return str(self.settings.get("engine_dtype", self.settings.get("dtype"))).removeprefix(f"{name}: ")

    def summary_line(self) -> str:
        a, b = self.labels
        return (f"{self.engine.get('name')} {self.engine.get('version')} in {self.engine_dtype()}: {a} vs {b}, "
                f"first differing: {self.row_label(self.first_differing)}, first beyond rounding: "
                f"{self.row_label(self.first_beyond)}")


def _req(key: str, ids: list[int], n: int, salt: str | None = None) -> dict:
    return {"key": key, "ids": list(map(int, ids)), "max_new_tokens": n, "salt": salt}


def _prompts(lm, cfg: EngineLayersConfig, ids: list[int]) -> list[tuple[str, list[int], list[int], list[list[int]]]]:
    """(text, ids, warmer, batch neighbours) of the prompt and of cfg.others built-in prompts (compared at their outputs):
    the warmer is the shared prefix (or the identical prompt); the neighbours the next k-1 built-in prompts."""
    from ...core.prompts import load_prompts

    pool = [q for q in load_prompts("builtin") if q != cfg.prompt]
    texts = [cfg.prompt] + pool[: cfg.others]
    every = [ids] + [encode(lm, cfg.prefix + q) for q in texts[1:]]
    for q_ids in every[1:]:
        check_context(lm, q_ids, extra_tokens=cfg.max_new_tokens)
    warm = encode(lm, cfg.prefix) if cfg.prefix.strip() else None
    out = []
    for k, q_ids in enumerate(every):
        others = [q for q in pool if q != texts[k]]
        neigh = [encode(lm, cfg.prefix + q) for q in others[: cfg.batch_size - 1]] if cfg.pair == "batch" else []
        out.append((texts[k], q_ids, warm or q_ids, neigh))
    return out


def _side_groups(pair: str, side: str, k: int, ids: list[int], n: int, warmer: list[int],
                 neighbours: list[list[int]]) -> list[dict]:
    """The engine submissions of prompt k on one side (A or B) of the pair; prompt 0's states are captured under
    the side's tag. Every group starts cold (the prefix cache emptied) but a warm prompt, which follows its warmer
    under the same cache salt."""
    key, tag = f"{side}{k}", (side if k == 0 else None)
    if side == "A" or pair == "tp":
        return [{"requests": [_req(key, ids, n)], "reset": True, "capture": tag}]
    if pair == "warm":
        return [{"requests": [_req(key + "~warmer", warmer, 1, key)], "reset": True},
                {"requests": [_req(key, ids, n, key)], "reset": False, "capture": tag}]
    return [{"requests": [_req(key, ids, n, key)] + [_req(f"{key}~n{j}", q, n, f"{key}~n{j}")
                                                     for j, q in enumerate(neighbours)],
             "reset": True, "capture": tag}]


def _states64(lm, ex: Executor, ids: list[int]) -> list[torch.Tensor]:
    """Every hidden state [T, H] of one full no-cache forward over ids (transformers' output_hidden_states)."""
    t = torch.tensor([ids], device=lm.device)
    with ex.session():
        out = ex.forward(t, use_cache=False, hidden=True)
    return [h[0].detach() for h in out.hidden_states]


def _write_reference(states: list[torch.Tensor], folder: str, name: str, npz: bool = False) -> str:
    """The reference's states [R, T, H] float64 and positions: safetensors (vLLM's worker), .npz (llama.cpp's)."""
    hidden = torch.stack([s.to("cpu", torch.float64) for s in states]).contiguous()
    if npz:
        path = str(Path(folder) / f"{name}.npz")
        np.savez(path, hidden=hidden.numpy(), positions=np.arange(hidden.shape[1]))
        return path
    from safetensors.torch import save_file

    path = str(Path(folder) / f"{name}.safetensors")
    save_file({"hidden": hidden, "positions": torch.arange(states[0].shape[0])}, path)
    return path


def _matrices(reply: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(reply[k], dtype=float) for k in METRICS}


def _first_row(m: np.ndarray, bound: np.ndarray | None) -> int | None:
    """The first row with any entry above the bound (None: bit for bit where bound is None)."""
    if m.size == 0:
        return None
    worst = m.max(axis=1)
    over = worst > (0.0 if bound is None else bound)
    return int(np.argmax(over)) if over.any() else None


def run_engine_layers(lm, cfg: EngineLayersConfig, progress: Progress | None = None,
                      settings: ExecSettings | None = None) -> EngineLayersResult:
    """Run the pair (module docstring) and judge it. The engine runs the model's folder in the model's dtype."""
    progress = progress or no_progress
    settings = settings or DEFAULT_SETTINGS  # validated once, by its RunContext
    if settings.invariant:
        raise KvvizError("vLLM's deterministic mode (VLLM_BATCH_INVARIANT=1) needs its CUDA/ROCm kernels; the "
                         "engine-layers view runs the engine as it serves: rerun without --invariant")
    cfg.validate()
    kind = registry.check(cfg.engine)
    dtype = kind.layer_dtype(lm)  # one line where the engine cannot run this model (its format: its rounding)
    tp_b = cfg.tensor_parallel_size if cfg.pair == "tp" else 1
    check_parallel(lm, tp_b)
    t0 = time.perf_counter()
    ids = encode(lm, cfg.prefix + cfg.prompt)
    check_context(lm, ids, extra_tokens=cfg.max_new_tokens)
    eps = 2 * UNIT_ROUNDOFF["q8"] if kind.quantized else float(torch.finfo(lm.dtype).eps)
    label_a, label_b = PAIRS[cfg.pair]
    if cfg.pair == "tp":
        label_a, label_b = "tp 1", f"tp {tp_b}"
    prompts = _prompts(lm, cfg, ids)
    lm64 = lm.reference()
    ex64 = Executor(lm64, settings.with_(invariant=False))
    ex_own = None if kind.quantized else Executor(lm, settings.with_(invariant=False))
    # the registry's class itself (not open(): vLLM importable here would run in this process, and its layers are
    # captured in its worker all the same)
    cap = _capture_pair(kind(), lm, cfg, ids=ids, prompts=prompts, labels=(label_a, label_b), tp_b=tp_b,
                        ex64=ex64, ex_own=ex_own, dtype=dtype, eps=eps, progress=progress)
    progress(0.9, "every prompt's two completions against the float64 reference")
    rows = _output_rows(lm, prompts, cap.outs, ex64, ex_own, dtype, label_a, label_b)
    gaps = _matrices(cap.ab)
    out_a, out_b = cap.outs["A0"], cap.outs["B0"]
    side_a = Side(label_a, cap.toks_a, int(out_a.get("cached_tokens", 0)), cap.pos_a, cap.ref_a,
                  _first_row(cap.ref_a["relative"], cap.bound), float(out_a.get("seconds", 0.0)))
    side_b = Side(label_b, cap.toks_b, int(out_b.get("cached_tokens", 0)), cap.pos_b, cap.ref_b,
                  _first_row(cap.ref_b["relative"], cap.bound), float(out_b.get("seconds", 0.0)))
    labels = layer_labels(len(cap.own))
    first_diff = _first_row(gaps["max_abs"], None)
    first_beyond = _first_row(gaps["relative"], cap.bound)
    fd = first_divergence(cap.toks_a, cap.toks_b)
    layers_verdict, layers_why = _judge(side_a, side_b, gaps, first_diff, first_beyond, fd, labels, cap.bound, dtype,
                                        cap.own, cfg.pair, kind.label)
    engine = {"name": cfg.engine, "version": cap.infos[label_a].get("version"),
              "settings": {k: v.get("settings", {}) for k, v in cap.infos.items()},
              "start_s": {k: v.get("start_s") for k, v in cap.infos.items()}}
    run = RunInfo.of(lm, settings).to_dict()
    if kind.engine_dtype(lm) is not None:
        run["engine_dtype"] = kind.engine_dtype(lm)
    full = ids + cap.toks_a
    tokens = display_tokens(lm.tokenizer, full)
    notes = []
    if kind.quantized:
        notes.append(f"{kind.label}'s 8-bit activations are not a format kvviz runs: the rounding bound is "
                     f"{QUANTIZED_BOUND:g} relative at every layer (the Serving view's K · u for them), and ε is 2^-7")
    elif cfg.pair == "warm" and side_b.cached_tokens == 0 and kind.cache_block:
        notes.append(f"the warm run took no tokens from the prefix cache ({kind.label} caches whole "
                     f"{kind.cache_block}-token blocks: the prompt and its shared prefix must be longer than "
                     f"{kind.cache_block} tokens)")
    res = EngineLayersResult({**run, **asdict(cfg)}, engine, tokens, full, len(ids), labels, side_a, side_b,
                             list(cap.ab["positions"]), gaps, cap.own, cap.bound.tolist(), first_diff, first_beyond,
                             fd, layers_verdict, layers_why, time.perf_counter() - t0, notes, rows, layers_verdict,
                             cap.lens, cap.lens_absent)
    lens_line = res.lens_line()
    if lens_line:  # the lens informs the layers' story; it does not change the verdict
        layers_why = f"{layers_why} {lens_line}"
    res.verdict, res.explanation = combine(layers_verdict, layers_why, rows, res.parting_line())
    return res


@dataclass
class _Captured:
    """What the engine's capture gave: every request's outputs, side A's and B's tokens, each side's gaps from the
    float64 reference and its positions, A against B, kvviz's own run's gap per row and the bound, the engines'
    infos per side."""
    outs: dict
    toks_a: list[int]
    toks_b: list[int]
    ref_a: dict
    ref_b: dict
    pos_a: list[int]
    pos_b: list[int]
    ab: dict
    own: list[float]
    bound: np.ndarray
    infos: dict
    lens: EngineLens | None = None
    lens_absent: str | None = None


def _capture_pair(engine: Engine, lm, cfg: EngineLayersConfig, *, ids, prompts, labels, tp_b, ex64, ex_own, dtype,
                  eps, progress) -> _Captured:
    """Both sides of the pair through the engine with layer capture on (a tp pair: two engines, one after the
    other), and their states reduced against each other and against kvviz's float64 reference."""
    label_a, label_b = labels
    n = cfg.max_new_tokens
    quantized = ex_own is None

    def side_groups(side: str) -> list[dict]:  # every prompt's submissions on one side of the pair
        return [g for k, (_, q_ids, warmer, neigh) in enumerate(prompts)
                for g in _side_groups(cfg.pair, side, k, q_ids, n, warmer, neigh)]

    def start(tp: int):
        return engine.capture(lm, tensor_parallel_size=tp, max_num_seqs=max(8, cfg.batch_size),
                              pipeline_parallel_size=cfg.pipeline_parallel_size,
                              distributed_executor_backend=cfg.distributed_executor_backend)

    sessions, infos = [], {}
    tmp = tempfile.mkdtemp(prefix="kvviz-engine-layers-")
    lens, absent, saved = None, None, None
    try:
        try:
            progress(0.05, f"starting {engine.label}" + (" (tensor parallel 1)" if engine.tensor_parallel else ""))
            cap = start(1)
            sessions.append(cap)
            infos[label_a] = cap.info
            groups = side_groups("A") + ([] if cfg.pair == "tp" else side_groups("B"))
            progress(0.3, f"{label_a}{'' if cfg.pair == 'tp' else ' and ' + label_b}: {len(prompts)} prompt(s)")
            outs = cap.generate(groups)
            toks_a = [int(t) for t in outs["A0"]["tokens"]]
            progress(0.45, "kvviz's float64 reference" + ("" if quantized else " and its own run in the engine's dtype")
                     + " on A's tokens")
            full_a = ids + toks_a[:-1]
            ref_a = _states64(ex64.lm, ex64, full_a)
            if quantized:  # kvviz has no 8-bit-activation run: the q8 bound at every row
                own = [0.0] * len(ref_a)
                bound = np.full(len(ref_a), QUANTIZED_BOUND)
            else:
                own_a = _states64(lm, ex_own, full_a)
                own = [float(hidden_divergence(r, o.to(r.device), eps)["relative"].max()) for r, o in zip(ref_a, own_a)]
                del own_a
                floor = K_GROWTH["float"] * UNIT_ROUNDOFF[dtype]
                bound = np.maximum(C_OWN * np.asarray(own), floor)
            path_a = _write_reference(ref_a, tmp, "ref_a", engine.reference_npz)
            del ref_a
            side_a_ref = _matrices(cap.gaps(("A", "A0"), file=path_a, eps=eps))
            pos_a = cap.positions("A", "A0")
            if cfg.pair == "tp":
                path_states_a = str(Path(tmp) / "states_a.safetensors")
                cap.save_states("A", "A0", path_states_a)
                cap.close()
                sessions.remove(cap)
                progress(0.55, f"starting {engine.label} with tensor parallel {tp_b}")
                cap = start(tp_b)
                sessions.append(cap)
                infos[label_b] = cap.info
                progress(0.7, f"tensor parallel {tp_b}: {len(prompts)} prompt(s)")
                outs.update(cap.generate(side_groups("B")))
            toks_b = [int(t) for t in outs["B0"]["tokens"]]
            fd = first_divergence(toks_a, toks_b)
            upto = None if fd is None else len(ids) + fd
            progress(0.8, "A against B, layer by layer")
            if cfg.pair == "tp":
                ab = cap.gaps(("B", "B0"), file=path_states_a, upto=upto, eps=eps)
            else:
                ab = cap.gaps(("B", "B0"), ("A", "A0"), upto=upto, eps=eps)
            full_b = ids + toks_b[:-1]
            ref_b = _states64(ex64.lm, ex64, full_b) if full_b != full_a else None
            path_b = path_a if ref_b is None else _write_reference(ref_b, tmp, "ref_b", engine.reference_npz)
            del ref_b
            side_b_ref = _matrices(cap.gaps(("B", "B0"), file=path_b, eps=eps))
            pos_b = cap.positions("B", "B0")
            progress(0.82, "each side's hidden states for the logit lens")
            try:
                saved = _save_sides(engine, cap, tmp, path_states_a if cfg.pair == "tp" else None)
            except NotImplementedError:  # never a fake lens: one line on the result says why it is absent
                absent = f"{engine.label}'s layer capture cannot save its hidden states"
            except KvvizError as e:
                absent = f"{engine.label} did not give its hidden states ({e})"
        finally:
            for c in sessions:
                c.close()
            engine.close()
        if saved is not None:  # the engine is closed: its memory is given back before the lens runs here
            progress(0.85, "the logit lens of both sides, layer by layer")
            lens = engine_lens(lm, *saved, list(ab["positions"]), len(ids), {label_a: toks_a, label_b: toks_b})
    finally:
        for f in Path(tmp).glob("*"):
            f.unlink()
        os.rmdir(tmp)
    return _Captured(outs, toks_a, toks_b, side_a_ref, side_b_ref, pos_a, pos_b, ab, own, bound, infos, lens, absent)


def _save_sides(engine: Engine, cap, folder: str, states_a: str | None) -> tuple[str, str]:
    """Both sides' captured states written by the engine's worker (states_a: side A's, already written from the
    first engine of a tp pair): safetensors for vLLM, .npz for llama.cpp."""
    suffix = ".npz" if engine.reference_npz else ".safetensors"
    if states_a is None:
        states_a = str(Path(folder) / f"lens_a{suffix}")
        cap.save_states("A", "A0", states_a)
    states_b = str(Path(folder) / f"lens_b{suffix}")
    cap.save_states("B", "B0", states_b)
    return states_a, states_b


class SavedStates:
    """One side's saved hidden states ("hidden" [R, T, H], "positions" [T]), read one hidden state at a time:
    safetensors (vLLM's worker) by slices of the open file; .npz (llama.cpp's, float32, no pickle) loaded once - a
    side's states, no larger than the float64 reference this view already holds."""

    def __init__(self, path: str, stack: contextlib.ExitStack):
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as f:
                self._rows, pos = f["hidden"], f["positions"]
            self.n_rows = int(self._rows.shape[0])
        else:
            from safetensors import safe_open

            f = stack.enter_context(safe_open(path, framework="pt"))
            self._rows = f.get_slice("hidden")
            self.n_rows = int(self._rows.get_shape()[0])
            pos = f.get_tensor("positions").numpy() if "positions" in f.keys() else \
                np.arange(self._rows.get_shape()[1])
        self.positions = [int(p) for p in pos]

    def row(self, r: int, positions: list[int]) -> torch.Tensor:
        at = {p: j for j, p in enumerate(self.positions)}
        missing = [p for p in positions if p not in at]
        if missing:
            raise KvvizError(f"the saved hidden states have no position {missing[0]}")
        x = self._rows[r:r + 1]
        x = (torch.from_numpy(np.asarray(x)) if isinstance(x, np.ndarray) else x)[0]
        return x[[at[p] for p in positions]]


def engine_lens(lm, path_a: str, path_b: str, positions: list[int], prompt_len: int, tokens: dict) -> EngineLens:
    """The logit lens of two sides' saved hidden states on `positions` (kvviz.core.lens.lens_pair): each row through
    the local model's final norm and head (the last row only through the head: it is the final norm's output), in
    the model's dtype on its device. tokens: side label -> the engine's generated tokens; the last row's top-1 at a
    generated position (prompt_len - 1 on) is checked against them (head_gap)."""
    lens = Lens.of(lm.model)
    with contextlib.ExitStack() as stack, torch.inference_mode():
        sa, sb = SavedStates(path_a, stack), SavedStates(path_b, stack)
        if sa.n_rows != sb.n_rows:
            raise KvvizError(f"{sa.n_rows} saved hidden states on one side against {sb.n_rows} on the other")

        def row_of(r: int):
            return (sa.row(r, positions).to(lm.device, lm.dtype), sb.row(r, positions).to(lm.device, lm.dtype))

        pair = lens_pair(lens, row_of, sa.n_rows, len(positions))
    head_gap, checked = {}, 0
    for (label, toks), side in zip(tokens.items(), (pair.a, pair.b)):
        last = side["top1"][-1]
        at = [(j, p - (prompt_len - 1)) for j, p in enumerate(positions) if 0 <= p - (prompt_len - 1) < len(toks)]
        head_gap[label] = sum(int(last[j] != toks[g]) for j, g in at)
        checked = len(at)
    ids = {int(i) for s in (pair.a, pair.b) for k in ("top1", "top2") for row in s[k] for i in row}
    vocab = {str(i): display_text(lm.tokenizer, [i]) for i in sorted(ids)}
    return EngineLens(list(positions), pair.a, pair.b, pair.kl, vocab, head_gap, checked)


def own_ratio(side: Side, own) -> float | None:
    """The largest ratio, over layers, of the side's gap from float64 to kvviz's own run's in the same dtype (how
    much more the engine's kernels round than torch's; layers where kvviz's own run is exact are left out)."""
    r = np.asarray(side.reference["relative"], dtype=float)
    o = np.asarray(own, dtype=float)
    if not r.size or not (o > 0).any():
        return None
    return float((r.max(axis=1)[o > 0] / o[o > 0]).max())


def _output_rows(lm, prompts, outs, ex64, ex_own, dtype, label_a, label_b) -> list[dict]:
    """Per prompt, the two sides at their outputs: tokens, distinct completions, the step where they part and the
    Serving view's verdict (each side's top-5 log-probs against the float64 reference on its own tokens; a parting
    step's reference margin against the rounding distance)."""
    u = rounding_scale(dtype)
    rows = []
    for k, (text, q_ids, _, _) in enumerate(prompts):
        oa, ob = outs[f"A{k}"], outs[f"B{k}"]
        ta, tb = [int(t) for t in oa["tokens"]], [int(t) for t in ob["tokens"]]
        fd = first_divergence(ta, tb)
        paths, refs = {}, {}
        for label, o, toks in ((label_a, oa, ta), (label_b, ob, tb)):
            if tuple(toks) not in refs:
                refs[tuple(toks)] = (reference_logprobs(ex64, q_ids, toks),
                                     None if ex_own is None else reference_logprobs(ex_own, q_ids, toks))
            ref, own = refs[tuple(toks)]
            top = [[(int(i), float(v)) for i, v in step] for step in o.get("top", [])]
            paths[label] = path_distance(ref, top, o.get("chosen", []), u, own)
        ref_a = refs[tuple(ta)][0]
        margin = margin_at(ref_a, fd) if fd is not None and fd < ref_a.shape[0] else None
        # past the rounding distance alone is not logic here: the distance is a heuristic, C_OWN× torch's rounding
        decides = ("What decides it: a distance measured on the engine's own kernels, or kvviz replaying the path in "
                   "float64 here.")
        verdict, why = judge(paths, fd, margin, paths[label_a]["rounding"], far_verdict="undecided", decides=decides)
        same = fd is None and oa.get("top") == ob.get("top")  # the same tokens and top log-probs, bit for bit
        if fd is None and verdict == Verdict.PRECISION or same and verdict == Verdict.UNDECIDED:
            if verdict == Verdict.UNDECIDED:
                why = (f"{label_a} and {label_b} gave the same tokens and the same top log-probs bit for bit: nothing "
                       f"changed at the outputs. Against float64 (another comparison): " + why)
            verdict = Verdict.IDENTICAL.value
        rows.append({"prompt": text, "tokens": {label_a: ta, label_b: tb}, "distinct": 1 if fd is None else 2,
                     "first_divergence": fd, "margin": margin, "verdict": verdict, "explanation": why,
                     "distance": {k2: float(v["distance"]) for k2, v in paths.items()},
                     "rounding": {k2: float(v["rounding"]) for k2, v in paths.items()}})
    return rows


WHAT_PAIR_CHANGES = {"warm": "the prefix cache", "batch": "batching", "tp": "tensor parallelism"}


def _pair_of(a: Side, b: Side) -> str:
    """The pair (warm, batch, tp) from its sides' labels."""
    return next((k for k, (x, y) in PAIRS.items() if a.label == x and b.label == y),
                "tp" if a.label.startswith("tp ") else "warm")


def deciding_step(pair: str, engine: str, dtype: str, b: Side) -> str:
    """The sentence that names what would decide a gap beyond the heuristic bound against float64."""
    tighter = ("" if dtype == "q8" else
               f"a bound measured on {engine}'s own {dtype} kernels rather than torch's (this one is {C_OWN}× kvviz's "
               f"own {dtype} run), or ")
    replay = (f"kvviz replaying {b.label}'s path in float64 here (`kvviz split --prompt \"<prefix + prompt>\" "
              f"--split {b.cached_tokens} --dtype float64`: the {b.cached_tokens} cached tokens first, the rest "
              "through the cache, judged by kvviz's one verdict rule)" if pair == "warm" and b.cached_tokens else
              f"kvviz replaying {b.label}'s path in float64 here")
    return f"What decides it: {tighter}{replay}."


def _past_bound(s: Side, row: int, labels, bound, dtype) -> str:
    gap = float(np.asarray(s.reference["relative"])[row].max())
    what = "K · u for 8-bit activations" if dtype == "q8" else f"{C_OWN}× kvviz's own {dtype} run there"
    return (f"{s.label} passes the rounding bound of the float64 reference at {labels[row]} (its relative gap "
            f"{gap:.3g} against a bound of {bound[row]:.3g}, {gap / bound[row]:.3g}× it; the bound is {what})")


def _judge(a: Side, b: Side, gaps, first_diff, first_beyond, fd, labels, bound, dtype, own, pair: str | None = None,
           engine: str = "the engine") -> tuple[str, str]:
    """The layers' verdict on the captured prompt, A vs B, by kvviz's one verdict rule as far as an engine allows:
    identical when A and B agree bit for bit (kvviz.core.verdict.classify) - whatever each side's distance from
    float64, which is about the kernels both runs share, not about what the pair changes; else precision when both
    sides stay within the rounding bound of float64 at every layer; logic only where A and B differ beyond the bound
    AND a side leaves the bound of float64 (evidence that survives precision); a side past the bound without that
    is undecided, never logic, and the sentence names the step that decides it (kvviz.core.verdict.classify_bounded:
    the evidence that survives precision is a gap beyond the bound between A and B with a side past float64's)."""
    pair = pair or _pair_of(a, b)
    changes = WHAT_PAIR_CHANGES.get(pair, "the pair")
    parts = []
    if fd is None:
        parts.append(f"{a.label} and {b.label} chose the same {len(a.tokens)} tokens")
    else:
        parts.append(f"{a.label} and {b.label} part at generated step {fd} "
                     f"(compared up to the last position both fed the same tokens)")
    if first_diff is None:
        parts.append(f"their hidden states are bit for bit equal at every layer on the {gaps['max_abs'].shape[1]} "
                     "positions both computed")
    else:
        worst_eps = float(gaps["eps_units"].max())
        parts.append(f"they first differ at {labels[first_diff]} (largest relative gap "
                     f"{float(gaps['relative'].max()):.3g}, {worst_eps:.3g} × {dtype}'s ε)")
        parts.append("never beyond the rounding bound" if first_beyond is None else
                     f"first beyond the rounding bound at {labels[first_beyond]}")
    far = [(s, s.first_logic) for s in (a, b) if s.first_logic is not None]
    for s in (a, b):
        r = s.reference["relative"]
        if r.size:
            worst_row = int(np.argmax((r.max(axis=1) / bound)))
            ratio = own_ratio(s, own)
            parts.append(f"{s.label} against float64: at most {float(r.max()):.3g} relative "
                         f"({float(r.max(axis=1)[worst_row] / bound[worst_row]):.3g} of the bound at "
                         f"{labels[worst_row]}" + ("" if ratio is None else
                                                   f"; at most {ratio:.2g}× kvviz's own {dtype} run") + ")")
    text = "; ".join(parts) + "."
    decides = deciding_step(pair, engine, dtype, b)
    verdict = classify_bounded(first_diff is None and fd is None, past_bound=bool(far),
                               survives=bool(far) and first_beyond is not None)
    if verdict == Verdict.IDENTICAL:
        why = (f"{a.label} vs {b.label}: bit for bit equal at every layer - {changes} changed nothing.")
        if far:
            s, row = far[0]
            why += (f" Against float64 (another comparison: {engine}'s {dtype} kernels, which both runs share, not "
                    f"{changes}): {_past_bound(s, row, labels, bound, dtype)} - beyond the rounding bound, not "
                    f"decided, and no verdict on {changes}. {decides}")
        return Verdict.IDENTICAL.value, why + " " + text
    if verdict == Verdict.PRECISION:
        return Verdict.PRECISION.value, (f"{a.label} vs {b.label}: both runs stay within rounding of the float64 "
                                         "reference at every layer: the gap between them is the order of rounding, "
                                         "not a bug. " + text)
    s, row = far[0]
    if verdict == Verdict.LOGIC:
        return Verdict.LOGIC.value, (f"{a.label} vs {b.label}: they differ beyond the rounding bound from "
                                     f"{labels[first_beyond]}, and {_past_bound(s, row, labels, bound, dtype)}: "
                                     "rounding cannot explain it. " + text)
    return Verdict.UNDECIDED.value, (f"{a.label} vs {b.label}: they differ, within the rounding bound of each other "
                                     f"at every layer; against float64, {_past_bound(s, row, labels, bound, dtype)} "
                                     f"- beyond the rounding bound, not decided (the engine's kernels may round "
                                     f"more than torch's). {decides} " + text)


def combine(layers_verdict: str, layers_why: str, prompts: list[dict], line: str) -> tuple[str, str]:
    """The verdict box: the worst of the layers' verdict (the captured prompt, A vs B) and every prompt's verdict at
    its outputs (kvviz.core.verdict.worst), each named by what it compares; line: the result's parting_line, the
    summary the box and the page's table caption share."""
    outs = [p["verdict"] for p in prompts if p.get("verdict")]
    verdict = worst([layers_verdict, *outs], default=layers_verdict)
    text = f"Layers (the captured prompt): {layers_verdict}. {layers_why}"
    if prompts:
        text += f" Outputs: {line}."
    out_worst = worst(outs)
    if out_worst is not None and severity(out_worst) < severity(layers_verdict):
        p = next(p for p in prompts if p["verdict"] == out_worst)
        text = f"Outputs: {out_worst} on {p['prompt'][:60]!r}: {p['explanation']} " + text
    return str(verdict), text


# what its run cannot honour (kvviz.core.protocol.RunContext.running; the CLI refuses the matching flag)
REFUSES = {"invariant": "vLLM's deterministic mode needs CUDA/ROCm kernels; the engines run as they serve",
           "prove": "it runs no invariant-mode rerun"}


def run(lm, config: EngineLayersConfig, ctx: RunContext = DEFAULT_CONTEXT) -> EngineLayersResult:
    """The view's run (kvviz.core.protocol: one signature for every view)."""
    with ctx.running(REFUSES) as progress:
        return run_engine_layers(lm, config, progress, settings=ctx.settings)
