"""State and URL: page controls that persist across pages and live in the URL, one-click scenarios and
Reset to defaults, and controls with one source of truth (linked slider and box)."""
from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path
from urllib.parse import quote

import streamlit as st

from kvviz import views as _views

SIDEBAR_DEFAULTS = {"model_preset": "default", "model_other": "", "dtype": "float32", "device": "auto",
                    "attn": "auto", "trust_remote_code": False, "invariant": False, "presenter": False,
                    "devices": "one device", "max_memory": ""}


# Page controls persist across page switches and live in the URL. Streamlit forgets the state of widgets a run did
# not draw, so app.py stashes every page control at the start of each run (`remember`) and a page restores its own
# before drawing them (`restore`). The URL carries the sidebar and the page's controls as JSON values. The prefixes
# come from the view registry (each view's Page(prefix=...)).
PREFIX_OF_PAGE = _views.page_prefixes()
PAGE_PREFIXES = tuple(PREFIX_OF_PAGE.values())
LINK_PREFIXES = _views.link_prefixes()  # other prefixes a saved link may carry -> the controls' own


SIDEBAR_KEYS = tuple(SIDEBAR_DEFAULTS)


# Keys that are not settings although they carry a page's prefix: the linked slider and box of split's k (split_k
# itself is the setting). The keys of read-only widgets (buttons, uploaders, downloads) are found in the code below.
_NOT_IN_URL = ("split_k_typed", "split_k_slider")


def _persistable(key: str) -> bool:
    return (key.startswith(PAGE_PREFIXES) or key in SIDEBAR_KEYS) and key not in _NOT_IN_URL \
        and not key.startswith(("dl_", "_")) and not is_read_only(key)


# What a control holds, by its widget: a link's value of another kind (split_pad="abc") would make Streamlit raise
# when the page draws the widget, so it is refused like unreadable JSON. (A selectbox or radio puts a value outside
# its options back to the default itself.)
_KIND_OF_WIDGET = {"number_input": "number", "slider": "number", "text_area": "text", "text_input": "text",
                   "toggle": "bool", "checkbox": "bool", "multiselect": "list"}
_FITS = {"number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
         "text": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool),
         "list": lambda v: isinstance(v, list)}


def _key_pattern(node: ast.expr) -> str | None:
    """A widget's key= as a regular expression: a literal as is, an f-string's fields as `.+`; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(re.escape(part.value) if isinstance(part, ast.Constant) else ".+" for part in node.values)
    return None


# Widgets whose key Streamlit makes read-only (a value assigned through st.session_state makes the widget raise
# StreamlitValueAssignmentNotAllowedError): never a setting - never stashed, in a link or restored.
READ_ONLY_WIDGETS = frozenset({"button", "download_button", "form_submit_button", "link_button", "menu_button",
                               "file_uploader", "camera_input", "audio_input", "chat_input", "data_editor",
                               "plotly_chart", "dataframe", "altair_chart", "vega_lite_chart", "pydeck_chart",
                               "run_button"})  # pages.runner.run_button: a long run's st.button, its key= passed on


def _widget_calls():
    """(widget name, key= expression or None, file, line) of every call in app.py and pages/*.py."""
    root = Path(__file__).resolve().parents[1]
    for path in [root / "app.py", *sorted((root / "pages").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                key = next((k.value for k in node.keywords if k.arg == "key"), None)
                yield name, key, path.name, node.lineno


@functools.cache
def control_kinds() -> tuple[tuple[re.Pattern, str], ...]:
    """(key pattern, kind) of every widget in app.py and pages/*.py whose value has one kind, read off the code."""
    found = []
    for name, key, _, _ in _widget_calls():
        kind = _KIND_OF_WIDGET.get(name)
        pattern = _key_pattern(key) if key is not None else None
        if kind and pattern:
            found.append((re.compile(pattern), kind))
    return tuple(found)


@functools.cache
def read_only_keys() -> tuple[re.Pattern, ...]:
    """The key patterns of every read-only widget in app.py and pages/*.py, read off the code (a literal or an
    f-string: tests/test_one_click_fixes.py checks each)."""
    return tuple(re.compile(p) for name, key, _, _ in _widget_calls()
                 if name in READ_ONLY_WIDGETS and key is not None and (p := _key_pattern(key)))


def is_read_only(key: str) -> bool:
    return any(p.fullmatch(key) for p in read_only_keys())


def fits_control(key: str, value) -> bool:
    """Whether `value` is of the kind the control `key` holds (a key no widget names: any JSON value)."""
    kinds = {kind for pattern, kind in control_kinds() if pattern.fullmatch(key)}
    return not kinds or any(_FITS[kind](value) for kind in kinds)


def remember() -> None:
    """Called by app.py at the start of every run: stash the controls' current values (and read a link's once)."""
    ss = st.session_state
    stash = ss.setdefault("_stash", {})
    if not ss.get("_url_read"):
        ss["_url_read"] = True
        bad = []
        for k, v in st.query_params.items():
            # the control it sets: a link made with another prefix still opens
            k = next((own + k[len(other):] for other, own in LINK_PREFIXES.items() if k.startswith(other)), k)
            if not _persistable(k) or k == "trust_remote_code":  # a link never turns remote code on
                continue
            try:
                value = json.loads(v)
            except (json.JSONDecodeError, TypeError):
                bad.append(k)
                continue
            if fits_control(k, value):
                stash[k] = value
            else:
                bad.append(k)
        for k in SIDEBAR_KEYS:
            if k in stash and k not in ss:
                ss[k] = stash[k]
        if bad:
            link_defaults_note(bad)
    for k in list(ss.keys()):
        if _persistable(k):
            try:
                json.dumps(ss[k])
            except TypeError:
                continue
            stash[k] = ss[k]


def link_defaults_note(keys: list[str]) -> None:
    """The one line the page shows above its controls: these settings of the link use their defaults."""
    ss = st.session_state
    named = ss.pop("_url_note_keys", [])
    named += [k for k in keys if k not in named]
    ss["_url_note_keys"] = named
    ss["_url_note"] = f"Some settings in the link could not be read and use their defaults: {', '.join(named)}"


def fall_back_outside(choices: dict[str, list]) -> None:
    """A sidebar choice (from a link) not among its options goes back to its default, and the note says so (the
    widget would show its first option: dtype float8 became float64)."""
    ss = st.session_state
    odd = [k for k, options in choices.items() if k in ss and ss[k] not in options]
    for k in odd:
        ss[k] = SIDEBAR_DEFAULTS[k]
        ss.setdefault("_stash", {})[k] = SIDEBAR_DEFAULTS[k]
    if odd:
        link_defaults_note(odd)


def restore(prefix: str) -> None:
    """Before a page draws its controls: bring back the values it had (or a link gave)."""
    ss = st.session_state
    for k, v in ss.get("_stash", {}).items():
        if k.startswith(prefix) and k not in ss and not is_read_only(k):  # a stash from before may hold a button's
            ss[k] = v
    pending = ss.pop("_pending_controls", None)  # a Home preset
    if pending:
        mine = {k: v for k, v in pending.items() if k.startswith(prefix) and not is_read_only(k)}
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
        url = (getattr(st.context, "url", "") or "").split("?")[0]
        query = "&".join(f"{k}={quote(v)}" for k, v in st.query_params.items())
        st.caption("This address opens this page with these settings (it runs once, then as usual):")
        st.code(url + ("?" + query if query else ""), language=None)


# One-click scenarios (Home): marked on their page, they hold while you stay there with their model; another page,
# another model or "Reset to defaults" brings the defaults back (your own settings on other pages stay).
CONTROL_NAMES = {"split_pad": "left padding", "split_pos": "position ids", "split_mask": "attention mask",
                 "split_mode": "feed", "greedy_prompt": "prompt", "greedy_n": "new tokens", "greedy_paths": "paths",
                 "dtypes_source": "prompts", "dtypes_limit": "prompt count", "_mx_preset": "the sliding-window preset"}


def start_scenario(preset, state: dict) -> None:
    """Home's callback: set the scenario's sidebar values and page controls, and remember them as the scenario's."""
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


def _to_defaults(prefix: str | None, keys=(), sidebar=()) -> None:
    """Controls starting with `prefix` and `keys` dropped (their widgets' defaults come back), `sidebar` reset."""
    ss = st.session_state
    stash = ss.setdefault("_stash", {})
    for k in list(ss.keys()) + list(stash.keys()):
        if (prefix and k.startswith(prefix)) or k in keys:
            ss.pop(k, None)
            stash.pop(k, None)
    for k in sidebar:
        ss[k] = stash[k] = SIDEBAR_DEFAULTS[k]


def leave_scenario(keep_model: bool = False) -> None:
    """The scenario's page controls and the sidebar values it set go back to their defaults."""
    sc = st.session_state.pop("_scenario", None)
    if sc:
        _to_defaults(PREFIX_OF_PAGE.get(sc["page"]), sc["controls"],
                     [k for k in sc["sidebar"] if not (k == "model_preset" and keep_model)])
        st.session_state.pop("_pending_controls", None)


def reset_to_defaults(prefix: str | None) -> None:
    """The "Reset to defaults" button (a callback: it runs before any widget is drawn)."""
    leave_scenario()
    _to_defaults(prefix, sidebar=("dtype", "device", "attn", "invariant"))


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
    """A slider and a number box for one integer with ONE source of truth, `key` (a plain session value the stash and
    the URL carry): both are set from it before they are drawn and write it back when moved, so they never disagree."""
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
    def typed() -> None:  # the box takes any whole number; one outside lo..hi is clamped, and says so
        v = int(ss[f"{key}_typed"])
        ss[key] = v
        if not lo <= v <= hi:
            ss[f"_{key}_note"] = f"{box_label} = {v} is outside {lo}–{hi}: using {min(max(v, lo), hi)}."

    # no max/min on the box: the browser would keep a typed 999 in it (flagged, not sent) while the run used the old
    # value; here the value goes through and comes back clamped, with a line saying so
    s2.number_input(box_label, step=1, key=f"{key}_typed", help=help, on_change=typed)
    note = ss.pop(f"_{key}_note", None)
    if note:
        st.caption(f"⚠️ {note}")
    return value
