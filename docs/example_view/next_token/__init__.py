"""Next token (an example view): the prompt's next-token logits from one full forward, and from its last token fed
through the cache of the rest. The whole view is this folder; kvviz learns of it from one line in
kvviz/views/__init__.py (VIEW_FOLDERS). See docs/architecture.md."""
from kvviz.views import MemoryProfile, Page, View

from . import figures, report, run
from .run import NextTokenConfig, NextTokenResult  # noqa: F401  (the view's library API; its run: kvviz.run)

# its name is its folder's: the JSON `view` "next_token", the subcommand `next-token` ('_' -> '-'), and its page at
# /next_token with controls prefixed next_token_ (the generic page: see docs/example_view/pages/next_token.py). memory:
# what its memory plan counts - two forwards, no float64 reference (a view without one is refused). No cli.py: its
# subcommand is made from its config. Its pieces are named by themselves (report.reopen, run.run), not by strings
VIEW = View("next_token", "Next token", "NextTokenResult", reopen=report.reopen, figures=figures.main,
            verdict=report.verdict, config=run.NextTokenConfig, run=run.run, refuses=run.REFUSES,
            page=Page("next_token", "Investigate", ":material/skip_next:"),
            memory=MemoryProfile(forwards=2, reference=False))
