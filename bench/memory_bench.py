"""Benchmark: memory of kvviz runs on models at their real size.

Builds random-weight model folders once (safetensors, shard by shard, never the whole model in memory):
  * big3b:   a Llama-3.2-3B-shaped model in bfloat16 (~6 GB on disk), tied embeddings, 128k vocabulary;
  * gemma270m: a Gemma-3-270M-shaped text model in bfloat16 with its 262k vocabulary.
Then runs kvviz's CLI on them in child processes capped with `prlimit --as=` and measured with `/usr/bin/time -f %M`
(peak RSS), and compares the streamed float64 reference with the full twin on the default model.

    python bench/memory_bench.py build [--root /work/bigmodels]
    python bench/memory_bench.py run [--root /work/bigmodels] [--write]

Not a test: timings and peaks belong here; results go to docs/benchmarks.md (with --write).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BIG3B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=3072, intermediate_size=8192,
             num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
             max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
             hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")
GEMMA270M = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=640,
                 intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                 head_dim=256, vocab_size=262144, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 sliding_window=512, query_pre_attn_scalar=256, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                 layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3, tie_word_embeddings=True,
                 hidden_activation="gelu_pytorch_tanh", bos_token_id=1, eos_token_id=2, pad_token_id=0,
                 dtype="bfloat16")
# A second sliding-window shape for the card, unlike Gemma 3's in every dimension: every layer sliding (Mistral),
# a 152k vocabulary, 24 layers, 2 KV heads of 64 - about Qwen2.5-0.5B's size, a 256-token window
MISTRAL500M = dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=896, intermediate_size=4864,
                   num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                   vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                   sliding_window=256, tie_word_embeddings=True, hidden_act="silu", bos_token_id=1, eos_token_id=2,
                   pad_token_id=0, dtype="bfloat16")
# Qwen2.5-0.5B's dimensions as a plain Llama (no sliding window): the 0.5-1B shape of the split-by-length bench
LLAMA500M = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
                 max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                 hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")
SPLIT_PROMPT = "The capital of France is Paris, and the capital of Italy is"
CAP = 20 * 1024 ** 3


def _tensors(cfg: dict):
    """(name, shape) of every parameter of a Llama/Gemma-3-shaped model, layer by layer."""
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    gemma = cfg["model_type"].startswith("gemma")
    yield "model.embed_tokens.weight", (cfg["vocab_size"], h)
    for k in range(L):
        p = f"model.layers.{k}."
        layer = [("self_attn.q_proj.weight", (q * hd, h)), ("self_attn.k_proj.weight", (kv * hd, h)),
                 ("self_attn.v_proj.weight", (kv * hd, h)), ("self_attn.o_proj.weight", (h, q * hd)),
                 ("mlp.gate_proj.weight", (i, h)), ("mlp.up_proj.weight", (i, h)), ("mlp.down_proj.weight", (h, i)),
                 ("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]
        if gemma:
            layer += [("pre_feedforward_layernorm.weight", (h,)), ("post_feedforward_layernorm.weight", (h,)),
                      ("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]
        for name, shape in layer:
            yield p + name, shape
    yield "model.norm.weight", (h,)


def build(folder: Path, cfg: dict, shard_bytes: int = 1 << 30) -> Path:
    """Write config, tokenizer and random bfloat16 weights shard by shard (seeded); skip when already there."""
    import torch
    from safetensors.torch import save_file

    from kvviz.models.tiny import byte_tokenizer

    if (folder / "model.safetensors.index.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(16)
    shard: dict = {}
    size, n, index = 0, 0, {}

    def flush():
        nonlocal shard, size, n
        if shard:
            n += 1
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            for k in shard:
                index[k] = name
            shard, size = {}, 0

    for name, shape in _tensors(cfg):
        if len(shape) == 1:
            t = torch.ones(shape) if not cfg["model_type"].startswith("gemma") else torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * (1.0 if "embed" in name else 0.02)
        shard[name] = t.to(torch.bfloat16)
        size += shard[name].numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    total = sum((folder / f).stat().st_size for f in set(index.values()))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": index}))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    byte_tokenizer().save_pretrained(folder)
    return folder


def measure(cmd: list[str], cap: int | None = CAP, env: dict | None = None) -> dict:
    """Run a kvviz CLI command niced under an address-space cap; peak RSS from /usr/bin/time."""
    full = ["nice", "-n", "10"] + (["prlimit", f"--as={cap}"] if cap else []) + \
        ["/usr/bin/time", "-f", "PEAK_KB %M"] + [sys.executable, "-m", "kvviz"] + cmd
    t0 = time.perf_counter()
    p = subprocess.run(full, capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
    wall = time.perf_counter() - t0
    peak = next((int(line.split()[1]) * 1024 for line in p.stderr.splitlines() if line.startswith("PEAK_KB")), None)
    out = {"cmd": " ".join(cmd), "rc": p.returncode, "wall_s": round(wall, 1), "peak_rss": peak}
    try:
        out["json"] = json.loads(p.stdout)
    except ValueError:
        out["stdout_tail"] = p.stdout[-400:]
    out["stderr_tail"] = "\n".join(l for l in p.stderr.splitlines() if not l.startswith("PEAK_KB"))[-600:]
    return out


def reference_timing(model: str = "default", repeats: int = 2) -> dict:
    """Streamed float64 reference vs the full float64 twin on the same split scenario and greedy float64 path
    (same process, same inputs, best of `repeats`)."""
    import torch

    import kvviz
    from kvviz.views.greedy.run import GreedyConfig
    from kvviz.core.inputs import build_inputs
    from kvviz.models.loading import load_model
    from kvviz.views.split.run import SplitConfig, _run

    lm = load_model(model, "float32", "cpu")
    refs = {"twin": lm.reference("twin"), "streamed": lm.reference("streamed")}
    cfg = SplitConfig(SPLIT_PROMPT, split=6, mode="step")
    out = {}
    for name, ref in refs.items():
        best = []
        for _ in range(repeats):
            t = time.perf_counter()
            _run(ref, cfg, build_inputs(ref, cfg.prompt, 0), lambda f, m: None)
            best.append(time.perf_counter() - t)
        g = []
        for _ in range(repeats):
            t = time.perf_counter()
            kvviz.run("greedy", lm, GreedyConfig(SPLIT_PROMPT, 16, paths=("cache", "float64")),
                      kvviz.RunContext(prove=False, reference=ref))
            g.append(time.perf_counter() - t)
        out[name] = {"split_s": min(best), "greedy_s": min(g)}
    out["split_ratio"] = out["streamed"]["split_s"] / out["twin"]["split_s"]
    out["greedy_ratio"] = out["streamed"]["greedy_s"] / out["twin"]["greedy_s"]
    out["threads"] = torch.get_num_threads()
    return out


# Peak RSS measured by `run` on one machine (docs/benchmarks.md, "Memory at real size"), bytes:
# (model, view, tokens as the plan counts them, compared positions) -> peak RSS.
RECORDED_PEAKS = {
    ("gemma270m", "split", 720, 120): 2_165_805_056,
    ("gemma270m", "check", 1028, None): 2_012_278_784,
    ("big3b", "split", 60, 54): 7_790_000_000,
    ("big3b", "greedy", 62, None): 7_367_327_744,  # --max-new-tokens 2 (paths no_cache,cache,float64)
    ("gemma270m", "bisect", 720, 120): 2_103_586_816,  # the bisector: no float64 reference
}


def bench_shape(cfg: dict):
    """The shape of a bench model, from its config and the tensors it writes (no files needed)."""
    from kvviz.core.memory import ModelShape

    sizes = []
    for _, shape in _tensors(cfg):
        n = 1
        for d in shape:
            n *= d
        sizes.append(n)
    return ModelShape.from_config(cfg, sum(sizes), max(sizes), "bfloat16")


def check_plans() -> int:
    """Today's plan against the recorded peaks: at least the peak everywhere, at most 1.5x it on the 270M model
    (its 262k vocabulary's activations dominate: the plan tracks them). Returns the number of misses."""
    from kvviz.core.memory import plan_shape

    misses = 0
    for (name, view, tokens, compared), peak in RECORDED_PEAKS.items():
        cfg = GEMMA270M if name == "gemma270m" else BIG3B
        plan = plan_shape(bench_shape(cfg), name, "bfloat16", "cpu", view, tokens, free=20 * 1024 ** 3,
                          compared=compared)
        ok = plan.total >= peak and (name != "gemma270m" or plan.total <= 1.5 * peak)
        misses += not ok
        print(f"{name} {view}: plan {plan.total / 1e9:.2f} GB, recorded peak {peak / 1e9:.2f} GB, "
              f"reference {plan.reference}: {'OK' if ok else 'MISS'}")
    return misses


# ----------------------------------------------------------------------------------------------------------------
# Plan against peak for every route x dtype x view that runs long prompts

GGUF_ENV = "KVVIZ_REAL_GEMMA3_GGUF"  # the real gemma-3-270m-q4_k_m.gguf (assembled from its PyPI chunk packages)
MATRIX_VIEWS = ("split", "greedy", "padding", "reuse", "check", "bisect")
MATRIX_DTYPES = ("bfloat16", "float32", "float64")
HUB_ID = "kvviz-bench/gemma-3-270m"


def gemma_prompt(folder: Path, tokens: int = 721) -> str:
    """A prose prompt of exactly `tokens` tokens (with <bos>) for the model in `folder`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    para = ("The museum guard knew every painting in the building, and at night he walked past them with a small "
            "lamp, stopping at the one of a small boat on the grey sea. ")
    ids = tok(para * 60)["input_ids"]
    start = 1 if ids and ids[0] == tok.bos_token_id else 0
    return tok.decode(ids[start:start + tokens - start])


def hub_cache(root: Path, folder: Path) -> Path:
    """A local Hugging Face cache holding `folder` as the snapshot of HUB_ID (files linked, nothing copied)."""
    cache = root / "hub"
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    snap = repo / "snapshots" / ("0" * 40)
    if not snap.is_dir():
        snap.mkdir(parents=True)
        for f in folder.iterdir():
            if f.is_file():
                (snap / f.name).symlink_to(f)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text("0" * 40)
    return cache


def matrix_cells(gguf: Path | None, root: Path) -> list[tuple[str, str, str, list[str], dict]]:
    """(route, dtype, view, argv, extra env) of every cell: the real GGUF (.gguf, its converted folder, a hub cache
    holding that folder) and the random-weight Gemma-3-270M-shaped folder, each dtype, each view."""
    routes: list[tuple[str, str, dict, Path]] = []
    if gguf is not None:
        from kvviz.models.loading import convert_gguf

        folder = convert_gguf(gguf)
        routes += [("gguf", str(gguf), {}, folder), ("folder", str(folder), {}, folder),
                   ("hub", HUB_ID, {"HF_HUB_CACHE": str(hub_cache(root, folder)), "HF_HUB_OFFLINE": "1"}, folder)]
    routes.append(("random", str(root / "gemma270m"), {}, root / "gemma270m"))
    cells = []
    for route, model, env, folder in routes:
        prompt = gemma_prompt(folder) if route != "random" else \
            " ".join(["The quick brown fox jumps over the lazy dog."] * 16)[:719]  # 721 byte tokens with BOS
        half = prompt[: len(prompt) // 2]
        argv = {"split": ["split", "--prompt", prompt, "--split", "600"],
                "greedy": ["greedy", "--prompt", prompt, "--max-new-tokens", "8"],
                "padding": ["padding", "--prompt", prompt, "--split", "600", "--left-pad", "4"],
                "reuse": ["reuse", "--prefix", half, "--continuation", prompt[len(half):], "--max-new-tokens", "8"],
                "check": ["check"],
                "bisect": ["bisect", "--prompt", prompt, "--split", "600"]}
        for dt in MATRIX_DTYPES:
            for view in MATRIX_VIEWS:
                cells.append((route, dt, view, argv[view] + ["--model", model, "--dtype", dt, "--json", "--quiet"],
                              env))
    return cells


def run_matrix(gguf: Path | None, root: Path, only: str, out: Path, no_proof: bool) -> int:
    """Run each cell in a fresh process (niced, under the address-space cap), plan and peak side by side; results
    are appended to `out` (JSON) as each cell ends, so a long matrix can be stopped and resumed."""
    if gguf is None:
        print(f"real Gemma 3 GGUF: skipped (no file; give --gguf PATH or ${GGUF_ENV})")
    done = json.loads(out.read_text()) if out.is_file() else {}
    wanted = [w for w in only.split(",") if w]
    for route, dt, view, argv, env in matrix_cells(gguf, root):
        proof_optional = view not in ("check", "bisect")  # the card and the bisector always run their proofs
        key = f"{route}/{dt}/{view}" + ("/proof" if proof_optional and not no_proof else "")
        if key in done or (wanted and not any(w in key for w in wanted)):
            continue
        if no_proof and proof_optional:
            argv = argv + ["--no-proof"]
        r = measure(argv, env=env)
        plan = (r.get("json") or {}).get("memory_plan") or {}
        ratio = plan["total"] / r["peak_rss"] if plan.get("total") and r["peak_rss"] else None
        done[key] = {"rc": r["rc"], "wall_s": r["wall_s"], "peak_rss": r["peak_rss"], "plan_total": plan.get("total"),
                     "ratio": ratio, "over_plan": plan.get("over_plan"), "no_proof": "--no-proof" in argv,
                     "stderr_tail": r["stderr_tail"][-300:] if r["rc"] else ""}
        out.write_text(json.dumps(done, indent=1))
        ok = ratio is not None and 1.0 <= ratio <= 1.25
        print(f"{key}: rc {r['rc']}, {r['wall_s']} s, peak {(r['peak_rss'] or 0) / 1e9:.2f} GB, plan "
              f"{(plan.get('total') or 0) / 1e9:.2f} GB, plan/peak {ratio or 0:.2f} {'OK' if ok else 'MISS'}",
              flush=True)
    return 0


def plan_now(argv: list[str], env: dict) -> int | None:
    """This commit's plan total of a cell's command (a child process: a hub cell's cache is read from its env)."""
    code = ("import sys; from kvviz.cli import build_parser; from kvviz.core.memory import plan_for_args; "
            "print(plan_for_args(build_parser().parse_args(sys.argv[1:])).total)")
    p = subprocess.run(["nice", "-n", "10", sys.executable, "-c", code] + argv, capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
    try:
        return int(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def matrix_table(outs: list[Path], replan: tuple[Path | None, Path] | None = None) -> str:
    """docs/benchmarks.md's table from the matrix results (a later file's cell replaces an earlier one's). replan:
    (gguf, root) to add this commit's plan of each cell and its ratio to the peak (the plan recorded at run time is
    the code's of that run)."""
    done = {}
    for out in outs:
        done.update(json.loads(out.read_text()))
    cells = {f"{r}/{d}/{v}": (argv, env) for r, d, v, argv, env in matrix_cells(*replan)} if replan else {}
    head = "| route | dtype | view | plan at run time (GB) | peak RSS (GB) | plan / peak |"
    rows = [head + (" plan now (GB) | plan now / peak |" if replan else ""), "|---|---|---|---|---|---|"
            + ("---|---|" if replan else "")]
    for key, r in done.items():
        route, dt, view = key.split("/")[:3]  # a fourth part: "proof" (a cell run with its invariant proof)
        if r["rc"] != 0 or not r["ratio"]:
            rows.append(f"| {route} | {dt} | {view} | - | - | failed (rc {r['rc']}) |" + (" - | - |" if replan else ""))
            continue
        row = (f"| {route} | {dt} | {view}{' (no proof)' if r['no_proof'] else ''} | {r['plan_total'] / 1e9:.2f} "
               f"| {r['peak_rss'] / 1e9:.2f} | {r['ratio']:.2f}{'' if 1.0 <= r['ratio'] <= 1.25 else ' MISS'} |")
        if f"{route}/{dt}/{view}" in cells:
            argv, env = cells[f"{route}/{dt}/{view}"]
            now = plan_now(argv + (["--no-proof"] if r["no_proof"] else []), env)
            ratio = now / r["peak_rss"] if now else 0
            row += (f" {now / 1e9:.2f} | {ratio:.2f}{'' if 1.0 <= ratio <= 1.25 else ' MISS'} |" if now else
                    " - | - |")
        rows.append(row)
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------------------------
# The split at growing lengths: plan against peak RSS per length (what grows with length: attention workspace,
# logits of the compared positions, the MLP's intermediate, the float64 evidence's chunks)

LENGTHS = (16, 64, 256, 1024, 4096)


def length_prompt(model: str, tokens: int) -> tuple[str, int]:
    """A prose prompt of about `tokens` tokens for `model` and its exact count (the plan's tokenizer)."""
    from kvviz.core.memory import tokens_of_text

    words = ("The museum guard knew every painting in the building, and at night he walked past them with a small "
             "lamp. ").split(" ")
    text = " ".join(words[i % len(words)] for i in range(tokens))
    lo, hi = 1, len(text)  # the longest prefix of at most `tokens` tokens (a byte tokenizer: one a character)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if tokens_of_text(model, text[:mid]) <= tokens else (lo, mid - 1)
    return text[:lo], tokens_of_text(model, text[:lo])


def run_lengths(model: str, dtypes: list[str], lengths: list[int], out: Path | None = None,
                forced: bool = False) -> list[dict]:
    """Split at half of each length (--no-proof), a fresh process each: plan total, peak RSS, plan / peak, whether
    the float64 rerun ran; each row appended to `out` (JSON) as it ends (the table can be re-planned from it)."""
    rows = json.loads(out.read_text()) if out is not None and out.is_file() else []
    for dt in dtypes:
        for n in lengths:
            prompt, T = length_prompt(model, n)
            # forced: the attention mask of the new tokens only (a logic error kvviz catches), so the float64
            # rerun happens whatever this CPU's rounding does (same shapes, same phases)
            r = measure(["split", "--model", model, "--prompt", prompt, "--split", str(T // 2), "--dtype", dt,
                         "--json", "--quiet", "--no-proof"] + (["--attention-mask", "new-only"] if forced else []))
            plan = (r.get("json") or {}).get("memory_plan") or {}
            ratio = plan["total"] / r["peak_rss"] if plan.get("total") and r["peak_rss"] else None
            j = r.get("json") or {}
            row = {"model": model, "dtype": dt, "tokens": T, "split": T // 2, "rc": r["rc"], "wall_s": r["wall_s"],
                   "plan": plan.get("total"), "peak": r["peak_rss"], "ratio": ratio,
                   "float64_ran": j.get("float64_evidence") is not None, "forced": forced,
                   "attention": (j.get("settings") or {}).get("attention"), "stderr_tail": r["stderr_tail"][-300:]}
            rows.append(row)
            if out is not None:
                out.write_text(json.dumps(rows, indent=1))
            ok = ratio is not None and 1.0 <= ratio <= 1.25
            print(f"| {Path(model).name} | {dt} | {T} | {(plan.get('total') or 0) / GIB:.3f} | "
                  f"{(r['peak_rss'] or 0) / GIB:.3f} | {ratio or 0:.2f}{'' if ok else ' MISS'} | {r['wall_s']} |"
                  + ("" if r["rc"] == 0 else f" rc {r['rc']}: {r['stderr_tail'][-160:]!r}"), flush=True)
    return rows


GIB = 1024 ** 3


def replan_lengths(out: Path) -> list[dict]:
    """This commit's plan of each row of a `lengths` results file (a child process per row, as the CLI plans it:
    same prompt, same split), settled as the run went (no float64 rerun where the run had none), against the
    peak recorded."""
    code = ("import sys, json, types; from kvviz.cli import build_parser; from kvviz.core.memory import plan_for_args; "
            "p = plan_for_args(build_parser().parse_args(sys.argv[2:])); "
            "p.settle(types.SimpleNamespace(float64=None) if sys.argv[1] == '0' else None); print(p.total)")
    rows = json.loads(out.read_text())
    for row in rows:
        prompt, T = length_prompt(row["model"], row["tokens"])
        argv = ["split", "--model", row["model"], "--prompt", prompt, "--split", str(row["split"]), "--dtype",
                row["dtype"]] + (["--attention-mask", "new-only"] if row.get("forced") else [])
        p = subprocess.run([sys.executable, "-c", code, "1" if row["float64_ran"] else "0"] + argv,
                           capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        row["plan_now"] = int(p.stdout.strip().splitlines()[-1])
        row["ratio_now"] = row["plan_now"] / row["peak"]
        ok = 1.0 <= row["ratio_now"] <= 1.25
        print(f"| {Path(row['model']).name} | {row['dtype']} | {row['tokens']} | "
              f"{'yes' if row['float64_ran'] else 'no (identical)'}{' (forced)' if row.get('forced') else ''} | "
              f"{row['plan_now'] / GIB:.3f} | {row['peak'] / GIB:.3f} | {row['ratio_now']:.2f}{'' if ok else ' MISS'} "
              f"| {row['wall_s']} |", flush=True)
    return rows


def serving_prompts(model: str, tokens: int, count: int = 4) -> Path:
    """A .txt prompt set for `model`: `count` prose prompts of about `tokens` tokens (the longest exactly that)."""
    prompt, _ = length_prompt(model, tokens)
    path = Path(f"/tmp/kvviz_serving_{tokens}.txt")
    path.write_text("\n".join([prompt] + [prompt[:max(1, len(prompt) - 3 * k)] for k in range(1, count)]) + "\n")
    return path


def cli_plan(argv: list[str]):
    """The memory plan a `python -m kvviz` command starts under (before its run settles it)."""
    from kvviz.cli import build_parser
    from kvviz.io.clirun import plan_for_args

    return plan_for_args(build_parser().parse_args(argv))


def run_serving(model: str, dtypes: list[str], lengths: list[int], out: Path | None = None, runs: int = 1,
                new_tokens: int = 8, batch: int = 4) -> list[dict]:
    """The serving study (transformers' engine, every condition) over 4 prompts of each length, a fresh process
    each: plan total (settled: without the float64 reference where no prompt parted), peak RSS, plan / peak."""
    rows = json.loads(out.read_text()) if out is not None and out.is_file() else []
    for dt in dtypes:
        for n in lengths:
            argv = ["serving", "--model", model, "--prompts", str(serving_prompts(model, n)), "--runs", str(runs),
                    "--max-new-tokens", str(new_tokens), "--batch-size", str(batch), "--dtype", dt, "--json",
                    "--quiet"]
            load = os.getloadavg()[0]
            r = measure(argv)
            j = r.get("json") or {}
            plan = j.get("memory_plan") or {}
            if not plan:  # a run that failed (the 4096-token study: the engine's 600 s limit in its float64 replay)
                plan = {"total": cli_plan(argv).total, "unsettled": True}  # the plan it started under
            ratio = plan["total"] / r["peak_rss"] if plan.get("total") and r["peak_rss"] else None
            parted = sum(p.get("first_divergence") is not None for p in j.get("prompts", []))
            row = {"model": model, "dtype": dt, "tokens": n, "plan_tokens": plan.get("tokens"), "rc": r["rc"],
                   "wall_s": r["wall_s"], "load": round(load, 1), "plan": plan.get("total"), "peak": r["peak_rss"],
                   "ratio": ratio, "parted": parted, "cache": plan.get("cache"),
                   "activations": plan.get("activations"), "reference": plan.get("reference"),
                   "stderr_tail": r["stderr_tail"][-300:]}
            rows.append(row)
            if out is not None:
                out.write_text(json.dumps(rows, indent=1))
            ok = ratio is not None and 1.0 <= ratio <= 1.25
            print(f"| {Path(model).name} | {dt} | {n} | {parted}/4 | {(plan.get('total') or 0) / GIB:.3f} | "
                  f"{(r['peak_rss'] or 0) / GIB:.3f} | {ratio or 0:.2f}{'' if ok else ' MISS'} | {r['wall_s']} | "
                  f"{row['load']} |" + ("" if r["rc"] == 0 else f" rc {r['rc']} (plan: as started, unsettled): "
                                                 f"{r['stderr_tail'][-160:]!r}"),
                  flush=True)
    return rows


PHASES = ("reference", "alone", "batch", "float64-full", "float64-alone", "float64-batch", "proof")


def serving_phases(model: str, dtype: str, tokens: int, phases: list[str], prompts: int = 4, new_tokens: int = 8,
                   batch: int = 4) -> None:
    """The serving study's phases one at a time in this process (call it in a fresh one per length): each phase's
    peak RSS above what the process held before it (/proc/self/clear_refs), beside the phase the plan counts for it
    (kvviz.core.memory.paged_study_bytes). Phases: kvviz's no-cache reference of one prompt; the engine's alone and
    batch calls of `prompts` prompts; the float64 full forward of the replay; the float64 replay of the alone and
    batch calls (the target's prompt with 1 new token, the neighbours' with `new_tokens`); the proof's first
    invariant-mode forward (its kernel probes) and its engine call."""
    from kvviz.core import memory
    from kvviz.core.execution import DEFAULT_SETTINGS, Executor
    from kvviz.core.inputs import build_inputs, encode
    from kvviz.core.replay import Replay, replay_step
    from kvviz.engines.serving import Request, TransformersEngine
    from kvviz.models.loading import load_model
    from kvviz.views.serving.run import _engine_run, _reference

    lm = load_model(model, dtype, "cpu")
    text, _ = length_prompt(model, tokens)
    texts = [text[:max(1, len(text) - 3 * k)] for k in range(prompts)]
    ids = [encode(lm, t) for t in texts]
    shape, b = memory.model_shape(__import__("kvviz.models.loading", fromlist=["parse_spec"]).parse_spec(model)), \
        memory.BYTES[dtype]
    T = max(len(i) for i in ids) + new_tokens
    eng, ex = TransformersEngine(memory.PAGE_SIZE), Executor(lm, DEFAULT_SETTINGS)
    k = min(batch, prompts)
    lm64 = ex64 = None
    for ph in phases:
        if ph.startswith("float64") and lm64 is None:
            lm64 = lm.reference()
            ex64 = Executor(lm64, DEFAULT_SETTINGS)
        base, t0 = memory.reset_peak("cpu"), time.perf_counter()
        res, res64 = memory.working_bytes(shape, b, T), memory.working_bytes(shape, 8, T)
        if ph == "reference":
            _reference(ex, lm, texts[0], new_tokens)
            plan = memory.decoding_bytes(shape, dtype, T, 1, new_tokens, False)
        elif ph in ("alone", "batch"):
            _engine_run(eng, ex, [Request(f"p{i}", x, new_tokens) for i, x in enumerate(ids)],
                        1 if ph == "alone" else k, False, set())
            plan = sum(memory.paged_call_bytes(shape, b, T, prompts, 1 if ph == "alone" else k, memory.PAGE_SIZE)) \
                + res
        elif ph == "float64-full":
            with ex64.session():
                replay_step(ex64, build_inputs(lm64, texts[0], 0, extra_tokens=new_tokens), Replay.FULL, []).double()
            plan = res64 + T * shape.vocab * 8 + memory.head_slice_bytes(shape, T)
        elif ph in ("float64-alone", "float64-batch"):
            ids64 = [encode(lm64, t) for t in texts]
            n = 1 if ph == "float64-alone" else k
            reqs = [Request("p0", ids64[0], 1, keep_scores=True)] + [Request(f"p{i}", ids64[i], new_tokens)
                                                                      for i in range(1, n)]
            _engine_run(eng, ex64, reqs, n, False, set())
            plan = sum(memory.paged_call_bytes(shape, 8, T, n, n, memory.PAGE_SIZE)) + res64 + \
                (new_tokens + 1) * shape.vocab * 8
        elif ph == "proof":
            exi = Executor(lm, DEFAULT_SETTINGS.with_(invariant=True))
            _reference(exi, lm, texts[0], 1)
            plan = memory.invariant_probe_bytes(shape, b) + memory.decoding_bytes(shape, dtype, T, 1, new_tokens,
                                                                                   False)
        else:
            raise SystemExit(f"unknown phase {ph!r}; choose from {', '.join(PHASES)}")
        peak = memory.measured_peak("cpu") - base
        print(f"| {dtype} | {T} | {ph} | {plan / GIB:.3f} | {peak / GIB:.3f} | {plan / max(peak, 1):.2f} | "
              f"{time.perf_counter() - t0:.1f} | {os.getloadavg()[0]:.1f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("build", "run", "reference", "plans", "matrix", "table", "lengths", "serving",
                                     "serving-phases"))
    ap.add_argument("--model", default="default", help="lengths: the model (spec or folder)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="lengths: comma list")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="lengths: comma list of token counts")
    ap.add_argument("--root", default="/work/bigmodels")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--phases", default=",".join(PHASES), help="serving-phases: comma list of " + ", ".join(PHASES))
    ap.add_argument("--only", default="", help="run: comma list of runs (big3b-split,big3b-greedy,gemma-split,"
                    "gemma-check); matrix: comma list of cell key parts (gguf/bfloat16/split, float64, ...)")
    ap.add_argument("--gguf", default=os.environ.get(GGUF_ENV), help=f"the real Gemma 3 270M GGUF (or ${GGUF_ENV})")
    ap.add_argument("--no-proof", action="store_true", help="matrix: runs without the invariant-mode proof")
    ap.add_argument("--force-rerun", action="store_true", help="lengths: split with the new tokens' attention mask "
                    "only (a logic error), so the float64 rerun happens at every length")
    ap.add_argument("--replan", action="store_true", help="lengths: this commit's plan of each row of --out; table: add this commit's plan of each cell beside the "
                    "plan recorded at run time")
    ap.add_argument("--out", default="", help="matrix/table: the results file (default ROOT/memory_matrix.json); "
                    "table reads every memory_matrix*.json under ROOT")
    args = ap.parse_args()
    root = Path(args.root)
    if args.what == "lengths":
        if args.replan:
            print("| model | dtype | tokens | float64 rerun | plan (GiB) | peak RSS (GiB) | plan / peak | wall (s) |\n"
                  "|---|---|---|---|---|---|---|---|")
            replan_lengths(Path(args.out))
            return 0
        print("| model | dtype | tokens | plan (GiB) | peak RSS (GiB) | plan / peak | wall (s) |\n|---|---|---|---|---|---|---|")
        run_lengths(args.model, [d for d in args.dtypes.split(",") if d],
                    [int(x) for x in args.lengths.split(",") if x], Path(args.out) if args.out else None,
                    args.force_rerun)
        return 0
    if args.what == "serving":  # 4 prompts a length, every condition, 1 run, 8 new tokens, batch 4
        print("| model | dtype | tokens | parted | plan (GiB) | peak RSS (GiB) | plan / peak | wall (s) | load |\n"
              "|---|---|---|---|---|---|---|---|---|")
        run_serving(args.model, [d for d in args.dtypes.split(",") if d],
                    [int(x) for x in args.lengths.split(",") if x], Path(args.out) if args.out else None)
        return 0
    if args.what == "serving-phases":  # one length and dtype a process (the first in --lengths, --dtypes)
        print("| dtype | tokens | phase | plan (GiB) | peak over the phase's start (GiB) | plan / peak | wall (s) | load |"
              "\n|---|---|---|---|---|---|---|---|")
        serving_phases(args.model, args.dtypes.split(",")[0], int(args.lengths.split(",")[0]),
                       [p for p in args.phases.split(",") if p])
        return 0
    if args.what == "plans":
        return 1 if check_plans() else 0
    if args.what in ("matrix", "table"):
        out = Path(args.out) if args.out else root / "memory_matrix.json"
        if args.what == "table":
            gguf = Path(args.gguf) if args.gguf and Path(args.gguf).is_file() else None
            print(matrix_table(sorted(root.glob("memory_matrix*.json")) if not args.out else [out],
                               (gguf, root) if args.replan else None))
            return 0
        gguf = Path(args.gguf) if args.gguf and Path(args.gguf).is_file() else None
        build(root / "gemma270m", GEMMA270M)
        return run_matrix(gguf, root, args.only, out, args.no_proof)
    if args.what == "build":
        for name, cfg in (("big3b", BIG3B), ("gemma270m", GEMMA270M), ("mistral500m", MISTRAL500M),
                          ("llama500m", LLAMA500M)):
            t = time.perf_counter()
            build(root / name, cfg)
            print(f"{name}: {root / name} ({time.perf_counter() - t:.0f} s)")
        return 0
    if args.what == "reference":
        print(json.dumps(reference_timing(), indent=1))
        return 0
    big, gemma = str(root / "big3b"), str(root / "gemma270m")
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 16)[:719]  # 721 tokens with BOS
    runs = {
        "big3b-split": ["split", "--model", big, "--prompt", SPLIT_PROMPT, "--split", "6", "--dtype", "bfloat16",
                        "--json", "--quiet", "--no-proof"],
        "big3b-greedy": ["greedy", "--model", big, "--prompt", SPLIT_PROMPT, "--max-new-tokens", "16", "--paths",
                         "no_cache,cache,float64", "--dtype", "bfloat16", "--json", "--quiet", "--no-proof"],
        "big3b-impossible": ["greedy", "--model", big, "--prompt", "x " * 50000, "--max-new-tokens", "16",
                             "--dtype", "bfloat16", "--quiet"],
        "gemma-split": ["split", "--model", gemma, "--prompt", long_prompt, "--split", "600", "--dtype", "bfloat16",
                        "--json", "--quiet"],
        "gemma-check": ["check", "--model", gemma, "--dtype", "bfloat16", "--json", "--quiet"],
    }
    for dt in ("bfloat16", "float32", "float64"):
        runs[f"mistral-check-{dt}"] = ["check", "--model", str(root / "mistral500m"), "--dtype", dt, "--json",
                                       "--quiet"]
    only = [r for r in args.only.split(",") if r] or list(runs)
    if any(r.startswith("mistral") for r in only):
        build(root / "mistral500m", MISTRAL500M)
    results = {}
    for name in only:
        r = measure(runs[name])
        results[name] = r
        plan = (r.get("json") or {}).get("memory_plan") or {}
        print(f"{name}: rc {r['rc']}, {r['wall_s']} s, peak RSS {r['peak_rss'] / 1e9 if r['peak_rss'] else '?':.3} GB"
              f", plan {plan.get('total_gib', '?')} GiB; {r['stderr_tail'][-200:]!r}", flush=True)
    def keep(v):
        j = v.get("json") or {}
        out = {kk: vv for kk, vv in v.items() if kk != "json"} | {"memory_plan": j.get("memory_plan")}
        out["verdict"] = j.get("verdict") or j.get("overall")
        out["float64_evidence"] = j.get("float64_evidence") is not None if "float64_evidence" in j else None
        if "paths" in j:
            out["paths"] = {k: {"seconds": p.get("seconds"), "forwards": p.get("forwards"),
                                "text": p.get("text")} for k, p in j["paths"].items()}
            out["pairs"] = [{kk: p.get(kk) for kk in ("a", "b", "verdict", "first_divergence")}
                            for p in j.get("pairs", [])]
        return out

    stamp = "-".join(only)
    (root / f"memory_bench-{stamp}.json").write_text(json.dumps({k: keep(v) for k, v in results.items()}, indent=1,
                                                                default=str))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
