"""`python -m kvviz greedy`: greedy decoding with and without the cache - where the paths part and why."""
from __future__ import annotations

from ...io.clirun import Outcome, context, load, model_args, nonnegative_pad, repro_arg
from ...core.inputs import POSITION_MODES
from .run import GreedyConfig, run


HELP = "greedy decoding with and without cache: where the paths part and why"


def add_arguments(gp) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    model_args(gp)
    gp.add_argument("--prompt", required=True)
    gp.add_argument("--max-new-tokens", type=int, default=20)
    gp.add_argument("--left-pad", type=int, default=0)
    gp.add_argument("--position-ids", default="auto", choices=POSITION_MODES, help="for the cache path")
    gp.add_argument("--paths", default="no_cache,cache,generate",
                    help="comma-separated: no_cache,cache,generate,user_loop,float64")
    gp.add_argument("--fast", action="store_true", help="preview the no-cache path by teacher forcing")
    gp.add_argument("--stop-at-divergence", action="store_true")
    repro_arg(gp)
    gp.set_defaults(handler=command)


def command(args) -> Outcome:
    nonnegative_pad(args)
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    cfg = GreedyConfig(prompt=args.prompt, max_new_tokens=args.max_new_tokens, left_pad=args.left_pad,
                       position_ids=args.position_ids, paths=paths, fast=args.fast,
                       stop_at_divergence=args.stop_at_divergence)
    cfg.validate()  # before loading the model: bad arguments fail at once
    args.workload = cfg.workload()  # its memory plan: what the config holds, as the Greedy page plans it
    lm = load(args)
    res = run(lm, cfg, context(args))
    return Outcome(res, lm, lambda: summary(res))


def summary(res) -> str:
    s = res.settings
    lines = [f"model: {res.model['description']}",
             f"dtype {s.dtype} on {s.device}, {s.max_new_tokens} new tokens, left pad {s.left_pad}"
             + (", FAST PREVIEW" if s.fast else ""), ""]
    for p in res.paths.values():
        unsettled = "" if p.settled is None else f", {p.settled.count(False)} steps not settled"
        lines.append(f"[{p.label}] {p.forwards} forwards, {p.seconds:.2f} s{unsettled}")
        lines.append(f"    {p.text!r}")
    lines.append("")
    for pr in res.pairs:
        if pr.first_divergence is None:
            lines.append(f"{pr.a} = {pr.b}: same tokens; max |Δ logit| {max(pr.max_abs_logit):.3g}")
        else:
            lines.append(f"{pr.a} vs {pr.b}: part at step {pr.first_divergence} — {pr.verdict.upper()}: "
                         f"{pr.explanation}")
    if res.proof_s is not None:
        lines.append(f"proof: the invariant-mode replay of the parting steps took {res.proof_s:.2f} s")
    return "\n".join(lines)
