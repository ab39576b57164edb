"""The serving engines live in kvviz/engines/serving.py (the Serving and Engine layers views share them); this name
is kept for the pages and the serving CLI that import it."""
from ...engines.serving import *  # noqa: F401,F403
