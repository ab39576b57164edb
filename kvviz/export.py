"""Exports: a result as JSON with the environment it was computed in, opened again without running any model;
a self-contained HTML report; a standalone repro script.

`export_json(result)` writes {"kvviz_result": {view, format, environment, model_fingerprint}, ...the result...}.
`open_result(text)` rebuilds the result object (numpy arrays where it has them) so the figures draw it as before,
and lists what differs between the environment it was computed in and this one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

import numpy as np

from .environment import compare_environments, environment
from .errors import KvvizError
from .execution import ExecSettings
from .jsonout import dumps
from . import views

FORMAT = 1


def view_of(result) -> str:
    return views.of(result).name


def _device(result) -> str | None:
    s = getattr(result, "settings", None)
    return s.get("device") if isinstance(s, dict) else getattr(s, "device", None)


def export_json(result, model_fingerprint: dict | None = None) -> str:
    """The result as one JSON document, with the environment and (when given) the model's fingerprint."""
    header = {"view": view_of(result), "format": FORMAT, "environment": environment(_device(result)),
              "model_fingerprint": model_fingerprint}
    return dumps({"kvviz_result": header, **result.to_dict()})


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
    view = head.get("view")
    if head.get("format") != FORMAT:
        raise KvvizError(f"this result has format {head.get('format')!r}; this kvviz reads format {FORMAT}")
    if view not in views.names():
        raise KvvizError(f"unknown view {view!r} in this result")
    plan = d.pop("memory_plan", None)  # the run's memory plan rides beside the result, not inside its type
    if plan is not None:
        head["memory_plan"] = plan
    try:
        result = views.get(view).rebuild(d)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise KvvizError(f"this {view} result is incomplete or damaged ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120]})") from None
    return OpenedResult(view, result, compare_environments(head.get("environment")), head)


# ------------------------------------------------------------------------------------------------------------------
# Rebuilding each result type


def _exec(d: dict | None) -> ExecSettings:
    d = d or {}
    return ExecSettings(cache=d.get("cache", "dynamic"), compile=d.get("compile", "off"),
                        flags=tuple(d.get("flags", ())), invariant=bool(d.get("invariant", False)))


def _typed(cls, d: dict, **conv):
    names = {f.name for f in fields(cls)}
    kw = {k: v for k, v in d.items() if k in names}
    kw.update({k: f(kw[k]) for k, f in conv.items() if k in kw})
    if "execution" in names:
        kw["execution"] = _exec(d.get("execution"))
    return cls(**kw)


def _arrays(d: dict | None) -> dict:
    return {k: np.array([np.nan if x is None else x for x in v] if v and not isinstance(v[0], list) else
                        [[np.nan if x is None else x for x in row] for row in v], dtype=float)
            for k, v in (d or {}).items()}


def _comparison(d: dict | None):
    from .split import Comparison

    if d is None:
        return None
    c = Comparison(dtype=d["dtype"], device=d["device"], attention=d["attention"], has_cache=d["has_cache"],
                   hidden=_arrays(d.get("hidden")), logits=_arrays(d.get("logits")), describe=d.get("describe", {}),
                   kv=d.get("kv", []), reference_top1=d.get("reference_top1", []),
                   cached_top1=d.get("cached_top1", []), bidirectional_change=d.get("bidirectional_change"))
    if "argmax_agree" in c.logits:
        c.logits["argmax_agree"] = c.logits["argmax_agree"].astype(bool)
    if "top5_overlap" in c.logits:
        c.logits["top5_overlap"] = c.logits["top5_overlap"].astype(np.int64)
    return c


def reopen_split(d: dict):
    from .split import SplitResult, SplitSettings

    return SplitResult(settings=_typed(SplitSettings, d["settings"]), model=d["model"], tokens=d["tokens"],
                       token_ids=d["token_ids"], compared=d["compared_positions"], layer_labels=d["layer_labels"],
                       main=_comparison(d["result"]), float64=_comparison(d.get("float64_evidence")),
                       verdict=d["verdict"], explanation=d["explanation"], notes=d.get("notes", []),
                       elapsed_s=d.get("elapsed_s", 0.0), invariant=_comparison(d.get("invariant_check")),
                       proof=d.get("proof"))


def reopen_greedy(d: dict):
    from .greedy import GreedyResult, GreedySettings, PairResult, PathResult

    paths = {k: _typed(PathResult, v) for k, v in d["paths"].items()}
    pairs = [PairResult(**{**p, "hidden_relative": np.array(p["hidden_relative"], dtype=float)}) for p in d["pairs"]]
    return GreedyResult(settings=_typed(GreedySettings, d["settings"], paths=tuple), model=d["model"],
                        prompt_tokens=d["prompt_tokens"], layer_labels=d["layer_labels"], paths=paths, pairs=pairs,
                        notes=d.get("notes", []), elapsed_s=d.get("elapsed_s", 0.0))


def reopen_dtypes(d: dict):
    from .dtype_sweep import DtypesResult, DtypesSettings

    per_prompt = {m: {k: np.array(v, dtype=float) for k, v in by.items()} for m, by in d["per_prompt"].items()}
    return DtypesResult(settings=_typed(DtypesSettings, d["settings"], skipped_dtypes=tuple), model=d["model"],
                        dtypes=d["dtypes"], prompts=d["prompts"], layer_labels=d["layer_labels"],
                        per_prompt=per_prompt, logits_max_abs=d["logits_max_abs"], verdicts=d["verdicts"],
                        elapsed_s=d.get("elapsed_s", 0.0), proved=d.get("proved", {}))


def reopen_padding(d: dict):
    from .padding import PaddingResult, PaddingSettings

    return PaddingResult(settings=_typed(PaddingSettings, d["settings"], companions=tuple), model=d["model"],
                         tokens=d["tokens"], compared=d["compared"], cells=d["cells"])


def reopen_reuse(d: dict):
    from .reuse import ReuseResult, ReuseSettings

    return ReuseResult(settings=_typed(ReuseSettings, d["settings"], continuations=tuple), model=d["model"],
                       prefix_tokens=d["prefix_tokens"], runs=d["runs"])


def reopen_matrix(d: dict):
    from .matrix import Cell, MatrixResult

    return MatrixResult(settings=d["settings"], environment=d["environment"], reference=d["reference"],
                        cells=[_typed(Cell, c) for c in d["cells"]], elapsed_s=d.get("elapsed_s", 0.0))


def reopen_quant(d: dict):
    from .quant import QuantResult, QuantSettings

    d = {k: v for k, v in d.items() if k not in ("kl_max", "kl_mean", "worst_layer")}
    return QuantResult(**{**d, "settings": _typed(QuantSettings, d["settings"])})


def reopen_loading_trap(d: dict):
    from .loading_trap import BufferDiff, LoadingTrapResult

    return LoadingTrapResult(**{**d, "buffers": [BufferDiff(**b) for b in d["buffers"]]})


def reopen_check(d: dict):
    from .check import Check, CheckCard

    return CheckCard(**{**d, "checks": [Check(**c) for c in d["checks"]]})


def reopen_bisect(d: dict):
    from .bisect import BisectResult, ModuleGap

    return BisectResult(settings=d["settings"], first=ModuleGap(**d["first"]) if d.get("first") else None,
                        modules=[ModuleGap(**m) for m in d.get("modules", [])], explanation=d.get("explanation", ""))


def reopen_kv_reload(d: dict):
    from .kvcache import ContinueResult

    return ContinueResult(**d)


def reopen_kv_size(d: dict):
    from .cachesize import SizeReport

    return SizeReport(**d)


def reopen_serving(d: dict):
    from .serving import ServeResult

    return ServeResult.from_dict(d)


# ------------------------------------------------------------------------------------------------------------------
# HTML report


def main_figures(result) -> list:
    """The view's main charts, as the pages draw them (pure functions of the result)."""
    return views.of(result).main_figures(result)


def verdict_text(result) -> tuple[str, str]:
    """(verdict, one paragraph) for the report and Open a result."""
    return views.of(result).verdict_text(result)


# the per-view pieces the registry names (kvviz/view_entries.py)


def split_figures(result) -> list:
    from . import figures

    return [figures.split_heatmap(result), figures.layer_lines(result)] if result.main.has_cache else []


def greedy_figures(result) -> list:
    from . import figures

    ref = figures.greedy_reference_gap(result)
    return [figures.greedy_margins(result), figures.greedy_heatmap(result)] + ([ref] if ref is not None else [])


def split_verdict(result) -> tuple[str, str]:
    proof = result.proof if result.proof and "invariant mode" not in result.explanation else None
    return result.verdict, result.explanation + (f" {proof}" if proof else "")


def greedy_verdict(result) -> tuple[str, str]:
    parting = [p for p in result.pairs if p.first_divergence is not None]
    if not parting:
        return "identical", f"All paths chose the same {result.steps} tokens."
    first = min(parting, key=lambda p: p.first_divergence)
    return first.verdict, first.explanation


def bisect_verdict(result) -> tuple[str, str]:
    from .naming import module_label

    return (("first difference: " + module_label(result.first.name)) if result.first else "no difference",
            result.explanation)


def kv_reload_verdict(result) -> tuple[str, str]:
    return ("bitwise equal" if result.bitwise_equal else "differs",
            f"Reloaded {result.n_cached} cached tokens and fed {len(result.continuation_tokens)} more: largest "
            f"gap to a fresh cache — logits {result.max_abs_logits:.3g}, hidden states {result.max_abs_hidden:.3g}, "
            f"keys/values {result.max_abs_kv:.3g}.")


def kv_size_verdict(result) -> tuple[str, str]:
    measured = "—" if result.measured_bytes is None else f"{result.measured_bytes:,}"
    return ("size", f"{result.model} in {result.dtype}: {result.per_token_bytes:,} bytes per token; "
                    f"{result.tokens} tokens × batch {result.batch}: formula {result.formula_bytes:,} bytes, "
                    f"measured {measured} bytes.")


def check_verdict(result) -> tuple[str, str]:
    rows = "".join(f"<tr><td>{c.status}</td><td>{c.name}</td><td>{c.evidence}</td></tr>" for c in result.checks)
    return result.overall, f"{result.summary}<table>{rows}</table>"


def matrix_verdict(result) -> tuple[str, str]:
    counts = {}
    for c in result.cells:
        counts[c.verdict or "error"] = counts.get(c.verdict or "error", 0) + 1
    return "cells", ", ".join(f"{v}: {n}" for v, n in counts.items())


def dtypes_figures(result) -> list:
    from . import figures

    return [figures.dtype_curves(result, "max_abs", "mean"), figures.dtype_curves(result, "eps_units", "max")]


def padding_figures(result) -> list:
    from . import figures

    return [figures.padding_grid(result, "hidden_relative")]


def matrix_figures(result) -> list:
    from . import figures

    return [figures.matrix_grid(result)]


def quant_figures(result) -> list:
    from . import figures

    return [figures.quant_steps(result), figures.quant_layers(result)]


def loading_trap_figures(result) -> list:
    from . import figures

    return [figures.loading_trap_steps(result)]


def bisect_figures(result) -> list:
    from . import figures

    return [figures.bisect_modules(result)]


def dtypes_verdict(result) -> tuple[str, str]:
    return "see the table", result.verdict_counts().to_html()


def padding_verdict(result) -> tuple[str, str]:
    return "see the grid", result.grid().to_html()


def reuse_verdict(result) -> tuple[str, str]:
    return "see the table", result.table().to_html(index=False)




def html_report(result) -> str:
    """A self-contained HTML file: verdict, settings, environment, the main charts (plotly inlined: works offline)."""
    import html

    import plotly.io as pio

    entry = views.of(result)
    view = entry.name
    verdict, text = entry.verdict_text(result)
    settings = getattr(result, "settings", None) or (result.to_dict() if view in ("kv_reload", "kv_size")
                                                     else {"model": getattr(result, "model", "")})
    settings = settings if isinstance(settings, dict) else settings.to_dict()
    env = environment(_device(result))
    figs = main_figures(result)
    parts = [pio.to_html(f, include_plotlyjs=(i == 0), full_html=False) for i, f in enumerate(figs)]
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in settings.items())
    env_rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                       for k, v in env.items() if k != "flags")
    body_text = text if entry.verdict_is_html else html.escape(text)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>kvviz — {view}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#111;
background:#fff}}th{{text-align:left;padding-right:1em;vertical-align:top}}td,th{{font-size:14px}}
.verdict{{padding:.8em 1em;border-radius:6px;background:#eef3fb;border:1px solid #9bb4dc}}
@media (prefers-color-scheme: dark){{body{{background:#111;color:#eee}}.verdict{{background:#1c2a40;
border-color:#4a6a9a}}}}</style></head><body>
<h1>kvviz — {view}</h1>
<div class="verdict"><b>Verdict: {html.escape(str(verdict))}.</b> {body_text}</div>
{''.join(parts) if parts else '<p>(no chart for this view)</p>'}
<h2>Settings</h2><table>{rows}</table>
<h2>Environment</h2><table>{env_rows}</table>
<p><small>Written by kvviz {html.escape(env['kvviz'])}. Open the JSON export in kvviz to explore it again.</small></p>
</body></html>"""
