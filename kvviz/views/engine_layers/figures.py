"""The engine-layers view's figures and tables: pure functions of its result. The layer × token maps are Split
point's (kvviz.core.plotting.heatmap: exact zeros in their own colour, one shared colour range for the two sides)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ...core.theme import log_axis
from ...core.plotting import METRIC_TITLES, floor_zeros, heatmap, shared_range, short, thin_x, zero_floor, fit_text
from .run import METRICS, EngineLayersResult


def _labels(res: EngineLayersResult, positions: list[int]) -> list[str]:
    return [f"{p}: {short(res.tokens[p])}" if p < len(res.tokens) else str(p) for p in positions]


def _worst(res: EngineLayersResult, m) -> np.ndarray:
    """Per row (hidden state), the largest entry over tokens (zeros where nothing was compared)."""
    m = np.asarray(m, dtype=float)
    return m.max(axis=1) if m.size else np.zeros(len(res.layer_labels))


def _check(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric}; choose one of {', '.join(METRICS)}")


def pair_heatmap(res: EngineLayersResult, metric: str = "relative", log: bool = True) -> go.Figure:
    """A against B, layer × token, on the positions both computed with the same inputs. The dtype is left to the
    verdict and the layer lines (a fourth title line would overlap an all-zero map's bitwise-equal legend)."""
    _check(metric)
    a, b = res.labels
    title = (f"{METRIC_TITLES[metric]}: {b} vs {a} inside {res.engine.get('name')}; "
             f"first differing {res.row_label(res.first_differing)}, beyond rounding {res.row_label(res.first_beyond)}")
    return heatmap(res.gaps[metric], _labels(res, res.positions), res.layer_labels, title, METRIC_TITLES[metric], log)


def reference_heatmaps(res: EngineLayersResult, metric: str = "relative", log: bool = True
                       ) -> tuple[go.Figure, go.Figure]:
    """Each side against kvviz's float64 reference on its own tokens, on one colour range."""
    _check(metric)
    za, zb = (np.asarray(s.reference[metric], dtype=float) for s in (res.a, res.b))
    zrange = shared_range(za, zb, log)
    figs = []
    for s, z in ((res.a, za), (res.b, zb)):
        title = f"{METRIC_TITLES[metric]}: {s.label} vs the float64 reference (its own tokens)"
        figs.append(heatmap(z, _labels(res, s.positions), res.layer_labels, title, METRIC_TITLES[metric], log,
                            zrange=zrange))
    return figs[0], figs[1]


def layer_lines(res: EngineLayersResult, log: bool = True) -> go.Figure:
    """Per layer, the largest relative gap over tokens: A vs B, each side vs float64, and the rounding bound."""
    a, b = res.labels
    series = [(f"{b} vs {a}", res.gaps["relative"], None), (f"{a} vs float64", res.a.reference["relative"], "dash"),
              (f"{b} vs float64", res.b.reference["relative"], "dash")]
    rows = [(name, _worst(res, m), dash) for name, m, dash in series]
    rows.append(("rounding bound", np.asarray(res.bound, dtype=float), "dot"))
    positive = [v for _, vals, _ in rows for v in vals if v > 0]
    floor = min(positive) / 10 if positive else 1e-20
    fig = go.Figure()
    for name, vals, dash in rows:
        fig.add_trace(go.Scatter(x=res.layer_labels, y=floor_zeros(vals, floor) if log else vals,
                                 mode="lines+markers", name=name, line=dict(dash=dash), customdata=vals,
                                 hovertemplate="%{x}: %{customdata:.4g}<extra></extra>"))
    fig.update_layout(title=f"Relative gap per layer (max over tokens) — {res.engine_dtype()}",
                      xaxis_title="hidden state", yaxis_title="relative gap", height=380,
                      margin=dict(l=10, r=10, t=60, b=10), legend=dict(orientation="h", y=-0.35))
    if log:
        log_axis(fig)
        if any((vals == 0).any() for _, vals, _ in rows):
            zero_floor(fig, floor, "0 (bitwise equal)")
    thin_x(fig, list(res.layer_labels))
    return fit_text(fig)


def layers_frame(res: EngineLayersResult) -> pd.DataFrame:
    a, b = res.labels
    return pd.DataFrame({"hidden state": res.layer_labels,
                         f"{b} vs {a} (relative)": _worst(res, res.gaps["relative"]),
                         f"{b} vs {a} (× ε)": _worst(res, res.gaps["eps_units"]),
                         f"{a} vs float64": _worst(res, res.a.reference["relative"]),
                         f"{b} vs float64": _worst(res, res.b.reference["relative"]),
                         "rounding bound": res.bound})


def prompts_frame(res: EngineLayersResult) -> pd.DataFrame:
    """Every prompt at its outputs: distinct completions over the two sides, where they part, the verdict."""
    a, b = res.labels
    return pd.DataFrame([{"prompt": p["prompt"], "distinct completions": p["distinct"],
                          "parts at step": p["first_divergence"], "reference margin there": p["margin"],
                          f"{a} vs float64 (nats)": p["distance"].get(a), f"{b} vs float64 (nats)": p["distance"].get(b),
                          "verdict": p["verdict"]} for p in res.prompts])


def lens_heatmap(res: EngineLayersResult) -> go.Figure | None:
    """The logit lens of both sides (the Logit lens view's map): KL(A ‖ B) of the two sides' lens distributions per
    layer and position, the tokens written in the cells where their top-1 differ (A's → B's); None without a lens."""
    lens = res.lens
    if lens is None:
        return None
    a, b = res.labels
    dec = res.decision
    title = (f"Logit lens inside {res.engine.get('name')}: KL({a} ‖ {b}) per layer"
             + (f" — decision depth {dec['layer']}" if dec else " — top-1 agrees at every layer"))
    fig = heatmap(np.asarray(lens.kl, dtype=float), _labels(res, lens.positions), res.layer_labels, title, "KL")
    ta, tb = np.asarray(lens.a["top1"]), np.asarray(lens.b["top1"])
    ys, xs = np.nonzero(ta != tb)
    if len(ys):
        differs = f"top-1 differs ({a} → {b})"
        text = [f"{short(lens.token(ta[y, x]), 6)}→{short(lens.token(tb[y, x]), 6)}" for y, x in zip(ys, xs)]
        fig.add_trace(go.Scatter(x=xs.tolist(), y=ys.tolist(), mode="text", text=text, name=differs,
                                 textfont=dict(color="#d32f2f", size=11), showlegend=True,
                                 hovertemplate="%{text}<extra>" + differs + "</extra>"))
    return fig


def lens_frame(res: EngineLayersResult) -> pd.DataFrame:
    """Per hidden state: where the two sides' lens top-1 differ (count, the first position) and the largest KL, with
    each side's top-1 and margin there (at the largest KL where they agree)."""
    lens = res.lens
    a, b = res.labels
    rows = []
    for r, label in enumerate(res.layer_labels):
        differ = [j for j in range(len(lens.positions)) if lens.a["top1"][r][j] != lens.b["top1"][r][j]]
        j = differ[0] if differ else int(np.argmax(lens.kl[r])) if len(lens.kl[r]) else None
        row = {"hidden state": label, "positions where top-1 differs": len(differ),
               "max KL": float(max(lens.kl[r])) if len(lens.kl[r]) else 0.0}
        if j is not None:
            row.update({"position": lens.positions[j],
                        f"{a} top-1": lens.token(lens.a["top1"][r][j]), f"{a} margin": float(lens.a["margin"][r][j]),
                        f"{b} top-1": lens.token(lens.b["top1"][r][j]), f"{b} margin": float(lens.b["margin"][r][j])})
        rows.append(row)
    return pd.DataFrame(rows)


def main(result) -> list:
    lens = lens_heatmap(result)
    return [pair_heatmap(result), *reference_heatmaps(result), layer_lines(result)] + ([lens] if lens else [])


def tables(result) -> list:
    return ([layers_frame(result)] + ([prompts_frame(result)] if result.prompts else [])
            + ([lens_frame(result)] if result.lens is not None else []))
