"""The JSON-lines loop every engine worker runs (vllm_worker.py, llamacpp_worker.py import it from their own folder:
a worker runs as a script in the engine's environment, without kvviz). One request per line on stdin, one reply per
line on the protocol stream: {"op": "start"|"generate"|"ping"|"stop", ...} -> {"ok": true, ...} or
{"ok": false, "error": "<one line>"}."""
import json
import os
import sys


def protocol_stream():
    """The real stdout, kept for replies; everything the engine prints goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


def serve(worker) -> None:
    """Answer requests until "stop" or the end of stdin, then stop the worker and end the process (an engine's helper
    threads/processes must not keep it alive)."""
    proto = protocol_stream()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "start":
                reply = worker.start(msg)
            elif op == "generate":
                reply = worker.generate(msg)
            elif op == "stop":
                proto.write(json.dumps({"ok": True, **worker.stop()}) + "\n")
                proto.flush()
                break
            elif op == "ping":
                reply = {}
            elif op in getattr(worker, "OPS", ()):  # an engine's own ops (vLLM's layer capture)
                reply = getattr(worker, op)(msg) or {}
            else:
                raise ValueError(f"unknown op {op!r}")
            proto.write(json.dumps({"ok": True, **reply}) + "\n")
        except Exception as e:  # noqa: BLE001 - every failure is one line to kvviz
            proto.write(json.dumps({"ok": False, "error": first_line(e)}) + "\n")
        proto.flush()
    worker.stop()
    os._exit(0)
