"""The precision lab: dtypes side by side over a prompt set, padding and batching scenarios, prompt-cache reuse.

Every verdict follows the foundation's rule: rerun the very same scenario in float64; a gap that closes is
precision, a gap that stays is logic.
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import pandas as pd
import torch

from .dtypes import DTYPE_NAMES, dtype_name, machine_eps, parse_dtype, supports_dtype
from .errors import KvvizError
from .greedy import first_divergence
from .inputs import encode, pad_token_id, positions_from_mask, token_texts, validate_prompt
from .loading import LoadedModel, load_model
from .metrics import hidden_divergence
from .split import SplitConfig, SplitResult, check_split, classify, float64_model, run_split

Progress = Callable[[float, str], None]
VERDICTS = ("identical", "precision", "logic")


def _noop(f: float, m: str) -> None:
    pass


def _eta(t0: float, done: int, total: int) -> str:
    if done == 0:
        return ""
    left = (time.perf_counter() - t0) / done * (total - done)
    return f", about {left:.0f} s left" if left >= 1 else ", almost done"


# ----------------------------------------------------------------------------------------------------------------
# Dtypes side by side


@dataclass
class DtypesResult:
    settings: dict
    model: dict
    dtypes: list[str]
    prompts: list[str]
    layer_labels: list[str]
    # metric -> dtype -> [n_prompts, n_hidden]: per prompt, the worst compared token of each hidden state
    per_prompt: dict[str, dict[str, np.ndarray]]
    logits_max_abs: dict[str, list[float]]
    verdicts: dict[str, list[str]]
    elapsed_s: float
    single: dict[str, SplitResult] = field(default_factory=dict)  # full results when the set is one prompt

    METRICS = ("max_abs", "relative", "eps_units")

    def stat(self, metric: str = "max_abs", how: str = "mean") -> pd.DataFrame:
        """Layers × dtypes: the mean (as seed 000 averages) or max over the prompts."""
        f = np.mean if how == "mean" else np.max
        return pd.DataFrame({d: f(self.per_prompt[metric][d], axis=0) for d in self.dtypes}, index=self.layer_labels)

    def verdict_counts(self) -> pd.DataFrame:
        return pd.DataFrame({d: [self.verdicts[d].count(v) for v in VERDICTS] for d in self.dtypes}, index=VERDICTS)

    def to_dict(self) -> dict:
        return {
            "settings": self.settings, "model": self.model, "dtypes": self.dtypes, "n_prompts": len(self.prompts),
            "prompts": self.prompts, "layer_labels": self.layer_labels,
            "per_layer": {m: {how: {d: self.stat(m, how)[d].tolist() for d in self.dtypes}
                              for how in ("mean", "max")} for m in self.METRICS},
            "per_prompt": {m: {d: v.tolist() for d, v in by.items()} for m, by in self.per_prompt.items()},
            "logits_max_abs": self.logits_max_abs, "verdicts": self.verdicts,
            "verdict_counts": {d: dict(zip(VERDICTS, self.verdict_counts()[d].tolist())) for d in self.dtypes},
            "elapsed_s": self.elapsed_s,
        }


def split_point(n_tokens: int, split: int | str) -> int:
    """'last': all but the last token go to the cache (seed 000's table); 'half'; or a number (clipped)."""
    if split == "last":
        return n_tokens - 1
    if split == "half":
        return max(1, n_tokens // 2)
    return min(int(split), n_tokens - 1)


def run_dtypes(spec: str, prompts: list[str], dtypes=DTYPE_NAMES, device="auto", attn: str | None = None,
               split: int | str = "last", mode: str = "chunk", trust_remote_code: bool = False,
               progress: Progress | None = None) -> DtypesResult:
    """The split comparison for several dtypes over a set of prompts; float64 runs once per prompt and serves as
    every dtype's verdict evidence."""
    progress = progress or _noop
    t0 = time.perf_counter()
    if not prompts:
        raise KvvizError("no prompts to run")
    names = [dtype_name(parse_dtype(d)) for d in dtypes]
    names = list(dict.fromkeys(["float64"] + names))  # float64 first: it is every dtype's reference
    progress(0.0, "Loading the models…")
    models = {d: load_model(spec, d, device, attn, trust_remote_code=trust_remote_code) for d in names
              if d != "float64"}
    first = next(iter(models.values()), None)
    dev = first.device if first is not None else None
    lm64 = float64_model(first) if first is not None else load_model(spec, "float64", device, attn,
                                                                      trust_remote_code=trust_remote_code)
    models = {"float64": lm64, **models}
    skipped = [d for d in names if not supports_dtype(models[d].device, parse_dtype(d))]
    per_prompt: dict[str, dict[str, list]] = {m: {d: [] for d in names} for m in DtypesResult.METRICS}
    logits_max: dict[str, list[float]] = {d: [] for d in names}
    verdicts: dict[str, list[str]] = {d: [] for d in names}
    single: dict[str, SplitResult] = {}
    kept_prompts: list[str] = []
    labels: list[str] = []
    total = len(prompts)
    for i, prompt in enumerate(prompts):
        progress(i / total, f"Prompt {i + 1}/{total}{_eta(t0, i, total)}")
        validate_prompt(prompt)
        n = len(encode(lm64, prompt))
        if n < 2:
            continue  # a one-token prompt has nothing to split
        cfg = SplitConfig(prompt=prompt, split=split_point(n, split), mode=mode)
        f64_res = run_split(lm64, cfg)
        if not f64_res.main.has_cache:
            raise KvvizError(f"{lm64.name} returns no cache (a bidirectional model): nothing to compare per dtype")
        kept_prompts.append(prompt)
        labels = f64_res.layer_labels
        for d in names:
            res = f64_res if d == "float64" else run_split(models[d], cfg, float64_comparison=f64_res.main)
            h = res.main.hidden
            for m in DtypesResult.METRICS:
                per_prompt[m][d].append(h[m].max(axis=1))
            logits_max[d].append(float(res.main.logits["max_abs"].max()))
            verdicts[d].append(res.verdict)
            if total == 1:
                single[d] = res
    if not kept_prompts:
        raise KvvizError("every prompt is a single token; nothing to split")
    progress(1.0, "Done")
    ref = models["float64"]
    return DtypesResult(
        settings={"model": spec, "device": str(dev or ref.device), "float64_device": str(ref.device),
                  "split": split, "mode": mode, "attention": {d: m.attn_implementation for d, m in models.items()},
                  "skipped_dtypes": skipped},
        model=ref.summary(), dtypes=names, prompts=kept_prompts, layer_labels=labels,
        per_prompt={m: {d: np.array(v) for d, v in by.items()} for m, by in per_prompt.items()},
        logits_max_abs=logits_max, verdicts=verdicts, elapsed_s=time.perf_counter() - t0, single=single)


# ----------------------------------------------------------------------------------------------------------------
# Padding and batching


PLACEMENTS = ("alone", "left-padded", "in a batch")
SCENARIOS = (  # (label, use cache, position ids, attention mask)
    ("no cache", False, "auto", "full"),
    ("cache", True, "auto", "full"),
    ("cache, positions omitted", True, "omit", "full"),
    ("cache, mask new-only", True, "auto", "new-only"),
    ("cache, omitted + new-only", True, "omit", "new-only"),
)
DEFAULT_COMPANIONS = (
    "The museum guard knew every painting in the building, but he had a favourite one hanging in the far corner.",
    "Every summer the children built a raft from old planks and empty barrels, and every summer it sank in the lake.",
)


@dataclass
class PaddingResult:
    settings: dict
    model: dict
    tokens: list[str]
    compared: list[int]
    cells: list[dict]  # one per placement × scenario

    def grid(self, field_name: str = "verdict") -> pd.DataFrame:
        df = pd.DataFrame(self.cells)
        return df.pivot(index="placement", columns="scenario", values=field_name).loc[
            list(PLACEMENTS), [s[0] for s in SCENARIOS]]

    def to_dict(self) -> dict:
        return asdict(self)


def _batch(lm: LoadedModel, rows: list[list[int]], target: int, extra_pad: int):
    """Left-pad rows to one length (plus extra_pad for all). Returns ids, mask, auto positions, target's pad."""
    width = max(len(r) for r in rows) + extra_pad
    pid = pad_token_id(lm.tokenizer)
    ids = torch.tensor([[pid] * (width - len(r)) + r for r in rows], device=lm.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=lm.device)
    return ids, mask, positions_from_mask(mask), width - len(rows[target])


def _scenario(lm: LoadedModel, rows, target: int, extra_pad: int, k: int, use_cache: bool, pos_mode: str,
              mask_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [n_hidden, n_compared, H] and logits [n_compared, V] of the target row's tokens [k, L)."""
    ids, mask, pos, pad = _batch(lm, rows, target, extra_pad)
    c = pad + k  # the column where the cache ends, the same for every row
    model = lm.model
    if not use_cache:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True, use_cache=False)
        return torch.stack([h[target, c:] for h in out.hidden_states]), out.logits[target, c:]
    pre = model(input_ids=ids[:, :c], attention_mask=mask[:, :c], position_ids=pos[:, :c], use_cache=True)
    if pre.past_key_values is None:
        raise KvvizError(f"{lm.name} returns no cache (a bidirectional model): past_key_values cannot be used")
    out = model(input_ids=ids[:, c:], attention_mask=mask if mask_mode == "full" else mask[:, c:],
                position_ids=pos[:, c:] if pos_mode == "auto" else None, past_key_values=pre.past_key_values,
                use_cache=True, output_hidden_states=True)
    return torch.stack([h[target] for h in out.hidden_states]), out.logits[target]


def _padding_cells(lm: LoadedModel, ids: list[int], companions: list[list[int]], k: int, left_pad: int):
    model = lm.model
    dev = lm.device
    eps = machine_eps(lm.dtype)
    with lm.lock, torch.inference_mode():
        ref = model(input_ids=torch.tensor([ids], device=dev), output_hidden_states=True, use_cache=False)
        ref_h = torch.stack([h[0, k:] for h in ref.hidden_states])
        ref_l = ref.logits[0, k:]
        out = {}
        for placement in PLACEMENTS:
            rows = [ids] + (companions if placement == "in a batch" else [])
            extra = left_pad if placement == "left-padded" else 0
            for label, use_cache, pm, mm in SCENARIOS:
                h, lg = _scenario(lm, rows, 0, extra, k, use_cache, pm, mm)
                hd = hidden_divergence(ref_h, h, eps)
                ldiff = (lg.double() - ref_l.double()).abs().amax(-1)
                out[(placement, label)] = {
                    "hidden_relative": float(hd["relative"].max()),
                    "hidden_max_abs": float(hd["max_abs"].max()),
                    "logits_max_abs": float(ldiff.max()),
                    "logits_relative": float((ldiff / ref_l.double().abs().amax(-1)).max()),
                    "argmax_agree": bool((lg.argmax(-1) == ref_l.argmax(-1)).all()),
                    "bitwise_equal": bool(torch.equal(h, ref_h) and torch.equal(lg, ref_l)),
                }
    return out


def run_padding(lm: LoadedModel, prompt: str, split: int | None = None, left_pad: int = 4,
                companions: list[str] | None = None, progress: Progress | None = None) -> PaddingResult:
    """The same prompt alone, left-padded, and in a batch with longer prompts; with and without cache, position
    ids auto or omitted, mask full or new-only. Each cell is compared with the prompt alone, no cache, no padding."""
    progress = progress or _noop
    if not isinstance(left_pad, int) or left_pad < 0:
        raise KvvizError(f"left padding must be 0 or more, not {left_pad}")
    ids = encode(lm, prompt)
    k = split_point(len(ids), "half" if split is None else split)
    check_split(len(ids), k if split is None else split)
    comp_ids = [encode(lm, c) for c in (companions or DEFAULT_COMPANIONS)]
    comp_ids = [c if len(c) > len(ids) else c + c[1:] * (len(ids) // max(1, len(c) - 1) + 1) for c in comp_ids]
    limit = lm.max_positions
    width = max(len(c) for c in comp_ids + [ids]) + left_pad
    if limit is not None and width > limit:
        raise KvvizError(f"the padded batch is {width} tokens, longer than the model's context of {limit} tokens")
    progress(0.1, f"Running {len(PLACEMENTS) * len(SCENARIOS)} scenarios in {dtype_name(lm.dtype)}…")
    main = _padding_cells(lm, ids, comp_ids, k, left_pad)
    lm64 = float64_model(lm)
    progress(0.55, "Rerunning every scenario in float64…")
    f64 = main if lm64 is lm else _padding_cells(lm64, ids, comp_ids, k, left_pad)
    cells = []
    for (placement, label), c in main.items():
        c64 = f64[(placement, label)]
        gap64 = max(c64["hidden_relative"], c64["logits_relative"])
        cells.append({"placement": placement, "scenario": label, **c, "float64_relative": gap64,
                      "verdict": classify(c["bitwise_equal"], gap64)})
    progress(1.0, "Done")
    return PaddingResult(settings={"prompt": prompt, "split": k, "left_pad": left_pad, "dtype": dtype_name(lm.dtype),
                                   "device": str(lm.device), "model": lm.name,
                                   "companions": [len(c) for c in comp_ids]},
                         model=lm.summary(), tokens=token_texts(lm.tokenizer, ids), compared=list(range(k, len(ids))),
                         cells=cells)


# ----------------------------------------------------------------------------------------------------------------
# Prompt-cache reuse (seed 001)


REUSE_STRATEGIES = {
    "fresh": "no prefix cache: prefix + continuation prefilled afresh",
    "deepcopy": "prefix cached once, a deep copy per continuation",
    "reused": "prefix cached once, the same cache object reused (grown by earlier continuations)",
}


@dataclass
class ReuseResult:
    settings: dict
    model: dict
    prefix_tokens: list[str]
    runs: list[dict]  # per continuation × strategy: tokens, text, first divergence vs fresh, gaps, verdict

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{k: r[k] for k in ("continuation", "strategy", "text", "first_divergence",
                                                "logits_relative", "float64_relative", "verdict")}
                             for r in self.runs])

    def to_dict(self) -> dict:
        return asdict(self)


def _decode_after(lm: LoadedModel, cache, cont: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
    """Feed the continuation through `cache` (positions inferred from the cache length, as people do), then decode
    greedily n tokens. Returns the tokens and the logits of each step [n, V]."""
    model = lm.model
    out = model(input_ids=cont, past_key_values=cache, use_cache=True)
    toks, logits = [], []
    for t in range(n):
        lg = out.logits[0, -1]
        tok = int(lg.argmax())
        toks.append(tok)
        logits.append(lg)
        if t < n - 1:
            out = model(input_ids=torch.tensor([[tok]], device=cont.device), past_key_values=out.past_key_values,
                        use_cache=True)
    return toks, torch.stack(logits)


def _reuse_runs(lm: LoadedModel, prefix: list[int], conts: list[list[int]], n: int) -> dict:
    dev = lm.device
    model = lm.model
    res = {}
    with lm.lock, torch.inference_mode():
        pre = model(input_ids=torch.tensor([prefix], device=dev), use_cache=True)
        if pre.past_key_values is None:
            raise KvvizError(f"{lm.name} returns no cache (a bidirectional model): past_key_values cannot be used")
        shared = copy.deepcopy(pre.past_key_values)  # the object every continuation of (b) reuses
        for i, cont in enumerate(conts):
            c = torch.tensor([cont], device=dev)
            res[(i, "fresh")] = _decode_after(lm, None, torch.tensor([prefix + cont], device=dev), n)
            res[(i, "deepcopy")] = _decode_after(lm, copy.deepcopy(pre.past_key_values), c, n)
            res[(i, "reused")] = _decode_after(lm, shared, c, n)
    return res


def run_reuse(lm: LoadedModel, prefix: str, continuations: list[str], max_new_tokens: int = 12,
              progress: Progress | None = None) -> ReuseResult:
    """A shared prefix cached once and reused for several continuations, three ways, against a fresh prefill."""
    progress = progress or _noop
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= 256:
        raise KvvizError(f"new tokens must be between 1 and 256, not {max_new_tokens}")
    conts = [c for c in continuations if c and c.strip()]
    if not conts:
        raise KvvizError("give at least one continuation")
    prefix_ids = encode(lm, prefix)
    cont_ids = [lm.tokenizer(c, add_special_tokens=False)["input_ids"] for c in conts]
    if any(len(c) == 0 for c in cont_ids):
        raise KvvizError("a continuation gives no tokens")
    longest = len(prefix_ids) + sum(len(c) + max_new_tokens for c in cont_ids)  # what the reused cache grows to
    if lm.max_positions is not None and longest > lm.max_positions:
        raise KvvizError(f"prefix + continuations + new tokens reach {longest} tokens, more than the model's "
                         f"context of {lm.max_positions}")
    progress(0.1, f"Decoding {len(conts)} continuations three ways in {dtype_name(lm.dtype)}…")
    main = _reuse_runs(lm, prefix_ids, cont_ids, max_new_tokens)
    lm64 = float64_model(lm)
    progress(0.55, "The same in float64…")
    f64 = main if lm64 is lm else _reuse_runs(lm64, prefix_ids, cont_ids, max_new_tokens)
    runs = []
    tok = lm.tokenizer
    for i, cont in enumerate(conts):
        ref_toks, ref_logits = main[(i, "fresh")]
        ref64_toks, ref64_logits = f64[(i, "fresh")]
        for strategy in REUSE_STRATEGIES:
            toks, logits = main[(i, strategy)]
            div = first_divergence(toks, ref_toks)
            upto = len(toks) if div is None else div + 1  # compare logits while both saw the same tokens
            rel = float(((logits[:upto].double() - ref_logits[:upto].double()).abs().amax(-1)
                         / ref_logits[:upto].double().abs().amax(-1)).max())
            t64, l64 = f64[(i, strategy)]
            d64 = first_divergence(t64, ref64_toks)
            u64 = len(t64) if d64 is None else d64 + 1
            rel64 = float(((l64[:u64].double() - ref64_logits[:u64].double()).abs().amax(-1)
                           / ref64_logits[:u64].double().abs().amax(-1)).max())
            same = strategy == "fresh" or (div is None and torch.equal(logits, ref_logits))
            runs.append({"continuation": cont, "index": i, "strategy": strategy, "token_ids": toks,
                         "text": tok.decode(toks), "first_divergence": div, "logits_relative": rel,
                         "float64_relative": rel64, "verdict": classify(same, rel64)})
    progress(1.0, "Done")
    return ReuseResult(settings={"prefix": prefix, "continuations": conts, "max_new_tokens": max_new_tokens,
                                 "dtype": dtype_name(lm.dtype), "device": str(lm.device), "model": lm.name},
                       model=lm.summary(), prefix_tokens=token_texts(tok, prefix_ids), runs=runs)
