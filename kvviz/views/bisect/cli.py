"""`python -m kvviz bisect`: the first module whose output differs between the cached run and the full forward."""
from __future__ import annotations

from ...io.clirun import Outcome, context, load, model_args
from ...core.inputs import MASK_MODES, POSITION_MODES
from .run import BisectConfig, run
from ...core.naming import module_label


HELP = ("name the first module whose output differs between the cached run and the "
        "full forward")


def add_arguments(bp) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    model_args(bp)
    bp.add_argument("--prompt", required=True)
    bp.add_argument("--split", type=int, required=True)
    bp.add_argument("--mode", default="chunk", choices=("chunk", "step"))
    bp.add_argument("--left-pad", type=int, default=0)
    bp.add_argument("--position-ids", default="auto", choices=POSITION_MODES)
    bp.add_argument("--attention-mask", default="full", choices=MASK_MODES)
    bp.set_defaults(handler=command)  # what it refuses: its run's REFUSES


def command(args) -> Outcome:
    cfg = BisectConfig(prompt=args.prompt, split=args.split, mode=args.mode, left_pad=args.left_pad,
                      position_ids=args.position_ids, attention_mask=args.attention_mask)
    cfg.validate()
    args.workload = cfg.workload()  # its memory plan: what the config holds, as its page plans it
    lm = load(args)
    res = run(lm, cfg, context(args))

    def summary() -> str:
        lines = [f"{module_label(g.name):<60} {g.kind:<18} max |Δ| {g.max_abs:<10.3g}"
                 + ("  <- first difference" if res.first is not None and g.name == res.first.name else "")
                 for g in res.modules]
        return "\n".join(lines + ["", res.explanation])

    return Outcome(res, lm, summary)
