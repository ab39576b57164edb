"""`python -m kvviz dtypes`: the split comparison in several dtypes over one prompt or a prompt set."""
from __future__ import annotations

from ... import views
from ...io.clirun import Outcome, context, load, model_args, plan_gate, repro_arg
from ...core.errors import KvvizError
from .run import DtypesConfig
from ...core.prompts import load_prompts


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
    if args.split not in ("last", "half"):
        try:
            args.split = int(args.split)
        except ValueError:
            raise KvvizError(f"--split must be 'last', 'half' or a number, not {args.split!r}") from None
        if args.split < 1:
            raise KvvizError(f"--split must be 1 or more, not {args.split}")
    prompts = [args.prompt] if args.prompt is not None else load_prompts(args.prompts, args.limit)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    cfg = DtypesConfig(tuple(prompts), tuple(dtypes), args.split, args.mode)
    args.workload = cfg.workload()  # as its page plans
    plan_gate(args)
    lm = load(args)  # each dtype is its twin (from the same cache), float64 its reference
    res = views.run("dtypes", lm, cfg, context(args))

    # the export's model (fingerprint, repro script): the run's own float64 reference, already built by the sweep
    lm64 = lm.reference()

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
