"""optimum-quanto's compiled extensions, without a silent wait.

optimum-quanto compiles a C++ extension the first time it needs one (`Extension.lib` in
optimum/quanto/library/extensions/extension.py calls torch.utils.cpp_extension.load). torch's `_jit_compile` takes a
lock file, `<build directory>/lock` (torch/utils/file_baton.py's FileBaton: created with O_EXCL, removed when the
build ends), and any other process that finds the file polls until it disappears - forever, without a message: a
killed build (a timeout, a restarted server) leaves the file behind and every later quantized run hangs at 0 % CPU.
The build itself (`ninja`, run by subprocess.run) has no time limit either.

What kvviz does instead (`prepare(device)`, called before quanto quantizes or dequantizes anything):

  CPU (quanto_cpp)  the extension's only kernel is `quanto::unpack` (int2/int4 bits out of uint8 bytes: masks,
                    shifts and a cat). kvviz gives quanto the same integer operations in PyTorch, so nothing is
                    compiled and no lock is read; the unpacked bytes are bit for bit those of the C++ kernel
                    (tests/test_no_silent_waits.py compares them), so every quantized number is the same.
                    KVVIZ_QUANTO_CPP=extension uses the compiled kernel instead, through the guarded build below.
  CUDA (quanto_cuda) the AWQ / Marlin GEMMs have no PyTorch twin: the extension is built in a child process with
                    a time limit (KVVIZ_QUANTO_BUILD_TIMEOUT seconds, default 900 on CUDA, 300 on the CPU), and
                    loaded from its built file without torch's lock.

The guarded build reads the lock first. A lock no process holds open (the kernel closes a killed builder's file
descriptors; /proc says who holds one) is left over from a build that was stopped: it is removed and the build
runs. A lock a live process holds is waited on up to the same limit, then refused in one line naming the file and
the process. Where /proc cannot say (another user's processes), a lock older than the limit counts as left over.
Every refusal is a KvvizError with one line.

TORCH_EXTENSIONS_DIR, when set, also moves quanto's build directories under it (`<dir>/optimum-quanto/<name>`)
instead of quanto's own package folder - a read-only install cannot be built into, and tests keep their builds
away from the user's.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time

import torch
from torch.utils.cpp_extension import LIB_EXT

from .compat import extension_lib, set_extension_lib
from ..core.cancel import Progress
from ..core.errors import KvvizError


CPP, CUDA = "quanto_cpp", "quanto_cuda"
STALE_GRACE_S = 3.0  # a lock nobody holds, younger than this, may be a builder between close() and remove()
POLL_S = 0.5
_LOCK = threading.Lock()
_PREPARED: set[str] = set()


def cpp_mode() -> str:
    """KVVIZ_QUANTO_CPP: 'pytorch' (default: quanto's unpack in PyTorch, nothing compiled) or 'extension'."""
    mode = os.environ.get("KVVIZ_QUANTO_CPP", "pytorch").strip().lower() or "pytorch"
    if mode not in ("pytorch", "extension"):
        raise KvvizError(f"KVVIZ_QUANTO_CPP='{mode}' is not a choice: use pytorch (the default, nothing to build) "
                         f"or extension (optimum-quanto's compiled C++ kernel)")
    return mode


def build_timeout(name: str) -> float:
    raw = os.environ.get("KVVIZ_QUANTO_BUILD_TIMEOUT")
    if raw is None:
        return 900.0 if name == CUDA else 300.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise KvvizError(f"KVVIZ_QUANTO_BUILD_TIMEOUT='{raw}' is not a number of seconds above 0")
    return value


def unpack(packed, bits: int):
    """quanto's `quanto::unpack` in PyTorch: the same masks and shifts as its C++ kernel (unpack.cpp) and its own
    default implementation (optimum/quanto/library/unpack.py), so the same bytes."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"Unsupported data type: {packed.dtype}")
    if bits not in (2, 4):
        raise ValueError("Can only unpack 2-bit or 4-bit tensors.")
    return torch.cat([(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]).to(torch.uint8)


class _PyTorchUnpack:
    """What quanto's CPU kernel registration asks of its compiled module (`ext.lib.unpack`)."""

    unpack = staticmethod(unpack)


def _extension(name: str):
    try:
        from optimum.quanto.library.extensions import get_extension, is_extension_available
    except ImportError:  # another quanto layout: nothing of this kind to guard
        return None
    if not is_extension_available(name):
        return None
    ext = get_extension(name)
    if not all(hasattr(ext, a) for a in ("_lib", "build_directory", "name")):
        return None
    return ext


def prepare(device=None, progress: Progress | None = None) -> str | None:
    """Make optimum-quanto ready for a run on `device` without a silent wait; returns a note of what it did (None
    when there was nothing to do). Raises KvvizError with one line when a build is locked or too slow."""
    device = torch.device(device or "cpu")
    names = [CPP] + ([CUDA] if device.type == "cuda" else [])
    notes = []
    with _LOCK:
        for name in names:
            if name in _PREPARED:
                continue
            ext = _extension(name)
            if ext is None:
                _PREPARED.add(name)
                continue
            if extension_lib(ext) is None:
                _redirect(ext)
                if name == CPP and cpp_mode() == "pytorch":
                    set_extension_lib(ext, _PyTorchUnpack())
                    notes.append("optimum-quanto's CPU unpack runs in PyTorch (nothing compiled)")
                else:
                    load_bounded(ext, build_timeout(name), progress)
                    notes.append(f"optimum-quanto's {name} extension built and loaded")
            _PREPARED.add(name)
    return "; ".join(notes) or None


def _redirect(ext) -> None:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        ext.build_directory = os.path.join(root, "optimum-quanto", ext.name)


# ------------------------------------------------------------------------------------------------------------------
# The lock file


def lock_path(ext) -> str:
    return os.path.join(ext.build_directory, "lock")


def lock_holders(path: str) -> list[int] | None:
    """The ids of the processes that hold `path` open (FileBaton keeps its descriptor open while it builds); None
    when that cannot be known (no /proc, or a process whose descriptors this user cannot read)."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    try:
        target = os.stat(path)
    except FileNotFoundError:
        return []
    holders, unknown = [], False
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            unknown = True
            continue
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            continue
        for fd in fds:
            try:
                st = os.stat(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if st.st_ino == target.st_ino and st.st_dev == target.st_dev:
                holders.append(int(pid))
                break
    if unknown and not holders:
        return None
    return holders


def clear_stale_lock(ext, limit: float, grace: float = STALE_GRACE_S) -> bool:
    """Remove `ext`'s lock when it is left over from a build that was stopped (nobody holds it open and it is older
    than `grace`, or, where that cannot be known, it is older than `limit`); True when a lock was removed."""
    path = lock_path(ext)
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return False
    holders = lock_holders(path)
    if not ((holders == [] and age >= grace) or (holders is None and age > limit)):
        return False
    try:
        os.remove(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise KvvizError(f"optimum-quanto's {ext.name} extension build is locked by {path}, left by a build that "
                         f"was stopped, and kvviz cannot remove it ({e.strerror}): delete it, then retry") from None
    return True


def wait_for_lock(ext, limit: float, progress: Progress | None = None) -> None:
    """Wait, at most `limit` seconds, for a build in progress elsewhere to release `ext`'s lock; a stale lock is
    removed at once. Raises KvvizError with one line when the lock stays."""
    path = lock_path(ext)
    start = time.monotonic()
    while os.path.exists(path):
        if clear_stale_lock(ext, limit):
            return
        waited = time.monotonic() - start
        holders = lock_holders(path)
        who = f"process {', '.join(map(str, holders))}" if holders else "another process"
        if waited >= limit:
            raise KvvizError(f"optimum-quanto's {ext.name} extension build is locked by {path}, held by {who} for "
                             f"more than {limit:.0f} s: wait for that build to finish, or stop it and delete the "
                             f"file, then retry (KVVIZ_QUANTO_BUILD_TIMEOUT sets the limit)")
        if progress is not None:
            progress(0.0, f"Waiting for optimum-quanto's {ext.name} build in {who} ({waited:.0f} of at most "
                          f"{limit:.0f} s; lock {path})…")
        time.sleep(POLL_S)


# ------------------------------------------------------------------------------------------------------------------
# The bounded build


def _built_file(ext) -> str:
    return os.path.join(ext.build_directory, f"{ext.name}{LIB_EXT}")


def load_bounded(ext, limit: float, progress: Progress | None = None) -> None:
    """Build `ext` in a child process that may take `limit` seconds (killed, with its lock, beyond), then load the
    built file in this process without torch's lock."""
    deadline = time.monotonic() + limit
    wait_for_lock(ext, limit, progress)
    os.makedirs(ext.build_directory, exist_ok=True)
    code = ("import sys; from kvviz.models.quanto_ext import _child_build; _child_build(sys.argv[1], sys.argv[2])")
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    child = subprocess.Popen([sys.executable, "-c", code, ext.name, ext.build_directory], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    output: list[bytes] = []
    reader = threading.Thread(target=lambda: output.append(child.stdout.read()), daemon=True)
    reader.start()
    start = time.monotonic()
    try:
        while child.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                _kill(child)
                clear_stale_lock(ext, limit, grace=0.0)
                raise KvvizError(f"optimum-quanto's {ext.name} extension build did not finish in {limit:.0f} s and "
                                 f"was stopped: raise KVVIZ_QUANTO_BUILD_TIMEOUT, or build it once outside kvviz "
                                 f"(build directory {ext.build_directory})")
            if progress is not None:
                progress(0.0, f"Building optimum-quanto's {ext.name} extension (first use only; "
                              f"{time.monotonic() - start:.0f} of at most {limit:.0f} s)…")
            time.sleep(POLL_S)
    except BaseException:
        if child.poll() is None:  # interrupted (a Stop, Ctrl-C): take the build and its lock down with us
            _kill(child)
            clear_stale_lock(ext, limit, grace=0.0)
        raise
    reader.join(timeout=5)
    if child.returncode != 0:
        text = b"".join(output).decode(errors="replace")
        last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), f"exit {child.returncode}")
        raise KvvizError(f"optimum-quanto's {ext.name} extension could not be built here: {last[:200]}")
    path = _built_file(ext)
    spec = importlib.util.spec_from_file_location(ext.name, path)
    if spec is None or spec.loader is None:
        raise KvvizError(f"optimum-quanto's {ext.name} extension was built but {path} cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise KvvizError(f"optimum-quanto's {ext.name} extension at {path} does not load: "
                         f"{str(e).splitlines()[0][:160]}") from None
    set_extension_lib(ext, module)


def session_members(sid: int) -> list[int]:
    """The live processes of session `sid` (ninja starts each compiler in a process group of its own, so killing the
    child's group would leave the compilers running; they stay in its session)."""
    members = []
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return members
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if len(fields) > 3 and fields[3] == str(sid) and fields[0] != "Z":  # a zombie has nothing left to kill
            members.append(int(pid))
    return members


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (a child started with start_new_session: its id is the session's)."""
    for _ in range(3):  # a process may fork while we look: look again
        members = session_members(sid)
        if not members:
            break
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(child: subprocess.Popen) -> None:
    kill_session(child.pid)
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait for anything
        pass


def _child_build(name: str, build_directory: str) -> None:
    """The child process: quanto's own build (torch's load, its lock and ninja) into `build_directory`."""
    from optimum.quanto.library.extensions import get_extension

    ext = get_extension(name)
    ext.build_directory = build_directory
    ext.lib  # noqa: B018 - the property builds and loads
