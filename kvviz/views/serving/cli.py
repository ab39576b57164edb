"""`python -m kvviz serving` (or `serve-study`): serving conditions (alone, continuous batch, warm prefix) x R runs."""
from __future__ import annotations

from ... import views
from ...engines import registry
from ...io.clirun import FlagRefused, Outcome, context, load, model_args, repro_arg, split_list
from .run import ServeConfig, load_prompt_set, summary_text
from .sweep import SweepConfig
from .sweep import summary_text as sweep_summary_text
from ...core.errors import KvvizError


HELP = ("serving conditions (alone, continuous batch, warm prefix) × R runs: "
        "distinct completions per prompt, where and why they part")


# Options of the study alone and of the sweep alone (their argparse defaults, used there): given to the other, refused in one line
STUDY_ONLY = {"prompt": None, "prompts": None, "prefix": "", "conditions": None, "page_size": None,
              "tensor_parallel_size": 1, "batch_size": 4, "no_proof": False}
SWEEP_ONLY = {"concurrency": "1,2,4,8,16,32", "lengths": "16,64,256,1024", "budget": None, "cell_limit": None}


def add_arguments(vp) -> None:
    """Its options, on the parser kvviz.cli makes under the subcommand its folder derives."""
    model_args(vp)
    vsrc = vp.add_mutually_exclusive_group()
    vsrc.add_argument("--prompt", help="one prompt")
    vsrc.add_argument("--prompts", default=None,
                      help="'builtin' (default), 'builtin:<category>', or a .txt (one a line) / .jsonl file")
    vp.add_argument("--limit", type=int, default=20, help="at most this many prompts (default 20)")
    vp.add_argument("--prefix", default=STUDY_ONLY["prefix"], help="a shared prefix put before every prompt (warmed for 'warm')")
    vp.add_argument("--conditions", default=STUDY_ONLY["conditions"],
                    help="comma-separated: alone,batch,warm (default all three)")
    vp.add_argument("--runs", type=int, default=5, help="runs per condition (R)")
    vp.add_argument("--max-new-tokens", type=int, default=16)
    vp.add_argument("--batch-size", type=int, default=STUDY_ONLY["batch_size"], help="k: requests in flight in the batch condition")
    vp.add_argument("--seed", type=int, default=0, help="seed of the batch draws")
    vp.add_argument("--engine", default=registry.default(), choices=registry.names(),
                    help="transformers (in kvviz), vllm or llama.cpp (their own environments: `make engines`)")
    vp.add_argument("--page-size", type=int, default=STUDY_ONLY["page_size"],
                    help="tokens per cache page (prefix sharing is per page; transformers engine only, default 8)")
    vp.add_argument("--tensor-parallel-size", type=int, default=STUDY_ONLY["tensor_parallel_size"],
                    help="GPUs one vLLM engine spreads the model over (the vLLM engine only; refused otherwise)")
    vp.add_argument("--server", default=None,
                    help="URL of your running OpenAI-compatible server (vllm serve, llama-server, SGLang): its "
                         "/v1/completions with log-probs run the conditions, judged against --model's weights")
    vp.add_argument("--sweep", action="store_true",
                    help="where determinism ends: requests in flight × prompt length against the engine (or --server)")
    vp.add_argument("--concurrency", default=SWEEP_ONLY["concurrency"], help="--sweep: requests in flight per column")
    vp.add_argument("--lengths", default=SWEEP_ONLY["lengths"], help="--sweep: prompt lengths in tokens per row")
    vp.add_argument("--budget", type=float, default=SWEEP_ONLY["budget"], help="--sweep: stop between cells after this many seconds")
    vp.add_argument("--cell-limit", type=float, default=SWEEP_ONLY["cell_limit"],
                    help="--sweep: stop a cell still running after this many seconds; it is listed as not finished, "
                         "the cells at least as large as not run, and the sweep goes on (default: an engine worker's "
                         "own limit, 900 s an answer)")
    repro_arg(vp)
    vp.set_defaults(handler=command)


def _refuse_the_others(args) -> None:
    other = STUDY_ONLY if args.sweep else SWEEP_ONLY
    given = [k for k, default in other.items() if getattr(args, k, default) != default]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise FlagRefused(f"{flag} does nothing {'with' if args.sweep else 'without'} --sweep (the "
                         f"{'sweep draws its own prompts per cell and runs no proof' if args.sweep else 'study'}"
                         f"{'' if args.sweep else ' has no grid of requests in flight × lengths'}); leave it out")


def command(args) -> Outcome:
    _refuse_the_others(args)
    if not args.server:
        registry.check(args.engine)  # one line where vLLM is asked for and absent, before anything loads
    if args.sweep:
        return sweep_command(args)
    prompts, source = load_prompt_set(args.prompts, args.prompt, args.limit)
    conditions = args.conditions or "alone,batch,warm"
    cfg = ServeConfig(prompts=prompts, shared_prefix=args.prefix, conditions=split_list(conditions),
                      runs=args.runs, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                      engine=args.engine, page_size=args.page_size, prompt_source=source,
                      tensor_parallel_size=args.tensor_parallel_size, server=args.server)
    cfg.validate()
    args.workload = cfg.workload()  # its memory plan: what the config holds, as the Serving page plans it
    lm = load(args)
    res = views.run("serving", lm, cfg, context(args))  # --no-proof: prove=False (None proves as True does here)
    return Outcome(res, lm, lambda: summary(res))


def summary(res) -> str:
    return summary_text(res)


def sweep_command(args) -> Outcome:
    if getattr(args, "repro", None):  # said before the sweep runs, not after it
        raise FlagRefused("--repro does nothing for `serving --sweep` (no repro script rebuilds a sweep; it has its "
                         "--json-out and --html exports); leave it out")
    try:
        conc, lengths = (tuple(int(x) for x in split_list(v)) for v in (args.concurrency, args.lengths))
    except ValueError:
        raise KvvizError("--concurrency and --lengths take comma-separated whole numbers, like 1,4,16") from None
    cfg = SweepConfig(concurrency=conc, lengths=lengths, prompts_per_cell=min(args.limit, 64),
                      max_new_tokens=args.max_new_tokens, runs=args.runs, seed=args.seed, engine=args.engine,
                      server=args.server, budget_s=args.budget, cell_limit_s=args.cell_limit)
    cfg.validate()
    # its memory plan is the sweep's, as on the Serving page: kvviz's process holds one prompt's float64 reference
    # at a time, and on transformers' engine (pages in this process) the largest batch of the grid
    args.plan_view, args.workload = "serving_sweep", cfg.workload()
    lm = load(args)
    res = views.run("serving_sweep", lm, cfg, context(args))
    return Outcome(res, lm, lambda: sweep_summary_text(res), payload=res.to_dict)  # --json-out / --html: its own view's
