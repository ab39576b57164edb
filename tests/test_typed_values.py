"""Typed values: step policies, greedy paths, replayed computations and cache kinds are str-valued enums. They
compare, print and export as their words, so JSON results (and exports written before they were typed) read the
same, and a reopened result carries the enum members again."""
import json

import pytest

import kvviz
from kvviz.core import execution, loops
from kvviz.core.execution import CacheKind, ExecSettings, StepPolicy
from kvviz.io.export import export_json, open_result
from kvviz.core.replay import Replay
from kvviz.views.greedy.run import GreedyConfig, GreedyPath, run_greedy
from kvviz.core.verdict import Verdict

from conftest import DEVICE


@pytest.mark.parametrize("enum", [StepPolicy, GreedyPath, Replay, CacheKind, Verdict])
def test_each_value_is_its_word(enum):
    for member in enum:
        assert member == member.value and str(member) == member.value and f"{member}" == member.value
        assert json.dumps(member) == json.dumps(member.value)
        assert json.dumps({member: 1}) == json.dumps({member.value: 1})
        assert enum(member.value) is member


def test_lossy_is_a_property_of_the_cache_kind():
    assert {k for k in CacheKind if k.lossy} == {CacheKind.QUANTIZED, CacheKind.QUANTIZED_FP8,
                                                 CacheKind.QUANTIZED_QUANTO, CacheKind.QUANTIZED_HQQ}
    assert set(execution._CACHE_KINDS) == set(CacheKind)  # every kind has its factory, and no kind is untyped
    s = ExecSettings(cache="quantized:hqq")  # a word (from JSON or a flag) becomes its kind
    assert s.cache is CacheKind.QUANTIZED_HQQ and s.lossy and not ExecSettings(cache="static").lossy
    assert ExecSettings(cache="dynamic") == ExecSettings()
    with pytest.raises(kvviz.KvvizError, match="unknown cache kind 'paged'"):
        ExecSettings(cache="paged").validate()


def test_step_policies_are_typed_and_words_still_run():
    assert list(loops.STEP_POLICIES) == list(StepPolicy)
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    ids = lm.tokenizer("Hello world", return_tensors="pt")["input_ids"].to(lm.device)
    ex = execution.Executor(lm)
    with ex.session():
        typed = ex.decode(ids, None, 3, policy=StepPolicy.USER_LOOP, hidden=False)
        word = ex.decode(ids, None, 3, policy="user_loop", hidden=False)  # a repro script passes the word
        with pytest.raises(kvviz.KvvizError, match="unknown step policy 'cached'"):
            ex.decode(ids, None, 3, policy="cached")
    assert typed.tokens == word.tokens


def test_an_export_in_the_words_reopens_with_its_enums():
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    res = run_greedy(lm, GreedyConfig("Hello", 3, paths=("no_cache", "cache")), settings=ExecSettings(cache="static"),
                     prove=False)
    assert res.settings.paths == (GreedyPath.NO_CACHE, GreedyPath.CACHE)
    text = export_json(res)
    d = json.loads(text)
    # the format exports have always had: the plain words
    assert d["settings"]["paths"] == ["no_cache", "cache"] and d["settings"]["execution"]["cache"] == "static"
    assert set(d["paths"]) == {"no_cache", "cache"} and {d["pairs"][0]["a"], d["pairs"][0]["b"]} == set(d["paths"])
    back = open_result(text).result
    assert all(type(p) is GreedyPath for p in back.settings.paths)
    assert all(type(k) is GreedyPath and type(v.name) is GreedyPath for k, v in back.paths.items())
    assert type(back.pairs[0].a) is GreedyPath and back.settings.execution.cache is CacheKind.STATIC
    again = json.loads(export_json(back))
    again["kvviz_result"], d["kvviz_result"] = None, None  # the environment head is written anew
    assert again == d
