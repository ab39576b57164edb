"""The run wrapper every page uses: progress at the top with time left and Stop, the memory plan before a run
(refusing what cannot fit), one run per distinct inputs (view-only reruns reuse it), errors in one line."""
from __future__ import annotations

import contextlib
import hashlib
import json

import streamlit as st

from kvviz.errors import OUT_OF_MEMORY_HINT, KvvizError, free_memory, is_out_of_memory

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


def workload(key_parts: dict):
    """What a run holds, read off its run_cached key (kvviz.memory.Workload): its prompts, new tokens, padding,
    split point, dtypes, batch, weights."""
    from kvviz.memory import Workload

    cfg = key_parts.get("cfg") if isinstance(key_parts.get("cfg"), dict) else {}
    texts = [key_parts.get("prompt"), key_parts.get("prefix"), cfg.get("prompt")]
    if isinstance(key_parts.get("prompts"), (list, tuple)):
        texts += [str(t) for t in key_parts["prompts"]]
    conts = key_parts.get("conts")
    new = key_parts.get("n") or cfg.get("max_new_tokens") or 0
    split = cfg.get("split", key_parts.get("split"))
    dtypes = key_parts.get("dtypes")
    return Workload(texts=tuple(str(t) for t in texts if t),
                    continuations=tuple(str(c) for c in conts) if isinstance(conts, (list, tuple)) else (),
                    new_tokens=int(new) if str(new).isdigit() else 0,
                    left_pad=int(key_parts.get("pad") or cfg.get("left_pad") or 0),
                    tokens=key_parts.get("tokens"), batch=key_parts.get("batch"),
                    dtypes=tuple(dtypes) if isinstance(dtypes, (list, tuple)) else (),
                    split=split if isinstance(split, int) and not isinstance(split, bool) else None,
                    weights=str(key_parts.get("weights") or cfg.get("weights") or "none"))


def _memory_plan(name: str, key_parts: dict, fresh: bool):
    """The run's memory plan beside the result (a caption, the full plan on hover); a run that cannot fit is refused
    in one line naming what to lower, before it starts (kvviz.memory; nothing is loaded to make the plan)."""
    from pages.memory_plan import blocks_run, show_plan

    from kvviz import views

    choice = st.session_state.get("model_choice")
    view = views.for_run(name)
    if view is None or choice is None:
        return None
    with st.sidebar:  # beside the run's settings; the page's first screen stays the verdict and the chart
        plan = show_plan(choice, view.name, workload(key_parts))
    if fresh and blocks_run(plan):
        st.error("Cannot run: " + plan.refusal(), icon=":material/memory:")
        st.stop()
    return plan


def _measured(compute, plan):
    """compute(), with the run's own peak measured against its plan (kvviz.memory.reset_peak: the server ran other
    work before) and the plan attached to the result (its JSON export carries it)."""
    from kvviz.memory import reset_peak

    baseline = reset_peak(plan.device) if plan is not None else None
    result = compute()
    if baseline is not None:
        plan.peak_baseline = baseline
        plan.with_peak()
        try:
            result.memory_plan = plan
        except AttributeError:  # a result that takes no attribute: no plan beside it
            pass
    return result


def run_cached(name: str, key_parts: dict, compute):
    """Run `compute()` once per distinct inputs in this session; view-only reruns reuse the stored result. The
    run's memory plan is shown first, and a run that cannot fit is refused before it starts."""
    store = st.session_state.setdefault(f"_results_{name}", {})
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()
    plan = _memory_plan(name, key_parts, key not in store)
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
        store[key] = _measured(compute, plan)
    result = store[key]
    plan = getattr(result, "memory_plan", None)
    over = plan.over_plan() if plan is not None else None
    if over:  # the plan was wrong for this run: said on the page, not only in a benchmark
        st.warning(over, icon=":material/memory:")
    return result
