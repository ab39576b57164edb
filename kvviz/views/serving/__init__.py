"""Serving: conditions (alone, continuous batch, warm prefix) x R runs through a serving engine - distinct completions
per prompt, where and why they part; and where determinism ends: a sweep of requests in flight × prompt length
(sweep.py). Two views, one subcommand (`serving`, `serving --sweep`), one page (the sweep is a section of it).

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), repro.py, cli.py;
sweep.py the sweep's config, run, result, figure, table, reopen and verdict.
Registered by one line in kvviz/views/__init__.py."""
from .. import MemoryProfile, Page, View
from . import cli, figures, report, repro, run, sweep
from .memory import ServingMemory
from .run import ServeConfig, ServeResult, run_serving
from .sweep import SweepConfig, SweepResult, run_sweep

VIEW = View("serving", "Serving", "ServeResult", report.reopen, figures.main, report.verdict,
            tables=figures.tables, repro=repro, cli=cli, command_aliases=("serve-study",),
            page=Page("serving", "Engine", ":material/dns:", link_prefix="sv_",
                      defaults={"category": "math_and_facts", "limit": 5, "runs": 3, "n": 8, "batch": 4}),
            config=run.ServeConfig, run=run.run,
            # transformers' engine, one per call (run._requests): alone holds every prompt, batch every batch of k
            # (the last filled up), warm a warmer and its prompt for each; vLLM and llama.cpp hold their own
            memory=ServingMemory(engine_calls=(("alone", 1, False), ("batch", 1, True), ("warm", 2, False))))
# The sweep: its own result type (its JSON export's `view`), reopened, drawn and judged through the registry like
# any view; run by `serving --sweep` and by the Serving page's "Where determinism ends" section (its run there is
# "serving_sweep"). kvviz's process holds the float64 reference of one prompt at a time (and, on transformers'
# engine, the batch): the page names its longest prompt and its batch.
SWEEP = View("serving_sweep", "Where determinism ends", "SweepResult", sweep.reopen, sweep.figures,
             sweep.verdict, tables=sweep.tables, config=sweep.SweepConfig, run=sweep.run,
             runs=("serving_sweep",), memory=MemoryProfile(many_prompts=True, batch_from_workload=True),
             refuses=sweep.REFUSES)
VIEWS = (VIEW, SWEEP)
