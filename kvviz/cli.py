"""Command line: `python -m kvviz <view> ...` — every view of the library, one subcommand each (`--help` lists them).

Each subcommand checks its arguments, runs the library and returns an Outcome; `_run` refuses the common flags a
subcommand cannot honour, writes --json-out / --html / --repro, and prints JSON (--json) or the summary."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Callable

from .dtypes import DTYPE_NAMES
from .errors import OUT_OF_MEMORY_HINT, KvvizError, free_memory, is_out_of_memory
from .inputs import MASK_MODES, POSITION_MODES
from .loading import ATTN_CHOICES


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, non-zero exit
        self.exit(2, f"kvviz: error: {message}\n")


def _progress_to_stderr(quiet: bool):
    if quiet:
        return None
    last = {"msg": None}

    def report(frac: float, msg: str) -> None:
        if msg != last["msg"]:
            last["msg"] = msg
            print(f"[{frac * 100:3.0f}%] {msg}", file=sys.stderr, flush=True)

    return report


def _model_args(p: argparse.ArgumentParser, attn_list: bool = False) -> None:
    p.add_argument("--model", default="default", help="default | tiny:<arch> | hub id | folder | file.gguf")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    if attn_list:  # the matrix: a comma-separated list of attention implementations, one grid column each
        p.add_argument("--attn", "--attns", dest="attns", default="eager,sdpa",
                       help="comma-separated: eager,sdpa,flex_attention,flash_attention_2")
        p.set_defaults(attn="auto")
    else:
        p.add_argument("--attn", default="auto", choices=ATTN_CHOICES, help="attention implementation")
    p.add_argument("--devices", default="one", choices=("one", "auto", "spread"),
                   help="one: the whole model on --device; auto: accelerate's device_map (GPUs, then CPU RAM, then "
                        "disk offload); spread: layers split evenly over several GPUs")
    p.add_argument("--max-memory", default=None,
                   help="with --devices auto|spread: budget per device, e.g. 0=20GiB,1=20GiB,cpu=64GiB")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model's own Python code (off by default; only for models you trust)")
    p.add_argument("--invariant", action="store_true",
                   help="run in invariant mode: every op computes a row the same way however many rows it sees, so a "
                        "cached run equals the full forward bit for bit wherever the logic is right")
    p.add_argument("--no-proof", action="store_true",
                   help="skip the invariant-mode rerun that proves precision verdicts (faster; verdicts stay)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.add_argument("--json-out", default=None, help="also save the result as JSON (with the environment) to this file")
    p.add_argument("--html", default=None, help="also write a self-contained HTML report to this file")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--plan", action="store_true", help="print the memory plan of this run and exit (nothing loaded)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m kvviz", description="Where does a KV cache change a model's numbers, and why?")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    sp = sub.add_parser("split", help="full forward vs prefix cached + rest through past_key_values")
    _model_args(sp)
    sp.add_argument("--prompt", required=True)
    sp.add_argument("--split", type=int, required=True, help="prompt tokens [0, K) go to the cache")
    sp.add_argument("--mode", default="chunk", choices=("chunk", "step"))
    sp.add_argument("--left-pad", type=int, default=0)
    sp.add_argument("--position-ids", default="auto", choices=POSITION_MODES)
    sp.add_argument("--attention-mask", default="full", choices=MASK_MODES)
    sp.add_argument("--repro", default=None, help="also write a standalone repro script (torch + transformers only)")
    gp = sub.add_parser("greedy", help="greedy decoding with and without cache: where the paths part and why")
    _model_args(gp)
    gp.add_argument("--prompt", required=True)
    gp.add_argument("--max-new-tokens", type=int, default=20)
    gp.add_argument("--left-pad", type=int, default=0)
    gp.add_argument("--position-ids", default="auto", choices=POSITION_MODES, help="for the cache path")
    gp.add_argument("--paths", default="no_cache,cache,generate",
                    help="comma-separated: no_cache,cache,generate,user_loop,float64")
    gp.add_argument("--fast", action="store_true", help="preview the no-cache path by teacher forcing")
    gp.add_argument("--stop-at-divergence", action="store_true")
    gp.add_argument("--repro", default=None, help="also write a standalone repro script (torch + transformers only)")
    dp = sub.add_parser("dtypes", help="the split comparison in several dtypes, over one prompt or a prompt set")
    _model_args(dp)
    src = dp.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompts", help="'builtin', 'builtin:<category>', or a .txt (one a line) / .jsonl file")
    dp.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    dp.add_argument("--dtypes", default="float32,float16,bfloat16", help="compared with float64 (always run)")
    dp.add_argument("--split", default="last", help="'last' (all but the last token cached), 'half', or K")
    dp.add_argument("--mode", default="chunk", choices=("chunk", "step"))
    dp.add_argument("--repro", default=None, help="also write a standalone repro script (torch + transformers only)")

    pp = sub.add_parser("padding", help="alone / left-padded / in a batch × cache settings: precision or logic")
    _model_args(pp)
    pp.add_argument("--prompt", required=True)
    pp.add_argument("--split", type=int, default=None, help="default: half the prompt")
    pp.add_argument("--left-pad", type=int, default=4)
    pp.add_argument("--repro", default=None, help="also write a standalone repro script (torch + transformers only)")

    bp = sub.add_parser("bisect", help="name the first module whose output differs between the cached run and the "
                                       "full forward")
    _model_args(bp)
    bp.add_argument("--prompt", required=True)
    bp.add_argument("--split", type=int, required=True)
    bp.add_argument("--mode", default="chunk", choices=("chunk", "step"))
    bp.add_argument("--left-pad", type=int, default=0)
    bp.add_argument("--position-ids", default="auto", choices=POSITION_MODES)
    bp.add_argument("--attention-mask", default="full", choices=MASK_MODES)

    tp = sub.add_parser("loading-trap", help="from_pretrained(dtype=16-bit) vs float32 + .to(16-bit): two models")
    _model_args(tp)
    tp.add_argument("--prompt", default="This is a ")
    tp.add_argument("--max-new-tokens", type=int, default=24)
    tp.add_argument("--cast-dtype", default="bfloat16", choices=("bfloat16", "float16"))
    tp.add_argument("--repro", default=None, help="also write a standalone repro script (torch + transformers only)")

    mp = sub.add_parser("matrix", help="attention × cache kind × compile × precision flags, repeated: which "
                                       "settings change greedy decoding, and how")
    _model_args(mp, attn_list=True)
    mp.add_argument("--prompt", default=None, help="the prompt (row 0); required unless --preset sliding-window")
    mp.add_argument("--preset", choices=("sliding-window",), default=None,
                    help="sliding-window (the torch.compile report): a short left-padded prompt "
                         "batched with one longer than the sliding window, "
                         "generating past the window")
    mp.add_argument("--max-new-tokens", type=int, default=16)
    mp.add_argument("--cache", default="dynamic,static",
                    help="comma-separated: dynamic,static,offloaded,offloaded_static,quantized")
    mp.add_argument("--compile", default="off", help="comma-separated: off,default,reduce-overhead,max-autotune")
    mp.add_argument("--flags", action="append", default=None,
                    help="one flag set per option, comma-separated inside: tf32, no-bf16-reduced-reduction, "
                         "no-fp16-reduced-reduction, deterministic, sdpa=math|flash|efficient|cudnn; 'none' for "
                         "no flags (repeat --flags for several sets)")
    mp.add_argument("--repeats", type=int, default=2)
    mp.add_argument("--left-pad", type=int, default=0)
    mp.add_argument("--position-ids", default="auto", choices=POSITION_MODES)
    mp.add_argument("--batch-with", action="append", default=[], help="another prompt in the batch (repeatable)")
    mp.add_argument("--repro", default=None, help="also write a standalone repro script of the cells run without "
                                                   "torch.compile (torch + transformers only)")

    cp = sub.add_parser("cache", help="the KV cache as an object: save, load (continue and compare), size")
    csub = cp.add_subparsers(dest="cache_command", parser_class=_Parser)
    cs = csub.add_parser("save", help="write the cache of a prompt to a safetensors file")
    _model_args(cs)
    cs.add_argument("--prompt", required=True)
    cs.add_argument("--out", required=True, help="FILE.safetensors")
    cl = csub.add_parser("load", help="reload a saved cache, continue with text, compare with a fresh cache")
    _model_args(cl)
    cl.add_argument("--file", required=True)
    cl.add_argument("--continue", dest="cont", required=True, help="text fed after the cached tokens")
    cz = csub.add_parser("size", help="bytes per token, the formula and the live cache's measured size")
    _model_args(cz)
    cz.add_argument("--tokens", type=int, required=True)
    cz.add_argument("--batch", type=int, default=1)
    cz.add_argument("--no-measure", action="store_true", help="formula only (no forward)")

    op = sub.add_parser("open", help="show a saved result (JSON export) without running any model")
    op.add_argument("file")

    kp = sub.add_parser("check", help="is this model cache-safe? a battery of float64 checks")
    _model_args(kp)
    kp.add_argument("--weights", default="none", choices=("none", "int8", "int4", "bnb-int8", "bnb-nf4"),
                    help="check the model with weight-only quantized linear layers (optimum-quanto)")
    kp.add_argument("--repro", default=None, help="also write a standalone script of the card's float64 split checks")
    kp.add_argument("--kv", default="none", help="check with a quantized KV cache: fp8, quanto:int4, quanto:int2, "
                                                 "hqq:int4, hqq:int2, hqq:int8")

    qp = sub.add_parser("quant", help="a quantized KV cache and/or quantized weights against the unquantized run: "
                                      "per-step KL, greedy agreement, gap per layer")
    _model_args(qp)
    qp.add_argument("--prompt", required=True)
    qp.add_argument("--kv", default="none", help="fp8, quanto:int4, quanto:int2, hqq:int4, hqq:int2, hqq:int8, none")
    qp.add_argument("--residual", type=int, default=8, help="tokens kept unquantized in the KV cache's residual")
    qp.add_argument("--weights", default="none", choices=("none", "int8", "int4", "bnb-int8", "bnb-nf4"),
                    help="int8/int4: optimum-quanto weight-only (CPU and CUDA); bnb-int8/bnb-nf4: bitsandbytes (CUDA)")
    qp.add_argument("--max-new-tokens", type=int, default=24)
    qp.add_argument("--repro", default=None, help="also write a standalone repro script (torch + transformers only)")

    rp = sub.add_parser("reuse", help="a prompt cache reused for several continuations: fresh, deep copy, reused")
    _model_args(rp)
    rp.add_argument("--prefix", required=True)
    rp.add_argument("--continuation", action="append", required=True, help="repeat for several")
    rp.add_argument("--max-new-tokens", type=int, default=12)
    rp.add_argument("--repro", default=None, help="also write a standalone repro script (torch + transformers only)")
    vp = sub.add_parser("serve-study", help="serving conditions (alone, continuous batch, warm prefix) × R runs: "
                                            "distinct completions per prompt, where and why they part")
    _model_args(vp)
    vsrc = vp.add_mutually_exclusive_group()
    vsrc.add_argument("--prompt", help="one prompt")
    vsrc.add_argument("--prompts", default=None,
                      help="'builtin' (default), 'builtin:<category>', or a .txt (one a line) / .jsonl file")
    vp.add_argument("--limit", type=int, default=20, help="at most this many prompts (default 20)")
    vp.add_argument("--prefix", default="", help="a shared prefix put before every prompt (warmed for 'warm')")
    vp.add_argument("--conditions", default="alone,batch,warm", help="comma-separated: alone,batch,warm")
    vp.add_argument("--runs", type=int, default=5, help="runs per condition (R)")
    vp.add_argument("--max-new-tokens", type=int, default=16)
    vp.add_argument("--batch-size", type=int, default=4, help="k: requests in flight in the batch condition")
    vp.add_argument("--seed", type=int, default=0, help="seed of the batch draws")
    vp.add_argument("--engine", default="transformers", choices=("transformers", "vllm"))
    vp.add_argument("--page-size", type=int, default=8, help="tokens per cache page (prefix sharing is per page)")
    vp.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="GPUs one vLLM engine spreads the model over (the vLLM engine only; refused otherwise)")
    vp.add_argument("--repro", default=None, help="also write a standalone repro script (torch + transformers only)")
    from .archsweep import add_parser as _archsweep_parser  # every causal-LM architecture transformers ships

    _archsweep_parser(sub)
    return parser


def _spec(args):
    """The model spec, parsed once from --model and carried whole from here on."""
    from .loading import parse_spec

    if not hasattr(args, "spec"):
        args.spec = parse_spec(args.model)
    return args.spec


def _settings(args):
    """How the model runs (kvviz.execution.ExecSettings), from the common options."""
    from .execution import ExecSettings

    return ExecSettings(invariant=bool(getattr(args, "invariant", False))).validate()


class _PlanShown(Exception):
    """--plan: the memory plan was printed; nothing is loaded or run."""


def _plan_gate(args) -> None:
    """The memory plan, after the arguments are checked and before anything is loaded: --plan prints it and stops;
    a run that cannot fit is refused in one line (KvvizError); the plan rides on the result (`memory_plan`). Where
    the input itself is wrong there is no plan: the run then reports that in its own line."""
    if getattr(args, "memory_plan", None) is not None:
        return
    from .memory import check_fits, plan_or_none

    plan = plan_or_none(args)
    if args.plan:
        if plan is None:
            raise KvvizError("no memory plan for this input; run it without --plan to see what is wrong")
        print("\n".join(plan.lines()))
        raise _PlanShown
    args.memory_plan = check_fits(plan) if plan is not None else None


def _load(args):
    from .loading import load_model

    _plan_gate(args)

    return load_model(_spec(args), args.dtype, args.device, args.attn, trust_remote_code=args.trust_remote_code,
                      progress=_progress_to_stderr(args.quiet), **_placement(args))


def _placement(args) -> dict:
    """load_model's placement arguments from --devices/--max-memory (checked in one line; {} for one device)."""
    from .placement import parse_placement

    place = parse_placement(getattr(args, "devices", "one"), getattr(args, "max_memory", None))
    if not place.dispatched:
        return {}
    why = _NOT_DISPATCHED.get(args.command)
    if why is None and getattr(args, "weights", "none") not in (None, "none"):
        why = "quantizes a copy of the weights"
    if why:
        raise KvvizError(f"--devices {place.mode} cannot be used with {args.command}: it {why}; use --devices one")
    return {"placement": place}


_NOT_DISPATCHED = {"matrix": "loads one model per attention implementation",
                   "loading-trap": "casts a copy of the whole model", "quant": "quantizes a copy of the weights"}


def _exports(args, res, lm=None) -> None:
    """--json-out, --html and --repro (every view but bisect): written after the run; a message on stderr each."""
    from pathlib import Path

    from .export import export_json, html_report

    if getattr(args, "memory_plan", None) is not None:
        from .memory import attach

        attach(res, args.memory_plan)  # every JSON result carries the plan, with the measured peak
    fp = None
    if lm is not None:
        from .kvcache import fingerprint

        fp = fingerprint(lm)
    for flag, make in (("json_out", lambda: export_json(res, fp)), ("html", lambda: html_report(res))):
        target = getattr(args, flag, None)
        if target:
            _write(Path(target), make(), args)
    if getattr(args, "repro", None):
        from .repro import repro_script

        _write(Path(args.repro), repro_script(res, lm, Path(args.repro).name), args)


def _write(path, text: str, args) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise KvvizError(f"could not write {path}: {e.strerror or e}") from None
    if not args.quiet:
        print(f"written: {path}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------------------------
# The subcommands. Each one checks its arguments, runs, and returns an Outcome; `_run` does the rest for all of them
# (flags a subcommand cannot honour refused, exports, JSON or the summary), so no subcommand prints or exports itself.


@dataclass
class Outcome:
    result: object
    lm: object = None  # the model the result was computed with (for the export's fingerprint and the repro script)
    summary: "Callable[[], str] | None" = None  # the human summary (default: the result's verdict line)
    payload: "Callable[[], dict] | None" = None  # what --json prints (default: result.to_dict())
    exportable: bool = True  # --json-out / --html / --repro apply
    printed: bool = False  # the subcommand printed its output as it went (a long sweep's rows)


# Common flags a subcommand does not honour, and why: given one of these, the subcommand refuses to run (exit 2).
_NOT_HONOURED = {
    "bisect": {"no_proof": "the bisector runs no proof rerun"},
    "loading-trap": {"invariant": "it compares two loadings of the model, each decoded plainly",
                     "no_proof": "it runs no proof rerun"},
    "matrix": {"no_proof": "the matrix runs no proof rerun (its --invariant runs every cell in invariant mode)"},
    "check": {"invariant": "the card decides in float64, where invariant mode has nothing to prove",
              "no_proof": "the card never runs the proof rerun"},
    "quant": {"invariant": "a quantized run is lossy by design; invariant mode cannot make it exact",
              "no_proof": "it runs no proof rerun"},
    "cache save": {"invariant": "the saved cache is the model's plain cache",
                   "no_proof": "it runs no proof rerun",
                   "json_out": "its product is the --out file", "html": "its product is the --out file"},
    "cache load": {"invariant": "the reload is compared with a plain fresh cache", "no_proof": "it runs no proof rerun"},
    "cache size": {"invariant": "sizes do not depend on it", "no_proof": "it runs no proof rerun"},
}
_FLAG = {"invariant": "--invariant", "no_proof": "--no-proof", "json_out": "--json-out", "html": "--html",
         "repro": "--repro"}


def _refuse_flags(name: str, args) -> None:
    for flag, why in _NOT_HONOURED.get(name, {}).items():
        if getattr(args, flag, None):
            raise _Refused(f"{_FLAG[flag]} does nothing for `{name}` ({why}); leave it out")


class _Refused(KvvizError):
    """A flag the subcommand cannot honour: exit 2, like any other argument error."""


def _command_name(args) -> str:
    return args.command + (f" {args.cache_command}" if args.command == "cache" and args.cache_command else "")


def _run(args) -> int:
    name = _command_name(args)
    _refuse_flags(name, args)
    out: Outcome = COMMANDS[args.command](args)
    if out.exportable:
        _exports(args, out.result, out.lm)
    if out.printed:
        return 0
    if getattr(args, "json", False):
        from .jsonout import dumps

        print(dumps(out.payload() if out.payload else out.result.to_dict()))
        return 0
    text = out.summary() if out.summary else f"verdict: {out.result.verdict.upper()}\n{out.result.explanation}"
    if getattr(args, "invariant", False):
        text = "(run in invariant mode)\n" + text
    print(text)
    return 0


def cmd_open(args) -> Outcome:
    from pathlib import Path

    from .export import open_result

    p = Path(args.file)
    if not p.is_file():
        raise KvvizError(f"no such file: {p}")
    opened = open_result(p.read_bytes())
    res = opened.result
    summaries = {"split": split_summary, "greedy": greedy_summary}
    if opened.view == "serving":
        from .serving import summary_text

        summaries["serving"] = summary_text

    def summary() -> str:
        from .views import get

        view = get(opened.view)
        verdict, text = view.verdict_text(res)
        head = summaries[opened.view](res) if opened.view in summaries else \
            f"a {view.title} result — verdict: {verdict}" + ("" if view.verdict_is_html else f"\n{text}")
        return head + "\n\nenvironment: " + ("the same as here" if not opened.environment_differences else
                                             "differs from here — " + "; ".join(opened.environment_differences))

    return Outcome(res, summary=summary, exportable=False, payload=lambda: json.loads(p.read_text(encoding="utf-8")))


def _nonnegative_pad(args) -> None:
    if getattr(args, "left_pad", 0) < 0:
        raise KvvizError(f"--left-pad must be 0 or more, not {args.left_pad}")


def _prove(args):
    return False if args.no_proof else None


def cmd_split(args) -> Outcome:
    from .split import SplitConfig, run_split

    _nonnegative_pad(args)
    cfg = SplitConfig(prompt=args.prompt, split=args.split, mode=args.mode, left_pad=args.left_pad,
                      position_ids=args.position_ids, attention_mask=args.attention_mask)
    lm = _load(args)
    res = run_split(lm, cfg, progress=_progress_to_stderr(args.quiet), settings=_settings(args), prove=_prove(args))
    return Outcome(res, lm, lambda: split_summary(res))


def split_summary(res) -> str:
    s = res.settings
    lines = [f"model: {res.model['description']}",
             f"dtype {s.dtype} on {s.device}, attention {s.attention}, mode {s.mode}, "
             f"left pad {s.left_pad}, position ids {s.position_ids}, mask {s.attention_mask}",
             f"cached tokens [0, {s.split}): {''.join(res.tokens[:s.split])!r}",
             f"compared tokens: {''.join(res.compared_tokens)!r}", ""]
    m = res.main
    if m.has_cache:
        rel = m.hidden["relative"].max(axis=1)
        mx = m.hidden["max_abs"].max(axis=1)
        lines.append(f"{'hidden state':<28}{'max |Δ|':>12}{'relative':>12}{'× eps':>10}")
        eps_units = m.hidden["eps_units"].max(axis=1)
        for lab, a, r, e in zip(res.layer_labels, mx, rel, eps_units):
            lines.append(f"{lab:<28}{a:>12.3g}{r:>12.3g}{e:>10.3g}")
        lg = m.logits
        lines += ["", f"logits: max |Δ| {lg['max_abs'].max():.3g}, max KL {lg['kl'].max():.3g}, argmax agrees at "
                      f"{int(lg['argmax_agree'].sum())}/{len(lg['argmax_agree'])} positions",
                  "K/V elements differing: " + ", ".join(
                      f"layer {r['layer'] + 1} {r['keys_differ']}+{r['values_differ']}/{r['keys_total'] + r['values_total']}"
                      for r in m.kv)]
    if res.float64 is not None:
        lines.append(f"float64 rerun: max relative gap {res.float64.max_relative:.3g}")
    lines += ["", f"verdict: {res.verdict.upper()}", res.explanation]
    if res.proof and "invariant mode" not in res.explanation:  # not when the explanation already says it
        lines.append(res.proof)
    return "\n".join(lines)


def cmd_greedy(args) -> Outcome:
    from .greedy import GreedyConfig, run_greedy

    _nonnegative_pad(args)
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    cfg = GreedyConfig(prompt=args.prompt, max_new_tokens=args.max_new_tokens, left_pad=args.left_pad,
                       position_ids=args.position_ids, paths=paths, fast=args.fast,
                       stop_at_divergence=args.stop_at_divergence)
    cfg.validate()  # before loading the model: bad arguments fail at once
    lm = _load(args)
    res = run_greedy(lm, cfg, progress=_progress_to_stderr(args.quiet), settings=_settings(args), prove=_prove(args))
    return Outcome(res, lm, lambda: greedy_summary(res))


def greedy_summary(res) -> str:
    s = res.settings
    lines = [f"model: {res.model['description']}",
             f"dtype {s.dtype} on {s.device}, {s.max_new_tokens} new tokens, left pad {s.left_pad}"
             + (", FAST PREVIEW" if s.fast else ""), ""]
    for p in res.paths.values():
        unsettled = "" if p.settled is None else f", {p.settled.count(False)} steps not settled"
        lines.append(f"[{p.label}] {p.forwards} forwards, {p.seconds:.2f} s{unsettled}")
        lines.append(f"    {p.text!r}")
    lines.append("")
    for pr in res.pairs:
        if pr.first_divergence is None:
            lines.append(f"{pr.a} = {pr.b}: same tokens; max |Δ logit| {max(pr.max_abs_logit):.3g}")
        else:
            lines.append(f"{pr.a} vs {pr.b}: part at step {pr.first_divergence} — {pr.verdict.upper()}: "
                         f"{pr.explanation}")
    return "\n".join(lines)


def cmd_dtypes(args) -> Outcome:
    from .dtype_sweep import run_dtypes
    from .prompts import load_prompts

    if args.split not in ("last", "half"):
        try:
            args.split = int(args.split)
        except ValueError:
            raise KvvizError(f"--split must be 'last', 'half' or a number, not {args.split!r}") from None
        if args.split < 1:
            raise KvvizError(f"--split must be 1 or more, not {args.split}")
    prompts = [args.prompt] if args.prompt is not None else load_prompts(args.prompts, args.limit)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    _plan_gate(args)
    res = run_dtypes(_load(args) if _placement(args) else _spec(args), prompts, dtypes, args.device, args.attn,
                     split=args.split, mode=args.mode, trust_remote_code=args.trust_remote_code, progress=_progress_to_stderr(args.quiet),
                     settings=_settings(args), prove=_prove(args))

    # the export's model (fingerprint, repro script): the run's own float64 reference, already built by the sweep
    lm64 = _load(args).reference()

    def summary() -> str:
        return "\n".join([
            f"model: {res.model['description']}; device {res.settings.device}; {len(res.prompts)} prompts, "
            f"split {res.settings.split}",
            "\nmax |Δ| per layer, mean over prompts:",
            res.stat("max_abs", "mean").to_string(float_format=lambda v: f"{v:.3g}"),
            "\nin units of each dtype's epsilon, max over prompts:",
            res.stat("eps_units", "max").to_string(float_format=lambda v: f"{v:.3g}"),
            "\nverdicts:", res.verdict_counts().to_string()])

    return Outcome(res, lm64, summary)


def cmd_padding(args) -> Outcome:
    from .padding import run_padding

    _nonnegative_pad(args)
    lm = _load(args)
    res = run_padding(lm, args.prompt, args.split, args.left_pad, progress=_progress_to_stderr(args.quiet),
                      settings=_settings(args), prove=not args.no_proof)

    def summary() -> str:
        import pandas as pd

        with pd.option_context("display.width", 200, "display.max_columns", 20):
            return (f"{res.settings.dtype} on {res.settings.device}; prompt split at {res.settings.split}; "
                    f"left pad {res.settings.left_pad}\n\nverdicts:\n" + res.grid().to_string()
                    + "\n\nrelative gap of the hidden states vs the prompt alone without cache:\n"
                    + res.grid("hidden_relative").to_string(float_format=lambda v: f"{v:.2g}"))

    return Outcome(res, lm, summary)


def cmd_reuse(args) -> Outcome:
    from .reuse import run_reuse

    lm = _load(args)
    res = run_reuse(lm, args.prefix, args.continuation, args.max_new_tokens, progress=_progress_to_stderr(args.quiet),
                    settings=_settings(args), prove=_prove(args))

    def summary() -> str:
        return "\n".join(
            f"[{r['index']}] {r['strategy']:<9} {r['verdict']:<9} "
            f"{'same tokens' if r['first_divergence'] is None else 'parts at step %d' % r['first_divergence']:<16} "
            f"{r['continuation']!r} → {r['text']!r}" for r in res.runs)

    return Outcome(res, lm, summary)


def cmd_bisect(args) -> Outcome:
    from .bisect import run_bisect
    from .naming import module_label
    from .split import SplitConfig

    cfg = SplitConfig(prompt=args.prompt, split=args.split, mode=args.mode, left_pad=args.left_pad,
                      position_ids=args.position_ids, attention_mask=args.attention_mask)
    cfg.validate()
    lm = _load(args)
    res = run_bisect(lm, cfg, _settings(args))

    def summary() -> str:
        lines = [f"{module_label(g.name):<60} {g.kind:<18} max |Δ| {g.max_abs:<10.3g}"
                 + ("  <- first difference" if res.first is not None and g.name == res.first.name else "")
                 for g in res.modules]
        return "\n".join(lines + ["", res.explanation])

    return Outcome(res, lm, summary)


def cmd_loading_trap(args) -> Outcome:
    from .loading_trap import run_loading_trap

    lm = _load(args)
    res = run_loading_trap(lm, args.prompt, args.max_new_tokens, args.cast_dtype)
    return Outcome(res, lm, lambda: (f"from_pretrained(dtype={args.cast_dtype}): {res.loaded_text!r}\n"
                                     f"float32 + .to({args.cast_dtype}):     {res.cast_text!r}\n"
                                     f"\nverdict: {res.verdict.upper()}\n{res.explanation}"))


def _split_list(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))


def cmd_matrix(args) -> Outcome:
    from .matrix import MatrixConfig, run_matrix, sliding_window_config

    flag_sets = tuple(() if f.strip() in ("", "none") else _split_list(f) for f in (args.flags or ["none"]))
    if args.preset == "sliding-window":
        lm = _load(args)
        cfg = sliding_window_config(lm, args.max_new_tokens if args.max_new_tokens != 16 else None)
        cfg.invariant = bool(args.invariant)
    else:
        if not args.prompt:
            raise KvvizError("give --prompt TEXT (or --preset sliding-window)")
        cfg = MatrixConfig(prompt=args.prompt, max_new_tokens=args.max_new_tokens, attentions=_split_list(args.attns),
                           caches=_split_list(args.cache), compiles=_split_list(args.compile), flag_sets=flag_sets,
                           repeats=args.repeats, left_pad=args.left_pad, position_ids=args.position_ids,
                           batch_with=tuple(args.batch_with), invariant=bool(args.invariant))
        cfg.validate()  # bad axes fail before any model loads
        lm = _load(args)
    res = run_matrix(lm, cfg, trust_remote_code=args.trust_remote_code, progress=_progress_to_stderr(args.quiet))

    def summary() -> str:
        lines = [f"reference (eager, no cache): {res.reference['text']!r}"]
        for c in res.cells:
            what = f"ERROR: {c.error}" if c.error else (
                f"{c.verdict:<16} part at {c.first_divergence}  distinct {c.distinct_outputs}  max |Δ logit| "
                f"{c.max_abs_logit:.3g}  {c.seconds_per_token * 1000:.1f} ms/token"
                + (f"  compiled frames {c.compiled['frames']}" if c.compiled and c.compiled['requested'] else ""))
            lines.append(f"{c.label:<58} {what}")
        return "\n".join(lines)

    return Outcome(res, lm, summary)


def cmd_cache(args) -> Outcome:
    if args.cache_command is None:
        raise KvvizError("choose a cache command: save, load or size")
    lm = _load(args)
    if args.cache_command == "save":
        from .kvcache import save_cache

        meta = save_cache(lm, args.prompt, args.out)
        out = {"file": args.out, "n_tokens": meta["n_tokens"], "layers": len(meta["layers"]),
               "fingerprint": meta["fingerprint"]}
        return Outcome(out, lm, lambda: f"saved {meta['n_tokens']} tokens × {len(meta['layers'])} layers to {args.out}",
                       payload=lambda: out, exportable=False)
    if args.cache_command == "load":
        from .kvcache import continue_and_compare, load_cache

        res = continue_and_compare(lm, load_cache(lm, args.file), args.cont)
        return Outcome(res, lm, lambda: (
            f"reloaded {res.n_cached} cached tokens, continued with {len(res.continuation_tokens)}: bitwise equal to "
            f"a fresh cache: {res.bitwise_equal} (largest gap: logits {res.max_abs_logits:.3g}, hidden "
            f"{res.max_abs_hidden:.3g}, K/V {res.max_abs_kv:.3g})"))
    from .cachesize import size_report

    rep = size_report(lm, args.tokens, args.batch, measure=not args.no_measure)
    return Outcome(rep, lm, lambda: (
        f"{rep.model} in {rep.dtype}: {rep.per_token_bytes:,} bytes per token; {args.tokens} tokens × batch "
        f"{args.batch}: formula {rep.formula_bytes:,} bytes, measured "
        f"{'—' if rep.measured_bytes is None else f'{rep.measured_bytes:,}'} bytes"
        + (f" ({rep.note})" if rep.note else "")))


def cmd_check(args) -> Outcome:
    from .check import run_check
    from .quant import QuantConfig

    if args.weights != "none" or args.kv != "none":
        QuantConfig("x", kv=args.kv, weights=args.weights).validate()  # bad names fail before any model loads
    lm = _load(args)
    card = run_check(lm, progress=_progress_to_stderr(args.quiet), weights=args.weights, kv=args.kv)

    def summary() -> str:
        return "\n".join([f"[{c.status:^5}] {c.name:<34} {c.evidence}" for c in card.checks]
                         + [f"\noverall: {card.overall.upper()} — {card.summary}"])

    return Outcome(card, lm, summary)


def cmd_quant(args) -> Outcome:
    from .quant import QuantConfig, run_quant

    cfg = QuantConfig(args.prompt, kv=args.kv, residual_length=args.residual, weights=args.weights,
                      max_new_tokens=args.max_new_tokens)
    cfg.validate()
    lm = _load(args)
    res = run_quant(lm, cfg, progress=_progress_to_stderr(args.quiet))

    def summary() -> str:
        lines = [f"unquantized: {res.reference_text!r}", f"quantized:   {res.quantized_text!r}",
                 f"greedy agreement: {res.agreement} of {res.steps} tokens; KL per step mean {res.kl_mean:.3g}, "
                 f"max {res.kl_max:.3g}"]
        lines += [f"  {name:<28} max |Δ| {a:<10.3g} relative {r:.3g}"
                  for name, a, r in zip(res.layers, res.layer_max_abs, res.layer_relative)]
        lines += [f"note: {note}" for note in res.notes]
        return "\n".join(lines + [f"\nverdict: {res.verdict.upper()}\n{res.explanation}"])

    return Outcome(res, lm, summary)


def cmd_serve_study(args) -> Outcome:
    from .engines import check_engine
    from .serving import ServeConfig, load_prompt_set, run_serving, summary_text

    check_engine(args.engine)  # one line where vLLM is asked for and absent, before anything loads
    prompts, source = load_prompt_set(args.prompts, args.prompt, args.limit)
    cfg = ServeConfig(prompts=prompts, shared_prefix=args.prefix, conditions=_split_list(args.conditions),
                      runs=args.runs, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                      engine=args.engine, page_size=args.page_size, prompt_source=source,
                      tensor_parallel_size=args.tensor_parallel_size)
    cfg.validate()
    lm = _load(args)
    res = run_serving(lm, cfg, progress=_progress_to_stderr(args.quiet), settings=_settings(args),
                      prove=not args.no_proof)
    return Outcome(res, lm, lambda: summary_text(res))


COMMANDS = {"quant": cmd_quant, "split": cmd_split, "greedy": cmd_greedy, "dtypes": cmd_dtypes, "padding": cmd_padding,
            "reuse": cmd_reuse, "bisect": cmd_bisect, "matrix": cmd_matrix, "open": cmd_open, "cache": cmd_cache,
            "check": cmd_check, "loading-trap": cmd_loading_trap, "serve-study": cmd_serve_study}


def cmd_sweep_architectures(args) -> Outcome:
    from .archsweep import cli

    cli(args)  # a long sweep prints each row as it finishes, then its totals (or the JSON)
    return Outcome(None, exportable=False, printed=True)


COMMANDS["sweep-architectures"] = cmd_sweep_architectures


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return _run(args)
    except _PlanShown:
        return 0
    except _Refused as e:
        print(f"kvviz: error: {e}", file=sys.stderr)
        return 2
    except KvvizError as e:
        print(f"kvviz: error: {e}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(e):
            raise
        free_memory(e)
        print(f"kvviz: error: {OUT_OF_MEMORY_HINT}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head`: not an error
        sys.stderr.close()
        return 0
