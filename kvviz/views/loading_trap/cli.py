"""`python -m kvviz loading-trap`: from_pretrained(dtype=16-bit) vs float32 + .to(16-bit) - two models."""
from __future__ import annotations

from ...io.clirun import Outcome, context, load, model_args, repro_arg
from .run import LoadingTrapConfig, run


HELP = "from_pretrained(dtype=16-bit) vs float32 + .to(16-bit): two models"


def add_arguments(tp) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    model_args(tp)
    tp.add_argument("--prompt", default="This is a ")
    tp.add_argument("--max-new-tokens", type=int, default=24)
    tp.add_argument("--cast-dtype", default="bfloat16", choices=("bfloat16", "float16"))
    repro_arg(tp)
    tp.set_defaults(handler=command, not_dispatched="casts a copy of the whole model")


def command(args) -> Outcome:
    cfg = LoadingTrapConfig(args.prompt, args.max_new_tokens, args.cast_dtype).validate()
    args.workload = cfg.workload()  # its memory plan: what the config holds, as its page plans it
    lm = load(args)
    res = run(lm, cfg, context(args))
    return Outcome(res, lm, lambda: (f"from_pretrained(dtype={args.cast_dtype}): {res.loaded_text!r}\n"
                                     f"float32 + .to({args.cast_dtype}):     {res.cast_text!r}\n"
                                     f"\nverdict: {res.verdict.upper()}\n{res.explanation}"))
