"""`python -m kvviz matrix`: attention x cache kind x compile x precision flags, repeated."""
from __future__ import annotations

from dataclasses import replace

from ...io.clirun import Outcome, context, load, model_args, repro_arg, split_list
from ...core.errors import KvvizError
from ...core.inputs import POSITION_MODES
from .run import MatrixConfig, run, sliding_window_config


HELP = "attention × cache kind × compile × precision flags, repeated: which settings change greedy decoding, and how"


def add_arguments(mp) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    model_args(mp, attn_list=True)
    mp.add_argument("--prompt", default=None, help="the prompt (row 0); required unless --preset sliding-window")
    mp.add_argument("--preset", choices=("sliding-window",), default=None,
                    help="sliding-window (the torch.compile report): a short left-padded prompt batched with one "
                         "longer than the sliding window, generating past the window")
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
    repro_arg(mp, " of the cells run without torch.compile")
    mp.set_defaults(handler=command, not_dispatched="loads one model per attention implementation")


def command(args) -> Outcome:
    flag_sets = tuple(() if f.strip() in ("", "none") else split_list(f) for f in (args.flags or ["none"]))
    if args.preset == "sliding-window":
        lm = load(args)
        cfg = sliding_window_config(lm, args.max_new_tokens if args.max_new_tokens != 16 else None)
        cfg = replace(cfg, invariant=bool(args.invariant))
    else:
        if not args.prompt:
            raise KvvizError("give --prompt TEXT (or --preset sliding-window)")
        cfg = MatrixConfig(prompt=args.prompt, max_new_tokens=args.max_new_tokens, attentions=split_list(args.attns),
                           caches=split_list(args.cache), compiles=split_list(args.compile), flag_sets=flag_sets,
                           repeats=args.repeats, left_pad=args.left_pad, position_ids=args.position_ids,
                           batch_with=tuple(args.batch_with), invariant=bool(args.invariant))
        cfg.validate()  # bad axes fail before any model loads
        args.workload = cfg.workload()  # its memory plan: what the config holds, as the Matrix page plans it
        lm = load(args)
    res = run(lm, cfg, context(args))

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
