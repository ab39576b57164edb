"""The cache-safety card's table: pure functions of its result."""
import pandas as pd


def tables(result) -> list:
    return [pd.DataFrame([{"status": c.status, "check": c.name, "evidence": c.evidence}
                          for c in result.checks])]
