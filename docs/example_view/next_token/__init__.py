"""Next token (an example view): the prompt's next-token logits from one full forward, and from its last token fed
through the cache of the rest. The whole view is this folder; kvviz learns of it from one line in
kvviz/views/__init__.py (VIEW_FOLDERS). See docs/architecture.md."""
from kvviz.views import View

from .run import NextTokenResult, run_next_token  # noqa: F401  (the view's library API)

VIEW = View("next_token", "Next token", "NextTokenResult", reopen="report:reopen", figures="figures:main",
            verdict="report:verdict", cli="cli", command="next-token")
