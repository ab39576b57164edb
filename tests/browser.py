"""Helpers for the real-browser tests: start `streamlit run app.py` on a free port, drive headless Chromium."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-sync", "--disable-quic"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_threads_env() -> dict:
    """A child process's share of the cores, as tests/conftest.py gives each xdist worker (or KVVIZ_TEST_THREADS): the
    thread count torch has here. A server left at the machine's count ran its OpenMP threads beside the other
    worker's: the default model's Split page took 144 s and 84 CPU-s at 2 threads, 77 s and 42 CPU-s at 1 (2 cores,
    the other one busy). Nothing when the tests run in one process."""
    if not (os.environ.get("PYTEST_XDIST_WORKER_COUNT") or os.environ.get("KVVIZ_TEST_THREADS")):
        return {}
    import torch

    return {"OMP_NUM_THREADS": str(torch.get_num_threads())}


@contextlib.contextmanager
def streamlit_server(env_extra: dict | None = None, script: Path | None = None, log_path: Path | None = None):
    """`streamlit run` of app.py (or of `script`, e.g. view_launcher's) on a free port: (URL, log path)."""
    port = free_port()
    # its log written as it happens; its share of the cores
    env = dict(os.environ, PYTHONUNBUFFERED="1", **child_threads_env(), **(env_extra or {}))
    log_path = log_path or ROOT / "test-artifacts" / f"streamlit-{port}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(script or ROOT / "app.py"),
                             "--server.port", str(port), "--server.headless", "true"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
            if proc.poll() is not None:
                raise RuntimeError("streamlit exited early; see test-artifacts")
        else:
            raise RuntimeError("streamlit did not start within 60 s")
        yield url, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def view_launcher(root: Path, folder: str) -> Path:
    """A launcher under `root` that runs app.py with one more view folder in the registry (the one line a new view
    adds), `root` first on sys.path: run it with streamlit_server(script=...)."""
    import textwrap

    launcher = root / "launch.py"
    launcher.write_text(textwrap.dedent(f"""
        import runpy, sys
        sys.path[:0] = [{str(root)!r}, {str(ROOT)!r}]
        from kvviz import views
        if {folder!r} not in views.VIEW_FOLDERS:
            views.VIEW_FOLDERS.append({folder!r})  # the one line
        runpy.run_path({str(ROOT / "app.py")!r}, run_name="__main__")
    """))
    return launcher


def app_server_fixture():
    """A module-scoped `server` fixture: the app under `streamlit run`, yielding its URL; the test module fails if
    the server logged an exception while its tests ran. Use: `server = app_server_fixture()` in a browser test module.

    One server per test process (an xdist worker) serves every browser module (tests/conftest.py's `app_server`):
    each start costs a Python process importing torch, transformers and kvviz and its first model load. Sessions
    share nothing but the loaded models (results are kept per session), as they did within a module; each module
    reads only its own part of the server's log."""
    import pytest

    @pytest.fixture(scope="module")
    def server(app_server):
        url, log = app_server
        start = log.stat().st_size
        yield url
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        assert "Traceback" not in text, "the server logged an exception; see " + str(log)

    return server


_SHARED: dict = {}  # this process's one Chromium and its playwright driver, started by the first browser()


def _shared_chromium():
    import asyncio

    if "playwright" not in _SHARED:
        import atexit

        from playwright.sync_api import sync_playwright

        _SHARED["playwright"] = sync_playwright().start()
        _SHARED["loop"] = asyncio._get_running_loop()  # playwright's loop, "running" between its calls
        atexit.register(_stop_shared)
    else:
        asyncio._set_running_loop(_SHARED["loop"])  # as playwright leaves it after each of its calls
    b = _SHARED.get("browser")
    if b is None or not b.is_connected():
        b = _SHARED["browser"] = _SHARED["playwright"].chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    return b


def _release_loop() -> None:
    """Between browser blocks the thread has no running asyncio loop, as before any playwright started (playwright
    marks its loop running after each call: an AppTest or asyncio.run in a later test of this process would fail)."""
    import asyncio

    asyncio._set_running_loop(None)


def _stop_shared() -> None:
    import asyncio

    asyncio._set_running_loop(_SHARED["loop"])
    with contextlib.suppress(Exception):
        _SHARED["browser"].close()
    with contextlib.suppress(Exception):
        _SHARED["playwright"].stop()


@contextlib.contextmanager
def browser():
    """Headless Chromium for one test: every context (and page) opened in the block is closed when it ends, each its
    own Streamlit session as with a browser of its own. One Chromium per test process serves every block: a launch
    costs 2-3 s, and the suite opens ~45 browsers."""
    b = _shared_chromium()
    try:
        for ctx in list(b.contexts):  # left by a block that ended without closing them
            ctx.close()
        yield b
    finally:
        try:
            for ctx in list(b.contexts):
                with contextlib.suppress(Exception):
                    ctx.close()
        finally:
            _release_loop()


# Streamlit's own record of the script run: stApp's data-test-script-state is "initial" until the first run, then
# "running" (or "rerunRequested", "stopRequested") and "notRunning"; it changes as the server's messages arrive. The
# status widget (the running man) only shows after 500 ms of a run, so it alone cannot tell a short run from none.
_RUN_STATE_JS = """() => {
  const app = document.querySelector('[data-testid="stApp"]');
  return [app ? app.getAttribute('data-test-script-state') : null,
          app ? app.getAttribute('data-test-connection-state') : null,
          document.querySelectorAll('[data-testid="stStatusWidget"]').length,
          document.querySelectorAll('[data-testid="stProgress"]').length,
          window.__kvvizRunStateChanges || 0]; }"""
# counts the changes of the run state from now on (a run that starts and ends between two polls is still seen)
_WATCH_RUN_STATE_JS = """() => {
  const app = document.querySelector('[data-testid="stApp"]');
  window.__kvvizRunStateChanges = 0;
  if (!app) return false;
  if (window.__kvvizRunStateApp !== app) {
    window.__kvvizRunStateApp = app;
    new MutationObserver(() => { window.__kvvizRunStateChanges++; }).observe(
      app, {attributes: true, attributeFilter: ['data-test-script-state']});
  }
  return true; }"""
IDLE_SETTLE_S = 0.4  # idle this long unbroken: a rerun (st.rerun, a click during a run) stops and restarts at once
RUN_START_S = 1.2  # after a click: the longest wait for the run it starts to show (the old fixed wait was 0.8 s)


def wait_idle(page, timeout_s: float = 180, started: bool = False) -> None:
    """Wait until Streamlit has finished running the script (its run state "notRunning", connected, no running
    indicator, no progress bar) and stayed so for IDLE_SETTLE_S.

    started=False (after a click, a typed value, a navigation whose page shows nothing new yet): the run the action
    starts may not have reached the browser yet, so the page idle as it was does not count until a change of the run
    state has been seen or RUN_START_S has passed. started=True: the caller waited for something the run it waits on
    draws (the page's first run after goto, a text only the new run shows), so that run has started."""
    t0 = time.time()
    deadline = t0 + timeout_s
    page.evaluate(_WATCH_RUN_STATE_JS)
    seen_run = started
    idle_since, last_changes = None, 0
    while time.time() < deadline:
        state, conn, status, progress, changes = page.evaluate(_RUN_STATE_JS)
        now = time.time()
        idle = state in ("notRunning", "compilationError") and conn == "CONNECTED" and not status and not progress
        if not idle or changes != last_changes:  # running, or a run came and went since the last poll
            seen_run = True
            idle_since = now if idle else None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= IDLE_SETTLE_S and (seen_run or now - t0 >= RUN_START_S):
            return
        last_changes = changes
        time.sleep(0.1)
    raise TimeoutError("the app kept running")


def click_until(page, target, done, timeout_s: float = 240, retry_s: float = 30, tries: int = 3) -> None:
    """Click `target` (a locator) and wait until `done()` is true. Under load the rerun a click starts can begin
    seconds later (a wait for "idle" then sees the old page), and a click that lands while the script reruns can be
    lost: so the condition itself is waited on, and when no run started and nothing changed within `retry_s` the
    click is made again. Only for clicks that may land twice: a radio option, a button whose callback sets a value;
    never a checkbox or toggle (a second click turns it back: use set_checked)."""
    deadline = time.time() + timeout_s
    for attempt in range(tries):
        target.click()
        clicked = time.time()
        seen_run = False
        while time.time() < deadline:
            if done():
                return
            if page.locator('[data-testid="stStatusWidget"]').count():
                seen_run = True
            elif not seen_run and time.time() - clicked > retry_s and attempt < tries - 1:
                break  # nothing ran: the click was lost
            time.sleep(0.3)
        else:
            break
    raise TimeoutError(f"the click did not lead to the expected page within {timeout_s:.0f} s")


def set_checked(page, label: str, on: bool = True, tries: int = 3) -> None:
    """Set a Streamlit checkbox or toggle by clicking its label, and see its input take the state: a click that lands
    while the script reruns (the widget drawn again) can be lost, so it is tried again."""
    box = page.locator("label", has_text=label).first
    box.wait_for(timeout=60_000)
    for _ in range(tries):
        if box.locator("input").is_checked() == on:
            return
        box.click()
        deadline = time.time() + 15
        while time.time() < deadline and box.locator("input").is_checked() != on:
            time.sleep(0.3)
    assert box.locator("input").is_checked() == on, f"{label!r} did not become {'on' if on else 'off'}"


def no_exception(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, "a Streamlit exception box is shown"
    assert page.get_by_text("Traceback").count() == 0


def open_page(b, url: str, height: int = 1800, ready: str = ".js-plotly-plot", timeout_ms: int = 240_000):
    """A new page at `url`, waited on until `ready` shows and the script is idle, with no exception box."""
    page = b.new_page(viewport={"width": 1400, "height": height})
    page.goto(url)
    page.wait_for_selector(ready, timeout=timeout_ms)
    wait_idle(page, started=True)  # `ready` shows, or the run has not begun ("initial"): not idle
    figures_drawn(page, titled=False)  # plotly draws after the script
    no_exception(page)
    return page


# --- text fit (tests/test_text_fit.py, and the walks that check it on their way) ------------------------------------
# Every chart page with short settings (as test_first_screen_in_normal_mode runs them); the matrix runs on a button.
TEXT_FIT_PAGES = {"split": {}, "greedy": {"greedy_n": 8}, "dtypes": {}, "padding": {},
                  "loading_trap": {"loading_trap_n": 6}, "quant": {"quant_n": 4}, "matrix": {}, "serving": {}}

TEXT_JS = """() => {
  const named = 'text.gtitle, .legendtext, .xtitle, .ytitle, .cbtitle text, .annotation-text';
  const box = (el) => el.getBoundingClientRect();
  const hit = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > 2 &&
                        Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 2;
  const out = [];
  document.querySelectorAll('.js-plotly-plot').forEach((plot, i) => {
    const fb = box(plot);
    if (fb.width === 0 || fb.height === 0) return;  // a figure in a folded expander or another tab
    const texts = [...plot.querySelectorAll(named)].filter(t => t.textContent.trim() && box(t).width > 0);
    const ticks = [...plot.querySelectorAll('.xtick text, .ytick text, .colorbar .tick text, .cbaxis text')].filter(t => t.textContent.trim() && box(t).width > 0);
    const title = (plot.querySelector('text.gtitle') || {}).textContent || ('figure ' + i);
    for (const k of ticks) {  // a tick label cut at the figure's edge (the last x tick's right half)
      const r = box(k);
      if (r.left < fb.left - 1 || r.right > fb.right + 1 || r.top < fb.top - 1 || r.bottom > fb.bottom + 1)
        out.push({figure: title.slice(0, 60), problem: 'tick label clipped', text: k.textContent.slice(0, 60),
                  box: [r.left - fb.left, r.top - fb.top, r.width, r.height].map(Math.round),
                  figure_size: [Math.round(fb.width), Math.round(fb.height)]});
    }
    for (const t of texts) {
      const r = box(t);
      if (r.left < fb.left - 1 || r.right > fb.right + 1 || r.top < fb.top - 1 || r.bottom > fb.bottom + 1)
        out.push({figure: title.slice(0, 60), problem: 'clipped', text: t.textContent.slice(0, 60),
                  box: [r.left - fb.left, r.top - fb.top, r.width, r.height].map(Math.round),
                  figure_size: [Math.round(fb.width), Math.round(fb.height)]});
    }
    plot.querySelectorAll('.legend').forEach(lg => {  // a legend clips its entries to its background
      const bg = lg.querySelector('rect.bg');
      if (!bg) return;
      const lb = box(bg);
      lg.querySelectorAll('.legendtext').forEach(t => {
        const r = box(t);
        if (t.textContent.trim() && r.right > lb.right + 1)
          out.push({figure: title.slice(0, 60), problem: 'cut by its legend', text: t.textContent.slice(0, 60)});
      });
      const marks = [...lg.querySelectorAll('.legendpoints, .legendlines, .legendsymbols')];
      lg.querySelectorAll('.legendtext').forEach(t => marks.forEach(m => {
        if (!m.closest('.traces').contains(t) && hit(box(t), box(m)))
          out.push({figure: title.slice(0, 60), problem: 'legend text over another entry', text: t.textContent.slice(0, 60)});
      }));
    });
    for (let a = 0; a < texts.length; a++) {
      const ra = box(texts[a]);
      for (let b = a + 1; b < texts.length; b++)
        if (hit(ra, box(texts[b])))
          out.push({figure: title.slice(0, 60), problem: 'overlap', text: texts[a].textContent.slice(0, 40),
                    other: texts[b].textContent.slice(0, 40)});
      for (const k of ticks)
        if (hit(ra, box(k)))
          out.push({figure: title.slice(0, 60), problem: 'over a tick label', text: texts[a].textContent.slice(0, 40),
                    other: k.textContent.slice(0, 40)});
    }
  });
  return out; }"""


# What the figures show, as TEXT_JS measures it: per Streamlit plotly chart, whether plotly has drawn it (and shown it:
# it stays hidden until its width is known), its size, and each text element with its box.
_FIGURES_JS = """() => {
  const sel = 'text.gtitle, .legendtext, .xtitle, .ytitle, .cbtitle text, .annotation-text, .xtick text, ' +
              '.ytick text, .colorbar .tick text, .cbaxis text, .legend rect.bg, .legendpoints, .legendlines';
  const r = (b) => [b.left, b.top, b.width, b.height].map(Math.round);
  const charts = [...document.querySelectorAll('[data-testid="stPlotlyChart"]')].map(c => {
    const plot = c.querySelector('.js-plotly-plot');
    const cb = c.getBoundingClientRect();
    if (cb.width === 0 || cb.height === 0) return ['folded'];  // a figure in a folded expander or another tab
    if (!plot || !plot.querySelector('.main-svg') || getComputedStyle(plot).visibility === 'hidden') return null;
    return [r(plot.getBoundingClientRect()),
            ...[...plot.querySelectorAll(sel)].map(t => [t.textContent, r(t.getBoundingClientRect())])];
  });
  return [document.querySelectorAll('.js-plotly-plot text.gtitle').length, JSON.stringify(charts),
          charts.every(c => c !== null)]; }"""


def figures_drawn(page, timeout_s: float = 600, polls: int = 3, every_s: float = 0.25,
                  titled: bool = True) -> int:
    """The page's figures have drawn their text (plotly draws after Streamlit's script is idle, a figure once more when
    its width is known): a figure's title shows (titled=False: a page that may have no figure), every shown chart is
    drawn, and what they draw (TEXT_JS's elements, their boxes, the figures' sizes) is the same in `polls` polls
    `every_s` apart. The number of titled figures."""
    deadline = time.time() + timeout_s
    last, same = None, 0
    while time.time() < deadline:
        n, drawn, complete = page.evaluate(_FIGURES_JS)
        ready = (n or not titled) and complete
        if ready and drawn == last:
            same += 1
            if same >= polls - 1:
                return n
        else:
            same = 0
        last = drawn if ready else None
        time.sleep(every_s)
    raise TimeoutError("the figures did not finish drawing (no title, or still changing)")


def text_fit_problems(page, shot: Path, drawn: bool = False) -> list:
    """Once the page's figures have drawn (drawn=True: the caller has just waited for them with figures_drawn): a
    full-page screenshot to `shot`, then the text of every plotly figure that lies outside it, over another text or
    over a tick label (TEXT_JS; [] when all fits)."""
    if not drawn:
        figures_drawn(page)
    page.screenshot(path=str(shot), full_page=True)
    return page.evaluate(TEXT_JS)
