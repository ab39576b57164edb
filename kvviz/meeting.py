"""Prepare the meeting: run a chosen list of one-click scenarios (kvviz.presets) ahead of time and keep their results
(JSON, the export format) in a folder, so that "Open a result" shows each at once during the meeting, and one HTML
file bundles all their reports. Nothing here draws or imports Streamlit; the app, the CLI and a notebook call it."""
from __future__ import annotations

import json
import re
from pathlib import Path

from .errors import KvvizError
from .presets import BY_KEY, PRESETS, Preset

VIEW_OF_PAGE = {"pages/split_point.py": "split", "pages/greedy_paths.py": "greedy", "pages/dtypes_lab.py": "dtypes",
                "pages/backends.py": "matrix"}


def run_scenario(p: Preset, device: str = "cpu", progress=None):
    """The result a scenario's page computes with the scenario's settings (defaults for the rest)."""
    import kvviz

    from .execution import ExecSettings

    settings = ExecSettings(invariant=p.invariant)
    c = p.controls
    view = VIEW_OF_PAGE.get(p.page)
    if view == "dtypes":
        from .views.dtypes.run import run_dtypes
        from .prompts import builtin_prompts

        prompts = [r["prompt"] for r in builtin_prompts()][: int(c.get("dt_limit", 8))]
        return run_dtypes(kvviz.parse_spec(p.model), prompts, ["float32", "float16", "bfloat16"], device, "auto",
                          split="last", mode="chunk", progress=progress)
    lm = kvviz.load_model(p.model, p.dtype, device)
    if view == "split":
        from .inputs import encode

        prompt = c.get("split_prompt", "The capital of France is Paris, and the capital of Italy is")
        n = len(encode(lm, prompt))
        cfg = kvviz.SplitConfig(prompt=prompt, split=int(c.get("split_k", min(max(1, n // 2), n - 1))),
                                mode=c.get("split_mode", "chunk"), left_pad=int(c.get("split_pad", 0)),
                                position_ids=c.get("split_pos", "auto"), attention_mask=c.get("split_mask", "full"))
        return kvviz.run_split(lm, cfg, progress=progress, settings=settings)
    if view == "greedy":
        from .views.greedy.run import DEFAULT_PATHS, GreedyConfig, run_greedy

        cfg = GreedyConfig(prompt=c.get("greedy_prompt", "This is a "), max_new_tokens=int(c.get("greedy_n", 24)),
                           paths=tuple(c.get("greedy_paths", DEFAULT_PATHS)))
        return run_greedy(lm, cfg, progress=progress, settings=settings)
    if view == "matrix":
        from .views.matrix.run import run_matrix, sliding_window_config

        return run_matrix(lm, sliding_window_config(lm), progress=progress)
    raise KvvizError(f"scenario {p.key}: its page {p.page} cannot be prepared ahead")


def prepare(keys: list[str] | None, out_dir: "str | Path", device: str = "cpu", progress=None) -> list[Path]:
    """Run the scenarios `keys` (None: all) and write `<key>.json` (the export format, opened by open_result) and
    `meeting.html` (every report, one after the other) into `out_dir`. Returns the JSON paths, in order."""
    from .export import export_json, html_report

    keys = [p.key for p in PRESETS] if keys is None else keys
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        raise KvvizError(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(BY_KEY)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths, reports = [], []
    for i, key in enumerate(keys):
        p = BY_KEY[key]
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
    found = []
    for p in PRESETS:
        f = out / f"{p.key}.json"
        if f.is_file():
            found.append((p.title, f))
    return found


def default_dir() -> Path:
    """Where the app keeps the meeting's results: <kvviz cache>/meeting."""
    from .loading import cache_dir

    return cache_dir() / "meeting"
