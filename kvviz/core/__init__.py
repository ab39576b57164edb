"""The execution core: the seam every model call goes through (execution, loops), the run contexts (backends,
flags, invariant, float64 / streamed reference), the run protocol, metrics, verdicts and the memory plan. Imports
nothing from kvviz.views, kvviz.teach or kvviz.io (tests/test_architecture.py)."""
