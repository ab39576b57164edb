"""Every decoder transformers ships: for each model type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, a tiny random model
built from its own config class (2-4 layers, small hidden size and vocabulary, a sliding window the prompt passes,
its special features kept - MoE routing, QK-norm, softcapping, alibi, parallel blocks, layer patterns), then the
cache-safety card (kvviz.views.check.run) in float64 plus the invariant-mode proof (cached vs full in invariant mode, past
the window: exactly 0, or the first op that breaks it, from the bisector).

A row: `safe`, `unsafe` (the failing checks and their float64 gaps) or `cannot run` (one line: why). Multimodal
types run text only. The models are written with kvviz.models.tiny's byte tokenizer and loaded through the real loading
code, like `tiny:*`.

    python -m kvviz sweep-architectures                       # every type -> docs/architectures.md (+ .json)
    python -m kvviz sweep-architectures --only gemma3_text,qwen3 --json
"""
from __future__ import annotations

import json
import math
import signal
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
import argparse
import re
import subprocess
import sys
import threading

import torch
import transformers

from ..models.archconfig import (FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, WINDOW,  # noqa: F401 (re-exported)
                         tiny_arch_config)
from ..core.errors import KvvizError, first_line
from ..core import cancel
from ..core.execution import DEFAULT_SETTINGS, ExecSettings, Executor
from ..core.protocol import RunContext
from ..models.compat import causal_lm_type_names, state_argument
from ..models import loading
from ..models.loading import clear_cache
from ..models.tiny import byte_tokenizer, random_model
from ..views import bisect, check, split
from ..views.bisect.run import made_inside
from .. import views

SEED = 1234
PROMPT = "The guard knew each one."  # 25 byte tokens: past the window of 8 (2 x 8 + 4)
REUSE = ("Be brief.", (" Q: Sky? A:", " Q: Sea? A:"))
# The CI subset (tests/test_archsweep.py): checked against docs/architectures.json on every run.
CI_SUBSET = ("gemma3_text", "gemma2", "qwen3", "qwen2_moe", "phi3", "falcon", "mpt", "gpt_bigcode", "olmo2",
             "cohere", "starcoder2", "mixtral", "bloom", "opt", "gptj", "gpt2", "llama", "mistral", "gpt_neox",
             "cohere2", "roberta", "phi", "camembert", "marian")


@dataclass
class ArchRow:
    model_type: str
    status: str  # safe | unsafe | cannot run
    reason: str = ""  # cannot run: one line; unsafe: the failing checks and gaps
    checks: list[dict] = field(default_factory=list)
    proof: str = ""  # "0" (exactly 0 in invariant mode), "not run (…)" or the first op / module that breaks it
    proof_gap: float | None = None
    proof_s: float | None = None  # seconds the invariant-mode proof took (None: not run)
    config: dict = field(default_factory=dict)  # what was built: layers, hidden, window, features
    seconds: float = 0.0
    transformers: str = field(default_factory=lambda: _transformers_version())  # the version the row ran on

    def to_dict(self) -> dict:
        return asdict(self)


def _transformers_version() -> str:
    return transformers.__version__


def table_version(rows: list[dict]) -> str:
    """The transformers version a table was made with: its rows' one version ("mixed: a, b" when they differ; rows
    written before versions were recorded count as unknown)."""
    versions = sorted({r.get("transformers") or "unknown" for r in rows})
    return versions[0] if len(versions) == 1 else "mixed: " + ", ".join(versions)


def model_types() -> list[str]:
    return causal_lm_type_names()


class _Timeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float | None):
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def handler(signum, frame):
        raise _Timeout(f"took longer than {seconds:g} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _one_line(e: BaseException) -> str:
    return first_line(e, 220, typed=True)


def build_arch(model_type: str, folder: Path) -> dict:
    """Write the tiny random `model_type` model with the byte tokenizer to `folder`; return a summary of it."""
    config = tiny_arch_config(model_type)
    model = random_model(config, SEED)
    model.save_pretrained(folder)
    if getattr(model.config, "model_type", model_type) != config.model_type:
        # a causal-LM class that keeps only its text sub-config (Emu3, Mllama) saves that one, whose model type
        # transformers' causal-LM mapping does not know: write the type's own config, as a real checkpoint has
        config.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    text = getattr(config, "text_config", None) or config
    n_params = sum(p.numel() for p in model.parameters())
    return {"class": type(model).__name__, "params": n_params,
            "layers": getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None),
            "hidden": getattr(text, "hidden_size", None),
            "window": getattr(text, "sliding_window", None),
            "layer_types": sorted(set(getattr(text, "layer_types", None) or [])) or None}


def _proof(lm64) -> tuple[str, float | None]:
    """Invariant mode, float64: cached vs full, the rest in one chunk, on the sweep's prompt (past the window of 8
    where the type has one). "0" or the first op that breaks it."""
    cfg = split.SplitConfig(PROMPT, split=len(lm64.tokenizer(PROMPT)["input_ids"]) // 2, mode="chunk")
    res = views.run(split.VIEW, lm64, cfg, RunContext(settings=ExecSettings(invariant=True)))
    if not res.main.has_cache:
        return "n/a (no cache)", None
    if not res.main.identical:
        return f"{res.main.max_abs:.3g} survives (chunk); first: {_first_op(lm64, cfg)}", res.main.max_abs
    return "0", 0.0


def _first_op(lm64, cfg) -> str:
    try:
        res = views.run(bisect.VIEW, lm64, cfg, RunContext(settings=ExecSettings(invariant=True)))
        op = getattr(res, "first_op", None)
        if op is not None:
            made = ""
            if res.first is not None and res.first.input_differs and made_inside(res.first):
                made = (f"; its input already differs - made inside {res.first.name.rsplit('.', 1)[0]} by ops of "
                        f"other shapes in the two runs (the model's own chunked algorithm)")
            return (f"{op.op} in {op.layer}, inputs {op.shapes} {'/'.join(dict.fromkeys(op.dtypes))}, max |Δ| "
                    f"{op.max_abs:.3g}{made}")
        return res.explanation
    except Exception as e:  # noqa: BLE001
        return f"(bisector failed: {_one_line(e)})"


def run_arch(model_type: str, workdir: Path, timeout: float | None = 120) -> ArchRow:
    """Build, load and check one model type; never raises."""
    t0 = time.perf_counter()
    row = ArchRow(model_type, "cannot run")
    folder = Path(workdir) / model_type
    lm = None
    try:
        with _time_limit(timeout):
            try:
                row.config = build_arch(model_type, folder)
            except _Timeout:
                raise
            except Exception as e:  # noqa: BLE001
                row.reason = _cache_api_reason(model_type, e) or _build_failure(model_type, e)
                return row
            try:
                lm = loading.load_model(str(folder), dtype="float64", device="cpu")
            except Exception as e:  # noqa: BLE001
                row.reason = "cannot load: " + _one_line(e)
                return row
            langs = getattr(lm.config, "languages", None)
            if hasattr(lm.model, "set_default_language") and langs:
                lm.model.set_default_language(langs[0])  # X-MOD: one language's adapters (every input has one)
                row.config["language"] = langs[0]
            recurrent = _recurrent_state(lm.model)
            if recurrent:
                row.config["cache"] = recurrent
            card = views.run(check.VIEW, lm, check.CheckConfig(prompt=PROMPT, reuse_prefix=REUSE[0],
                                                               reuse_questions=tuple(REUSE[1])))
            row.checks = [{"name": c.name, "status": c.status, "figure": c.figure, "evidence": c.evidence}
                          for c in card.checks]
            failed = [c for c in card.checks if c.status == "fail"]
            no_cache = next((c for c in card.checks if c.name == "cache" and c.status == "n/a"), None)
            row.status = "unsafe" if failed else ("no cache" if no_cache else "safe")
            if no_cache:
                row.reason, row.proof = no_cache.evidence, "n/a (no cache)"
                return row
            row.reason = "; ".join(f"{c.name}: {_gap_text(c.figure)}" for c in failed)
            if any(c.name == "causal attention" and c.status == "fail" for c in card.checks):
                row.proof = "n/a (no cache: bidirectional)"
            else:
                t_proof = time.perf_counter()
                row.proof, row.proof_gap = _proof(lm)
                row.proof_s = round(time.perf_counter() - t_proof, 3)
    except _Timeout as e:
        row.status, row.reason = "cannot run", f"timeout: {e}"
    except (KvvizError, Exception) as e:  # noqa: BLE001
        row.status = "cannot run"
        row.reason = _cache_api_reason(model_type, e) or "the run failed: " + _one_line(e)
        row.checks.append({"name": "traceback", "status": "note", "figure": None,
                           "evidence": traceback.format_exc(limit=-2)[-600:]})
        if lm is not None and model_type not in _CACHE_API and cache_path_raises(lm):
            row.status = "unsafe"
            row.reason = ("the cache path raises where the same forward without a cache runs: "
                          + _one_line(e)[:160])
            row.checks.insert(0, {"name": "cache path runs", "status": "fail", "figure": None,
                                  "evidence": row.reason})
            row.proof = "n/a (the cached forward raises)"
    finally:
        row.seconds = round(time.perf_counter() - t0, 2)
        clear_cache()
        torch.set_num_threads(torch.get_num_threads())
    return row


def cache_path_raises(lm) -> bool:
    """A model whose cached forward raises while the same forward without a cache runs: the model cannot use its
    cache (a logic failure of the model, proved by the two calls), not a failure of the sweep."""
    ex = Executor(lm, DEFAULT_SETTINGS)
    ids = torch.arange(1, 9, device=lm.device).unsqueeze(0) % max(2, int(getattr(lm.config, "vocab_size", 2) or 2))
    try:
        with ex.session():
            ex.forward(ids, use_cache=False, hidden=False)
    except Exception:  # noqa: BLE001 - the model fails without a cache too: not the cache's doing
        return False
    try:
        with ex.session():
            ex.forward(ids, use_cache=True, hidden=False)
    except Exception:  # noqa: BLE001
        return True
    return False


def _recurrent_state(model) -> str | None:
    """What a state-space / recurrent model's cache holds (None for a key/value cache model)."""
    arg = state_argument(model)
    if arg is None:
        return None
    return "a recurrent state" + (" (cache_params)" if arg != "state" else "")


def _build_failure(model_type: str, e: BaseException) -> str:
    """One line: why the tiny model could not be built. A package the model needs that is not installed, or
    transformers' own causal-LM class failing on the type's own config, is 'not buildable here' (outside the
    percentage); anything else is the sweep's config builder failing, which counts against it."""
    text = str(e)
    pkg = re.search(r"requires the (\w[\w-]*) library", text)
    if pkg or isinstance(e, ImportError):
        name = pkg.group(1) if pkg else getattr(e, "name", None) or "a package"
        return f"{NOT_BUILDABLE}needs the `{name}` package, not installed (" + _one_line(e)[:120] + ")"
    if model_type in _TRANSFORMERS_CANNOT_BUILD:
        return f"{NOT_BUILDABLE}{_TRANSFORMERS_CANNOT_BUILD[model_type]} ({_one_line(e)[:100]})"
    return "cannot build a tiny model: " + _one_line(e)


# Types whose causal-LM class in transformers' own mapping cannot be built from the type's own config at all (any
# size, any device): a real checkpoint of the type fails in AutoModelForCausalLM the same way.
_TRANSFORMERS_CANNOT_BUILD = {
    "musicgen": "transformers' MusicgenForCausalLM reads config.dropout, which only the decoder sub-config of a "
                "musicgen config has: AutoModelForCausalLM cannot build it from a musicgen config",
    "musicgen_melody": "transformers' MusicgenMelodyForCausalLM reads config.dropout, which only the decoder "
                       "sub-config of a musicgen_melody config has: AutoModelForCausalLM cannot build it",
}


# Types whose transformers implementation takes its cache in a way kvviz's loops (prefix, then the new tokens with
# the cache) do not drive: the run fails, and this says why (they count as not run).
_CACHE_API = {
    "cpmant": "CPM-Ant's cached call takes the whole sequence again and slices off the past itself; kvviz feeds "
              "only the new tokens",
    "blt": "transformers' BLT cannot make its own cache: with use_cache=True it builds DynamicCache(config=BltConfig), "
           "which reads num_hidden_layers, a field only its sub-configs have (plain transformers fails the same way)",
    "gemma4_assistant": "a Gemma 4 draft (assistant) model: every layer reads the keys and values its target model "
                        "shares with it (num_kv_shared_layers = num_hidden_layers), so it cannot run alone",
    "gemma4_unified_assistant": "a Gemma 4 draft (assistant) model: its layers read the keys and values its target "
                                "model shares with it, so it cannot run alone",
    "prophetnet": "ProphetNet's decoder takes its cache one token per call only (transformers asserts it), so the "
                  "one-chunk checks cannot run",
}


def _cache_api_reason(model_type: str, e: BaseException) -> str | None:
    """Why a type of _CACHE_API cannot run, with the error it raised; None for any other type."""
    return f"{_CACHE_API[model_type]} ({_one_line(e)[:120]})" if model_type in _CACHE_API else None


def _gap_text(fig) -> str:
    if fig is None:
        return "no cache"
    return f"float64 gap {fig:.3g}" if math.isfinite(fig) else "float64 gap ∞"


def sweep(types: list[str] | None = None, timeout: float | None = 120, progress=None,
          workdir: Path | None = None, jobs: int = 1) -> list[ArchRow]:
    """Run the types (all by default) and return their rows in order. jobs > 1: that many worker processes
    (`python -m kvviz.io.archsweep TYPE...`, one JSON row per line), each type still under its own time limit."""
    progress = progress or (lambda i, n, t, row: None)
    all_types = model_types()
    types = types or all_types
    unknown = [t for t in types if t not in all_types]
    if unknown:
        raise KvvizError(f"unknown model type '{unknown[0]}': not in transformers' causal-LM mapping "
                         f"({len(all_types)} types, e.g. {', '.join(all_types[:5])})")
    if jobs > 1 and len(types) > 1:
        return _sweep_parallel(types, timeout, progress, workdir, jobs)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvviz-archsweep-", dir=workdir) as tmp:
        for i, t in enumerate(types):
            row = run_arch(t, Path(tmp), timeout)
            rows.append(row)
            progress(i + 1, len(types), t, row)
    return rows


WORKER_SLACK_S = 60.0  # a worker's start (torch, transformers) on top of its types' time limits


def _sweep_parallel(types, timeout, progress, workdir, jobs) -> list[ArchRow]:
    groups = [types[i::jobs] for i in range(min(jobs, len(types)))]
    done: dict[str, ArchRow] = {}
    lock = threading.Lock()

    def read(proc, group):
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            row = ArchRow(**json.loads(line))
            with lock:
                done[row.model_type] = row
                progress(len(done), len(types), row.model_type, row)
        proc.wait()
        why = stopped.get(proc.pid) or f"its worker process ended (exit {proc.returncode})"
        for t in group:  # a worker that died (out of memory, killed) leaves its remaining types without a row
            with lock:
                if t not in done:
                    done[t] = ArchRow(t, "cannot run", f"not reached: {why}")
                    progress(len(done), len(types), t, done[t])

    stopped: dict[int, str] = {}
    env_timeout = "0" if not timeout else repr(float(timeout))
    procs, threads = [], []
    for group in groups:
        cmd = [sys.executable, "-m", "kvviz.io.archsweep", "--timeout", env_timeout,
               *(["--workdir", str(workdir)] if workdir else []), *group]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             cwd=str(Path(__file__).resolve().parents[2]))
        th = threading.Thread(target=read, args=(p, group), daemon=True)
        th.start()
        procs.append(p)
        threads.append(th)
    # each type has `timeout` s inside its worker (SIGALRM, which a wait inside C code never sees): the parent
    # stops a worker past all its types' time plus a minute, so the sweep never waits without limit
    limit = None if not timeout else float(timeout) * max(len(g) for g in groups) + WORKER_SLACK_S
    deadline = None if limit is None else time.monotonic() + limit
    try:
        for th in threads:
            while th.is_alive():
                if deadline is not None and time.monotonic() > deadline:
                    for p in procs:
                        if p.poll() is None:
                            stopped[p.pid] = f"its worker passed the sweep's limit ({limit:.0f} s) and was stopped"
                            p.kill()
                    deadline = None
                th.join(timeout=1.0)
                cancel.check()  # a stopped sweep: its workers are killed below (kvviz.core.cancel)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [done[t] for t in types]


def _worker(argv: list[str]) -> int:
    """`python -m kvviz.io.archsweep [--timeout S] [--workdir D] TYPE...`: one JSON row per line (the parallel sweep's
    worker)."""
    ap = argparse.ArgumentParser(prog="python -m kvviz.io.archsweep")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("types", nargs="+")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvviz-archsweep-", dir=a.workdir) as tmp:
        for t in a.types:
            row = run_arch(t, Path(tmp), a.timeout or None)
            print(json.dumps(row.to_dict(), default=str), flush=True)
    return 0


NOT_BUILDABLE = "not buildable here: "  # the reason's prefix for a type outside the percentage


def totals(rows: list[ArchRow]) -> dict:
    """Counts, and the share of the types buildable on a CPU that actually ran (a type is outside it only when its
    reason says it cannot be built here: a package or CUDA kernel it needs, or transformers' own class failing)."""
    ran = [r for r in rows if r.status != "cannot run"]
    unbuildable = sum(r.status == "cannot run" and r.reason.startswith(NOT_BUILDABLE) for r in rows)
    buildable = len(rows) - unbuildable
    return {"types": len(rows), "run": len(ran), "safe": sum(r.status == "safe" for r in rows),
            "unsafe": sum(r.status == "unsafe" for r in rows),
            "no cache": sum(r.status == "no cache" for r in rows),
            "cannot run": sum(r.status == "cannot run" for r in rows),
            "not buildable": unbuildable, "buildable": buildable,
            "run %": round(100.0 * len(ran) / buildable, 1) if buildable else 0.0,
            "proof 0": sum(r.proof == "0" for r in rows)}


def merge_rows(path: Path, rows: list[ArchRow]) -> list[dict]:
    """Rows of `path` (JSON) with `rows` replacing the same model types."""
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    new = {r.model_type: r.to_dict() for r in rows}
    merged = [new.pop(r["model_type"], r) for r in old] + list(new.values())
    return sorted(merged, key=lambda r: r["model_type"])


def markdown(rows: list[dict], meta: dict) -> str:
    objs = [ArchRow(**{"transformers": "unknown", **r}) for r in rows]
    t = totals(objs)
    lines = [
        "# Every causal-LM architecture in transformers",
        "",
        f"`python -m kvviz sweep-architectures` (`make arch-sweep`): transformers {table_version(rows)}, "
        f"{t['types']} model types in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`. For each, a tiny random model from its "
        f"own config class ({LAYERS}-4 layers, hidden {HIDDEN}, vocabulary {VOCAB}, sliding window {WINDOW} where the "
        f"type has one, special features kept), then the cache-safety card in float64 (cached vs full in one chunk "
        f"and token by token, left padding with position ids, alone vs in a batch, reuse through deep copies, past "
        f"the window) and the invariant-mode proof (cached vs full, the rest in one chunk, float64: a gap of "
        f"exactly 0, or the first op that breaks it).",
        "",
        f"**Totals:** {t['run']} run ({t['safe']} safe, {t['unsafe']} unsafe, {t['no cache']} causal with no cache "
        f"to check), {t['cannot run']} cannot run ({t['not buildable']} of them not buildable on a CPU here); "
        f"**{t['run']} of the {t['buildable']} buildable on a CPU ran: {t['run %']:g} %**; proof exactly 0 on "
        f"{t['proof 0']}. {meta.get('note', '')}",
        "",
        "| model type | verdict | evidence | proof (invariant mode) | transformers |",
        "|---|---|---|---|---|",
    ]
    for r in objs:
        ev = r.reason if r.status != "safe" else (
            f"every check passes in float64 ({r.config.get('layers')} layers"
            + (f", window {r.config['window']}" if r.config.get("window") else "") + ")")
        lines.append(f"| {r.model_type} | {r.status} | {_cell(ev)} | {_cell((r.proof or '—') + (f' ({r.proof_s:.1f} s)' if r.proof_s is not None else ''))} | {r.transformers} |")
    lines.append("")
    return "\n".join(lines)


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def write_docs(rows: list[dict], docs: Path, meta: dict | None = None) -> None:
    docs.mkdir(parents=True, exist_ok=True)
    meta = {**(meta or {}), "transformers": table_version(rows)}
    (docs / "architectures.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    (docs / "architectures.md").write_text(markdown(rows, meta or {}))


def add_parser(sub) -> None:
    """The `sweep-architectures` subcommand (kvviz/cli.py adds it)."""
    ap = sub.add_parser("sweep-architectures", help="every causal-LM type in transformers: a tiny random model "
                        "each, the cache-safety card in float64 and the invariant proof -> docs/architectures.md")
    ap.add_argument("--only", default=None, help="comma-separated model types to (re)run; their rows replace the "
                    "old ones in the output")
    ap.add_argument("--only-new", action="store_true", help="only the installed transformers' types the table has "
                    "no row for yet (a new release's new types); their rows are added to it")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per model type (default 120)")
    ap.add_argument("--note", default=None, help="how and where the sweep ran (machine load), for the table's "
                    "totals line (default: the table's current note)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1); each type keeps its own "
                    "time limit")
    ap.add_argument("--out", default="docs", help="folder of architectures.md/.json (default docs); '-' writes none")


def out_path_json(args) -> Path:
    return Path("/nonexistent") if args.out == "-" else Path(args.out) / "architectures.json"


def unmeasured_types(table: Path) -> list[str]:
    """The installed transformers' causal-LM types that the table (architectures.json) has no row for."""
    rows = json.loads(table.read_text())["rows"] if table.exists() else []
    return sorted(set(model_types()) - {r["model_type"] for r in rows})


def selected_types(args) -> list[str] | None:
    """The types a `sweep-architectures` call runs (None: every type)."""
    if getattr(args, "only_new", False):
        if args.only is not None:
            raise KvvizError("--only-new and --only choose the types two ways: give one of them")
        return unmeasured_types(Path(args.out if args.out != "-" else "docs") / "architectures.json")
    types = [t.strip() for t in args.only.split(",") if t.strip()] if args.only else None
    if args.only is not None and not types:
        raise KvvizError("--only needs at least one model type")
    return types


def cli(args) -> int:
    types = selected_types(args)
    if types == [] and getattr(args, "only_new", False):
        print(f"every causal-LM type of transformers {transformers.__version__} has a row: nothing new to sweep")
        return 0
    if args.timeout is not None and args.timeout <= 0:
        raise KvvizError(f"--timeout must be a positive number of seconds, not {args.timeout:g}")
    jobs = getattr(args, "jobs", 1) or 1
    note = getattr(args, "note", None)
    if note is None and out_path_json(args).exists():  # an --only rerun keeps the table's note on how it was run
        note = json.loads(out_path_json(args).read_text()).get("meta", {}).get("note", "")
    note = note or ""
    if jobs < 1:
        raise KvvizError(f"--jobs must be 1 or more, not {jobs}")
    out = None if args.out == "-" else Path(args.out)
    t0 = time.perf_counter()
    done: list[ArchRow] = []

    def progress(i, n, t, row):
        done.append(row)
        if not args.json:
            print(f"[{i}/{n}] {t}: {row.status}" + (f" - {row.reason}" if row.reason else "")
                  + (f"; proof {row.proof}" if row.proof else "")
                  + (f" in {row.proof_s:.1f} s" if row.proof_s is not None else "") + f" ({row.seconds:.1f} s)",
                  flush=True)
        if out is not None:  # written as it goes: an interrupted sweep keeps its rows
            rows = merge_rows(out / "architectures.json", [row])
            write_docs(rows, out, {"note": note})

    rows = sweep(types, args.timeout, progress, jobs=jobs)
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"rows": [r.to_dict() for r in rows], "totals": totals(rows), "elapsed_s": elapsed},
                         indent=1, default=str))
    else:
        t = totals(rows)
        print(f"\n{t['types']} types: {t['run']} run ({t['safe']} safe, {t['unsafe']} unsafe, {t['no cache']} no "
              f"cache), {t['cannot run']} cannot run ({t['not buildable']} not buildable on a CPU here); "
              f"{t['run %']:g} % of the buildable ran; proof 0 on {t['proof 0']}; {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_worker(sys.argv[1:]))
