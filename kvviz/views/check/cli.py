"""`python -m kvviz check`: is this model cache-safe? The card's battery of float64 checks."""
from __future__ import annotations

from ...io.clirun import Outcome, context, load, model_args, repro_arg
from .run import CheckConfig, run


HELP = "is this model cache-safe? a battery of float64 checks"


def add_arguments(kp) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    model_args(kp)
    kp.add_argument("--weights", default="none", choices=("none", "int8", "int4", "bnb-int8", "bnb-nf4"),
                    help="check the model with weight-only quantized linear layers (optimum-quanto)")
    repro_arg(kp, " of the card's float64 split checks")
    kp.add_argument("--kv", default="none", help="check with a quantized KV cache: fp8, quanto:int4, quanto:int2, "
                                                 "hqq:int4, hqq:int2, hqq:int8")
    kp.set_defaults(handler=command)  # what it refuses: its run's REFUSES


def command(args) -> Outcome:
    config = CheckConfig(weights=args.weights, kv=args.kv).validate()  # bad names fail before any model loads
    args.workload = config.workload()  # its memory plan: what the config holds, as its page plans it
    lm = load(args)
    card = run(lm, config, context(args))

    def summary() -> str:
        return "\n".join([f"[{c.status:^5}] {c.name:<34} {c.evidence}" for c in card.checks]
                         + [f"\noverall: {card.overall.upper()} — {card.summary}"])

    return Outcome(card, lm, summary)
