"""`python -m kvviz quant`: a quantized KV cache and/or quantized weights against the unquantized run."""
from __future__ import annotations

from ...io.clirun import Outcome, context, load, model_args, repro_arg
from .run import QuantConfig, run


HELP = ("a quantized KV cache and/or quantized weights against the unquantized run: "
        "per-step KL, greedy agreement, gap per layer")


def add_arguments(qp) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    model_args(qp)
    qp.add_argument("--prompt", required=True)
    qp.add_argument("--kv", default="none", help="fp8, quanto:int4, quanto:int2, hqq:int4, hqq:int2, hqq:int8, none")
    qp.add_argument("--residual", type=int, default=8, help="tokens kept unquantized in the KV cache's residual")
    qp.add_argument("--weights", default="none", choices=("none", "int8", "int4", "bnb-int8", "bnb-nf4"),
                    help="int8/int4: optimum-quanto weight-only (CPU and CUDA); bnb-int8/bnb-nf4: bitsandbytes (CUDA)")
    qp.add_argument("--max-new-tokens", type=int, default=24)
    repro_arg(qp)
    qp.set_defaults(handler=command, not_dispatched="quantizes a copy of the weights")


def command(args) -> Outcome:
    cfg = QuantConfig(args.prompt, kv=args.kv, residual_length=args.residual, weights=args.weights,
                      max_new_tokens=args.max_new_tokens)
    cfg.validate()
    args.workload = cfg.workload()  # its memory plan: what the config holds, as its page plans it
    lm = load(args)
    res = run(lm, cfg, context(args))

    def summary() -> str:
        lines = [f"unquantized: {res.reference_text!r}", f"quantized:   {res.quantized_text!r}",
                 f"greedy agreement: {res.agreement} of {res.steps} tokens; KL per step mean {res.kl_mean:.3g}, "
                 f"max {res.kl_max:.3g}"]
        lines += [f"  {name:<28} max |Δ| {a:<10.3g} relative {r:.3g}"
                  for name, a, r in zip(res.layers, res.layer_max_abs, res.layer_relative)]
        lines += [f"note: {note}" for note in res.notes]
        return "\n".join(lines + [f"\nverdict: {res.verdict.upper()}\n{res.explanation}"])

    return Outcome(res, lm, summary)
