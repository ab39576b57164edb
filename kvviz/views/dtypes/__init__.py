"""Dtypes side by side: the split comparison in several dtypes over one prompt or a prompt set, against float64.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), repro.py, cli.py.
Registered by one line in kvviz/views/__init__.py."""
from .. import MemoryProfile, Page, View
from . import cli, figures, report, repro, run, scenario
from ...core.prompts import CAPITALS
from .run import DtypesResult

VIEW = View("dtypes", "Dtypes side by side", "DtypesResult", report.reopen, figures.main, report.verdict,
            verdict_is_html=True, tables=figures.tables, repro=repro, cli=cli,
            page=Page("dtypes", "Investigate", ":material/stacked_line_chart:", link_prefix="dt_",
                      defaults={"prompt": CAPITALS, "dtypes": ("float32", "float16", "bfloat16")},
                      url_aliases=("dtypes_lab",)),
            config=run.DtypesConfig, run=run.run,
            memory=MemoryProfile(forwards=2, many_prompts=True), scenario=scenario.setup)
