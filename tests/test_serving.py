"""The Serving view on tiny models: transformers' continuous batching × {alone, batch of 4, warm prefix} × R runs.

Machine-independent by construction: invariant mode must give exactly one completion per prompt everywhere, and
`tiny:split` under the simulated split-K kernel (kvviz/core/simkernel.py) must part exactly where its construction
says (the head sees one row: "b"; several rows: "a") - and never in invariant mode."""
import functools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import kvviz
from kvviz.core import invariant
from kvviz.cli import main
from kvviz.models.compat import transformers_at_least as _transformers_at_least
from kvviz.core.errors import KvvizError
from kvviz.core.execution import ExecSettings
from kvviz.io.export import export_json, html_report, open_result
from kvviz.views.serving.figures import prompt_frame
from kvviz.views.serving.run import CONDITIONS, ServeConfig, load_prompt_set, plan_batches, run_serving, summary_text
from kvviz.io.repro import key_figure
from kvviz.core.simkernel import split_k_kernel
from conftest import ROOT, DEVICE

PROMPTS = ["Hi there", "The cat", "abc", "Once upon", "xyz!"]


def _study(model, prompts, dtype="float32", invariant_mode=False, **kw):
    lm = kvviz.load_model(model, dtype, DEVICE)
    cfg = ServeConfig(prompts=prompts, **{"runs": 2, "max_new_tokens": 3, **kw})
    return lm, run_serving(lm, cfg, settings=ExecSettings(invariant=invariant_mode))


@pytest.mark.heavy
def test_builtin_set_all_conditions_and_invariant_mode_gives_one_completion():
    prompts, _ = load_prompt_set("builtin:math_and_facts", limit=20)
    assert len(prompts) == 20
    lm, res = _study("tiny:llama", prompts, "bfloat16", invariant_mode=True, max_new_tokens=2)
    assert res.settings.conditions == CONDITIONS and res.settings.execution.invariant
    assert res.histogram == {1: 20}
    for p in res.prompts:
        assert p.distinct == {"alone": 1, "batch": 1, "warm": 1} and p.distinct_all == 1
        assert all(x == p.reference for c in CONDITIONS for x in p.completions[c])
        assert p.first_divergence is None and p.warm_differs is False
    assert res.warm_differs_share == 0.0 and res.first_divergences == []
    # the warm condition really reused cached pages (whole pages of 8 tokens of each prompt); the others none
    assert res.conditions["warm"].cached_tokens >= 8 * 20 * 2 and res.conditions["warm"].cached_tokens % 8 == 0
    assert res.conditions["alone"].cached_tokens == 0 and res.conditions["batch"].cached_tokens == 0
    assert {c.new_tokens for c in res.conditions.values()} >= {20 * 2 * 2}
    frame = prompt_frame(res)
    assert len(frame) == 20 and set(frame["distinct (all)"]) == {1}


def test_builtin_set_normal_mode_counts_every_run():
    prompts, _ = load_prompt_set("builtin:math_and_facts", limit=20)
    lm, res = _study("tiny:llama", prompts, max_new_tokens=2)
    assert len(res.prompts) == 20 and sum(res.histogram.values()) == 20
    for p in res.prompts:
        assert [len(p.completions[c]) for c in CONDITIONS] == [2, 2, 2]
        assert all(len(x) == 2 for c in CONDITIONS for x in p.completions[c])
        assert p.distinct_all == len({tuple(p.reference)} | {tuple(x) for c in CONDITIONS for x in p.completions[c]})
    # every prompt is counted once per run in the batch condition, whatever the fill-up neighbours
    for batches in res.batches.values():
        assert all(len(b) == 4 for b in batches) and set(i for b in batches for i in b) == set(range(20))


def test_constructed_split_parts_where_it_must_and_never_in_invariant_mode():
    with split_k_kernel():
        lm, res = _study("tiny:split", PROMPTS)
        _, inv = _study("tiny:split", PROMPTS, invariant_mode=True)
    a, b = (lm.tokenizer.convert_tokens_to_ids(t) for t in ("a", "b"))
    for p in res.prompts:
        # the reference's head sees every position (several rows): split sum, "a"; alone and warm: one row, "b";
        # a batch of 4 decodes 4 rows together: "a"
        assert p.reference == [a] * 3
        assert p.completions["alone"] == [[b] * 3] * 2 and p.completions["warm"] == [[b] * 3] * 2
        assert p.completions["batch"] == [[a] * 3] * 2
        assert p.distinct == {"alone": 1, "batch": 1, "warm": 1} and p.distinct_all == 2
        assert p.first_divergence == 0 and p.condition == "alone" and p.run == 0
        assert (p.reference_token, p.run_token) == ("a", "b")
        assert p.margin > 1.0  # not a near tie: the split drops a whole term
        assert p.verdict == "precision" and p.float64_gap <= 1e-9
        assert p.proved is True and p.proof.startswith("Precision — proved")
    assert res.histogram == {2: len(PROMPTS)}
    # the proof's time is reported (issue 38): in the JSON, the reopened result and the text summary
    assert res.proof_s is not None and 0 < res.proof_s < res.elapsed_s
    assert type(res).from_dict(json.loads(json.dumps(res.to_dict()))).proof_s == res.proof_s
    assert f"invariant-mode rerun took {res.proof_s:.2f} s" in summary_text(res)
    assert inv.proof_s is None  # already in invariant mode: nothing reruns
    assert res.conditions["batch"].parting_prompts == 0 and res.conditions["alone"].parting_prompts == len(PROMPTS)
    for p in inv.prompts:
        # invariant mode: every linear call is one fixed block of rows, so every row takes the split sum: "a", always
        assert p.reference == [a] * 3 and p.distinct_all == 1 and p.first_divergence is None
    assert inv.histogram == {1: len(PROMPTS)}


def test_invariant_mode_covers_the_engine_thread(monkeypatch):
    seen = set()
    real = invariant.block_linear

    def counting(*a, **k):
        seen.add(threading.current_thread() is threading.main_thread())
        return real(*a, **k)

    monkeypatch.setattr(invariant, "block_linear", counting)
    _study("tiny:llama", PROMPTS[:2], invariant_mode=True, runs=1, max_new_tokens=2, conditions=("alone",))
    assert seen == {True, False}  # the reference in this thread, the engine in its own: both in invariant mode


def test_engine_leaves_the_shared_model_as_it_was():
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE, "eager")
    run_serving(lm, ServeConfig(prompts=PROMPTS[:2], runs=1, max_new_tokens=2, conditions=("alone",)))
    assert lm.model.config._attn_implementation == "eager"  # paged|eager only while the engine ran
    assert not hasattr(lm.model, "_cached_continuous_batching_manager")


def test_plan_is_seeded_and_fills_the_last_batch():
    p1, p2 = plan_batches(10, 4, 3, seed=7), plan_batches(10, 4, 3, seed=7)
    assert p1 == p2 and p1 != plan_batches(10, 4, 3, seed=8)
    for batches in p1.values():
        assert [len(b) for b in batches] == [4, 4, 4]
        assert sorted(batches[0] + batches[1] + batches[2][:2]) == list(range(10))


def test_export_reopen_and_html():
    with split_k_kernel():
        _, res = _study("tiny:split", PROMPTS[:2], runs=1, max_new_tokens=2)
    text = export_json(res)
    head = json.loads(text)["kvviz_result"]
    assert head["view"] == "serving" and "torch" in json.dumps(head["environment"])
    back = open_result(text).result
    assert back.histogram == res.histogram and back.prompts[0].verdict == "precision"
    assert back.prompts[0].completions == res.prompts[0].completions
    assert back.conditions["alone"].tokens_per_s == pytest.approx(res.conditions["alone"].tokens_per_s)
    html = html_report(res)
    assert "kvviz — serving" in html and "Distinct completions per prompt" in html


@pytest.fixture
def no_engine_envs(monkeypatch, tmp_path):
    """vLLM / llama.cpp as on a machine where `make engines` has not run (an empty engines folder)."""
    monkeypatch.setenv("KVVIZ_ENGINES", str(tmp_path / "no-engines"))


def test_bad_config_one_line(no_engine_envs):
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    for cfg, msg in ((ServeConfig(prompts=[]), "at least one prompt"),
                     (ServeConfig(prompts=["a"], runs=0), "runs must be"),
                     (ServeConfig(prompts=["a"], batch_size=1), "batch size must be"),
                     (ServeConfig(prompts=["a"], conditions=("hot",)), "unknown condition 'hot'"),
                     (ServeConfig(prompts=["a"], page_size=2), "page size"),
                     (ServeConfig(prompts=["a"], engine="vllm", page_size=16), "setting of transformers' continuous"),
                     (ServeConfig(prompts=["a"], engine="llama.cpp", page_size=8), "llama.cpp has no pages"),
                     (ServeConfig(prompts=["a"], engine="vllm"), "vLLM is not installed here: .*make engines"),
                     (ServeConfig(prompts=["a"], engine="llama.cpp", conditions=("alone",)),
                      "llama.cpp is not installed here: .*make engines"),
                     (ServeConfig(prompts=["a"], engine="llama.cpp"), "llama.cpp is not installed here"),
                     (ServeConfig(prompts=["a"], shared_prefix=" \n\t"), "the shared prefix is only whitespace")):
        with pytest.raises(KvvizError, match=msg):
            run_serving(lm, cfg)


def _cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args,msg", [
    (("--prompts", "/no/such/prompts.txt"), "prompt file not found"),
    (("--engine", "vllm"), "vLLM is not installed here: `make engines`"),
    (("--engine", "llama.cpp"), "llama.cpp is not installed here: `make engines`"),
    (("--runs", "0"), "runs must be"),
    (("--conditions", "alone,hot"), "unknown condition 'hot'"),
    (("--prompt", "  "), "the prompt is empty"),
    (("--prefix", "  "), "the shared prefix is only whitespace"),
])
def test_cli_bad_input_one_line_nonzero(capsys, no_engine_envs, args, msg):
    code, out, err = _cli(capsys, "serving", "--model", "tiny:llama", "--quiet", *args)
    assert code == 1 and msg in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_bad_prompt_file_contents(capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("{not json\n")
    code, out, err = _cli(capsys, "serving", "--model", "tiny:llama", "--quiet", "--prompts", str(f))
    assert code == 1 and "line 1: not valid JSON" in err and err.count("\n") == 1


@pytest.mark.heavy
def test_cli_runs_and_writes_exports(capsys, tmp_path):
    code, out, err = _cli(capsys, "serving", "--model", "tiny:llama", "--prompts", "builtin:math_and_facts",
                          "--limit", "5", "--runs", "1", "--max-new-tokens", "2", "--json-out",
                          str(tmp_path / "s.json"), "--repro", str(tmp_path / "r.py"), "--quiet")
    assert code == 0 and "distinct completions per prompt" in out and "tokens/s" in out
    res = open_result((tmp_path / "s.json").read_text()).result
    # the repro script (torch + transformers only) makes the same engine calls plainly: the same figure
    script = (tmp_path / "r.py").read_text()
    assert "import kvviz" not in script and "init_continuous_batching" in script
    run = subprocess.run([sys.executable, str(tmp_path / "r.py")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(  # kvviz out of reach, other packages kept
                             p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                             if p and Path(p).resolve() != ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == f"prompts with 1 distinct completion = {key_figure(res):.0f}"


@pytest.mark.app
def test_serving_page_runs_and_reopens(no_engine_envs):
    from streamlit.testing.v1 import AppTest

    from conftest import ROOT

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.session_state["model_preset"] = "tiny:llama"
    at.session_state["serving_limit"] = 3
    at.session_state["serving_runs"] = 1
    at.session_state["serving_tokens"] = 2
    at.run()
    at.switch_page("pages/serving.py")
    at.run()
    assert not at.exception, at.exception
    assert len(at.get("plotly_chart")) >= 2 and len(at.dataframe) == 1
    res = next(iter(at.session_state["_results_serving"].values()))
    assert len(res.prompts) == 3 and res.settings.runs == 1 and res.settings.page_size == 8
    assert not at.number_input(key="serving_page").disabled
    at.selectbox(key="serving_engine").set_value("vllm").run()
    assert not at.exception and any("vLLM is not installed" in e.value for e in at.info)
    assert at.number_input(key="serving_page").disabled  # vLLM's blocks are not kvviz's page size


@pytest.mark.app
def test_serving_page_whitespace_prefix_is_one_line_naming_the_prefix(no_engine_envs):
    # it said "the prompt is empty" (the prefix alone went through the prompt check)
    from streamlit.testing.v1 import AppTest

    from conftest import ROOT

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.session_state["model_preset"] = "tiny:llama"
    at.session_state["serving_prefix"] = "   \t "
    at.run()
    at.switch_page("pages/serving.py").run()
    assert not at.exception, at.exception
    assert [e.value for e in at.error] == [
        "the shared prefix is only whitespace; leave it empty for no prefix, or give the text every prompt starts with"]
    assert len(at.get("plotly_chart")) == 0


@pytest.mark.app
def test_open_result_page_shows_a_serving_result(monkeypatch):
    from conftest import open_result_page

    with split_k_kernel():
        _, res = _study("tiny:split", PROMPTS[:2], runs=1, max_new_tokens=2)
    at = open_result_page(monkeypatch, export_json(res).encode(), "kvviz-serving.json")
    assert any("serving" in c.value for c in at.caption)
    assert len(at.dataframe) == 1 and len(at.get("plotly_chart")) >= 2
    assert any("precision" in e.value for e in at.info)


def test_a_bidirectional_model_parts_as_logic_and_stays_in_invariant_mode():
    """RoBERTa without is_decoder attends to later tokens: a causal cache computes another function (logic). From
    transformers 5.24 its forward reads `cache.get_seq_length()` (models/roberta/modeling_roberta.py), which the
    continuous-batching engine's PagedAttentionCache does not have, so every request fails in the engine: kvviz says
    so in one line (docs/compat.md, "RoBERTa in continuous batching"). Both branches are asserted; `make test-oldest`
    runs the logic one."""
    if _transformers_at_least(5, 24):
        with pytest.raises(KvvizError, match=r"^request p0 failed in the engine: 'PagedAttentionCache' object has no "
                                             r"attribute 'get_seq_length'$"):
            _study("tiny:roberta", PROMPTS, runs=1, conditions=("alone",))
        return
    lm, res = _study("tiny:roberta", PROMPTS, runs=1, conditions=("alone",))
    parting = [p for p in res.prompts if p.first_divergence is not None]
    assert parting
    for p in parting:
        assert p.verdict == "logic" and p.float64_gap > 1e-6
        assert p.proved is False and "logic" in p.proof


@pytest.mark.slow
def test_default_model_bf16_small_study_runs_and_invariant_gives_one_completion():
    prompts, _ = load_prompt_set("builtin", limit=3)
    _, res = _study("default", prompts, "bfloat16", runs=1, max_new_tokens=3)
    assert len(res.prompts) == 3 and sum(res.histogram.values()) == 3
    assert all(p.verdict in (None, "precision", "logic") for p in res.prompts)
    _, inv = _study("default", prompts, "bfloat16", invariant_mode=True, runs=1, max_new_tokens=3)
    assert inv.histogram == {1: 3}


# ----------------------------------------------------------------------------------------------------------------
# The vLLM adapter, against a stand-in `vllm` module (vLLM itself needs a GPU machine): what it asks vLLM for


def _stand_in_vllm(monkeypatch, lm, parting_prompt: int | None = None):
    """A `vllm` module whose LLM decodes greedily with the tiny model (full forward each step, top-2 logprobs) and
    records what kvviz asked for. parting_prompt: that prompt's second token is changed (a parting run)."""
    import importlib.machinery
    import types

    import torch

    log = {"inits": [], "env": [], "alive": 0, "max_alive": 0, "shutdowns": 0, "params": []}

    class LLM:
        def __init__(self, **kw):
            log["inits"].append(kw)
            log["env"].append(os.environ.get("VLLM_BATCH_INVARIANT"))
            log["alive"] += 1
            log["max_alive"] = max(log["max_alive"], log["alive"])
            self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=self._shutdown))

        def _shutdown(self):
            log["shutdowns"] += 1
            log["alive"] -= 1

        def generate(self, prompts, params):
            outs = []
            for p, sp in zip(prompts, params):
                log["params"].append(dict(sp.__dict__))
                ids, toks, lps = torch.tensor([p["prompt_token_ids"]], device=lm.device), [], []
                with torch.no_grad():
                    for _ in range(sp.max_tokens):
                        lp = torch.log_softmax(lm.model(input_ids=ids).logits[0, -1].double(), -1)
                        top = lp.topk(2)
                        toks.append(int(top.indices[0]))
                        lps.append({int(i): types.SimpleNamespace(logprob=float(v))
                                    for v, i in zip(top.values, top.indices)})
                        ids = torch.cat([ids, top.indices[:1].view(1, 1)], 1)
                if parting_prompt is not None and p["prompt_token_ids"] == PARTING[0] and len(toks) > 1:
                    toks[1] = (toks[1] + 1) % 50
                outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=toks, logprobs=lps)],
                                                  num_cached_tokens=0))
            return outs

    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    mod = types.ModuleType("vllm")
    mod.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    mod.LLM, mod.SamplingParams = LLM, SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", mod)
    # kvviz probes optional packages once a process (kvviz.core.optional): this test's probes go to a fresh cache,
    # and the process's own (which may say "no vLLM") comes back with the rest at teardown
    from kvviz.core import optional

    monkeypatch.setattr(optional, "available", functools.cache(optional.available.__wrapped__))
    return log


PARTING = [None]


def test_vllm_adapter_asks_for_each_condition_s_toggles_one_engine_at_a_time(monkeypatch):
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    log = _stand_in_vllm(monkeypatch, lm)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    cfg = ServeConfig(prompts=PROMPTS[:3], runs=2, max_new_tokens=3, batch_size=2, engine="vllm",
                      tensor_parallel_size=2)
    res = run_serving(lm, cfg)
    # alone: one request in flight, no prefix caching; batch: k in flight; warm: prefix caching on
    assert [(k["enable_prefix_caching"], k["max_num_seqs"]) for k in log["inits"]] == [(False, 1), (False, 2),
                                                                                     (True, 1)]
    assert {k["tensor_parallel_size"] for k in log["inits"]} == {2} and {k["dtype"] for k in log["inits"]} == {"float32"}
    assert log["max_alive"] == 1 and log["alive"] == 0 and log["shutdowns"] == 3  # the last one freed at the end
    assert log["env"] == ["0", "0", "0"] and "VLLM_BATCH_INVARIANT" not in os.environ  # restored after each run
    assert all(p["temperature"] == 0.0 and p["ignore_eos"] and p["logprobs"] == 5 for p in log["params"])
    assert res.settings.engine == "vllm" and res.settings.tensor_parallel_size == 2
    p0 = res.prompts[0]
    assert p0.distinct == {"alone": 1, "batch": 1, "warm": 1}
    # invariant mode turns vLLM's batch-invariant kernels on (and only for the run)
    log["inits"].clear(), log["env"].clear()
    run_serving(lm, ServeConfig(prompts=PROMPTS[:2], runs=1, max_new_tokens=2, conditions=("alone",), engine="vllm"),
                settings=ExecSettings(invariant=True))
    assert log["env"] == ["1"] and "VLLM_BATCH_INVARIANT" not in os.environ


def test_vllm_parting_prompt_is_judged_against_the_float64_reference(monkeypatch):
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    from kvviz.core.inputs import encode

    PARTING[0] = encode(lm, PROMPTS[0])
    log = _stand_in_vllm(monkeypatch, lm, parting_prompt=0)
    res = run_serving(lm, ServeConfig(prompts=PROMPTS[:2], runs=1, max_new_tokens=3, conditions=("alone",),
                                      engine="vllm"))
    p = res.prompts[0]
    # the stand-in swaps the second token for another after the fact: it reports a token it did not rank first,
    # and its next step's log-probs belong to another path (a stale state) - far beyond float32 rounding: logic
    assert p.first_divergence == 1 and p.verdict == "logic" and "rounding cannot explain it" in p.explanation
    (path,) = p.engine_paths.values()
    assert path["chose_top"] is False and path["step"] == 2 and path["distance"] > 100 * path["rounding"]
    # prompt 1 is the stand-in's own greedy path: its float32 log-probs are within rounding of float64, no verdict
    (own,) = res.prompts[1].engine_paths.values()
    assert 0 < own["distance"] < own["rounding"] and own["chose_top"] and res.prompts[1].verdict is None
    assert p.run_margin is not None and p.run_margin >= 0  # read from vLLM's top-2 logprobs
    assert res.prompts[1].first_divergence is None
    assert all(k["dtype"] == "float32" for k in log["inits"])  # no float64 engine was asked for
    with pytest.raises(KvvizError, match="tensor_parallel_size applies to the vLLM engine only"):
        ServeConfig(prompts=["a"], tensor_parallel_size=2).validate()
    code = main(["serving", "--model", "tiny:llama", "--prompt", "Hi", "--tensor-parallel-size", "2", "--quiet"])
    assert code != 0


def test_a_serve_config_is_normalised_when_made_and_validate_changes_nothing():
    """ServeConfig is frozen like the other views' configs (issue 40): the defaults are set when it is made (the
    transformers engine's page, each condition once, a server's engine), and validate() only checks."""
    import dataclasses

    cfg = ServeConfig(prompts=["a"], conditions=["warm", "alone", "warm"])
    assert (cfg.page_size, cfg.conditions, cfg.engine) == (8, ("warm", "alone"), "transformers")
    before = dataclasses.asdict(cfg)
    cfg.validate()
    assert dataclasses.asdict(cfg) == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 16
    server = ServeConfig(prompts=["a"], server="http://localhost:1")
    assert (server.engine, server.page_size) == ("server", None)
    server.validate()
    assert ServeConfig(prompts=["a"], engine="vllm").page_size is None
    with pytest.raises(KvvizError, match="leave --engine, --page-size"):
        ServeConfig(prompts=["a"], server="http://localhost:1", page_size=8).validate()


def test_the_engine_wait_ends_on_a_stall_not_on_a_long_run_that_keeps_stepping(monkeypatch):
    """transformers' engine is waited on while it keeps sampling steps (a float64 replay of a long batch may run for
    longer than the limit in all), and given up in one line when it takes no step for the limit."""
    import time

    from kvviz.core.errors import KvvizError
    from kvviz.core.execution import Executor
    from kvviz.engines import serving as engines

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    reqs = [engines.Request(key="a", ids=[1, 5, 9, 13], max_new_tokens=6)]
    monkeypatch.setattr(engines, "_TIMEOUT_S", 1.0)
    real = engines._Capture.record
    delays = iter([0.35] * 6)

    def slow(self, rows, probs):  # each step 0.35 s: 6 steps, over 2 s in all, never 1 s without a step
        time.sleep(next(delays, 0.0))
        real(self, rows, probs)

    monkeypatch.setattr(engines._Capture, "record", slow)
    with Executor(lm).session():
        out = engines.TransformersEngine().generate(lm, reqs, max_in_flight=1, prefix_sharing=False)
    assert len(out.outputs["a"].tokens) == 6 and out.seconds > 2.0
    delays = iter([0.1, 3.0])  # the second step stalls past the limit

    def stalling(self, rows, probs):
        time.sleep(next(delays, 0.0))
        real(self, rows, probs)

    monkeypatch.setattr(engines._Capture, "record", stalling)
    with pytest.raises(KvvizError, match="gave no result and took no step for 1 s"):
        with Executor(lm).session():
            engines.TransformersEngine().generate(lm, reqs, max_in_flight=1, prefix_sharing=False)


def test_an_engine_given_up_on_mid_step_ends_without_a_traceback(monkeypatch, capfd):
    """After the wait gives up (one line), the engine's thread may still be inside a long step when stop() stops
    waiting for it: its end must not print transformers' traceback under kvviz's line."""
    import time

    from kvviz.core.errors import KvvizError
    from kvviz.core.execution import Executor
    from kvviz.engines import serving as engines

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    reqs = [engines.Request(key="a", ids=[1, 5, 9, 13], max_new_tokens=6)]
    monkeypatch.setattr(engines, "_TIMEOUT_S", 0.5)
    monkeypatch.setattr(engines, "_STOP_WAIT_S", 0.1)
    real = engines._Capture.record
    delays = iter([0.0, 2.0])  # the second step outlasts both the wait and stop()'s wait

    def stalling(self, rows, probs):
        time.sleep(next(delays, 0.0))
        real(self, rows, probs)

    monkeypatch.setattr(engines._Capture, "record", stalling)
    capfd.readouterr()
    with pytest.raises(KvvizError, match="took no step for 0 s|took no step for 1 s"):
        with Executor(lm).session():
            engines.TransformersEngine().generate(lm, reqs, max_in_flight=1, prefix_sharing=False)
    time.sleep(0.5)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Error in generation loop" not in out + err, err[-2000:]
