"""Types, not prose (issue 40 item 4): no code reads a result's generated text back as data. A verdict, a proof state,
a check's outcome or a grade is a typed field; the words are written from those fields and only ever shown.

The scan (AST, kvviz/, pages/ and app.py) fails on, where X is an attribute that holds a result's text (explanation,
proof, summary, reason, evidence, ...):
  `... in obj.X` / `... not in obj.X`            (searching the words)
  `obj.X.split(…)`, `.startswith(…)`, `.find(…)`  (cutting or testing the words)
  `re.search(…, obj.X)` and friends              (the same with a pattern)
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT_FIELDS = {"explanation", "proof", "summary", "reason", "evidence", "why", "feedback", "verdict_text", "headline",
               "message", "caption", "note", "text"}
STRING_TESTS = {"split", "rsplit", "startswith", "endswith", "find", "rfind", "index", "rindex", "partition",
                "rpartition", "count", "removeprefix", "removesuffix", "splitlines"}
PATTERN_CALLS = {"search", "match", "fullmatch", "findall", "finditer", "split", "sub"}

# Known exceptions, each with why it still stands (empty the list as they are fixed):
KNOWN = {
    # the sweep counts types "not buildable here" by the reason's prefix; ArchRow needs a typed field (and the stored
    # table its value) - the check-status enums of issue 40 item 4, a later slice
    "kvviz/io/archsweep.py": {"reason.startswith"},
}


def _text_field(node: ast.AST) -> str | None:
    """The text field an expression reads: `res.explanation`, `p.proof`, `rows[0].reason` (not a bare name: a
    function's own string parameter is not a result's field)."""
    if isinstance(node, ast.Attribute) and node.attr in TEXT_FIELDS:
        return node.attr
    return None


def scan(path: Path) -> list[tuple[str, int]]:
    """(what, line) for every place `path` reads a result's text as data."""
    tree = ast.parse(path.read_text(), filename=str(path))
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                field = _text_field(right)
                if isinstance(op, (ast.In, ast.NotIn)) and field:
                    hits.append((f"in .{field}", node.lineno))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            field = _text_field(f.value)
            if field and f.attr in STRING_TESTS:
                hits.append((f"{field}.{f.attr}", node.lineno))
            if (f.attr in PATTERN_CALLS and isinstance(f.value, ast.Name) and f.value.id == "re"
                    and any(_text_field(a) for a in node.args[1:2])):
                hits.append((f"re.{f.attr} on .{_text_field(node.args[1])}", node.lineno))
    return hits


def _files() -> list[Path]:
    return [p for d in ("kvviz", "pages") for p in sorted((ROOT / d).rglob("*.py"))] + [ROOT / "app.py"]


def test_no_result_text_is_read_back_as_data():
    found = []
    for path in _files():
        rel = str(path.relative_to(ROOT))
        for what, line in scan(path):
            if what not in KNOWN.get(rel, set()):
                found.append(f"{rel}:{line}: {what}")
    assert found == [], ("a result's words read back as data - give the result a typed field instead:\n"
                         + "\n".join(found))


def test_the_known_exceptions_are_still_there():
    """An exception that has been fixed leaves the list (so the list never hides a new one)."""
    for rel, whats in KNOWN.items():
        assert whats <= {w for w, _ in scan(ROOT / rel)}, f"{rel} no longer does {whats}: remove it from KNOWN"


def test_the_scan_catches_each_form(tmp_path):
    src = tmp_path / "bad.py"
    src.write_text("import re\n"
                   "def f(res, p, rows):\n"
                   "    a = 'invariant mode' in res.explanation\n"
                   "    b = p.explanation.split(' Replayed in float64')[0]\n"
                   "    c = res.feedback.startswith('Right')\n"
                   "    d = re.search('logic', rows[0].summary)\n"
                   "    e = 'x' not in p.proof\n"
                   "    ok = res.explanation + ' more'\n"
                   "    ok2 = explanation.split('. ')[0] if (explanation := 'x') else ''\n")
    assert sorted(w for w, _ in scan(src)) == sorted(["in .explanation", "explanation.split", "feedback.startswith",
                                                      "re.search on .summary", "in .proof"])


def test_greedy_rebuilds_a_proved_explanation_from_its_parts():
    """A greedy pair keeps where it parts as a part of its own (`parting`); the invariant-mode proof rewrites the
    explanation from that part and the proof state, never by cutting its earlier words."""
    import dataclasses

    import kvviz
    from kvviz.core.inputs import build_inputs
    from kvviz.views.greedy.run import GreedyConfig, GreedyPath, prove_pairs, run_greedy

    lm = kvviz.load_model("tiny:tie", "bfloat16", "cpu")  # 16-bit ties "a" and "b" exactly; float64 picks "b"
    cfg = GreedyConfig("Bonjour", 3, paths=("no_cache", "cache", "float64"))
    res = run_greedy(lm, cfg)
    flip = res.pair("no_cache", "float64")
    assert flip.verdict == "precision" and flip.parting.startswith("At step 0 ")
    assert flip.explanation.startswith(flip.parting + " Replayed in float64 on the same tokens: a near tie")
    assert "Not proved" in flip.explanation and flip.proof is None and not flip.proof_in_explanation
    # the same parting between two same-dtype paths, proved in invariant mode: the explanation keeps its first part
    same = dataclasses.replace(flip, a=GreedyPath.NO_CACHE, b=GreedyPath.CACHE, explanation="(replaced below)")
    prove_pairs(lm, cfg, kvviz.ExecSettings(), build_inputs(lm, cfg.prompt, 0, extra_tokens=3), [same],
                lambda f, m: None)
    assert same.proved is True and same.proof_in_explanation
    assert same.explanation.startswith(flip.parting + " Replayed in float64 on the same tokens: a near tie")
    assert "proved: in invariant mode" in same.explanation and same.to_dict()["parting"] == flip.parting


def test_the_verdict_box_drops_the_proof_line_on_the_results_flag_not_its_words():
    from streamlit.testing.v1 import AppTest

    def box():
        import streamlit as st

        from pages.common import show_verdict

        flag = st.session_state["flag"]
        show_verdict("precision", "Rounding (no words about the proof here).", "PROOF LINE",
                     proof_in_explanation=flag)

    for flag, shown in ((True, False), (False, True)):
        at = AppTest.from_function(box)
        at.session_state["flag"] = flag
        at.run(timeout=60)
        assert not at.exception, at.exception
        text = " ".join(e.value for e in at.info)
        assert "Verdict: precision" in text and ("PROOF LINE" in text) is shown, text


def test_presenter_headline_comes_from_the_verdict_and_proof_state_not_from_the_text():
    """Presenter mode's one-sentence verdict is written from (verdict, proved), never cut out of the explanation
    (it was `explanation.split(". ")[0]`: an explanation starting "max |Δ| 1.5e-05. …" headlined as a number)."""
    from kvviz.core.verdict import ROUNDING_NOT_A_BUG, UNKNOWN, Verdict, headline

    src = (ROOT / "pages" / "common.py").read_text()
    tree = ast.parse(src)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "show_verdict")
    cuts = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "explanation" and n.func.attr in STRING_TESTS]
    assert cuts == []
    assert headline(Verdict.PRECISION, True) == f"{ROUNDING_NOT_A_BUG} - proved."
    assert "not proved" in headline(Verdict.PRECISION, None)
    assert headline(Verdict.PRECISION, False).startswith("Precision, unproved")
    assert headline(Verdict.PRECISION, UNKNOWN) == "Precision: the gap closes in float64."
    words = {headline(v) for v in Verdict}
    assert len(words) == len(Verdict)  # one sentence a verdict, none empty
    assert all(w.endswith(".") and len(w) < 80 for w in words)
