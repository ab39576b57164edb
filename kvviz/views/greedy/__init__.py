"""Greedy paths: decoding with and without the cache (and generate, a user loop, float64): where the paths part and
why.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), repro.py, cli.py.
Registered by one line in kvviz/views/__init__.py."""
from .. import Decoding, Page, View
from . import cli, figures, report, repro, run, scenario
from .run import DEFAULT_PATHS, GreedyConfig, GreedyResult

VIEW = View("greedy", "Greedy paths", "GreedyResult", report.reopen, figures.main, report.verdict,
            repro=repro, cli=cli,
            page=Page("greedy", "Investigate", ":material/call_split:",
                      defaults={"prompt": "This is a ", "n": 12}, url_aliases=("greedy_paths",)),
            config=run.GreedyConfig, run=run.run,
            memory=Decoding(decoded_runs=len(DEFAULT_PATHS), reference_decodes_with="float64", cache_copies=1),
            scenario=scenario.setup)
