"""Exports: a result as JSON with the environment it was computed in, opened again without running any model;
a self-contained HTML report; a standalone repro script.

`export_json(result)` writes {"kvviz_result": {view, format, environment, numerics, model_fingerprint}, ...the
result...}; `numerics` holds the process settings that change the last bits (torch's threads, the CPU capability,
deterministic algorithms, float32 matmul precision, MKL/oneDNN instruction-set variables: kvviz.core.numerics), which the
repro script sets again. `open_result(text)` rebuilds the result object (numpy arrays where it has them) so the
figures draw it as before, and lists what differs between the environment it was computed in and this one.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
import enum
import html

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

from ..core.environment import compare_environments, environment
from ..core.errors import KvvizError
from ..core.estimate import Timed, Timings
from ..core.execution import ExecSettings
from .jsonout import dumps
from ..core.numerics import describe as describe_numerics, differences as numerics_differences, numerics
from ..core import theme
from ..core.plotting import plain_index
from .. import views

FORMAT = 1


def _device(result) -> str | None:
    s = getattr(result, "settings", None)
    return s.get("device") if isinstance(s, dict) else getattr(s, "device", None)


def result_dict(result) -> dict:
    """The result's own dict, and its memory plan beside it when the run had one (kvviz.core.memory.attach)."""
    d = result.to_dict()
    d.pop("timings", None)  # a to_dict made by dataclasses.asdict carries the field: written as the two numbers
    if isinstance(result, Timed):  # the estimate the run started with, beside the seconds it took
        t = result.timings_dict()
        d["estimate_s"] = t["estimate_s"]
        if d.get("elapsed_s") is None:
            d["elapsed_s"] = t["elapsed_s"]
    plan = getattr(result, "memory_plan", None)
    if plan is not None:
        d["memory_plan"] = plan.to_dict()
    return d


def export_json(result, model_fingerprint: dict | None = None) -> str:
    """The result as one JSON document, with the environment and (when given) the model's fingerprint."""
    header = {"view": views.of(result).name, "format": FORMAT, "environment": environment(_device(result)),
              "numerics": numerics(), "model_fingerprint": model_fingerprint}
    return dumps({"kvviz_result": header, **result_dict(result)})


@dataclass
class OpenedResult:
    view: str
    result: object
    environment_differences: list[str]
    header: dict


def open_result(data: "str | bytes") -> OpenedResult:
    """Rebuild a result from its exported JSON; no model is loaded or run."""
    try:
        d = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise KvvizError("this file is not JSON: open a result exported by kvviz (.json)") from None
    if not isinstance(d, dict) or "kvviz_result" not in d:
        raise KvvizError("this JSON is not a kvviz result (no kvviz_result header)")
    head = d.pop("kvviz_result")
    if not isinstance(head, dict):
        raise KvvizError("this JSON is not a kvviz result (its kvviz_result header is not an object)")
    view = head.get("view")
    if head.get("format") != FORMAT:
        raise KvvizError(f"this result has format {head.get('format')!r}; this kvviz reads format {FORMAT}")
    if view not in views.names():
        raise KvvizError(f"unknown view {view!r} in this result")
    plan = d.pop("memory_plan", None)  # the run's memory plan rides beside the result, not inside its type
    if plan is not None:
        head["memory_plan"] = plan
    try:
        d.pop("timings", None)
        est, took = d.pop("estimate_s", None), d.get("elapsed_s")
        try:
            result = views.get(view).rebuild(d)
        except TypeError as e:  # a result type without elapsed_s of its own: the export wrote the run's beside it
            if "elapsed_s" not in str(e):
                raise
            d.pop("elapsed_s", None)
            result = views.get(view).rebuild(d)
        number = (int, float)
        if isinstance(result, Timed) and (isinstance(est, number) or isinstance(took, number)):
            result.timed(Timings(float(est) if isinstance(est, number) else None,
                                 float(took) if isinstance(took, number) else None))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise KvvizError(f"this {view} result is incomplete or damaged ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120]})") from None
    return OpenedResult(view, result, compare_environments(head.get("environment"))
                        + numerics_differences(head.get("numerics")), head)


# ------------------------------------------------------------------------------------------------------------------
# Rebuilding each result type


def typed(cls, d: dict, **conv):
    names = {f.name for f in fields(cls)} - {"timings"}  # a run's timings: set by open_result from its two numbers
    kw = {k: v for k, v in d.items() if k in names}
    kw.update({k: f(kw[k]) for k, f in conv.items() if k in kw})
    if "execution" in names:
        kw["execution"] = ExecSettings.from_dict(d.get("execution"))
    return cls(**kw)


def arrays(d: dict | None) -> dict:
    return {k: np.array([np.nan if x is None else x for x in v] if v and not isinstance(v[0], list) else
                        [[np.nan if x is None else x for x in row] for row in v], dtype=float)
            for k, v in (d or {}).items()}


# ------------------------------------------------------------------------------------------------------------------
# HTML report


def main_figures(result) -> list:
    """The view's main charts, as the pages draw them (pure functions of the result)."""
    return views.of(result).main_figures(result)


# Streamlit's chart theme: `import streamlit` makes "streamlit" plotly's default template for the whole process, so
# every figure built in the app's process - the HTML report's, the meeting bundle's, the lesson handout's, not only
# the page's - starts with that template, whose colours are placeholders (#000001..#000040) that only Streamlit's
# frontend replaces. Written to a file they draw black lines, solid black bars, cut-off labels. A figure is written
# with kvviz's own template instead (kvviz.core.theme: the one the app's charts take too).
PLACEHOLDER_COLOUR = re.compile(r"#0000(?:0[1-9]|[1-3][0-9]|40)(?![0-9a-fA-F])", re.IGNORECASE)
TEMPLATE = theme.NAME


def standalone_figure(fig):
    """A copy of `fig` to write outside the app: kvviz's own template (whatever the process default is), and
    ValueError if a Streamlit placeholder colour is still in it (a colour taken from the app's template at build
    time would draw black). The figure on the page is left as it is."""
    out = go.Figure(fig)
    out.layout.template = theme.register()  # assigned, not merged: nothing of another template is kept
    left = sorted(set(PLACEHOLDER_COLOUR.findall(out.to_json())))
    if left:
        raise ValueError(f"this figure carries Streamlit's theme placeholder colours {', '.join(left)}: it was built "
                         "with colours from the app's template, which only the app's frontend replaces")
    return out


def figure_html(fig, include_plotlyjs: bool, div_id: str | None = None) -> str:
    """One figure as an HTML fragment for a file (report, meeting bundle, handout): standalone_figure's colours and
    layout; plotly.js inlined where include_plotlyjs (the file then opens offline)."""
    return pio.to_html(standalone_figure(fig), include_plotlyjs=include_plotlyjs, full_html=False, div_id=div_id)


def shown(v) -> str:
    """A setting's value for people: an enum as its word, a missing value as "not set", a sequence joined."""
    if v is None:
        return "not set"
    if isinstance(v, enum.Enum):
        return str(v.value)
    if isinstance(v, (list, tuple)):
        return ", ".join(shown(x) for x in v) if v else "none"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {shown(x)}" for k, x in v.items()) if v else "none"
    return str(v)


STYLE = (theme.PAGE_CSS + "th{text-align:left;padding-right:1em;vertical-align:top}td,th{font-size:14px}"
         + theme.box_css(".verdict"))


def html_report(result) -> str:
    """A self-contained HTML file: verdict, settings, environment, the main charts (plotly inlined: works offline)."""
    entry = views.of(result)
    view = entry.name
    verdict, text = entry.verdict_text(result)
    settings = getattr(result, "settings", None) or result.to_dict()  # a result without settings: all of it
    settings = settings if isinstance(settings, dict) else settings.to_dict()
    env = environment(_device(result))
    figs = main_figures(result)
    parts = [figure_html(f, include_plotlyjs=(i == 0)) for i, f in enumerate(figs)]
    tables = "".join(t.to_html(index=not plain_index(t)) for t in entry.main_tables(result))
    def table_rows(items) -> str:
        return "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(shown(v))}</td></tr>" for k, v in items)

    rows = table_rows(settings.items())
    env_rows = table_rows((k, v) for k, v in env.items() if k != "flags")
    env_rows += (f"<tr><th>numerics</th><td>{html.escape(describe_numerics(numerics()))} (the settings that change "
                 "the last bits; the repro script sets them again)</td></tr>")
    body_text = text if entry.verdict_is_html else html.escape(text)
    box = theme.box_class(verdict)  # the app's verdict box colours: logic red, precision blue, identical green
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>kvviz — {view}</title>
<style>{STYLE}</style></head><body>
<h1>kvviz — {view}</h1>
<div class="verdict {box}"><b>Verdict: {html.escape(str(verdict))}.</b> {body_text}</div>
{''.join(parts) if parts else '<p>(no chart for this view)</p>'}
{tables}
<h2>Settings</h2><table>{rows}</table>
<h2>Environment</h2><table>{env_rows}</table>
<p><small>Written by kvviz {html.escape(env['kvviz'])}. Open the JSON export in kvviz to explore it again.</small></p>
</body></html>"""
