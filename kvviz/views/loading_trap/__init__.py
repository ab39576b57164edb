"""Loading trap: from_pretrained(dtype=16-bit) against float32 + .to(16-bit) - two models that are not the same.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), repro.py, cli.py.
Registered by one line in kvviz/views/__init__.py."""
from .. import MemoryProfile, Page, View
from . import cli, figures, report, repro, run
from .run import LoadingTrapResult

VIEW = View("loading_trap", "Loading trap", "LoadingTrapResult", report.reopen, figures.main, None,
            tables=figures.tables, repro=repro, cli=cli,
            page=Page("loading_trap", "Classic traps", ":material/swap_horiz:", link_prefix="trap_",
                      defaults={"prompt": "This is a ", "n": 12}),
            config=run.LoadingTrapConfig, run=run.run, refuses=run.REFUSES,
            memory=MemoryProfile(reference=False), runs=("trap",))
