"""kvviz is pip-installable: a wheel built from the checkout, installed into a fresh venv in a temp folder, gives the
library, its package data and the `kvviz` command, and runs from outside the checkout.

The fresh venv gets the wheel only (`--no-deps`); its dependencies (torch, transformers, ...) come from the test
environment through a .pth file, so the test never downloads a torch build. That the wheel declares them is checked
from its metadata."""
import json
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.heavy


def _build_and_install(tmp: Path) -> tuple[Path, Path]:
    """The wheel built from a copy of the checkout into tmp/dist, installed into the venv tmp/venv: (wheel, venv)."""
    import shutil

    src = tmp / "src"  # a copy: building writes build/ and *.egg-info next to the sources, not into the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvviz", src / "kvviz", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next((tmp / "dist").glob("kvviz-*.whl"))
    venv = tmp / "venv"
    # a venv without pip of its own (ensurepip's install took 4 CPU-s, up to 40 s on busy cores): this environment's
    # pip installs the wheel into it (--python: pip run by the venv's interpreter, its scripts pointing at it)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                        "--disable-pip-version-check", str(wheel)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies: this environment's packages, after the venv's own (so kvviz is the wheel's)
    (Path(site) / "kvviz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return wheel, venv


@pytest.fixture(scope="module")
def installed(tmp_path_factory, worker_id):
    """(wheel, venv, an empty folder outside the checkout). Under pytest-xdist the wheel and its venv are made once
    for the session, by the first worker that asks (the others wait for it, then use them read-only): a module
    fixture is per worker, and this file's tests spread over both workers built it twice."""
    import fcntl

    work = tmp_path_factory.mktemp("elsewhere")  # this worker's own
    if worker_id == "master":
        wheel, venv = _build_and_install(tmp_path_factory.mktemp("wheel"))
        return wheel, venv, work
    shared = tmp_path_factory.getbasetemp().parent  # the session's root, above every worker's own basetemp
    with open(shared / "kvviz-wheel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        tmp, done = shared / "kvviz-wheel", shared / "kvviz-wheel.done"
        if not done.exists():  # first here (or the first one failed: its folder is started afresh)
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            wheel, _ = _build_and_install(tmp)
            done.write_text(wheel.name)
        return tmp / "dist" / done.read_text(), tmp / "venv", work


def _run(venv, work, *args, timeout=900):
    from browser import child_threads_env  # under xdist: this worker's share of the cores, not the whole machine

    return subprocess.run([*args], capture_output=True, text=True, cwd=work, timeout=timeout,
                          env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(Path.home()),
                               "HF_HUB_OFFLINE": "1", **child_threads_env()})


def test_the_wheel_holds_the_library_its_data_and_declares_its_dependencies(installed):
    wheel, _, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvviz/data/prompts.jsonl" in names and any(n.startswith("kvviz/data/configs/") for n in names)
    assert "kvviz/views/split/run.py" in names and not any(n.startswith(("tests/", "pages/")) for n in names)
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    from kvviz.models import compat

    assert f"Requires-Dist: transformers<={compat.TESTED_MAX},>={compat.TESTED_MIN}" in meta or \
        f"Requires-Dist: transformers>={compat.TESTED_MIN},<={compat.TESTED_MAX}" in meta, meta[:2000]
    for dep in ("torch", "safetensors", "gguf", "accelerate", "plotly", "pandas"):
        assert re.search(rf"^Requires-Dist: {dep}\b", meta, re.M), dep
    assert 'Requires-Dist: streamlit>=1.40; extra == "app"' in meta
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kvviz = kvviz.cli:main" in entry


def test_the_kvviz_command_runs_a_split_from_outside_the_checkout(installed):
    _, venv, work = installed
    # the venv's python finds the wheel's kvviz (found, not imported: the split below imports it, as does the
    # notebook snippet's test, which checks the file it imported too)
    r = _run(venv, work, str(venv / "bin" / "python"), "-c",
             "import importlib.util; print(importlib.util.find_spec('kvviz').origin)")
    assert r.returncode == 0 and str(venv) in r.stdout, (r.stdout, r.stderr[-2000:])
    r = _run(venv, work, str(venv / "bin" / "kvviz"), "--help")
    assert r.returncode == 0 and "split" in r.stdout and "serving (serve-study)" in r.stdout
    r = _run(venv, work, str(venv / "bin" / "kvviz"), "split", "--model", "tiny:llama", "--prompt",
             "The capital of France is Paris", "--split", "3", "--dtype", "float32", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["verdict"] in ("identical", "precision"), out["verdict"]
    # bad input from the installed command: one line, non-zero
    r = _run(venv, work, str(venv / "bin" / "kvviz"), "split", "--model", "tiny:llama", "--prompt", "Hi",
             "--split", "99", "--quiet")
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and len(errors) == 1 and "outside the prompt" in errors[0], r.stderr


def test_the_readme_notebook_snippet_runs_from_the_installed_package(installed):
    _, venv, work = installed
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## From a notebook", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    code = block + "\nimport kvviz\nprint('SNIPPET-OK', res.verdict, kvviz.__file__)\n"
    r = _run(venv, work, str(venv / "bin" / "python"), "-c", code, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SNIPPET-OK" in r.stdout
    assert str(venv) in r.stdout.split("SNIPPET-OK", 1)[1], r.stdout[-2000:]  # the wheel's kvviz, not the checkout's
