"""The example view's chart: a pure function of its result, fitted to a narrow column (fit_text: its title wrapped,
its margins kept) as every view's figures are."""
import plotly.graph_objects as go

from kvviz.core.plotting import fit_text


def main(result) -> list:
    fig = go.Figure(go.Bar(x=["last token"], y=[result.max_abs], width=0.4))
    fig.update_layout(title=f"Cached vs full forward: {result.verdict}", height=300, yaxis_title="max |Δ logit|")
    return [fit_text(fig)]
