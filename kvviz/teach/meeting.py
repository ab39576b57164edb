"""Prepare the meeting: run a chosen list of one-click scenarios (kvviz.teach.presets) ahead of time and keep their results
(JSON, the export format) in a folder, so that "Open a result" shows each at once during the meeting, and one HTML
file bundles all their reports. Nothing here draws or imports Streamlit; the app, the CLI and a notebook call it."""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..core.errors import KvvizError
from .presets import Preset, all_presets, by_key

def run_scenario(p: Preset, device: str = "cpu", progress=None):
    """The result a scenario's page computes with the scenario's settings (defaults for the rest): the `scenario`
    hook of the view whose page it is gives the model, config and settings; the view's run (kvviz.core.protocol) runs
    them."""
    from .. import views
    from ..core.protocol import RunContext

    view = views.for_page(Path(p.page).stem)
    setup = view.resolve(view.scenario)
    lm, config, settings = setup(p, device) if setup else _setup_from_controls(p, device, view)
    return view.runner()(lm, config, RunContext(settings=settings, progress=progress))


def _setup_from_controls(p: Preset, device: str, view):
    """A view without a scenario hook: the preset's model and dtype, its controls (`<folder>_<field>`) as the
    config's fields (defaults for the rest), invariant mode as the preset says."""
    from ..core.execution import ExecSettings
    from ..models.loading import load_model
    from ..core.protocol import config_from

    prefix = view.page.prefix if view.page else ""
    values = {k.removeprefix(prefix): v for k, v in p.controls.items() if k.startswith(prefix)}
    config = config_from(view.config_type(), values)
    return load_model(p.model, p.dtype, device), config, ExecSettings(invariant=p.invariant)


def prepare(keys: list[str] | None, out_dir: "str | Path", device: str = "cpu", progress=None) -> list[Path]:
    """Run the scenarios `keys` (None: all) and write `<key>.json` (the export format, opened by open_result) and
    `meeting.html` (every report, one after the other) into `out_dir`. Returns the JSON paths, in order."""
    from ..io.export import export_json, html_report

    known = by_key()
    keys = list(known) if keys is None else keys
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise KvvizError(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(known)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths, reports = [], []
    for i, key in enumerate(keys):
        p = known[key]
        sub = None if progress is None else (lambda f, m, i=i: progress((i + f) / len(keys), f"{p.title}: {m}"))
        res = run_scenario(p, device, sub)
        path = out / f"{key}.json"
        doc = json.loads(export_json(res))
        doc["scenario"] = {"key": p.key, "title": p.title, "what": p.what}
        path.write_text(json.dumps(doc), encoding="utf-8")
        paths.append(path)
        reports.append((p.title, html_report(res)))
    (out / "meeting.html").write_text(bundle(reports), encoding="utf-8")
    return paths


def bundle(reports: list[tuple[str, str]]) -> str:
    """Several html_report pages in one file: a table of contents, then each report's body (plotly inlined once)."""
    import html

    bodies = []
    for i, (title, page) in enumerate(reports):
        body = re.search(r"<body>(.*)</body>", page, re.S)
        text = body.group(1) if body else page
        if i > 0:  # plotly.js is inlined by the first report only
            text = re.sub(r"<script[^>]*>/\*\*\s*\* plotly\.js.*?</script>", "", text, flags=re.S)
        bodies.append(f'<section id="s{i}"><h1>{html.escape(title)}</h1>{text}</section><hr>')
    style = re.search(r"<style>.*?</style>", reports[0][1], re.S).group(0) if reports else ""
    toc = "".join(f'<li><a href="#s{i}">{html.escape(t)}</a></li>' for i, (t, _) in enumerate(reports))
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>kvviz — the meeting</title>{style}</head>'
            f"<body><h1>kvviz — prepared for the meeting</h1><ol>{toc}</ol>{''.join(bodies)}</body></html>")


def prepared(out_dir: "str | Path") -> list[tuple[str, Path]]:
    """(title, path) of the results prepared in `out_dir`, in scenario order."""
    out = Path(out_dir)
    return [(p.title, out / f"{p.key}.json") for p in all_presets() if (out / f"{p.key}.json").is_file()]


def default_dir() -> Path:
    """Where the app keeps the meeting's results: <kvviz cache>/meeting."""
    from ..models.loading import cache_dir

    return cache_dir() / "meeting"
