"""Quantized cache & weights: a quantized KV cache and/or weight-only quantization against the unquantized run.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), repro.py, cli.py.
Registered by one line in kvviz/views/__init__.py."""
from .. import MemoryProfile, Page, View
from . import cli, figures, report, repro, run
from .run import QuantConfig, QuantResult

VIEW = View("quant", "Quantized cache & weights", "QuantResult", report.reopen, figures.main, None,
            tables=figures.tables, repro=repro, cli=cli,
            page=Page("quant", "Engine", ":material/compress:",
                      defaults={"prompt": "The museum guard knew every painting in the building, but his favourite was",
                      "kv": "quanto:int4", "n": 24}, url_aliases=("quantized",)),
            config=run.QuantConfig, run=run.run, refuses=run.REFUSES,
            memory=MemoryProfile(reference=False, weight_copies=True))
