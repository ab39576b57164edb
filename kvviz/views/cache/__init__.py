"""The KV cache as an object: save it (safetensors), reload it and continue (compared with a fresh cache), and its size
(formula and measured). Two views, one subcommand (`cache save|load|size`), one page.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), cli.py.
Registered by one line in kvviz/views/__init__.py."""
from .. import MemoryProfile, Page, View
from . import cli, report, run, size
from .run import ContinueResult, continue_and_compare, load_cache, save_cache, save_cache_bytes
from .size import SizeReport, size_report

_MEMORY = MemoryProfile(reference=False, batch_from_workload=True)  # no float64 reference; its own tokens, batch
VIEWS = (
    View("kv_reload", "KV cache: reload", "ContinueResult", report.reopen_reload, None, report.verdict_reload,
         cli=cli, command="cache load", memory=_MEMORY, config=run.ReloadConfig, run=run.run,
         refuses=run.REFUSES,
         page=Page("cache", "Engine", ":material/database:", "KV cache", link_prefix="kv_",
                      defaults={"prompt": "The capital of France is", "tokens": 1024}, url_aliases=("kv_cache",)),
         runs=("kv_save", "kv_load")),
    View("kv_size", "KV cache: sizes", "SizeReport", report.reopen_size, None, report.verdict_size, cli=cli,
         command="cache size", memory=_MEMORY, config=size.SizeConfig, run=size.run, refuses=size.REFUSES),
)
