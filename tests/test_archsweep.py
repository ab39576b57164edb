"""The architecture sweep on a fixed subset of transformers' causal-LM types: each tiny model built from
its own config class runs the cache-safety card in float64 and the invariant proof, and the rows agree with
docs/architectures.json/.md (the committed table): same verdict, same failing checks, same proof."""
import json
import warnings
from pathlib import Path

import pytest

from kvviz.io import archsweep
from kvviz.core.errors import KvvizError

from conftest import ROOT

TABLE = ROOT / "docs" / "architectures.json"


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    # two worker processes (`python -m kvviz.io.archsweep`, the sweep's --jobs path): half the wall time on 2 cores
    return {r.model_type: r for r in archsweep.sweep(list(archsweep.CI_SUBSET), timeout=None,
                                                        workdir=tmp_path_factory.mktemp("arch"), jobs=2)}


def _table():
    return {r["model_type"]: r for r in json.loads(TABLE.read_text())["rows"]}


def _locked_transformers() -> str:
    import re

    return re.search(r"^transformers==(\S+)$", (ROOT / "requirements.lock").read_text(), re.M).group(1)


def test_every_row_says_which_transformers_made_it():
    table = _table()
    assert all(r.get("transformers") for r in table.values())
    meta = json.loads(TABLE.read_text())["meta"]
    assert meta["transformers"] == archsweep.table_version(list(table.values()))
    md = (ROOT / "docs" / "architectures.md").read_text()
    assert f"transformers {meta['transformers']}" in md
    for r in table.values():  # each row names its version in the markdown table too
        assert f"| {r['model_type']} | {r['status']} |" in md and md.count(f"| {r['transformers']} |") >= 1


def test_the_subset_is_large_and_every_type_has_a_row():
    """The table is per release: each row names the transformers it was measured on. Types the installed release
    has and the table has not measured yet are listed (`make arch-sweep-new` measures them), not failed - but the
    locked release (what `make run` installs) is covered whole."""
    import transformers

    assert len(archsweep.CI_SUBSET) >= 20
    table = _table()
    have = archsweep.model_types()
    unmeasured = archsweep.unmeasured_types(TABLE)
    assert unmeasured == sorted(set(have) - set(table))
    if unmeasured:
        warnings.warn(f"docs/architectures.json has no row yet for {len(unmeasured)} model type(s) of transformers "
                      f"{transformers.__version__}: {', '.join(unmeasured)} (make arch-sweep-new)")
    if transformers.__version__ == _locked_transformers():
        assert not unmeasured, f"the locked transformers' types without a row: {unmeasured} (make arch-sweep-new)"
    md = (ROOT / "docs" / "architectures.md").read_text()
    for t in set(have) - set(unmeasured):
        assert f"| {t} |" in md


def test_only_new_sweeps_the_types_without_a_row(tmp_path):
    """`sweep-architectures --only-new`: the installed types the table has no row for, and nothing when it has all."""
    import argparse

    table = json.loads(TABLE.read_text())
    gone = [r["model_type"] for r in table["rows"] if r["model_type"] in ("gpt2", "llama")]
    table["rows"] = [r for r in table["rows"] if r["model_type"] not in gone]
    (tmp_path / "architectures.json").write_text(json.dumps(table))
    assert set(gone) <= set(archsweep.unmeasured_types(tmp_path / "architectures.json"))
    ap = argparse.ArgumentParser()
    archsweep.add_parser(ap.add_subparsers())
    args = ap.parse_args(["sweep-architectures", "--only-new", "--out", str(tmp_path), "--json"])
    assert archsweep.selected_types(args) == archsweep.unmeasured_types(tmp_path / "architectures.json")
    with pytest.raises(KvvizError, match="--only-new and --only"):
        archsweep.selected_types(ap.parse_args(["sweep-architectures", "--only-new", "--only", "gpt2"]))
    complete = ap.parse_args(["sweep-architectures", "--only-new"])  # the committed table: nothing (or the new) to run
    assert archsweep.selected_types(complete) == archsweep.unmeasured_types(TABLE)


def test_subset_runs_and_matches_the_table(rows):
    """The installed release against the table's rows (measured on the release each names): a verdict that moved
    between releases fails here, naming the type."""
    table = _table()
    assert all(rows[t].status != "cannot run" for t in archsweep.CI_SUBSET), \
        [(t, rows[t].reason) for t in archsweep.CI_SUBSET if rows[t].status == "cannot run"]
    for t in archsweep.CI_SUBSET:
        got, want = rows[t], table[t]
        if got.status == "cannot run":  # a crash the table records with the same reason
            assert got.reason.split(":")[0] == want["reason"].split(":")[0], (t, got.reason, want["reason"])
        assert got.status == want["status"], (t, got.status, got.reason, want["status"], want["reason"])
        failing = sorted(c["name"] for c in got.checks if c["status"] == "fail")
        assert failing == sorted(c["name"] for c in want["checks"] if c["status"] == "fail"), t
        assert (got.proof == "0") == (want["proof"] == "0"), (t, got.proof, want["proof"])


def test_seed_003_claims_are_rows_with_evidence(rows):
    assert rows["gpt2"].status == "safe" and rows["gpt2"].proof == "0"
    # the proof's time is reported (issue 38): each proved row says how long its invariant-mode proof took
    assert all(r.proof_s is not None and 0 < r.proof_s < r.seconds for r in rows.values() if r.proof == "0")
    assert rows["roberta"].status == "unsafe" and "causal attention" in rows["roberta"].reason
    for t in ("gemma3_text", "gemma2", "mistral", "qwen3", "llama"):
        assert rows[t].status == "safe" and rows[t].proof == "0", (t, rows[t].reason, rows[t].proof)


def test_gemma3_keeps_its_features():
    cfg = archsweep.tiny_arch_config("gemma3_text")
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    assert cfg.sliding_window == archsweep.WINDOW < len(archsweep.PROMPT)
    assert set(cfg.rope_parameters) == {"sliding_attention", "full_attention"}
    assert cfg.rope_parameters["full_attention"]["rope_theta"] != cfg.rope_parameters["sliding_attention"]["rope_theta"]


def test_unknown_type_is_one_clear_error():
    with pytest.raises(KvvizError, match="unknown model type 'nope'"):
        archsweep.sweep(["nope"])


def test_totals_say_how_many_of_the_cpu_buildable_types_ran():
    r = archsweep.ArchRow
    rows = [r("a", "safe"), r("b", "unsafe", "x"), r("c", "no cache", "y"), r("d", "cannot run", "the run failed: E"),
            r("e", "cannot run", archsweep.NOT_BUILDABLE + "needs the `timm` package")]
    t = archsweep.totals(rows)
    assert (t["run"], t["buildable"], t["not buildable"], t["run %"]) == (3, 4, 1, 75.0)
    md = archsweep.markdown([x.to_dict() for x in rows], {"note": "load 1"})
    assert "**3 of the 4 buildable on a CPU ran: 75 %**" in md and "load 1" in md


def test_the_committed_table_meets_the_issue():
    rows = [archsweep.ArchRow(**r) for r in json.loads(TABLE.read_text())["rows"]]
    t = archsweep.totals(rows)
    assert t["run %"] >= 95, t  # at least 95 % of the types buildable on a CPU actually run
    for r in rows:
        if r.status == "cannot run":  # each with a one-line reason, and none is a time limit
            assert r.reason and "\n" not in r.reason and not r.reason.startswith(("timeout", "not reached")), r
    md = (ROOT / "docs" / "architectures.md").read_text()
    assert f"{t['run %']:g} %" in md


def test_a_model_whose_cached_forward_raises_is_unsafe(tmp_path):
    """A model that runs without its cache but raises with it cannot use the cache: the row is 'unsafe' with that
    proof, not 'cannot run' (a sweep failure). dory on transformers 5.24: its looped sliding-window layer gets
    more keys from the cache than its mask covers, already in the prefill."""
    if "dory" not in archsweep.model_types():
        pytest.skip("this transformers has no dory")
    row = archsweep.run_arch("dory", tmp_path, timeout=None)
    assert row.status == "unsafe", (row.status, row.reason)
    assert row.reason.startswith("the cache path raises where the same forward without a cache runs")
    assert row.checks[0]["name"] == "cache path runs" and row.checks[0]["status"] == "fail"
