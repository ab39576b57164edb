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


@contextlib.contextmanager
def streamlit_server(env_extra: dict | None = None):
    port = free_port()
    env = dict(os.environ, **(env_extra or {}))
    log_path = ROOT / "test-artifacts" / f"streamlit-{port}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"),
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


def app_server_fixture():
    """A module-scoped `server` fixture: the app under `streamlit run`, yielding its URL; the test module fails if
    the server logged an exception. Use: `server = app_server_fixture()` in a browser test module."""
    import pytest

    @pytest.fixture(scope="module")
    def server():
        with streamlit_server() as (url, log):
            yield url
        text = log.read_text()
        assert "Traceback" not in text, "the server logged an exception; see " + str(log)

    return server


@contextlib.contextmanager
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def wait_idle(page, timeout_s: float = 180) -> None:
    """Wait until Streamlit has finished running the script (no running indicator, no spinner, no progress)."""
    deadline = time.time() + timeout_s
    time.sleep(0.8)
    while time.time() < deadline:
        running = page.locator('[data-testid="stStatusWidget"]').count()
        progress = page.locator('[data-testid="stProgress"]').count()
        if not running and not progress:
            time.sleep(0.5)
            if not page.locator('[data-testid="stStatusWidget"]').count():
                return
        time.sleep(0.3)
    raise TimeoutError("the app kept running")


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
    wait_idle(page)
    no_exception(page)
    return page
