"""`python -m kvviz padding`: alone / left-padded / in a batch x cache settings - precision or logic per cell."""
from __future__ import annotations

import pandas as pd

from ...io.clirun import Outcome, context, load, model_args, nonnegative_pad, repro_arg
from .run import PaddingConfig, run


HELP = "alone / left-padded / in a batch × cache settings: precision or logic"


def add_arguments(pp) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    model_args(pp)
    pp.add_argument("--prompt", required=True)
    pp.add_argument("--split", type=int, default=None, help="default: half the prompt")
    pp.add_argument("--left-pad", type=int, default=4)
    repro_arg(pp)
    pp.set_defaults(handler=command)


def command(args) -> Outcome:
    nonnegative_pad(args)
    cfg = PaddingConfig(args.prompt, args.split, args.left_pad).validate()
    args.workload = cfg.workload()  # its memory plan: what the config holds, as its page plans it
    lm = load(args)
    res = run(lm, cfg, context(args))

    def summary() -> str:
        with pd.option_context("display.width", 200, "display.max_columns", 20):
            return (f"{res.settings.dtype} on {res.settings.device}; prompt split at {res.settings.split}; "
                    f"left pad {res.settings.left_pad}\n\nverdicts:\n" + res.grid().to_string()
                    + "\n\nrelative gap of the hidden states vs the prompt alone without cache:\n"
                    + res.grid("hidden_relative").to_string(float_format=lambda v: f"{v:.2g}")
                    + "".join(f"\n{c['placement']} / {c['scenario']}: {c['reason']}" for c in res.cells
                              if c.get("reason"))
                    + (f"\n\nproof: the grid's invariant-mode rerun took {res.proof_s:.2f} s"
                       if res.proof_s is not None else ""))

    return Outcome(res, lm, summary)
