"""Padding and batching: the prompt alone, left-padded and in a batch, with and without cache, position ids and masks:
precision or logic per cell.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), repro.py, cli.py.
Registered by one line in kvviz/views/__init__.py."""
from .. import Page, View
from . import cli, figures, report, repro, run
from ...core.prompts import CAPITALS
from .memory import PaddingMemory
from .run import DEFAULT_COMPANIONS, PaddingResult

VIEW = View("padding", "Padding and batching", "PaddingResult", report.reopen, figures.main, report.verdict,
            verdict_is_html=True, tables=figures.tables, repro=repro, cli=cli,
            page=Page("padding", "Classic traps", ":material/grid_on:", link_prefix="pad_",
                      defaults={"prompt": CAPITALS, "left_pad": 4, "prove": False}, url_aliases=("padding_lab",)),
            config=run.PaddingConfig, run=run.run,
            memory=PaddingMemory(batch=1 + len(DEFAULT_COMPANIONS), batch_texts=DEFAULT_COMPANIONS,
                                 compared_after_split=True))
