"""The example view's chart: a pure function of its result."""
import plotly.graph_objects as go


def main(result) -> list:
    fig = go.Figure(go.Bar(x=["max |Δ logit|, last position"], y=[result.max_abs]))
    fig.update_layout(title=f"Cached vs full forward: {result.verdict}", height=300)
    return [fig]
