"""The lens view's figures and tables: pure functions of its result (no model runs here)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ...core.plotting import fit_text, heatmap, short
from .run import LensResult, most_moved

DIFFERS = "top-1 differs (full → cached)"


def _positions(res: LensResult) -> list[str]:
    return [f"{i}: {short(res.tokens[i])}" for i in res.compared]


def hidden_heatmap(res: LensResult) -> go.Figure:
    return heatmap(np.array(res.main.hidden), _positions(res), res.layer_labels,
                   f"Hidden state: relative gap, cached vs full — {res.main.dtype}", "relative gap")


def lens_heatmap(res: LensResult) -> go.Figure:
    """KL(full || cached) of the two lens distributions per layer and position; where the two top-1 differ, the
    cell carries both tokens."""
    kl = np.array(res.main.kl)
    f, c = np.array(res.main.full["top1"]), np.array(res.main.cached["top1"])
    dec = res.decision
    title = "Logit lens: KL(full ‖ cached) per layer" + (f" — decision depth {dec['layer']}" if dec else
                                                          " — top-1 agrees at every layer")
    fig = heatmap(kl, _positions(res), res.layer_labels, title, "KL")
    ys, xs = np.nonzero(f != c)
    if len(ys):
        text = [f"{short(res.token(f[y, x]), 6)}→{short(res.token(c[y, x]), 6)}" for y, x in zip(ys, xs)]
        fig.add_trace(go.Scatter(x=xs.tolist(), y=ys.tolist(), mode="text", text=text, name=DIFFERS,
                                 textfont=dict(color="#d32f2f", size=11), showlegend=True,
                                 hovertemplate="%{text}<extra>" + DIFFERS + "</extra>"))
    return fig


def margin_lines(res: LensResult) -> go.Figure | None:
    """At the decision depth's position: each path's top-1 margin over its runner-up, per layer."""
    dec = res.decision
    if dec is None:
        return None
    j = res.compared.index(dec["position"])
    fig = go.Figure()
    for side, dash in (("full", "solid"), ("cached", "dash")):
        p = getattr(res.main, side)
        fig.add_trace(go.Scatter(x=res.layer_labels, y=[row[j] for row in p["margin"]], name=f"{side} path",
                                 mode="lines+markers", line=dict(dash=dash),
                                 text=[f"{res.token(p['top1'][r][j])} over {res.token(p['top2'][r][j])}"
                                       for r in range(len(res.layer_labels))],
                                 hovertemplate="%{x}: margin %{y:.4g}<br>%{text}<extra>%{fullData.name}</extra>"))
    fig.add_vline(x=dec["row"], line=dict(color="#d32f2f", dash="dot"))
    fig.update_layout(title=f"Top-1 margin over the runner-up at position {dec['position']} ('{short(dec['at'])}')",
                      xaxis_title="hidden state", yaxis_title="margin (logits)", height=360)
    return fit_text(fig)


def attention_heatmap(res: LensResult) -> go.Figure | None:
    a = res.attention
    if not a.get("max_dp"):
        return None
    m = np.array(a["max_dp"])
    moved = most_moved(res)
    title = (f"Attention at position {a['position']} ('{short(a['token'])}'): max |Δp| per head, cached vs full"
             + (f" — most: layer {moved['layer']} head {moved['head']}" if moved else ""))
    return heatmap(m, [str(h) for h in range(m.shape[1])], [f"layer {k + 1}" for k in range(m.shape[0])], title,
                   "max |Δp|", x_title="head")


def main(res: LensResult) -> list:
    return [f for f in (hidden_heatmap(res), lens_heatmap(res), margin_lines(res), attention_heatmap(res))
            if f is not None]


def tables(res: LensResult) -> list:
    f, c = res.main.full, res.main.cached
    rows = []
    for r, label in enumerate(res.layer_labels):
        differ = [j for j in range(len(res.compared)) if f["top1"][r][j] != c["top1"][r][j]]
        j = differ[0] if differ else int(np.argmax(res.main.kl[r]))
        rows.append({"hidden state": label, "positions where top-1 differs": len(differ),
                     "max KL": float(max(res.main.kl[r])), "position": res.compared[j],
                     "full top-1": res.token(f["top1"][r][j]), "full margin": float(f["margin"][r][j]),
                     "cached top-1": res.token(c["top1"][r][j]), "cached margin": float(c["margin"][r][j]),
                     "runner-up (full)": res.token(f["top2"][r][j])})
    out = [pd.DataFrame(rows)]
    a = res.attention
    if a.get("max_dp"):
        att = []
        for layer, heads in enumerate(a["max_dp"]):
            for h, v in enumerate(heads):
                k = a["to_key"][layer][h]
                att.append({"layer": layer + 1, "head": h, "max |Δp|": float(v), "moved to key": k,
                            "key token": res.tokens[k] if 0 <= k < len(res.tokens) else "⟨pad⟩",
                            "Δp there": float(a["to_dp"][layer][h])})
        out.append(pd.DataFrame(att).sort_values("max |Δp|", ascending=False, kind="stable").reset_index(drop=True))
    return out
