"""`python -m kvviz next-token --prompt TEXT`: the example view's subcommand (its name derived from the folder's)."""
from kvviz.clirun import Outcome, load, model_args, settings

HELP = "(example view) the next-token logits, cached vs full forward"


def add_arguments(p) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    model_args(p)
    p.add_argument("--prompt", required=True)
    p.set_defaults(handler=command, not_honoured={"no_proof": "it runs no proof rerun"})


def command(args) -> Outcome:
    from .run import run_next_token

    lm = load(args)
    return Outcome(run_next_token(lm, args.prompt, settings(args)), lm)
