"""`python -m kvviz engine-layers`: two runs of one prompt through vLLM (warm vs cold, batch vs alone, tensor
parallel 1 vs N) compared layer by layer inside the engine, each against the float64 reference."""
from __future__ import annotations

from ...engines import registry
from ...io.clirun import Outcome, context, load, model_args

HELP = ("inside the engine: warm vs cold, batch vs alone or tensor parallel 1 vs N in vLLM, layer × token, each "
        "against the float64 reference; the first layer beyond rounding named")


def add_arguments(vp) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    model_args(vp)
    vp.add_argument("--prompt", required=True, help="the prompt (after --prefix)")
    vp.add_argument("--prefix", default="", help="a shared prefix before the prompt (for 'warm': the warmer)")
    vp.add_argument("--pair", default="warm", choices=("warm", "batch", "tp"),
                    help="warm: cold vs warm prefix cache; batch: alone vs in flight with k-1 neighbours; tp: tensor "
                         "parallel 1 vs --tensor-parallel-size")
    vp.add_argument("--max-new-tokens", type=int, default=8)
    vp.add_argument("--batch-size", type=int, default=4, help="k: requests in flight for --pair batch")
    vp.add_argument("--others", type=int, default=0,
                    help="also run this many built-in prompts on both sides, compared at their outputs (distinct "
                         "completions per prompt, where they part, the verdict against the float64 reference)")
    vp.add_argument("--engine", default=registry.capturing()[0], choices=registry.capturing(),
                    help="vllm or llama.cpp (their own environments: `make engines`; llama.cpp: the warm pair only, "
                         "on the GGUF itself)")
    vp.add_argument("--tensor-parallel-size", type=int, default=3,
                    help="N for --pair tp (must divide the model's attention heads; on a CPU the ranks' threads are "
                         "bound to cores with VLLM_CPU_OMP_THREADS_BIND, set it yourself to override)")
    vp.add_argument("--pipeline-parallel-size", type=int, default=1,
                    help="vLLM's pipeline parallel size (refused: capture needs every layer in one process)")
    vp.add_argument("--distributed-executor-backend", default=None, choices=("mp", "ray", "uni", "external_launcher"),
                    help="vLLM's distributed executor backend (ray for several nodes); default: vLLM's choice")
    vp.set_defaults(handler=command)  # what it refuses: its run's REFUSES


def command(args) -> Outcome:
    from .run import EngineLayersConfig, run

    cfg = EngineLayersConfig(prompt=args.prompt, pair=args.pair, prefix=args.prefix,
                             max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, others=args.others,
                             tensor_parallel_size=args.tensor_parallel_size,
                             pipeline_parallel_size=args.pipeline_parallel_size,
                             distributed_executor_backend=args.distributed_executor_backend, engine=args.engine)
    cfg.validate()  # one line before anything loads (llama.cpp, pipeline parallel, bad sizes)
    registry.check(cfg.engine)
    args.workload = cfg.workload()  # its memory plan: what the config holds, as the Engine layers page plans it
    lm = load(args)
    res = run(lm, cfg, context(args))
    return Outcome(res, lm, lambda: summary_text(res))


def summary_text(res) -> str:
    a, b = res.labels
    lines = [f"engine layers — {res.summary_line()}",
             f"verdict: {res.verdict}. {res.explanation}",
             f"{a}: {len(res.a.tokens)} tokens, {res.a.cached_tokens} prompt tokens from the cache; "
             f"{b}: {len(res.b.tokens)} tokens, {res.b.cached_tokens} from the cache"]
    lines.append(res.parting_line())
    dec = res.decision
    if res.lens is not None:
        lines.append(f"logit lens: decision depth {dec['layer']} at position {dec['position']}" if dec else
                     f"logit lens: top-1 agrees at every layer (largest KL {res.lens.max_kl:.3g})")
    elif res.lens_absent:
        lines.append(f"logit lens: absent ({res.lens_absent})")
    for p in res.prompts:
        if p["distinct"] > 1 or p["verdict"] in ("logic", "undecided"):
            lines.append(f"  {p['prompt'][:60]!r}: part at step {p['first_divergence']} — {p['verdict']}")
    lines += [f"note: {n}" for n in res.notes]
    return "\n".join(lines)
