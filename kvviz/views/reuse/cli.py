"""`python -m kvviz reuse`: a prompt cache reused for several continuations - fresh, deep copy, reused."""
from __future__ import annotations

from ...io.clirun import Outcome, context, load, model_args, repro_arg
from .run import ReuseConfig, run


HELP = "a prompt cache reused for several continuations: fresh, deep copy, reused"


def add_arguments(rp) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    model_args(rp)
    rp.add_argument("--prefix", required=True)
    rp.add_argument("--continuation", action="append", required=True, help="repeat for several")
    rp.add_argument("--max-new-tokens", type=int, default=12)
    repro_arg(rp)
    rp.set_defaults(handler=command)


def command(args) -> Outcome:
    cfg = ReuseConfig(args.prefix, tuple(args.continuation), args.max_new_tokens)
    args.workload = cfg.workload()  # its memory plan: what the config holds, as its page plans it
    lm = load(args)
    res = run(lm, cfg, context(args))

    def summary() -> str:
        return "\n".join(
            f"[{r['index']}] {r['strategy']:<9} {r['verdict']:<9} "
            f"{'same tokens' if r['first_divergence'] is None else 'parts at step %d' % r['first_divergence']:<16} "
            f"{r['continuation']!r} → {r['text']!r}" for r in res.runs)

    return Outcome(res, lm, summary)
