"""JSON that any parser accepts: numpy values become plain numbers, inf/nan become null."""
from __future__ import annotations

import json
import math

import numpy as np


def plain(obj):
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return plain(obj.tolist())
    if isinstance(obj, (np.floating, float)):
        f = float(obj)
        return f if math.isfinite(f) else None
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.bool_,)):
        return bool(obj)
    return obj


def dumps(obj, **kw) -> str:
    return json.dumps(plain(obj), allow_nan=False, ensure_ascii=False, **kw)
