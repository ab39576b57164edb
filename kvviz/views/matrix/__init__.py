"""Backends & compile: attention implementation x cache kind x compile x precision flags, repeated - which settings
change greedy decoding, and how.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), repro.py, cli.py.
Registered by one line in kvviz/views/__init__.py."""
from .. import MemoryProfile, Page, View
from . import cli, figures, report, repro, run, scenario
from ...core.prompts import CAPITALS
from .run import MatrixConfig, MatrixResult, sliding_window_config

VIEW = View("matrix", "Backends & compile", "MatrixResult", report.reopen, figures.main, report.verdict,
            repro=repro, cli=cli,
            page=Page("matrix", "Engine", ":material/memory:", link_prefix="mx_",
                      defaults={"prompt": CAPITALS, "n": 8, "repeats": 2, "attn": ("eager", "sdpa"),
                      "cache": ("dynamic", "static")}, url_aliases=("backends",)), config=run.MatrixConfig, run=run.run,
            refuses=run.REFUSES,
            memory=MemoryProfile(batch_from_workload=True),  # the prompt and its batch-mates in one batch
            scenario=scenario.setup)
