"""Engine layers: two runs of one prompt through vLLM (warm vs cold prefix cache, batch vs alone, tensor parallel 1
vs N) compared hidden state by hidden state inside the engine, each against kvviz's float64 reference; the first
layer where they differ beyond rounding, named.

This folder is the whole view: run.py (config, run, result, the logit lens of both sides), figures.py, report.py
(reopen, verdict), cli.py, memory.py (its memory plan).
Registered by one line in kvviz/views/__init__.py."""
from .. import Page, View
from . import cli, figures, report, run
from .memory import EngineLayersMemory
from .run import EngineLayersConfig, EngineLayersResult, run_engine_layers  # noqa: F401  (the library API)

# memory: kvviz runs two no-cache forwards of the prompt (the float64 reference and its own run in the engine's
# dtype), every hidden state kept (they go to the worker as a file), then the lens of both sides (memory.py); the
# engine's memory is its own process's
VIEW = View("engine_layers", "Engine layers", "EngineLayersResult", report.reopen, figures.main, report.verdict,
            tables=figures.tables, cli=cli, page=Page("engine_layers", "Engine", ":material/layers:", starts_engine=True),
            config=run.EngineLayersConfig, run=run.run, refuses=run.REFUSES,
            memory=EngineLayersMemory(forwards=3, streamed_hidden=False))
