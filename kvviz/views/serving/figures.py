"""The serving view's charts and table: pure functions of its result (the page, the HTML report and a notebook draw the same)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ...core.plotting import fit_text
from .run import CONDITION_LABELS, ServeResult
from ...core.text import fmt_number


def histogram_figure(res: ServeResult):
    """The TML-style chart: how many prompts gave 1, 2, 3… distinct completions, per condition and overall."""
    fig = go.Figure()
    top = max([res.settings.runs + 1] + list(res.histogram))
    xs = list(range(1, top + 1))
    for c in res.settings.conditions:
        h = res.condition_histogram(c)
        fig.add_bar(x=xs, y=[h.get(x, 0) for x in xs], name=CONDITION_LABELS[c])
    h = res.histogram
    fig.add_bar(x=xs, y=[h.get(x, 0) for x in xs], name="all runs + reference")
    fig.update_layout(title="Distinct completions per prompt", xaxis_title="distinct completions",
                      yaxis_title="prompts", barmode="group", xaxis=dict(dtick=1), height=380)
    return fit_text(fig)


def divergence_figure(res: ServeResult):
    """Where the first divergence falls, and the reference's top-2 margin there (a near tie or not)."""
    parting = [p for p in res.prompts if p.first_divergence is not None]
    fig = go.Figure()
    for verdict in sorted({p.verdict or "?" for p in parting}):
        ps = [p for p in parting if (p.verdict or "?") == verdict]
        fig.add_scatter(x=[p.first_divergence for p in ps], y=[max(p.margin or 0.0, 1e-12) for p in ps],
                        mode="markers", name=verdict, text=[f"[{p.index}] {p.prompt[:40]} ({p.condition})" for p in ps],
                        marker=dict(size=10))
    fig.update_layout(title="First divergence from the reference: step and top-2 margin there",
                      xaxis_title="step", yaxis_title="reference's top-2 margin", yaxis_type="log", height=380)
    return fit_text(fig)


def throughput_figure(res: ServeResult):
    cs = list(res.conditions.values())
    fig = go.Figure(go.Bar(x=[c.label for c in cs], y=[c.tokens_per_s for c in cs]))
    fig.update_layout(title="Tokens per second per condition", yaxis_title="new tokens / s", height=320)
    return fit_text(fig)


def main(res: ServeResult) -> list:
    figs = [histogram_figure(res), throughput_figure(res)]
    if res.first_divergences:
        figs.insert(1, divergence_figure(res))
    return figs


def prompt_frame(res: ServeResult):
    """One row per prompt: distinct counts, first divergence, margins, verdict, proof."""
    rows = []
    for p in res.prompts:
        row = {"#": p.index, "prompt": p.prompt[:60], "distinct (all)": p.distinct_all}
        row.update({f"distinct {c}": p.distinct[c] for c in res.settings.conditions})
        row.update({"first divergence": "—" if p.first_divergence is None else p.first_divergence,
                    "where": "—" if p.condition is None else f"{p.condition}, run {p.run + 1}",
                    "tokens (ref → run)": ("—" if p.reference_token is None
                                           else f"{p.reference_token!r} → {p.run_token!r}"),
                    "ref margin": fmt_number(p.margin), "run margin": fmt_number(p.run_margin),
                    "verdict": p.verdict or ("identical" if p.first_divergence is None else "—"),
                    "float64 gap": fmt_number(p.float64_gap),
                    **({"rounding distance": fmt_number(max(v["rounding"] for v in p.engine_paths.values()))}
                       if p.engine_paths else {}),
                    "proved": "—" if p.proved is None else ("yes" if p.proved else "no"),
                    "warm ≠ cold": "—" if p.warm_differs is None else ("yes" if p.warm_differs else "no")})
        rows.append(row)
    return pd.DataFrame(rows)


def tables(res: ServeResult) -> list:
    return [prompt_frame(res)]
