"""Split point: the prompt's first K tokens cached, the rest fed through past_key_values, against one full forward; per
layer and token, with the float64 and invariant-mode evidence.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), repro.py, cli.py.
Registered by one line in kvviz/views/__init__.py."""
from .. import MemoryProfile, Page, View
from . import cli, figures, report, repro, run, scenario
from ...core.prompts import CAPITALS
from .run import MODES, SplitConfig, SplitResult

VIEW = View("split", "Split point", "SplitResult", report.reopen, figures.main, report.verdict,
            tables=figures.tables, repro=repro, cli=cli,
            page=Page("split", "Investigate", ":material/content_cut:",
                      defaults={"prompt": CAPITALS}, url_aliases=("split_point",)),
            config=run.SplitConfig, run=run.run,
            memory=MemoryProfile(forwards=2, compared_after_split=True), scenario=scenario.setup)
