"""Serving: conditions (alone, continuous batch, warm prefix) x R runs through a serving engine - distinct completions
per prompt, where and why they part.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), repro.py, cli.py.
Registered by one line in kvviz/views/__init__.py."""
from .. import MemoryProfile, Page, View
from .run import ServeConfig, ServeResult, run_serving

VIEW = View("serving", "Serving", "ServeResult", "report:reopen", "figures:main", "report:verdict",
            tables="figures:tables", repro="repro", cli="cli", command_aliases=("serve-study",),
            page=Page("serving", "Engine", ":material/dns:", link_prefix="sv_",
                      defaults={"category": "math_and_facts", "limit": 5, "runs": 3, "n": 8, "batch": 4}),
            config="run:ServeConfig", run="run:run",
            memory=MemoryProfile())
