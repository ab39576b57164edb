"""Logit lens of both paths (issue 54): each layer's hidden state of the full forward and of the cached path through
the model's final norm and head; the decision depth (the first layer where the two paths' best next token differs),
the margins there, the KL per layer and position, and the attention that moved at the first cached position.

This folder is the whole view: run.py (config, run, result), figures.py, report.py (reopen, verdict), repro.py
(its standalone script). Registered by
one line in kvviz/views/__init__.py; its subcommand (`python -m kvviz lens`) and page (the generic one) come from
its config."""
from .. import MemoryProfile, Page, Preset, View
from . import figures, report, repro, run
from ...core.prompts import CAPITALS
from .run import LensConfig, LensResult  # noqa: F401  (the view's library API)

# memory: the split's working set - the full forward's compared rows held per layer, two paths' compared rows of one
# layer's lens logits (as split holds the two paths' logits) and their float64 comparison a chunk at a time; the
# float64 reference reruns the scenario; no invariant-mode proof (refused)
VIEW = View("lens", "Logit lens", "LensResult", reopen=report.reopen, figures=figures.main,
            verdict=report.verdict, tables=figures.tables, repro=repro, config=run.LensConfig, run=run.run,
            refuses=run.REFUSES,
            page=Page("lens", "Investigate", ":material/visibility:", defaults={"prompt": CAPITALS}),
            memory=MemoryProfile(forwards=2, compared_after_split=True),
            scenarios=(Preset(
                "lens_padding", "Where the padding bug takes over, layer by layer",
                "The logit lens of both paths with the classic left-padding bug (3 pads, the rest through the cache "
                "without position ids): the embeddings agree, and already after layer 1 the cached path ranks another "
                "token first - the decision depth - with both paths' margins there, and the attention head that "
                "moved most at the first cached position. Logic: the gap stays in float64.",
                "pages/lens.py", "tiny:llama", "bfloat16",
                {"lens_prompt": "The capital of France is Paris and the capital of Spain is", "lens_split": 5,
                 "lens_mode": "chunk", "lens_left_pad": 3, "lens_position_ids": "omit",
                 "lens_attention_mask": "full"}),))
