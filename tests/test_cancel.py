"""Stop means stop (issue 39 item 1): a cancelled run ends at its next checkpoint - a progress report, a model call,
a decoder layer, a wait for the model's lock - and frees the model's lock within seconds; the CLI's Ctrl-C ends a
run with exit code 130 and one line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import kvviz
from kvviz.core import cancel
from kvviz.views.split.run import run_split

from conftest import ROOT

LONG = "The quick brown fox jumps over the lazy dog. " * 10  # 451 tokens: fed one by one, a run of a minute here
MEDIUM = "The quick brown fox jumps over the lazy dog. " * 3  # 136 tokens: the run reaches its later phases sooner


def _start(lm, cfg, settings=None, prove=None, cancel_when=lambda msg: False):
    """run_split in a thread under a token; the token is cancelled (from this thread, not by the run's own progress
    callback, which only records) as soon as a progress message matches cancel_when. Returns (thread, token,
    outcome, messages, cancelled_at)."""
    token, outcome, messages, at = cancel.Token(), {}, [], {}
    hit = threading.Event()

    def progress(frac, msg):
        messages.append(msg)
        if cancel_when(msg):
            hit.set()

    def work():
        with cancel.scope(token):
            try:
                outcome["result"] = run_split(lm, cfg, progress=progress, settings=settings, prove=prove)
            except BaseException as e:  # noqa: BLE001 - the test reads what ended it
                outcome["error"] = e

    th = threading.Thread(target=work, daemon=True)
    th.start()
    assert hit.wait(300), messages[-3:]
    at["t"] = time.monotonic()
    token.cancel("test")
    return th, token, outcome, messages, at


def _assert_stopped_soon(lm, th, outcome, at, limit=10.0):
    th.join(limit + 5)
    ended = time.monotonic() - at["t"]
    assert not th.is_alive(), "the run went on after its token was cancelled"
    assert isinstance(outcome.get("error"), cancel.Cancelled), outcome
    assert ended < limit, f"stopped {ended:.1f} s after the cancel"
    assert lm.lock.acquire(blocking=False), "the model's lock is still held"
    lm.lock.release()
    return ended


@pytest.fixture(scope="module")
def lm():
    return kvviz.load_model("tiny:llama", "float32", "cpu")


def test_a_long_run_stopped_mid_way_ends_and_frees_the_lock(lm):
    cfg = kvviz.SplitConfig(prompt=LONG, split=10, mode="step")
    th, token, outcome, messages, at = _start(lm, cfg, cancel_when=lambda m: "token 30 of" in m)
    _assert_stopped_soon(lm, th, outcome, at)
    assert not any("token 200 of" in m for m in messages)  # it did not go on feeding tokens


def test_the_invariant_proof_stops_inside_its_forwards(lm):
    """The proof reports only between its phases: the cancel lands while one is running (its full forward, then 126
    tokens one by one in invariant mode), and the checkpoints at every call and layer end it there."""
    cfg = kvviz.SplitConfig(prompt=MEDIUM, split=10, mode="step")
    th, token, outcome, messages, at = _start(lm, cfg, prove=True,
                                              cancel_when=lambda m: m.startswith("invariant proof: Full forward"))
    _assert_stopped_soon(lm, th, outcome, at)
    assert messages[-1].startswith("invariant proof: ")  # the proof says its phase
    assert token.where.startswith("layer ") or token.checks > 0


def test_the_float64_rerun_stops(lm):
    cfg = kvviz.SplitConfig(prompt=MEDIUM, split=10, mode="step")
    th, token, outcome, messages, at = _start(lm, cfg, settings=kvviz.ExecSettings(),
                                              cancel_when=lambda m: m.startswith("float64: Rest through the cache"))
    _assert_stopped_soon(lm, th, outcome, at)
    assert not any(m.startswith("invariant proof") for m in messages)


def test_every_decoder_layer_is_a_checkpoint_while_a_token_is_current(lm):
    """Inside a scope each forward checks once, then before every decoder layer (and every module inside one),
    telling where the run is; outside a scope nothing is attached to the model."""
    from kvviz.core.execution import Executor
    from kvviz.core.streaming import decoder_layers

    ids = lm.tokenizer("Hello there, this is a prompt", return_tensors="pt")["input_ids"]
    layers = decoder_layers(lm.model)
    token = cancel.Token()
    with cancel.scope(token):
        with Executor(lm).session() as ex:
            ex.forward(ids)
    assert token.checks > len(layers) and token.where == f"layer {len(layers)} of {len(layers)}"
    assert all(not layer._forward_pre_hooks for layer in layers)  # removed after the session
    with Executor(lm).session() as ex:
        assert all(not layer._forward_pre_hooks for layer in layers)
        ex.forward(ids)
    stopped = cancel.Token()
    stopped.cancel()
    with cancel.scope(stopped), pytest.raises(cancel.Cancelled):
        with Executor(lm).session() as ex:
            ex.forward(ids)
    assert lm.lock.acquire(blocking=False)
    lm.lock.release()


def test_a_run_waiting_for_the_lock_stops_waiting(lm):
    """Another run holds the model; this one, stopped while it waits, gives up at once instead of queueing."""
    from kvviz.core.execution import Executor

    held, release = threading.Event(), threading.Event()

    def holder():
        with lm.lock:
            held.set()
            release.wait(30)

    threading.Thread(target=holder, daemon=True).start()
    assert held.wait(10)
    token, outcome = cancel.Token(), {}

    def waiter():
        with cancel.scope(token):
            try:
                with Executor(lm).session():
                    outcome["ran"] = True
            except cancel.Cancelled as e:
                outcome["error"] = e

    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    time.sleep(0.5)
    assert th.is_alive()  # waiting for the lock
    t0 = time.monotonic()
    token.cancel()
    th.join(5)
    assert not th.is_alive() and isinstance(outcome.get("error"), cancel.Cancelled) and "ran" not in outcome
    assert time.monotonic() - t0 < 2
    release.set()


def test_a_probe_cancels_at_the_next_checkpoint():
    asked = []
    token = cancel.Token(probe=lambda: bool(asked))
    with cancel.scope(token):
        cancel.check("step 1")
        asked.append(True)
        with pytest.raises(cancel.Cancelled):
            cancel.check("step 2")
    assert token.cancelled and token.where == "step 2"
    cancel.check()  # outside a scope: nothing to stop


def test_ctrl_c_ends_a_cli_run_with_one_line_and_exit_130():
    """A long CLI run (451 tokens one by one, then its float64 rerun and proof) gets SIGINT once it is feeding tokens:
    it ends within 10 s, exit code 130, its last stderr line the one line saying so, no traceback, nothing on
    stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.Popen([sys.executable, "-m", "kvviz", "split", "--model", "tiny:llama", "--prompt", LONG,
                          "--split", "10", "--mode", "step"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err, feeding = [], threading.Event()

    def read():
        for line in p.stderr:
            err.append(line.rstrip("\n"))
            if "Rest through the cache, token" in line:
                feeding.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert feeding.wait(300), err[-5:]
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        p.wait(60)
        took = time.monotonic() - t0
        out = p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
    reader.join(10)
    assert took < 10 and p.returncode == 130, (took, p.returncode, out[-300:], err[-3:])
    assert out == "" and err[-1] == "kvviz: stopped (Ctrl-C)", err[-5:]
    assert not any("Traceback" in line for line in err)


def test_a_ctrl_c_lost_in_a_finalizer_still_stops_the_cli_run_at_its_next_report(monkeypatch):
    """A KeyboardInterrupt raised while Python runs a finalizer (`__del__`) is printed as "Exception ignored" and
    dropped; the run would go on to its end. The CLI's Ctrl-C (kvviz.io.clirun.ctrl_c_stops) also marks the run
    interrupted, and its next progress report (quiet or not) raises KeyboardInterrupt again; the handler before it
    is back afterwards."""
    import threading

    from kvviz.io.clirun import ctrl_c_stops, progress_to_stderr

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    before = signal.getsignal(signal.SIGINT)
    report = progress_to_stderr(True)
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))  # Python's "Exception ignored"

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # the handler's KeyboardInterrupt is raised here, inside __del__, and dropped

    with ctrl_c_stops():
        report(0.1, "before")  # nothing yet
        Finalized()  # dropped at once
        assert dropped == [KeyboardInterrupt]
        with pytest.raises(KeyboardInterrupt):
            report(0.5, "the next step")
    assert signal.getsignal(signal.SIGINT) is before
    with ctrl_c_stops():
        report(0.6, "a later run starts uninterrupted")


def test_a_stopped_run_kills_its_engine_worker(monkeypatch, tmp_path):
    """An engine worker busy with a long request (here: a worker that sleeps on 'generate') is killed when the run is
    stopped: the call ends within seconds with Cancelled and the worker process is gone."""
    from kvviz import engines

    env = tmp_path / "engines" / "vllm"
    (env / "bin").mkdir(parents=True)
    os.symlink(sys.executable, env / "bin" / "python")
    (env / ".kvviz-engine-built").write_text("test\n")
    worker = tmp_path / "slow_worker.py"
    worker.write_text("import json, sys, time\n"
                      "for line in sys.stdin:\n"
                      "    if json.loads(line)['op'] == 'generate':\n"
                      "        time.sleep(600)\n"
                      "    print(json.dumps({'ok': True}), flush=True)\n")
    monkeypatch.setenv("KVVIZ_ENGINES", str(tmp_path / "engines"))
    monkeypatch.setitem(engines.WORKERS, "vllm", ("vllm", str(worker), "vllm"))
    client = engines.WorkerClient("vllm")
    assert client.call("ping") == {"ok": True}
    token, outcome = cancel.Token(), {}

    def work():
        with cancel.scope(token):
            try:
                client.call("generate")
            except cancel.Cancelled as e:
                outcome["error"] = e

    th = threading.Thread(target=work, daemon=True)
    th.start()
    time.sleep(1.5)
    assert th.is_alive() and client.proc.poll() is None  # busy
    t0 = time.monotonic()
    token.cancel()
    th.join(10)
    assert not th.is_alive() and isinstance(outcome.get("error"), cancel.Cancelled)
    assert time.monotonic() - t0 < 5 and client.proc.poll() is not None  # the worker is gone


def test_each_phase_of_the_bar_gets_its_own_pace():
    """Issue 39 item 5: the normal run took 10 s for a quarter of the bar; its invariant proof then takes 28 s for a
    tenth: the line says about 112 s left (the proof's own pace), not the 30 s the first pace would say, and says
    where the run is (the layer) between reports."""
    from pages.runner import _Ticker

    now, drawn, where = [0.0], [], [""]
    t = _Ticker(lambda f, text: drawn.append((f, text)), lambda: now[0], lambda: where[0])
    now[0] = 10.0
    t.report(0.25, "Rest through the cache, token 40…")
    assert drawn[-1][1] == "Rest through the cache, token 40… — about 30 s left"
    now[0] = 12.0
    t.phase("proof")  # the run names its phase as a value (RunContext.on_phase), not in its message
    t.report(0.5, "invariant proof: Full forward without cache…")  # a new phase: no pace of its own yet
    now[0] = 40.0
    where[0] = "layer 3 of 4"
    t.report(0.6, "invariant proof: Rest through the cache, token 2…")
    assert drawn[-1][1] == "invariant proof: Rest through the cache, token 2… — about 112 s left"
    now[0] = 45.0
    t.tick()
    assert drawn[-1][1] == ("invariant proof: Rest through the cache, token 2 (layer 3 of 4)… — about 107 s left")


@pytest.mark.app
def test_a_long_run_is_announced_and_can_skip_its_proof(monkeypatch, tmp_path):
    """A run its estimate says is long (kvviz.core.estimate, from this machine's stored pace): the page says how long
    (the run and its proof apart) and waits; 'Run without the proof' runs it with no invariant rerun (the run's
    context has auto_proof False), and the finished run refines the stored pace."""
    from kvviz.core import estimate
    from test_app import alerts, start

    monkeypatch.setattr(estimate, "store_path", lambda: tmp_path / "estimates.json")  # this test's store only
    key = estimate.key_of("tiny:llama", "float32", "cpu")
    # a slow machine's pace, as calibration would have stored it: 100 s a forward, 10 ms a token, 0.1 ms a token²
    estimate.save_pace(key, estimate.Pace(100.0, 0.01, 1e-4, inv=(100.0, 0.05, 1e-3)))
    calls = []
    import kvviz.views.split.run as split_run  # the split view's run (the page runs it through run_view)

    real = split_run.run_split
    monkeypatch.setattr(split_run, "run_split", lambda *a, **k: calls.append(k.get("auto_proof")) or real(*a, **k))
    at = start("pages/split.py", model="tiny:llama")
    said = alerts(at)
    assert "This run will take about" in said and "for the invariant proof" in said, said
    assert "from this machine's measured pace" in said, said
    assert not calls and "Verdict:" not in said
    at.button(key="_long_noproof_split").click().run()
    assert not at.exception, at.exception
    assert calls == [False] and "Verdict:" in alerts(at)
    (result,) = at.session_state["_results_split"].values()
    assert result.invariant is None and result.proof_s is None  # no proof was run
    assert result.timings.estimate_s > 120 and result.timings.elapsed_s > 0  # the estimate it started with
    full = real(kvviz.load_model("tiny:llama", "float32", "auto"), result.settings.config)
    assert full.verdict == result.verdict and full.proof_s is not None  # the same run proves itself by default
    assert set(estimate.load_pace(key).fix["split"]) >= {"run"}  # re-measured by this run


def test_in_invariant_mode_every_torch_call_is_a_checkpoint():
    """Invariant mode's fixed-order kernels make a layer of a long prompt take minutes (one layer of the default model
    over 1,800 tokens: over 30 s here): inside them every torch call is a checkpoint, so a stop lands within
    milliseconds; the numbers are the same as without it (the checks only look)."""
    import torch

    token = cancel.Token()
    with cancel.scope(token), cancel.op_checks():
        x = torch.arange(6.0).reshape(2, 3)
        assert torch.equal(x @ x.T, torch.tensor([[5.0, 14.0], [14.0, 50.0]]))
        token.cancel()
        with pytest.raises(cancel.Cancelled):
            x @ x.T
    assert torch.equal(x @ x.T, torch.tensor([[5.0, 14.0], [14.0, 50.0]]))  # outside: nothing checks


@pytest.mark.parametrize("invariant", [True, False])
def test_a_run_under_a_token_gives_the_same_numbers(lm, invariant):
    """The checks only look: invariant mode, and the float64 rerun and proof of a normal run, give the same bits."""
    import numpy as np

    cfg = kvviz.SplitConfig(prompt="The quick brown fox jumps over the lazy dog.", split=4, mode="step")
    settings = kvviz.ExecSettings(invariant=invariant)
    plain = run_split(lm, cfg, settings=settings)
    with cancel.scope(cancel.Token()):
        checked = run_split(lm, cfg, settings=settings)
    assert checked.verdict == plain.verdict
    for a, b in ((plain.main, checked.main), (plain.float64, checked.float64), (plain.invariant, checked.invariant)):
        assert (a is None) == (b is None)
        if a is not None:
            assert all(np.array_equal(a.hidden[k], b.hidden[k]) for k in a.hidden)
    if not invariant:
        assert plain.float64 is not None  # the float64 rerun ran (and under the token, checked op by op)
