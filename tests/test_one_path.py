"""Issue 52, "done when": one path for each thing kvviz does, checked on the code itself (AST)."""
import ast

from conftest import ROOT

KVVIZ = ROOT / "kvviz"

# ---- item 4: one capture mechanism --------------------------------------------------------------------------------

HOOK_REGISTRATION = {"register_forward_hook", "register_forward_pre_hook"}
# the capture module; the engine workers load this same file by its path (kvviz/engines/vllm_worker.py), no copy
CAPTURE_MODULES = {"core/capture.py"}


def hook_registrations(source: str) -> list[int]:
    """Lines naming a module-hook registration (a call, or the method taken as a value)."""
    return [n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Attribute) and n.attr in HOOK_REGISTRATION]


def test_the_hook_finder_finds_every_spelling():  # so that the test below can fail
    assert hook_registrations("h = layer.register_forward_hook(f)") == [1]
    assert hook_registrations("x = 1\nadd = m.register_forward_pre_hook\nadd(f, with_kwargs=True)") == [2]
    assert hook_registrations("m.register_full_backward_hook(f)\ncapture(m, names, on_output=f)") == []


def test_module_hooks_are_registered_only_by_the_capture_module():
    """`register_forward_hook` / `register_forward_pre_hook` appear in kvviz/core/capture.py only: the bisector,
    streaming, float64, the streamed reference, the cancellation checkpoints and the vLLM worker all capture
    through it (and remove every hook on exit)."""
    offenders = []
    for path in sorted(KVVIZ.rglob("*.py")):
        rel = path.relative_to(KVVIZ).as_posix()
        if rel in CAPTURE_MODULES:
            continue
        offenders += [f"{rel}:{line}" for line in hook_registrations(path.read_text(encoding="utf-8"))]
    assert offenders == [], f"module hooks registered outside kvviz/core/capture.py: {offenders}"
    assert hook_registrations((KVVIZ / "core" / "capture.py").read_text(encoding="utf-8"))  # it does register them
