"""Prompt-cache reuse: one prefix cache for several continuations - fresh, deep-copied, reused in place.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), repro.py, cli.py.
Registered by one line in kvviz/views/__init__.py."""
from .. import Decoding, Page, View
from . import cli, figures, report, repro, run
from .run import REUSE_STRATEGIES, ReuseResult

VIEW = View("reuse", "Prompt-cache reuse", "ReuseResult", report.reopen, None, report.verdict,
            verdict_is_html=True, tables=figures.tables, repro=repro, cli=cli,
            page=Page("reuse", "Classic traps", ":material/recycling:",
                      defaults={"prefix": "You are a helpful assistant. Answer in one short sentence.\n",
                      "continuations": ["Q: What is the capital of France?\nA:", "Q: What colour is the sky?\nA:"],
                      "n": 8, "prove": False}, url_aliases=("cache_reuse",)),
            config=run.ReuseConfig, run=run.run,
            memory=Decoding(decoded_runs=len(REUSE_STRATEGIES), cache_copies=3))
