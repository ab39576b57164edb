"""The run wrapper every page uses: progress at the top with time left and Stop, the memory plan before a run
(refusing what cannot fit), one run per distinct inputs (view-only reruns reuse it), errors in one line."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import gc
import hashlib
import json
import threading
import time

import streamlit as st
from streamlit import config, runtime
from streamlit.runtime.scriptrunner import add_script_run_ctx, get_script_run_ctx

from kvviz import views
from kvviz.core import cancel, estimate
from kvviz.core.estimate import PhaseClock
from kvviz.core.protocol import RunContext
from kvviz.io.clirun import config_workload
from kvviz.models.compat import script_request_state
from kvviz.core.errors import OUT_OF_MEMORY_HINT, KvvizError, first_line, free_memory, is_out_of_memory
from kvviz.core.memory import reset_peak
from pages.memory_plan import show_plan

_FREEZE_LOCK = threading.Lock()
_FROZEN_WITH: set[str] | None = None  # the sessions seen by the last gc.freeze (None: nothing frozen yet)


def freeze_what_lives() -> str:
    """Streamlit's full collection after every script run walked torch's, transformers' and kvviz's objects (0.15 s
    a rerun): the objects alive at the first run are frozen (gc.freeze), with every session's state then; once one of
    those sessions has closed, the next run unfreezes, collects (a closed tab's results are freed one run late) and
    freezes again. Returns "froze", "refroze", "kept" or "off" (AppTest's stand-in Runtime, no session, option off)."""
    global _FROZEN_WITH

    session = _session_id()
    if not session or not runtime.exists() or not config.get_option("runner.postScriptGC"):
        return "off"
    rt = runtime.get_instance()
    if type(rt) is not runtime.Runtime:  # AppTest runs the script with a stand-in Runtime
        return "off"
    with _FREEZE_LOCK:
        if _FROZEN_WITH is not None:
            _FROZEN_WITH.add(session)  # new since the freeze, or not: either way watched from now on
            if all(rt.get_app_session(s) is not None for s in _FROZEN_WITH):
                return "kept"
            gc.unfreeze()
        done = "froze" if _FROZEN_WITH is None else "refroze"
        gc.collect()  # garbage is freed, not frozen
        gc.freeze()
        _FROZEN_WITH = {s for s in (_FROZEN_WITH or set()) | {session} if rt.get_app_session(s) is not None}
    return done


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
        st.error(f"Unexpected error ({type(e).__name__}): {first_line(e)}", icon="⚠️")


def _request_stop() -> None:
    st.session_state["_stop_requested"] = True


def progress_text(frac: float, msg: str, elapsed: float, since: float = 0.0,
                  phase: tuple[float, float] | None = None, left: float | None = None) -> str:
    """The progress line: `msg` and the time left, from the measured pace at the last report (`since` seconds ago)
    less the time since; past the estimate it says so and counts, never a stale "about 9 s left". phase: (fraction,
    seconds) where the current phase began: once it has a pace of its own the time left is measured from it. left:
    the time left as the run's estimate says it (_Ticker.left)."""
    if "left" in msg or frac >= 1:
        return msg
    at = elapsed - since  # the last report
    if left is None and phase is not None and frac - phase[0] > 0.005 and at - phase[1] > 0.5:
        left = (at - phase[1]) / (frac - phase[0]) * (1 - frac) - since
    elif left is None and (frac <= 0.02 or at <= 0.5):  # no pace measured yet
        return f"{msg} — {elapsed:.0f} s so far" if elapsed >= 3 else msg
    elif left is None:
        left = at / frac * (1 - frac) - since
    if left >= 1:
        return f"{msg} — about {estimate.duration(left)} left"
    if since >= 3:
        return (f"{msg} — taking longer than the pace so far said: {since:.0f} s on this part, {elapsed:.0f} s in "
                "all")
    return f"{msg} — almost done"


class _Ticker:
    """Redraws the progress line every second (a run reports only between its steps), with the layer the run is at
    (where()) and each phase's own pace; the run names its phases as values (`phase(name)`: RunContext.on_phase).
    With the run's estimate the time left is the current phase's (its measured pace once it has one, else its
    estimate less the time it has run) plus the estimates of the phases still to come."""

    def __init__(self, draw, clock, where=None, estimate=None):
        self.draw, self.clock, self.where = draw, clock, where or (lambda: "")
        self.estimate = estimate
        self.t0 = self.t_report = clock()
        self.frac, self.msg = 0.0, ""
        self.phase_name, self.phase_start, self.fresh_phase = "", (0.0, 0.0), False
        self.phases = PhaseClock(clock, self.t0)  # each phase's measured seconds (the estimate store is refined by them)
        self.lock = threading.Lock()

    def phase(self, name: str) -> None:
        """The run's phase `name` starts now; its start on the bar is the fraction of its first report."""
        with self.lock:
            self.phases(name)
            self.phase_name, self.phase_start = name, (self.frac, self.clock() - self.t0)
            self.fresh_phase = True
            if self.msg:
                self._draw(self.clock())

    def left(self, now: float) -> float | None:
        """Seconds left by the estimate: None without one (the pace of the bar then says it)."""
        est = self.estimate
        if est is None or est.run_s <= 0:
            return None
        name = self.phase_name or (est.names()[0] if est.names() else "run")
        name = name if name in est.names() else "run"
        f0, t_phase = self.phase_start
        in_phase = now - self.t0 - t_phase
        end = est.bar().get(name, (0.0, 1.0))[1]
        at = self.t_report - self.t0
        if self.frac - f0 > 0.005 and at - t_phase > 0.5:  # the phase's own pace, measured
            current = (at - t_phase) / (self.frac - f0) * max(0.0, end - self.frac) - (now - self.t_report)
        else:
            current = est.seconds(name) - in_phase
        return max(0.0, current) + est.after(name)

    def _draw(self, now: float, msg: str = "") -> None:
        self.draw(self.frac, progress_text(self.frac, msg or self.msg, now - self.t0, now - self.t_report,
                                           self.phase_start, self.left(now)))

    def report(self, frac: float, msg: str) -> None:
        with self.lock:
            self.frac, self.msg, self.t_report = min(max(float(frac), 0.0), 1.0), msg, self.clock()
            if self.fresh_phase:  # the phase's first report: where it starts on the bar
                self.phase_start, self.fresh_phase = (self.frac, self.phase_start[1]), False
            self._draw(self.t_report)

    def tick(self) -> None:
        """Between reports: the last message with the layer the run is at now ("… (layer 12 of 30)")."""
        with self.lock:
            if self.msg:
                where = self.where()
                self._draw(self.clock(), f"{self.msg.rstrip('…')} ({where})…" if where and where not in self.msg
                           else self.msg)


@contextlib.contextmanager
def progress_bar(label: str):
    """Yields a progress callback (fraction, message) drawn as a bar at the top of the page with the time left
    (_Ticker) and a Stop button; removed when done. Inside `run_cached` Stop ends the run at its next checkpoint
    (kvviz.core.cancel) and the next script run says how far it got."""
    slot = st.session_state.get("_top_slot")
    box = slot if slot is not None else st.empty()
    with box.container():
        bar = st.progress(0.0, text=label)
        n = st.session_state["_stop_seq"] = st.session_state.get("_stop_seq", 0) + 1
        st.button("Stop", key=f"_stop_button_{n}", on_click=_request_stop, icon=":material/stop_circle:",
                  help="Stop this run; the page keeps its controls and you can start it again")
    token, run = cancel.current(), _RUN.get()
    ticker = _Ticker(lambda f, text: bar.progress(f, text=text), time.perf_counter,
                     (lambda: token.where) if token is not None else None,
                     run.get("estimate") if run is not None else None)
    if run is not None:
        run["ticker"] = ticker  # the run's context names its phases to it (run_context)
    stop = threading.Event()

    def report(frac: float, msg: str) -> None:
        if token is not None:
            token.check()  # Stop, a closed tab or a rerun: the run ends here (kvviz.core.cancel)
            token.where = ""  # a new step: the layer it is at comes with its next checkpoint
        if run is not None:
            run["frac"], run["msg"] = frac, msg
        ticker.report(frac, msg)

    def tick() -> None:
        while not stop.wait(1.0):
            if token is not None:
                _ = token.cancelled  # polls the page's stop: timed within a second of the click (stopped_line)
            try:
                ticker.tick()
            except Exception:  # noqa: BLE001 - the page moved on: stop redrawing
                return

    thread = threading.Thread(target=tick, daemon=True, name="kvviz-progress")
    ctx = get_script_run_ctx()
    if ctx is not None:
        add_script_run_ctx(thread, ctx)
        thread.start()
    try:
        yield report
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(timeout=2)
        box.empty()


def _memory_plan(name: str, work, fresh: bool):
    """The run's memory plan in the sidebar (pages.memory_plan.show_plan) for its workload; a fresh run that cannot
    fit is refused in one line naming what to lower, before it starts."""
    choice = st.session_state.get("model_choice")
    view = views.for_run(name)
    if view is None or choice is None:
        return None
    if work is None:  # a run with a plan names what it holds: never a plan guessed from the cache key
        raise TypeError(f"run_cached({name!r}): the {view.name} view plans its memory; pass workload=")
    with st.sidebar:  # beside the run's settings; the page's first screen stays the verdict and the chart
        plan = show_plan(choice, view.name, work)
    if fresh and plan is not None and not plan.fits:
        st.error("Cannot run: " + plan.refusal(), icon=":material/memory:")
        st.stop()
    return plan


def _measured(compute, plan):
    """compute(), its own peak measured against its plan (reset_peak: the server ran other work before), the plan
    attached to the result (its JSON export carries it)."""
    baseline = reset_peak(plan.device) if plan is not None else None
    result = compute()
    if baseline is not None:
        plan.peak_baseline = baseline
        plan.with_peak(result)  # settled on what the run did (e.g. no float64 rerun)
        try:
            result.memory_plan = plan
        except AttributeError:  # a result that takes no attribute: no plan beside it
            pass
    return result


# The runs working now in this server process, any session: a run waiting for another's model says so (held_line).
# Each entry: its cancel token, its last progress report, an event set when it has ended.
_RUNNING: dict[int, dict] = {}
_RUNNING_LOCK = threading.Lock()
_STOPPED: dict[tuple[str, str], dict] = {}  # (session, run name) -> the last stopped run's entry, read by the rerun
_RUN: contextvars.ContextVar[dict | None] = contextvars.ContextVar("kvviz_page_run", default=None)
STOP_WAIT_S = 15.0  # how long the page after a Stop waits for the stopped run to end before saying it still works


def _session_id() -> str:
    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else ""


def _page_probe():
    """What the run's checkpoints poll: has this script run been asked to stop or rerun (Stop, another control, a
    closed tab; with fast reruns the next one starts at once)? None outside a script run."""
    ctx = get_script_run_ctx()
    requests = getattr(ctx, "script_requests", None)
    if requests is None:
        return None

    def asked() -> bool:
        state, data = script_request_state(requests)
        # a fragment's rerun waits for this run: it does not interrupt it
        fragment = getattr(data, "fragment_id", None) and not getattr(data, "is_fragment_scoped_rerun", False)
        return state == "STOP" or (state == "RERUN" and not fragment)

    return asked


def held_line(run: dict, now: float | None = None) -> str:
    """One line on a run that holds the model: what it is and when it started."""
    now = time.time() if now is None else now
    when = time.strftime("%H:%M:%S", time.gmtime(run["started"]))
    return (f"Another run holds the model: {run['what']}, started {when} UTC ({now - run['started']:.0f} s ago), "
            "in another tab or by another user. Runs on one model take turns: this one starts when it ends.")


@contextlib.contextmanager
def _holding(name: str, token: cancel.Token | None = None):
    """Register this run on its model while it works, with held_line while another run holds the model (a caption
    after it: it waited). Yields the run's entry; a stopped run's is kept for the next script run (stopped_line)."""
    choice, session = st.session_state.get("model_choice"), _session_id()
    model = None if choice is None else (choice.spec, choice.dtype, choice.device)  # one loaded model, one lock
    with _RUNNING_LOCK:  # other sessions' (tabs', users') runs on it, oldest first
        others = sorted((r for r in _RUNNING.values() if model is not None and r["model"] == model
                         and r["session"] != session), key=lambda r: r["started"])
    note = st.empty()
    if others:
        note.info(held_line(others[0]), icon=":material/hourglass_top:")
    page_name = st.session_state.get("_page_title", "")  # app.py names the page's title
    what = f"{page_name} ({name})" if page_name and page_name.lower() != name.lower() else (page_name or name)
    entry = {"model": model, "session": session, "what": what, "started": time.time(), "name": name,
             "token": token, "done": threading.Event(), "frac": 0.0, "msg": "",
             "thread": threading.get_ident()}
    with _RUNNING_LOCK:
        for r in (r for r in _RUNNING.values() if r["model"] == model):  # sharing the model: no pace (_finish_timings)
            r["overlapped"] = entry["overlapped"] = True
        _RUNNING[id(entry)] = entry
    reset = _RUN.set(entry)
    try:
        yield entry
    finally:
        _RUN.reset(reset)
        entry["ended"] = time.time()
        with _RUNNING_LOCK:
            _RUNNING.pop(id(entry), None)
            if token is not None and token.cancelled:
                _STOPPED[(session, name)] = entry
                while len(_STOPPED) > 64:  # sessions that never came back
                    _STOPPED.pop(next(iter(_STOPPED)))
        entry["done"].set()
        if others:
            note.caption(":material/hourglass_top: " + held_line(others[0]).replace("this one starts when it ends",
                                                                                    "this one waited for it"))


def stopped_line(entry: dict | None) -> str:
    """What a stopped run had done, in one line: "Stopped after 42 % (last step: …, layer 12 of 30), 35 s in; the
    model was free again 0.8 s after Stop."."""
    if not entry:
        return "Stopped. Change a control, or start this run again."
    token = entry.get("token")
    where = token.where if token is not None else ""
    step = entry.get("msg") or "before its first step"
    if where and where not in step:
        step = f"{step.rstrip('…')} ({where})"
    ran = entry.get("ended", time.time()) - entry["started"]
    stop_at = min(t for t in (entry.get("stop_at"), getattr(token, "cancelled_at", None), entry.get("ended"))
                  if t is not None)
    freed = entry.get("ended", stop_at) - stop_at
    return (f"Stopped after {100 * float(entry.get('frac') or 0):.0f} % of the run (last step: {step.rstrip('…')}), "
            f"{ran:.0f} s in; the model was free again {max(0.0, freed):.1f} s after Stop. Change a control, or "
            "start this run again.")


def _stop_earlier_runs(session: str) -> None:
    """Cancel this session's runs still working (a Stop or a changed control ended their script run) and wait, with
    a line, until they freed the model (STOP_WAIT_S at most)."""
    with _RUNNING_LOCK:
        mine = [r for r in _RUNNING.values() if r["session"] == session and not r["done"].is_set()
                and r.get("thread") != threading.get_ident()]  # not a run this one is part of
    if not mine:
        return
    note = st.empty()
    note.info(f"Stopping the run that was working ({mine[-1]['what']})…", icon=":material/stop_circle:")
    t0 = time.time()
    for r in mine:
        r.setdefault("stop_at", t0)
        if r["token"] is not None:
            r["token"].cancel("stopped by the page")
    for r in mine:
        r["done"].wait(max(0.0, STOP_WAIT_S - (time.time() - t0)))
    note.empty()
    late = [r for r in mine if not r["done"].is_set()]
    if late:
        st.warning(f"The stopped run ({late[-1]['what']}) is still finishing its current step after "
                   f"{STOP_WAIT_S:.0f} s; this run waits for the model until it ends.", icon=":material/hourglass_top:")


LONG_RUN_S = 120.0  # a run its estimate says will take longer than this is announced first, with its proof's share


def run_estimate(lm, name: str, work) -> "estimate.Estimate | None":
    """The estimate of run `name` of workload `work` on `lm` from this machine's pace (kvviz.core.estimate: measured
    on first use, a few short forwards, and kept); None without a model or a workload, or where it cannot be made."""
    view = views.for_run(name)
    if lm is None or work is None or view is None:
        return None
    choice = st.session_state.get("model_choice")
    invariant = bool(getattr(choice, "invariant", False))
    try:
        measured = estimate.load_pace(estimate.key_of_model(lm)) is not None
        with contextlib.nullcontext() if measured else st.spinner(
                "Measuring this machine's pace for this model (once: a few short forwards)…"):
            return estimate.for_model(lm, work, estimate.tokens_of(lm, work), view.name, invariant)
    except (KvvizError, OSError, ValueError, RuntimeError):
        return None


def announce_long_run(name: str, key: str, est) -> None:
    """Before a run its estimate says is long: how long, run and proof apart, and buttons to run it as it is or
    without the automatic invariant proof (auto_proof False); the page stops here until one is clicked."""
    ss = st.session_state
    chosen = ss.setdefault("_long_ok", {})
    if est is None or est.run_s <= LONG_RUN_S or chosen.get(name, ("", ""))[0] == key:
        return
    def parts(maybe: bool) -> str:
        return ", ".join(f"{estimate.duration(p.seconds)} for the {estimate.PHASE_WORDS.get(p.name, p.name)}"
                         for p in est.phases if p.name != "load" and p.seconds >= 1 and p.maybe == maybe)
    sure, maybe = parts(False), parts(True)  # the phases that run whatever the numbers; those only where they differ
    certain, upper = (estimate.duration(s) for s in est.span(load=False))
    upto = f", up to {upper} if the paths differ" if upper != certain else ""
    st.warning(f"This run will take about {certain} on this machine{upto} "
               f"({sure}{'; if they differ, ' + maybe if maybe else ''}): {est.basis}. The progress bar says each "
               "phase as it goes; Stop ends it at once.", icon=":material/schedule:")
    skip = est.seconds("proof") >= 1
    cols = st.columns(2 if skip else 1)
    cols[0].button(f"Run it ({est.about(load=False)})", key=f"_long_run_{name}", type="primary",
                   on_click=chosen.__setitem__, args=(name, (key, "full")))
    if skip:
        cols[1].button(f"Run without the proof ({est.without('proof', 'load').about(load=False)})",
                       key=f"_long_noproof_{name}", on_click=chosen.__setitem__, args=(name, (key, "no proof")),
                       help="The verdict stays (the float64 rerun decides it); a precision verdict then says it is "
                            "not proved. Turn on invariant mode in the sidebar for a proof in one run.")
    st.stop()


def run_context(settings, report) -> RunContext:
    """The context of the page's run now working (inside run_cached and progress_bar): settings, progress, the
    user's proof choice, its estimate, and the progress line told each phase the run names."""
    run = _RUN.get() or {}
    ticker = run.get("ticker")
    return RunContext(settings=settings, progress=report, auto_proof=run.get("auto_proof", True),
                      estimate=run.get("estimate"), on_phase=ticker.phase if ticker is not None else None)


def _finish_timings(lm, name: str, entry: dict, result, elapsed: float) -> None:
    """The result carries its estimate and seconds; they refine the pace unless another run overlapped it."""
    est, ticker = entry.get("estimate"), entry.get("ticker")
    measured = ticker.phases.measured() if ticker is not None else {"run": elapsed}
    if isinstance(result, estimate.Timed) and result.timings is None:
        result.timed(estimate.Timings(est.total_s if est is not None else None, elapsed, measured))
    view = views.for_run(name)
    if est is not None and lm is not None and view is not None and not entry.get("overlapped"):
        estimate.record(estimate.key_of_model(lm), view.name, est, measured)


def run_cached(name: str, key_parts: dict, compute, workload=None, lm=None):
    """Run `compute()` once per distinct inputs (`key_parts`) in this session; view-only reruns reuse the result.
    First the memory plan of `workload` (required for a view that plans its memory; a run that cannot fit is refused)
    and, with the loaded model `lm`, the estimate (a long run is announced first). Stop, a closed tab or a changed
    control ends the run at its next checkpoint; the next script run says how far it got."""
    store = st.session_state.setdefault(f"_results_{name}", {})
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()
    plan = _memory_plan(name, workload, key not in store)
    if key not in store:
        ss = st.session_state
        session = _session_id()
        _stop_earlier_runs(session)
        stopped = ss.setdefault("_stopped", {})
        if ss.pop("_stop_requested", False):
            stopped[name] = key
        if stopped.get(name) == key:
            with _RUNNING_LOCK:
                entry = _STOPPED.pop((session, name), None)
            if entry is not None:
                stopped[f"{name}:line"] = stopped_line(entry)
            st.info(stopped.get(f"{name}:line") or stopped_line(None), icon=":material/stop_circle:")
            st.button("Run again", key=f"_run_again_{name}", on_click=lambda: stopped.pop(name, None))
            st.stop()
        stopped.pop(f"{name}:line", None)
        est = run_estimate(lm, name, workload)
        announce_long_run(name, key, est)
        if len(store) >= 8:
            store.pop(next(iter(store)))
        token = cancel.Token(_page_probe())
        t0 = time.perf_counter()
        try:
            with _holding(name, token) as entry, cancel.scope(token):
                entry["estimate"] = est
                entry["auto_proof"] = st.session_state.get("_long_ok", {}).get(name) != (key, "no proof")
                result = _measured(compute, plan)
        except cancel.Cancelled:
            st.stop()  # the next script run (already started by the click) says what was done
        if token.cancelled:  # stopped after its last checkpoint: a result of a stopped run is not kept
            st.stop()
        _finish_timings(lm, name, entry, result, time.perf_counter() - t0)
        store[key] = result
    result = store[key]
    plan = getattr(result, "memory_plan", None)
    over = plan.over_plan() if plan is not None else None
    if over:  # the plan was wrong for this run: said on the page below the verdict (pages.common.show_notes)
        st.session_state.setdefault("_notes_after_verdict", []).append(over)
    return result


def _value_key(value) -> object:
    """A config's value as a cache key's part: its fields, bytes by their digest (an uploaded cache)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _value_key(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (bytes, bytearray)):
        return "sha256:" + hashlib.sha256(value).hexdigest()
    if isinstance(value, dict):
        return {str(k): _value_key(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_value_key(v) for v in value]
    return value


def _model_key(lm, ignores: tuple[str, ...]) -> dict:
    """The model in a run's cache key: the sidebar's choice less what the run ignores (dtypes loads its own), and the
    loaded model's own dtype and attention (an A/B's B model differs from the sidebar's)."""
    choice = st.session_state.get("model_choice")
    key = {"choice": None if choice is None else choice.key_without("invariant", *ignores)}
    if lm is not None:
        key.update({"dtype": None if "dtype" in ignores else str(lm.dtype),
                    "attn": None if "attn" in ignores else lm.attn_implementation})
    return key


def run_view(view, lm, config, *, settings=None, prove=None, name: str | None = None, label: str | None = None,
             ignores: tuple[str, ...] = ()):
    """THE way a page runs a view (a View or its name): `view.runner()(lm, config, ctx)` through run_cached, once per
    (model, config, settings, prove), with the memory plan of the config's workload (as its subcommand plans it).

    settings: default the sidebar's (without invariant mode for a view that refuses it). prove: the context's (None:
    the automatic proof; False: none, and no proof in the plan). name: the run's name (default: the view's first;
    an A/B's B side is "<name>_ab"). label: the progress bar's first line. ignores: sidebar fields the run does not
    depend on ("dtype", "attn")."""
    view = views.get(view) if isinstance(view, str) else view
    choice = st.session_state.get("model_choice")
    settings = settings if settings is not None else (choice.settings if choice is not None else None)
    if settings is not None and settings.invariant and "invariant" in view.refusals():
        settings = settings.with_(invariant=False)
    work = config_workload(config)
    if prove is False:
        work = dataclasses.replace(work, prove=False)
    name = name or view.run_names()[0]
    key = {"model": _model_key(lm, ignores), "cfg": _value_key(config), "settings": _value_key(settings),
           "prove": prove}

    def compute():
        with progress_bar(label or f"{view.title}…") as report:
            # the proof choice, the estimate and the phases named to the progress line (run_context)
            ctx = dataclasses.replace(run_context(settings if settings is not None else RunContext().settings,
                                                  report), prove=prove, token=cancel.current())
            return view.runner()(lm, config, ctx)

    return run_cached(name, key, compute, work, lm=lm)


def run_or_stop(view, lm, config, *, button: str | None = None, **run):
    """run_view for a page's main result: a failure is one line (show_error) and the page stops there; the run
    button `button` (run_button's name) is then forgotten, so the next rerun does not start it again."""
    try:
        return run_view(view, lm, config, **run)
    except Exception as e:  # noqa: BLE001 - one line, the app keeps working
        if button:
            forget_button(button)
        show_error(e)
        st.stop()


def run_task(name: str, value, compute, *, ignores: tuple[str, ...] = ()):
    """A page's computation that is not a view's run (a Lesson step, an exercise, the cache's download): compute()
    once per `value` on the sidebar's model less `ignores`, with Stop and, for a value with a `workload()`, its plan."""
    work = config_workload(value) if callable(getattr(value, "workload", None)) else None
    return run_cached(name, {"model": _model_key(None, ignores), "value": _value_key(value)}, compute, work)


def run_button(name: str, value, label: str, waiting: str, *, auto: bool = False, ignores: tuple[str, ...] = (),
               **button) -> None:
    """A long run's button (st.button's keywords, its key among them): the page goes on once it was pressed for this
    `value` on this model, or at once when `auto`; until then it says `waiting` and stops. Marked in its callback (the
    app may rerun before the page reads a button's value); forget_button(name) after a failed run."""
    mark = repr({"model": _model_key(None, ignores), "value": _value_key(value)})
    asked = st.session_state.setdefault("_run_asked", {})
    if auto:
        asked[name] = mark
    st.button(label, on_click=asked.__setitem__, args=(name, mark), **button)
    if asked.get(name) != mark:
        st.info(waiting)
        st.stop()


def forget_button(name: str) -> None:
    st.session_state.get("_run_asked", {}).pop(name, None)
