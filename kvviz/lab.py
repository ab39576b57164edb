"""The precision lab, kept for older imports: each scenario now has its own module.

kvviz.dtype_sweep (dtypes side by side), kvviz.padding (padding and batching), kvviz.reuse (prompt-cache reuse).
"""
from .dtype_sweep import VERDICTS, DtypesResult, run_dtypes, split_point  # noqa: F401
from .padding import DEFAULT_COMPANIONS, PLACEMENTS, SCENARIOS, PaddingResult, run_padding  # noqa: F401
from .reuse import REUSE_STRATEGIES, ReuseResult, run_reuse  # noqa: F401
