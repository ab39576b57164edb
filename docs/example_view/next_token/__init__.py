"""Next token (an example view): the prompt's next-token logits from one full forward, and from its last token fed
through the cache of the rest. The whole view is this folder; kvviz learns of it from one line in
kvviz/views/__init__.py (VIEW_FOLDERS). See docs/architecture.md."""
from kvviz.views import MemoryProfile, View

from .run import NextTokenResult, run_next_token  # noqa: F401  (the view's library API)

# memory: what its memory plan counts - two forwards, no float64 reference (a view without one is refused)
VIEW = View("next_token", "Next token", "NextTokenResult", reopen="report:reopen", figures="figures:main",
            verdict="report:verdict", cli="cli", command="next-token",
            memory=MemoryProfile(forwards=2, reference=False))
