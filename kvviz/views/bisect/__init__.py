"""The bisector: the first module (and op) whose output differs between the cached run and the full forward.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), cli.py.
Registered by one line in kvviz/views/__init__.py."""
from .. import View
from . import cli, figures, report, run
from .memory import BisectMemory
from .run import BisectResult

VIEW = View("bisect", "Bisector", "BisectResult", report.reopen, figures.main, report.verdict, cli=cli,
            config=run.BisectConfig, run=run.run, refuses=run.REFUSES,
            memory=BisectMemory(forwards=2, reference=False, compared_after_split=True))
