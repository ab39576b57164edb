"""`python -m kvviz split`: full forward vs the prefix cached and the rest fed through the cache (`cache`; `past_key_values` before transformers 5.24)."""
from __future__ import annotations

from ...io.clirun import Outcome, context, load, model_args, nonnegative_pad, repro_arg
from ...core.inputs import MASK_MODES, POSITION_MODES
from .run import SplitConfig, run


HELP = "full forward vs prefix cached + rest through the cache (past_key_values before transformers 5.24)"


def add_arguments(sp) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    model_args(sp)
    sp.add_argument("--prompt", required=True)
    sp.add_argument("--split", type=int, required=True, help="prompt tokens [0, K) go to the cache")
    sp.add_argument("--mode", default="chunk", choices=("chunk", "step"))
    sp.add_argument("--left-pad", type=int, default=0)
    sp.add_argument("--position-ids", default="auto", choices=POSITION_MODES)
    sp.add_argument("--attention-mask", default="full", choices=MASK_MODES)
    repro_arg(sp)
    sp.set_defaults(handler=command)


def command(args) -> Outcome:
    nonnegative_pad(args)
    cfg = SplitConfig(prompt=args.prompt, split=args.split, mode=args.mode, left_pad=args.left_pad,
                      position_ids=args.position_ids, attention_mask=args.attention_mask)
    args.workload = cfg.workload()  # its memory plan: what the config holds, as its page plans it
    lm = load(args)
    res = run(lm, cfg, context(args))
    return Outcome(res, lm, lambda: summary(res))


def summary(res) -> str:
    s = res.settings
    lines = [f"model: {res.model['description']}",
             f"dtype {s.dtype} on {s.device}, attention {s.attention}, mode {s.mode}, "
             f"left pad {s.left_pad}, position ids {s.position_ids}, mask {s.attention_mask}",
             f"cached tokens [0, {s.split}): {''.join(res.tokens[:s.split])!r}",
             f"compared tokens: {''.join(res.compared_tokens)!r}", ""]
    m = res.main
    if m.has_cache:
        rel = m.hidden["relative"].max(axis=1)
        mx = m.hidden["max_abs"].max(axis=1)
        lines.append(f"{'hidden state':<28}{'max |Δ|':>12}{'relative':>12}{'× eps':>10}")
        eps_units = m.hidden["eps_units"].max(axis=1)
        for lab, a, r, e in zip(res.layer_labels, mx, rel, eps_units):
            lines.append(f"{lab:<28}{a:>12.3g}{r:>12.3g}{e:>10.3g}")
        lg = m.logits
        lines += ["", f"logits: max |Δ| {lg['max_abs'].max():.3g}, max KL {lg['kl'].max():.3g}, argmax agrees at "
                      f"{int(lg['argmax_agree'].sum())}/{len(lg['argmax_agree'])} positions",
                  "K/V elements differing: " + ", ".join(
                      f"layer {r['layer'] + 1} {r['keys_differ']}+{r['values_differ']}/{r['keys_total'] + r['values_total']}"
                      for r in m.kv)]
    if res.float64 is not None:
        lines.append(f"float64 rerun: max relative gap {res.float64.max_relative:.3g}")
    lines += ["", f"verdict: {res.verdict.upper()}", res.explanation]
    if res.proof and not res.proof_in_explanation:
        lines.append(res.proof)
    if res.proof_s is not None:
        lines.append(f"proof: the invariant-mode rerun took {res.proof_s:.2f} s (the whole run {res.elapsed_s:.2f} s)")
    return "\n".join(lines)
