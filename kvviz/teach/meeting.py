"""Prepare the meeting: run a chosen list of one-click scenarios (kvviz.teach.presets) ahead of time and keep their results
(JSON, the export format) in a folder, so that "Open a result" shows each at once during the meeting, and one HTML
file bundles all their reports. The presenter's own runs (their model, prompt, split: "Add to the meeting" beside a
result's downloads) join them as their saved JSON, reopened for the bundle without loading or running a model.
Nothing here draws or imports Streamlit; the app, the CLI and a notebook call it."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Sequence
import html

from ..core.errors import KvvizError
from .presets import Preset, all_presets, by_key
from ..core.execution import ExecSettings
from ..core.protocol import RunContext, config_from
from ..io.export import export_json, html_report, open_result
from ..models import loading
from ..models.loading import cache_dir
from .. import views

def run_scenario(p: Preset, device: str = "cpu", progress=None):
    """The result a scenario's page computes with the scenario's settings (defaults for the rest): the `scenario`
    hook of the view whose page it is gives the model, config and settings; the view's run (kvviz.core.protocol) runs
    them."""
    view = views.for_page(Path(p.page).stem)
    setup = view.scenario
    lm, config, settings = setup(p, device) if setup else _setup_from_controls(p, device, view)
    return views.run(view, lm, config, RunContext(settings=settings, progress=progress))


def _setup_from_controls(p: Preset, device: str, view):
    """A view without a scenario hook: the preset's model and dtype, its controls (`<folder>_<field>`) as the
    config's fields (defaults for the rest), invariant mode as the preset says."""
    prefix = view.page.prefix if view.page else ""
    values = {k.removeprefix(prefix): v for k, v in p.controls.items() if k.startswith(prefix)}
    config = config_from(view.config_type(), values)
    return loading.load_model(p.model, p.dtype, device), config, ExecSettings(invariant=p.invariant)


def prepare(keys: list[str] | None, out_dir: "str | Path", device: str = "cpu", progress=None,
            runs: "Sequence[str | bytes | os.PathLike]" = ()) -> list[Path]:
    """Run the scenarios `keys` (None: all) and write `<key>.json` (the export format, opened by open_result) and
    `meeting.html` (every report, one after the other) into `out_dir`. `runs`: results the presenter made and saved
    (the JSON export: its text, or a path to the file), reopened as they were (no model is loaded or run for them)
    and bundled after the scenarios, each as its own section, and kept in `out_dir/runs/` (see `prepared`).
    Returns the JSON paths, in order (the scenarios', then the runs')."""
    known = by_key()
    keys = list(known) if keys is None else keys
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise KvvizError(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(known)}")
    added = []  # all read before anything runs: a bad file fails first
    for i, r in enumerate(runs):
        title, opened, text = _reopen_run(r, i)
        added.append((_unique(title, [a[0] for a in added]), opened, text))
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
    paths += _write_runs(added, out)
    reports += [(title, added_report(opened)) for title, opened, _ in added]
    (out / "meeting.html").write_text(bundle(reports), encoding="utf-8")
    return paths


# ------------------------------------------------------------------------------------------------------------------
# The presenter's own runs ("Add to the meeting" beside a result's downloads): kept as their JSON export, reopened
# from it for the bundle, never rerun.

RUNS = "runs"  # their folder inside the meeting's folder: <i>-<view>.json and index.json (their titles, in order)


def run_title(view: str, result) -> str:
    """A run's name in the meeting: its page, its model and its verdict ("Split point: /models/my-llama — logic")."""
    entry = views.get(view)
    settings = getattr(result, "settings", None)
    settings = settings if isinstance(settings, dict) else settings.to_dict() if settings is not None else {}
    verdict, _ = entry.verdict_text(result)
    verdict = str(getattr(verdict, "value", verdict))
    model = settings.get("model") or getattr(result, "model", None) or "?"
    return f"{entry.title}: {model}" + ("" if not verdict or verdict.startswith("see the") else f" — {verdict}")


def _reopen_run(run, i: int):
    """(title, opened result, JSON text) of a saved run; one line (KvvizError) when it is not a kvviz result."""
    data = Path(run).read_bytes() if isinstance(run, os.PathLike) else run
    try:
        opened = open_result(data)
    except KvvizError as e:
        raise KvvizError(f"run {i + 1} added to the meeting: {e}") from None
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    return run_title(opened.view, opened.result), opened, text


def _write_runs(added, out: Path) -> list[Path]:
    """The runs' JSON, as saved, in out/runs/ (the runs of an earlier Prepare removed), with their titles."""
    folder = out / RUNS
    if folder.is_dir():
        for old in folder.glob("*.json"):
            old.unlink()
    if not added:
        return []
    folder.mkdir(exist_ok=True)
    paths, index = [], []
    for i, (title, opened, text) in enumerate(added):
        path = folder / f"{i + 1}-{opened.view}.json"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
        index.append({"title": title, "file": path.name})
    (folder / "index.json").write_text(json.dumps(index), encoding="utf-8")
    return paths


def _unique(title: str, taken: list[str]) -> str:
    """`title`, or `title (2)`, `title (3)`… when an earlier run has it (Open a result picks a run by its title)."""
    n, out = 1, title
    while out in taken:
        n += 1
        out = f"{title} ({n})"
    return out


def added_report(opened) -> str:
    """The HTML report of a run reopened from its JSON (verdict, charts, tables, settings), saying where its
    numbers come from and what differs from the machine this file is written on."""
    note = ("Added to the meeting by the presenter: reopened from its saved result (JSON), not rerun."
            + (" Computed elsewhere: " + "; ".join(opened.environment_differences[:6]) + "."
               if opened.environment_differences else ""))
    return html_report(opened.result).replace("<body>", f'<body><p class="added-run">{html.escape(note)}</p>', 1)


def bundle(reports: list[tuple[str, str]]) -> str:
    """Several html_report pages in one file: a table of contents, then each report's body (plotly inlined once)."""
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
    """(title, path) of the results prepared in `out_dir`: the scenarios, in scenario order, then the presenter's
    own runs, in the order they were added."""
    out = Path(out_dir)
    got = [(p.title, out / f"{p.key}.json") for p in all_presets() if (out / f"{p.key}.json").is_file()]
    index = out / RUNS / "index.json"
    try:
        runs = json.loads(index.read_text(encoding="utf-8")) if index.is_file() else []
    except (OSError, ValueError):
        runs = []
    return got + [(r["title"], out / RUNS / r["file"]) for r in runs
                  if isinstance(r, dict) and (out / RUNS / str(r.get("file"))).is_file()]


def default_dir() -> Path:
    """Where the app keeps the meeting's results: <kvviz cache>/meeting."""
    return cache_dir() / "meeting"
