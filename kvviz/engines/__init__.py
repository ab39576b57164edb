"""Serving engines that run in their own environments: where they live, and the JSON-lines worker client.

An engine whose pins clash with kvviz's (vLLM pins transformers < 5.20; llama.cpp is a compiled binding) runs as a
worker process in its own virtual environment, built by `make engines` (engines/build.sh) under
$KVVIZ_ENGINES (default ~/.cache/kvviz-engines/<name>). kvviz starts the worker, sends one JSON request a line on
its stdin, reads one JSON reply a line from its stdout, and stops it; nothing is pickled. The worker scripts
(vllm_worker.py, llamacpp_worker.py beside this file) never import kvviz.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

from ..core.errors import KvvizError
from .base import ANSWER_LIMIT_S
from ..core import cancel

HERE = Path(__file__).resolve().parent
# engine name -> (environment folder, worker script, the module the environment must import)
WORKERS = {"vllm": ("vllm", "vllm_worker.py", "vllm"), "llama.cpp": ("llamacpp", "llamacpp_worker.py", "llama_cpp")}


def engines_root() -> Path:
    return Path(os.environ.get("KVVIZ_ENGINES") or Path.home() / ".cache" / "kvviz-engines").expanduser()


def engine_python(name: str) -> Path | None:
    """The engine environment's python where `make engines` built it (its stamp is there), else None."""
    folder = engines_root() / WORKERS[name][0]
    py = folder / "bin" / "python"
    return py if py.is_file() and (folder / ".kvviz-engine-built").is_file() else None


def how_to_get(name: str) -> str:
    """One line: `name` is absent, and how to get it."""
    label = {"vllm": "vLLM"}.get(name, name)
    return (f"{label} is not installed here: `make engines` builds its environment under {engines_root()} (or set "
            f"KVVIZ_ENGINES to where it was built)")


def _die_with_parent() -> None:
    """In the worker, before it runs (Linux): SIGKILL when kvviz's process dies, so no worker outlives a study."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class WorkerClient:
    """One worker process: `call(op, **fields)` sends a request line and returns the reply (a dict); a failure in
    the worker, a dead worker or a timeout is one KvvizError line. `close()` stops it (and kills it if it hangs)."""

    def __init__(self, name: str, env: dict | None = None, timeout_s: float = ANSWER_LIMIT_S):
        py = engine_python(name)
        if py is None:
            raise KvvizError(how_to_get(name))
        self.name, self.timeout_s = name, timeout_s
        self._err: deque[str] = deque(maxlen=40)
        full_env = {**os.environ, **(env or {})}
        full_env.pop("PYTHONPATH", None)  # the worker sees its own environment only
        self.proc = subprocess.Popen([str(py), str(HERE / WORKERS[name][1])], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                     env=full_env, start_new_session=True, preexec_fn=_die_with_parent)
        self._replies: deque[str] = deque()
        self._cv = threading.Condition()
        threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True).start()

    def _read(self, stream, is_out: bool) -> None:
        try:
            for line in stream:
                if is_out:
                    with self._cv:
                        self._replies.append(line)
                        self._cv.notify_all()
                else:
                    self._err.append(line.rstrip())
        except (ValueError, OSError):  # close() closed the stream under this thread: nothing more to read
            pass
        if is_out:
            with self._cv:
                self._cv.notify_all()

    def call(self, op: str, **fields) -> dict:
        if self.proc.poll() is not None:
            raise KvvizError(f"the {self.name} worker has stopped{self._last_error()}")
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise KvvizError(f"the {self.name} worker has stopped{self._last_error()}") from None
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            while not self._replies:
                if self.proc.poll() is not None:
                    raise KvvizError(f"the {self.name} worker stopped during '{op}'{self._last_error()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    self.close()
                    raise KvvizError(f"the {self.name} worker gave no answer to '{op}' within {self.timeout_s:.0f} s")
                self._cv.wait(min(left, 1.0))
                self._stop_if_cancelled()
            line = self._replies.popleft()
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise KvvizError(f"the {self.name} worker answered something that is not JSON: {line[:120]!r}") from None
        if not reply.get("ok"):
            raise KvvizError(f"{self.name}: {reply.get('error', 'failed')}")
        return reply

    def _stop_if_cancelled(self) -> None:
        """A stopped run (kvviz.core.cancel) kills its worker at once: it may be in the middle of a long request."""
        try:
            cancel.check()
        except cancel.Cancelled:
            self.kill()
            raise

    def kill(self) -> None:
        self._killpg()
        self.close()

    def _killpg(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the worker and what it spawned
        except ProcessLookupError:
            pass

    def _last_error(self) -> str:
        lines = [x for x in self._err if x.strip()]
        return f" ({lines[-1][:300]})" if lines else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self._killpg()
            self.proc.wait(timeout=30)
        for s in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                s.close()
            except OSError:
                pass

