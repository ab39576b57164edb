"""Logit lens of both paths (issue 54): each layer's hidden state of the full forward and of the cached path through
the model's final norm and head; the decision depth (the first layer where the two paths' best next token differs),
the margins there, the KL per layer and position, and the attention that moved at the first cached position.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), repro.py
(its standalone script). Registered by
one line in kvviz/views/__init__.py; its subcommand (`python -m kvviz lens`) and page (the generic one) come from
its config."""
from .. import MemoryProfile, Page, View
from ...core.prompts import CAPITALS
from .run import LensConfig, LensResult, run_lens  # noqa: F401  (the view's library API)

# memory: the split's working set - the full forward's compared rows held per layer, two paths' compared rows of one
# layer's lens logits (as split holds the two paths' logits) and their float64 comparison a chunk at a time; the
# float64 reference reruns the scenario; no invariant-mode proof (refused)
VIEW = View("lens", "Logit lens", "LensResult", reopen="report:reopen", figures="figures:main",
            verdict="report:verdict", tables="figures:tables", repro="repro", config="run:LensConfig", run="run:run",
            refuses="run:REFUSES",
            page=Page("lens", "Investigate", ":material/visibility:", defaults={"prompt": CAPITALS}),
            memory=MemoryProfile(forwards=2, compared_after_split=True))
