"""No silent waits around optimum-quanto (kvviz/models/quanto_ext.py).

optimum-quanto compiled a C++ extension at first use and waited, forever and without a word, on its build's lock file
(torch.utils.file_baton.FileBaton); a build killed mid-way left the file and every later quantized run - page, CLI,
test suite - hung at "token 1 of N" at 0 % CPU. Here a real build is killed while it holds the lock, and the next
quantized runs (library call and `kvviz quant`) finish, or refuse in one line, within 60 s. Every test builds under
a temporary TORCH_EXTENSIONS_DIR (kvviz moves quanto's build directories there), never the user's own.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvviz.models import quanto_ext
from kvviz.core.errors import KvvizError

from conftest import QUANTO

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The museum guard knew every painting in the building"
LIMIT_S = 60  # the brief: the next run finishes or refuses in one line within this
QUANT_ARGS = ["--model", "tiny:llama", "--device", "cpu", "--prompt", PROMPT, "--kv", "quanto:int2",
              "--weights", "int4", "--max-new-tokens", "4"]

# quanto's own build, as kvviz used to reach it: Extension.lib -> torch.utils.cpp_extension.load -> FileBaton
QUANTO_OWN_BUILD = """
import sys
from optimum.quanto.library.extensions import get_extension
ext = get_extension("quanto_cpp")
ext.build_directory = sys.argv[1]
ext.lib
"""

# kvviz's library call, in a fresh process (the extension state is process-wide)
LIBRARY_RUN = """
import json, kvviz
from kvviz.views.quant.run import QuantConfig, run_quant
from kvviz.core.errors import KvvizError
lm = kvviz.load_model("tiny:llama", device="cpu")
try:
    r = run_quant(lm, QuantConfig(%r, kv="quanto:int2", weights="int4", residual_length=1, max_new_tokens=4))
except KvvizError as e:
    print(json.dumps({"error": str(e)}))
else:
    print(json.dumps({"kl": [float(k) for k in r.kl], "layers": [float(x) for x in r.layer_max_abs]}))
""" % PROMPT


def _env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVVIZ_QUANTO")}
    env.update(TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"), PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS="1", **extra)
    return env


def _build_dir(tmp_path) -> Path:
    return tmp_path / "torch_extensions" / "optimum-quanto" / "quanto_cpp"


def _timed(cmd, env, limit=LIMIT_S):
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=limit + 30)
    return p, time.monotonic() - t0


def _kill_a_build_midway(tmp_path) -> Path:
    """Start quanto's own build of its CPU extension, kill it (and its ninja and compilers) while it holds the lock:
    the lock stays behind, held by nobody."""
    build = _build_dir(tmp_path)
    build.mkdir(parents=True)
    lock = build / "lock"
    p = subprocess.Popen([sys.executable, "-c", QUANTO_OWN_BUILD, str(build)], env=_env(tmp_path), cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not lock.exists():
            assert p.poll() is None, f"quanto's build ended (exit {p.returncode}) before it took its lock"
            assert time.monotonic() < deadline, "quanto's build never took its lock"
            time.sleep(0.05)
        time.sleep(0.5)  # ninja and the compilers are running now
    finally:
        quanto_ext.kill_session(p.pid)  # ninja runs each compiler in a process group of its own
        p.wait(timeout=30)
    # nothing of it compiling on: its processes, all sent SIGKILL, gone (on a busy machine the kernel may take a
    # moment to end the last of them, so this looks again for up to 10 s)
    deadline = time.monotonic() + 10
    while (quanto_ext.session_members(p.pid) or _working_in(build)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert quanto_ext.session_members(p.pid) == [] and _working_in(build) == []
    assert lock.exists() and not (build / "quanto_cpp.so").exists()
    os.utime(lock, (time.time() - 10, time.time() - 10))  # as a lock left by an earlier session: past the grace
    assert quanto_ext.lock_holders(str(lock)) == []
    return lock


@pytest.fixture(scope="module")
def killed_build(tmp_path_factory) -> Path:
    """One real build killed while it held its lock (_kill_a_build_midway), for the tests of this module: the
    TORCH_EXTENSIONS_DIR it left behind. Each test works on its own copy (`_copy_of`): they change it."""
    where = tmp_path_factory.mktemp("killed-build")
    _kill_a_build_midway(where)
    return where / "torch_extensions"


def _copy_of(killed: Path, tmp_path) -> Path:
    """The killed build's files (its stale lock, its half-written build directory, their times) under `tmp_path`'s
    TORCH_EXTENSIONS_DIR, as that build left them; the lock, held by nobody, returned."""
    shutil.copytree(killed, tmp_path / "torch_extensions", symlinks=True)
    lock = _build_dir(tmp_path) / "lock"
    assert lock.exists() and not (_build_dir(tmp_path) / "quanto_cpp.so").exists()
    assert quanto_ext.lock_holders(str(lock)) == [] and _working_in(_build_dir(tmp_path)) == []
    return lock


def _working_in(folder: Path) -> list[int]:
    """Live processes whose working directory is `folder` (ninja runs the compilers in the build directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(folder.resolve()) and \
                    open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(pid))
        except OSError:
            continue
    return found


def _one_line_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("kvviz: error:")]
    assert len(lines) == 1, stderr[-2000:]
    return lines[0]


@QUANTO
def test_pytorch_unpack_gives_the_bytes_of_quanto_s_kernel():
    """kvviz's unpack against the kernel's definition (unpack.cpp: low bits first, each slice stacked on dim 0),
    written out with numpy, for every byte value; and quanto's own op on the CPU goes through it, compiling
    nothing."""
    b = np.arange(256, dtype=np.uint8).reshape(16, 16)
    want = {4: np.concatenate([b & 0x0F, (b & 0xF0) >> 4]),
            2: np.concatenate([b & 0x03, (b & 0x0C) >> 2, (b & 0x30) >> 4, (b & 0xC0) >> 6])}
    t = torch.from_numpy(b.copy())
    for bits in (2, 4):
        got = quanto_ext.unpack(t, bits)
        assert got.dtype == torch.uint8 and np.array_equal(got.numpy(), want[bits])
    with pytest.raises(ValueError, match="2-bit or 4-bit"):
        quanto_ext.unpack(t, 3)

    import optimum.quanto  # noqa: F401 - registers quanto::unpack
    from optimum.quanto.library.extensions import get_extension

    if os.environ.get("KVVIZ_QUANTO_CPP", "pytorch") == "pytorch":
        quanto_ext.prepare("cpu")
        assert isinstance(get_extension("quanto_cpp")._lib, quanto_ext._PyTorchUnpack)
    assert np.array_equal(torch.ops.quanto.unpack(t, 4).numpy(), want[4])


@QUANTO
def test_a_build_killed_midway_does_not_stop_the_next_quantized_run(tmp_path, killed_build):
    """A real build killed while it held its lock; then the library call and `kvviz quant` finish within 60 s
    (kvviz computes quanto's unpack in PyTorch and never waits on that lock)."""
    lock = _copy_of(killed_build, tmp_path)
    env = _env(tmp_path)
    p, took = _timed([sys.executable, "-c", LIBRARY_RUN], env)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert "error" not in out and len(out["kl"]) == 4 and max(out["kl"]) > 0, out
    assert took < LIMIT_S, took
    p, took = _timed([sys.executable, "-m", "kvviz", "quant", *QUANT_ARGS], env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "verdict: LOSSY" in p.stdout and took < LIMIT_S, (took, p.stdout[-500:])
    assert lock.exists()  # untouched: the PyTorch path never reads it


@QUANTO
def test_with_the_compiled_kernel_a_stale_lock_is_removed_and_a_slow_build_refused_in_one_line(tmp_path, killed_build):
    """KVVIZ_QUANTO_CPP=extension: the lock left by the killed build is removed (nobody holds it), the build runs
    in a child process with a time limit, and past it the child is killed, its lock removed and the run refused in
    one line - the CLI and the library call, each within 60 s."""
    lock = _copy_of(killed_build, tmp_path)
    env = _env(tmp_path, KVVIZ_QUANTO_CPP="extension", KVVIZ_QUANTO_BUILD_TIMEOUT="4")
    p, took = _timed([sys.executable, "-m", "kvviz", "quant", *QUANT_ARGS], env)
    assert p.returncode == 1 and took < LIMIT_S, (p.returncode, took, p.stderr[-2000:])
    line = _one_line_error(p.stderr)
    assert "optimum-quanto's quanto_cpp extension build did not finish in 4 s" in line, line
    assert "KVVIZ_QUANTO_BUILD_TIMEOUT" in line and str(_build_dir(tmp_path)) in line
    assert not lock.exists()  # the killed child's lock went with it
    assert _working_in(_build_dir(tmp_path)) == []  # and its compilers (ninja gives each a process group)
    p, took = _timed([sys.executable, "-c", LIBRARY_RUN], env)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert "did not finish in 4 s" in out.get("error", ""), (out, p.stderr[-2000:])
    assert took < LIMIT_S and not lock.exists()


def _hold_lock(path: Path) -> subprocess.Popen:
    """A process that holds `path` as FileBaton does while it builds (created with O_EXCL, descriptor open)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    code = ("import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); "
            "time.sleep(300)")
    p = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


@QUANTO
def test_a_build_in_progress_is_waited_on_with_a_limit_then_refused_naming_the_lock_and_its_process(tmp_path):
    from optimum.quanto.library.extensions.extension import Extension

    ext = Extension("quanto_cpp", root_dir=str(tmp_path / "src"), sources=["unpack.cpp"])
    lock = Path(quanto_ext.lock_path(ext))
    holder = _hold_lock(lock)
    try:
        assert quanto_ext.lock_holders(str(lock)) == [holder.pid]
        seen = []
        t0 = time.monotonic()
        with pytest.raises(KvvizError) as e:
            quanto_ext.load_bounded(ext, 2.0, progress=lambda f, m: seen.append(m))
        took = time.monotonic() - t0
        assert 2.0 <= took < 10, took
        msg = str(e.value)
        assert "\n" not in msg and f"locked by {lock}" in msg and f"held by process {holder.pid}" in msg, msg
        assert seen and all("Waiting for optimum-quanto's quanto_cpp build" in m for m in seen)
        assert lock.exists()  # a live build's lock is never taken away

        # the CLI, the same refusal in one line (the lock is in the temporary TORCH_EXTENSIONS_DIR's build folder)
        holder2_lock = _build_dir(tmp_path) / "lock"
        holder2 = _hold_lock(holder2_lock)
        try:
            env = _env(tmp_path, KVVIZ_QUANTO_CPP="extension", KVVIZ_QUANTO_BUILD_TIMEOUT="3")
            p, took = _timed([sys.executable, "-m", "kvviz", "quant", *QUANT_ARGS], env)
            assert p.returncode == 1 and took < LIMIT_S, (took, p.stderr[-2000:])
            line = _one_line_error(p.stderr)
            assert f"locked by {holder2_lock}, held by process {holder2.pid}" in line, line
        finally:
            holder2.kill()
            holder2.wait()
    finally:
        holder.kill()
        holder.wait()
    # its owner gone, the lock is stale: removed once past the grace period, not before
    assert quanto_ext.lock_holders(str(lock)) == []
    assert not quanto_ext.clear_stale_lock(ext, 60.0, grace=3600)
    assert quanto_ext.clear_stale_lock(ext, 60.0, grace=0.0) and not lock.exists()


def test_bad_settings_are_one_line(monkeypatch):
    monkeypatch.setenv("KVVIZ_QUANTO_CPP", "fast")
    with pytest.raises(KvvizError, match="KVVIZ_QUANTO_CPP='fast' is not a choice"):
        quanto_ext.cpp_mode()
    monkeypatch.setenv("KVVIZ_QUANTO_BUILD_TIMEOUT", "soon")
    with pytest.raises(KvvizError, match="KVVIZ_QUANTO_BUILD_TIMEOUT='soon' is not a number of seconds"):
        quanto_ext.build_timeout("quanto_cpp")


@QUANTO
@pytest.mark.heavy
def test_the_compiled_kernel_built_with_a_limit_gives_the_same_quantized_run(tmp_path):
    """KVVIZ_QUANTO_CPP=extension builds quanto's C++ kernel (child process, time limit, temporary
    TORCH_EXTENSIONS_DIR) and loads it; the quantized run's KL and layer gaps are bit for bit those of the PyTorch
    path, and the compiled unpack gives the same bytes as kvviz's on random data."""
    compare = LIBRARY_RUN + """
import torch
from optimum.quanto.library.extensions import get_extension
from kvviz.models.quanto_ext import unpack
lib = get_extension("quanto_cpp")._lib
g = torch.Generator().manual_seed(0)
t = torch.randint(0, 256, (513, 129), dtype=torch.uint8, generator=g)
print(json.dumps({"lib": type(lib).__name__, "same": all(torch.equal(lib.unpack(t, b), unpack(t, b)) for b in (2, 4))}))
"""
    outs = {}
    for mode in ("pytorch", "extension"):
        env = _env(tmp_path, KVVIZ_QUANTO_CPP=mode, KVVIZ_QUANTO_BUILD_TIMEOUT="600")
        p = subprocess.run([sys.executable, "-c", compare], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
        assert p.returncode == 0, p.stderr[-2000:]
        lines = p.stdout.strip().splitlines()
        outs[mode] = (json.loads(lines[-2]), json.loads(lines[-1]))
    assert outs["extension"][1] == {"lib": "module", "same": True}
    assert outs["pytorch"][1] == {"lib": "_PyTorchUnpack", "same": True}
    assert outs["extension"][0] == outs["pytorch"][0] and "kl" in outs["pytorch"][0]
    assert (_build_dir(tmp_path) / "quanto_cpp.so").exists() and not (_build_dir(tmp_path) / "lock").exists()


def test_a_run_waiting_for_the_precision_flags_is_refused_in_one_line_after_its_limit(monkeypatch):
    """kvviz.core.backends: a run that sets process-wide precision flags runs alone; it used to wait without limit for
    the runs in progress (Condition.wait()). Now KVVIZ_RUN_WAIT_TIMEOUT bounds it, and the refusal is one line."""
    import threading

    from kvviz.core.backends import _SharedExclusive

    monkeypatch.setenv("KVVIZ_RUN_WAIT_TIMEOUT", "1")
    gate = _SharedExclusive()
    holding, release = threading.Event(), threading.Event()

    def other_run():
        with gate.hold(exclusive=False):
            holding.set()
            release.wait(30)

    t = threading.Thread(target=other_run, daemon=True)
    t.start()
    assert holding.wait(10)
    t0 = time.monotonic()
    with pytest.raises(KvvizError) as e:
        with gate.hold(exclusive=True):
            pass
    assert 1.0 <= time.monotonic() - t0 < 5
    assert str(e.value) == ("this run waited 1 s for 1 run in progress to finish (precision flags are process-wide, "
                            "so a run that sets them runs alone): stop it or wait, then retry "
                            "(KVVIZ_RUN_WAIT_TIMEOUT sets the limit)")
    release.set()
    t.join(10)
    with gate.hold(exclusive=True):  # free again: the refused run left nothing behind
        with gate.hold(exclusive=True):  # nested in the same thread
            pass
    assert gate._shared == 0 and not gate._exclusive


def test_a_parallel_arch_sweep_stops_a_worker_that_hangs(monkeypatch, tmp_path):
    """kvviz.io.archsweep: the parallel sweep joined its reader threads without limit; a worker stuck where its own
    SIGALRM cannot reach (a wait inside C code) hung the sweep. The parent now stops a worker past its types' time
    limits plus a start-up slack, and each type it never reached says why in one line."""
    import kvviz.io.archsweep as archsweep

    hang = tmp_path / "hang.sh"
    hang.write_text("#!/bin/sh\nexec sleep 300\n")
    hang.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(hang))
    monkeypatch.setattr(archsweep, "WORKER_SLACK_S", 1.0)
    t0 = time.monotonic()
    rows = archsweep._sweep_parallel(["llama", "gpt2", "mistral"], 0.5, lambda *a: None, None, 2)
    took = time.monotonic() - t0
    assert took < 15, took  # 2 types x 0.5 s + 1 s slack, polled each second
    assert [r.model_type for r in rows] == ["llama", "gpt2", "mistral"]
    for r in rows:
        assert r.status == "cannot run"
        assert r.reason == "not reached: its worker passed the sweep's limit (2 s) and was stopped", r.reason
