"""`python -m kvviz cache save|load|size`: the KV cache as an object."""
from __future__ import annotations

from ...io.clirun import Outcome, context, load, model_args
from ...core.errors import KvvizError
from .run import ReloadConfig, save_cache
from .run import run as run_reload
from .size import SizeConfig
from .size import run as run_size


HELP = "the KV cache as an object: save, load (continue and compare), size"


def add_arguments(cp) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    csub = cp.add_subparsers(dest="cache_command", parser_class=type(cp))
    cs = csub.add_parser("save", help="write the cache of a prompt to a safetensors file")
    model_args(cs)
    cs.add_argument("--prompt", required=True)
    cs.add_argument("--out", required=True, help="FILE.safetensors")
    cs.set_defaults(handler=save, not_honoured={
        "invariant": "the saved cache is the model's plain cache", "no_proof": "it runs no proof rerun",
        "json_out": "its product is the --out file", "html": "its product is the --out file"})
    cl = csub.add_parser("load", help="reload a saved cache, continue with text, compare with a fresh cache")
    model_args(cl)
    cl.add_argument("--file", required=True)
    cl.add_argument("--continue", dest="cont", required=True, help="text fed after the cached tokens")
    cl.set_defaults(handler=reload)  # what it refuses: its run's REFUSES
    cz = csub.add_parser("size", help="bytes per token, the formula and the live cache's measured size")
    model_args(cz)
    cz.add_argument("--tokens", type=int, required=True)
    cz.add_argument("--batch", type=int, default=1)
    cz.add_argument("--no-measure", action="store_true", help="formula only (no forward)")
    cz.set_defaults(handler=size)
    cp.set_defaults(handler=command)


def command(args) -> Outcome:
    raise KvvizError("choose a cache command: save, load or size")


def save(args) -> Outcome:
    args.workload = ReloadConfig(prompt=args.prompt).workload()  # the prompt's cache, as its page plans it
    lm = load(args)
    meta = save_cache(lm, args.prompt, args.out)
    out = {"file": args.out, "n_tokens": meta["n_tokens"], "layers": len(meta["layers"]),
           "fingerprint": meta["fingerprint"]}
    return Outcome(out, lm, lambda: f"saved {meta['n_tokens']} tokens × {len(meta['layers'])} layers to {args.out}",
                   payload=lambda: out, exportable=False)


def reload(args) -> Outcome:
    cfg = ReloadConfig(continuation=args.cont, source=args.file)
    args.workload = cfg.workload()  # its memory plan: the saved cache's tokens + the continuation, as its page plans it
    lm = load(args)
    res = run_reload(lm, cfg, context(args))
    return Outcome(res, lm, lambda: (
        f"reloaded {res.n_cached} cached tokens, continued with {len(res.continuation_tokens)}: bitwise equal to "
        f"a fresh cache: {res.bitwise_equal} (largest gap: logits {res.max_abs_logits:.3g}, hidden "
        f"{res.max_abs_hidden:.3g}, K/V {res.max_abs_kv:.3g})"))


def size(args) -> Outcome:
    cfg = SizeConfig(args.tokens, args.batch, measure=not args.no_measure).validate()
    args.workload = cfg.workload()  # its memory plan: what the config holds, as its page plans it
    lm = load(args)
    rep = run_size(lm, cfg, context(args))
    return Outcome(rep, lm, lambda: (
        f"{rep.model} in {rep.dtype}: {rep.per_token_bytes:,} bytes per token; {args.tokens} tokens × batch "
        f"{args.batch}: formula {rep.formula_bytes:,} bytes, measured "
        f"{'—' if rep.measured_bytes is None else f'{rep.measured_bytes:,}'} bytes"
        + (f" ({rep.note})" if rep.note else "")))
