"""Is my model cache-safe? The cache-safety card: a battery of float64 checks, each safe / unsafe with its evidence.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), repro.py, cli.py.
Registered by one line in kvviz/views/__init__.py."""
from .. import Page, View
from . import cli, figures, report, repro, run
from .memory import CheckMemory
from .run import Check, CheckCard, CheckConfig

VIEW = View("check", "Is my model cache-safe?", "CheckCard", report.reopen, None, report.verdict,
            tables=figures.tables, repro=repro, cli=cli,
            page=Page("check", "Start", ":material/verified_user:", url_aliases=("cache_safety",)),
            config=run.CheckConfig, run=run.run, refuses=run.REFUSES,
            memory=CheckMemory(forwards=2, float64_only=True, weight_copies=True))
