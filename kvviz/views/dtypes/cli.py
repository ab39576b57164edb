"""`python -m kvviz dtypes`: the split comparison in several dtypes over one prompt or a prompt set."""
from __future__ import annotations

from ...io.clirun import (Outcome, load, model_args, placement, plan_gate, progress_to_stderr, prove, repro_arg,
                       settings, spec)
from ...core.errors import KvvizError


HELP = "the split comparison in several dtypes, over one prompt or a prompt set"


def add_arguments(dp) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    model_args(dp)
    src = dp.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompts", help="'builtin', 'builtin:<category>', or a .txt (one a line) / .jsonl file")
    dp.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    dp.add_argument("--dtypes", default="float32,float16,bfloat16", help="compared with float64 (always run)")
    dp.add_argument("--split", default="last", help="'last' (all but the last token cached), 'half', or K")
    dp.add_argument("--mode", default="chunk", choices=("chunk", "step"))
    repro_arg(dp)
    dp.set_defaults(handler=command)


def command(args) -> Outcome:
    from ...core.prompts import load_prompts
    from .run import DtypesConfig, run_dtypes

    if args.split not in ("last", "half"):
        try:
            args.split = int(args.split)
        except ValueError:
            raise KvvizError(f"--split must be 'last', 'half' or a number, not {args.split!r}") from None
        if args.split < 1:
            raise KvvizError(f"--split must be 1 or more, not {args.split}")
    prompts = [args.prompt] if args.prompt is not None else load_prompts(args.prompts, args.limit)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.workload = DtypesConfig(tuple(prompts), tuple(dtypes), args.split, args.mode).workload()  # as its page plans
    plan_gate(args)
    res = run_dtypes(load(args) if placement(args) else spec(args), prompts, dtypes, args.device, args.attn,
                     split=args.split, mode=args.mode, trust_remote_code=args.trust_remote_code,
                     progress=progress_to_stderr(args.quiet), settings=settings(args), prove=prove(args))

    # the export's model (fingerprint, repro script): the run's own float64 reference, already built by the sweep
    lm64 = load(args).reference()

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
