"""The order of verdicts, worst first, lives in kvviz.core.verdict (SEVERITY, severity(), worst()) and nowhere else."""
from __future__ import annotations

import ast
from pathlib import Path

from kvviz.core.verdict import SEVERITY, Verdict, severity, worst

ROOT = Path(__file__).resolve().parent.parent
WORDS = {v.value for v in Verdict}


def test_worst_takes_verdicts_or_words_and_skips_the_rest():
    assert list(SEVERITY) == [Verdict.LOGIC, Verdict.UNDECIDED, Verdict.NONDETERMINISTIC, Verdict.PRECISION,
                              Verdict.LOSSY, Verdict.IDENTICAL]
    assert set(SEVERITY) == set(Verdict)  # every verdict has its place
    assert worst(["identical", "precision", "identical"]) is Verdict.PRECISION
    assert worst([Verdict.PRECISION, "logic", "identical"]) is Verdict.LOGIC
    assert worst(["lossy", "precision"]) is Verdict.PRECISION
    assert worst(["lossy", "identical"]) is Verdict.LOSSY
    assert worst(["precision", "nondeterministic"]) is Verdict.NONDETERMINISTIC
    # not decided (a heuristic bound passed) hides under no milder word, and never becomes logic
    assert worst(["identical", "undecided", "precision"]) is Verdict.UNDECIDED
    assert worst(["undecided", "logic"]) is Verdict.LOGIC
    assert worst(v for v in ("identical", "cannot run", None, "reference")) is Verdict.IDENTICAL
    assert worst([]) is None and worst(["cannot run"]) is None
    assert worst([], default=Verdict.IDENTICAL) is Verdict.IDENTICAL
    assert worst({"logic": 1, "identical": 3}) is Verdict.LOGIC  # a count dict's keys
    # order does not matter; the result is a Verdict that compares and prints as its word
    assert all(worst(p) == "logic" for p in (["logic", "identical"], ["identical", "logic"]))
    assert f"{worst(['precision'])}" == "precision"
    assert severity("logic") < severity(Verdict.PRECISION) < severity("identical") < severity("cannot run")


def test_the_pages_verdict_style_reads_a_summary_as_its_worst_class():
    from pages.common import verdict_style

    from kvviz.core.verdict import Tally

    assert verdict_style("precision") == "precision"
    assert verdict_style(Tally({"identical": 3, "precision": 1})) == "precision"
    assert verdict_style(Tally({"precision": 2, "logic": 1})) == "logic"
    assert verdict_style("undecided") == "undecided" and verdict_style(Tally({"identical": 1, "undecided": 1})) == "undecided"
    assert Tally({"precision": 2, "logic": 1}) == "logic: 1, precision: 2"  # prints and exports as its text
    # issue 52.2: no generated text is searched for a verdict word: a plain line that names one is information
    assert verdict_style("logic: 1, precision: 3") is None and verdict_style("see the precision table") is None
    assert verdict_style("unsafe") == "logic" and verdict_style("same model") == "identical"
    assert verdict_style("see the table") is None


def test_the_first_screens_worst_verdicts():
    from types import SimpleNamespace

    from kvviz.teach.firstscreen import dtypes_line, padding_line

    res = SimpleNamespace(dtypes=["float64", "bfloat16", "float32"], prompts=["a", "b"],
                          verdicts={"float64": ["identical", "identical"], "bfloat16": ["precision", "identical"],
                                    "float32": ["identical", "identical"]},
                          settings=SimpleNamespace(mode="chunk", split="half", device="cpu"))
    assert dtypes_line(res)[0] == "precision"
    grid = SimpleNamespace(cells=[{"verdict": v, "scenario": f"s{i}", "placement": "p"}
                                  for i, v in enumerate(["identical", "logic", "precision", "cannot run"])])
    assert padding_line(grid)[0] == "logic"


def _literal_verdict_orders(path: Path) -> list[str]:
    """Tuples or lists of 3 or more verdict words written worst first: an order spelled out again."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) >= 3:
            words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(words) == len(node.elts) and set(words) <= WORDS and words[0] == "logic":
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno} {tuple(words)}")
    return hits


def test_no_module_writes_the_worst_first_order_again():
    files = [p for d in ("kvviz", "pages") for p in sorted((ROOT / d).rglob("*.py"))] + [ROOT / "app.py"]
    hits = [h for p in files for h in _literal_verdict_orders(p)]
    assert hits == [], "use kvviz.core.verdict.worst()/severity():\n" + "\n".join(hits)
