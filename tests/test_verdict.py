"""One verdict rule (kvviz.core.verdict): a precision verdict carries its proof (invariant gap exactly 0) or
says plainly "unproved", why and what the bisector found first; "rounding, not a bug" never stands beside a failed
proof; a precision gap that is a large fraction of the value says rounding was amplified and where it jumped."""
import pytest
import torch
import torch.nn.functional as F

import kvviz
from kvviz.core import invariant, verdict
from kvviz.views.split.run import SplitConfig, run_split

from conftest import DEVICE, PROMPT


def test_classify_is_relative_to_the_values():
    assert verdict.classify(True, None) == "identical"
    assert verdict.classify(False, 3.4e-12) == "precision"  # Gemma 3's float64 gap relative to ~1e4 activations
    assert verdict.classify(False, 2.2e-8) == "logic"  # the same gap in absolute terms would be judged logic
    assert verdict.classify(False, float("nan")) == "logic" and verdict.classify(False, None) == "logic"


def test_sentences_never_contradict_their_proof():
    proved = verdict.precision_sentence(1e-13, True, 0.0, normal_gap=0.5)
    by_numbers = verdict.precision_sentence(1e-13, None)
    first = verdict.Finding(module="model.layers.0.self_attn.o_proj", kind="attention output projection", layer=0,
                            max_abs=0.25, relative=1e-3, op="linear", shapes=[[1, 5, 64], [64, 64]])
    unproved = verdict.precision_sentence(1e-13, False, 3.2e3, first, 7.66e4)
    assert proved.startswith(verdict.ROUNDING_NOT_A_BUG) and "proved" in proved and "exactly 0" in proved
    assert by_numbers.startswith(verdict.ROUNDING_NOT_A_BUG) and "Not proved" in by_numbers
    assert "rounding, not a bug" not in unproved.lower() and unproved.startswith("Precision, unproved")
    assert "3.2e+03" in unproved and "layer 1 (model.layers.0.self_attn.o_proj)" in unproved  # read off the finding
    assert "attention output projection: max |Δ| 0.25" in unproved
    assert verdict.label("precision", False) == "precision (unproved)"
    assert verdict.label("precision", True) == "precision (proved)" and verdict.label("logic", False) == "logic"


def test_amplification_names_the_layer_where_the_gap_jumps():
    text = verdict.amplification([0.0, 1e-7, 2e-7, 1e-3, 0.5, 0.9], "model.layers")
    assert "amplified" in text and "layer 3 (model.layers.2)" in text  # 2e-7 -> 1e-3: the largest jump
    assert text.index("starts at layer 1 (model.layers.0)") >= 0
    assert verdict.amplification([0.0, 1e-7, 2e-7]) is None  # a small gap: nothing amplified


def _tiny_gemma3(dtype):
    lm = kvviz.load_model("tiny:gemma3", dtype, DEVICE)
    prompt = PROMPT * 2
    return lm, SplitConfig(prompt, split=20)  # 20 > the window of 8: the prefix is past it


def test_a_precision_verdict_carries_its_proof(row_count_rounding):
    lm, cfg = _tiny_gemma3("bfloat16")
    res = run_split(lm, cfg)
    assert res.verdict == "precision" and res.proved is True
    assert "proved" in res.explanation and "exactly 0" in res.explanation
    assert res.explanation.count(verdict.ROUNDING_NOT_A_BUG) == 1


def test_a_failed_proof_says_unproved_and_what_the_bisector_found(monkeypatch, row_count_rounding):
    """Break invariant mode on purpose (its linear layers and matmuls back to torch's): the proof fails, and the
    verdict must not say "rounding, not a bug"; it says unproved, the invariant gap and the bisector's first
    finding."""
    lm, cfg = _tiny_gemma3("bfloat16")
    monkeypatch.setattr(invariant, "block_linear", F.linear)
    monkeypatch.setattr(invariant, "fast_matmul", lambda a, b: torch.matmul(a, b))
    monkeypatch.setattr(invariant, "fast_sdpa", torch.nn.functional.scaled_dot_product_attention)
    res = run_split(lm, cfg)
    assert res.verdict == "precision" and res.proved is False
    assert "rounding, not a bug" not in res.explanation.lower()
    assert "Precision, unproved" in res.explanation and "survives" in res.explanation
    assert "bisector finds first" in res.explanation and "model.layers." in res.explanation


def test_units_on_the_normal_runs_gap():
    from kvviz.core.verdict import precision_sentence

    text = precision_sentence(1e-16, True, 0.0, normal_gap=4.0)
    assert "against a largest absolute gap of 4 (in the hidden state's own units) in the normal run" in text
