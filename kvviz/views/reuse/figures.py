"""The reuse view's figures and tables: pure functions of its result (no model runs here)."""
from __future__ import annotations

import pandas as pd

from ...core.text import fmt_number


def ab_reuse_frame(res_a, res_b) -> pd.DataFrame:
    """A/B for prompt-cache reuse: per continuation and way, A's and B's verdict, gap to fresh and text."""
    b = {(r["index"], r["strategy"]): r for r in res_b.runs}
    rows = []
    for r in res_a.runs:
        o = b.get((r["index"], r["strategy"]))
        if o is None:
            continue
        rows.append({"continuation": r["index"] + 1, "way": r["strategy"], "A verdict": r["verdict"],
                     "B verdict": o["verdict"], "A gap to fresh": fmt_number(r["logits_relative"]),
                     "B gap to fresh": fmt_number(o["logits_relative"]), "A text": r["text"], "B text": o["text"]})
    return pd.DataFrame(rows)


def reuse_frame(res) -> pd.DataFrame:
    df = res.table()
    df["first_divergence"] = df["first_divergence"].astype("Int64")  # empty where the tokens never part
    return df.rename(columns={"first_divergence": "parts from fresh at step", "logits_relative": "logit gap",
                              "float64_relative": "float64 gap"})


def tables(result) -> list:
    return [reuse_frame(result)]
