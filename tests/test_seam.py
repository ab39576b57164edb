"""The execution seam: one place builds every call; settings apply for one run and are restored, also on error."""
import ast
import contextlib
import threading

import pytest

from kvviz.models.compat import output_cache
import torch

import kvviz
from kvviz.core import execution
from kvviz.models import loading
from kvviz.core.errors import KvvizError
from kvviz.core.execution import ExecSettings, Executor, register_run_context, unregister_run_context
from kvviz.views.greedy.run import GreedyConfig, run_greedy
from kvviz.views.split.run import SplitConfig, run_split

from conftest import DEVICE, PROMPT, QUANTO


def test_settings_validate_and_describe_themselves():
    assert ExecSettings().is_default and ExecSettings().label() == "cache dynamic"
    with pytest.raises(KvvizError, match="unknown cache kind 'nope'"):
        ExecSettings(cache="nope").validate()
    s = ExecSettings(invariant=True)
    assert s.with_(invariant=False).is_default and s.to_dict()["invariant"] is True


def _count_executor_calls(monkeypatch):
    """Executor.forward / Executor.generate wrapped: (the list each call's name is appended to, a list for calls seen
    outside them, a thread-local whose `depth` is > 0 while the executor is calling the model)."""
    calls, bypass = [], []
    inside = threading.local()

    def wrap(real):
        def wrapped(self, *a, **k):
            calls.append(real.__name__)
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return real(self, *a, **k)
            finally:
                inside.depth -= 1
        return wrapped

    monkeypatch.setattr(Executor, "forward", wrap(Executor.forward))
    monkeypatch.setattr(Executor, "generate", wrap(Executor.generate))
    return calls, bypass, inside


def test_every_scenario_runs_through_the_executor(monkeypatch):
    """Every call of the model happens inside Executor.forward / Executor.generate: a forward pre-hook on the model
    sees each call and fails the test if one bypasses the seam; the executor's calls are counted too."""
    calls, bypass, inside = _count_executor_calls(monkeypatch)
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    lm64 = lm.reference()

    def seen(module, args, kwargs):
        if getattr(inside, "depth", 0) == 0:
            bypass.append(type(module).__name__)

    hooks = [m.model.register_forward_pre_hook(seen, with_kwargs=True) for m in (lm, lm64)]
    try:
        run_split(lm, SplitConfig(PROMPT, split=5, mode="step"))
        n_split = len(calls)
        assert n_split >= 3 + (len(lm.tokenizer(PROMPT)["input_ids"]) - 5)  # prefix, full, every step
        run_greedy(lm, GreedyConfig(PROMPT, 3, paths=("no_cache", "cache", "generate")))
        assert len(calls) - n_split == 3 + 3 + 1  # 3 full forwards + prefill and 2 decode steps + one generate
        from kvviz.views.padding.run import run_padding
        from kvviz.views.reuse.run import run_reuse

        before = len(calls)
        run_padding(lm, PROMPT, left_pad=0)
        assert len(calls) > before
        before = len(calls)
        run_reuse(lm, "Answer.", [" Q?"], 2)
        assert len(calls) > before
        # the hook itself works: a call made behind the seam's back is seen
        with torch.no_grad():
            lm.model(input_ids=torch.tensor([[1, 5, 6]], device=lm.device))
        assert bypass == ["LlamaForCausalLM"]
    finally:
        for h in hooks:
            h.remove()


def test_a_run_context_is_entered_per_run_and_restored_after_an_error():
    state = {"inside": 0, "entered": 0}

    @contextlib.contextmanager
    def marker():
        state["inside"] += 1
        state["entered"] += 1
        try:
            yield
        finally:
            state["inside"] -= 1

    def factory(settings, lm):
        return marker() if settings.invariant else None

    register_run_context(factory)
    try:
        lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
        ex = Executor(lm, ExecSettings(invariant=True))
        with pytest.raises(RuntimeError, match="boom"):
            with ex.session():
                assert state["inside"] == 1
                raise RuntimeError("boom")
        assert state == {"inside": 0, "entered": 1}
        with Executor(lm).session():  # default settings: the context is not entered
            assert state["inside"] == 0
        assert not lm.lock._is_owned()  # the model's lock is released after the error too
    finally:
        unregister_run_context(factory)


def test_the_session_holds_the_models_lock_and_inference_mode():
    lm = kvviz.load_model("tiny:gpt2", "float32", DEVICE)
    seen = []
    with Executor(lm).session():
        seen.append(torch.is_inference_mode_enabled())
        t = threading.Thread(target=lambda: seen.append(lm.lock.acquire(blocking=False)))
        t.start()
        t.join()
    assert seen == [True, False]  # another thread could not take the model while a run held it


def test_the_load_lock_table_stays_empty_between_loads():
    for arch in ("llama", "gpt2", "qwen2"):
        kvviz.load_model(f"tiny:{arch}", "bfloat16", DEVICE)
    assert loading._KEY_LOCKS == {}
    # concurrent loads of one key share one lock, and it is gone afterwards
    kvviz.clear_cache()
    out = []
    threads = [threading.Thread(target=lambda: out.append(kvviz.load_model("tiny:mistral", "float16", DEVICE)))
               for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len({id(m) for m in out}) == 1 and loading._KEY_LOCKS == {}


def test_a_pair_parting_at_step_zero_reads_as_parting():
    from kvviz.views.greedy import figures as greedy_figures

    lm = kvviz.load_model("tiny:tie", "bfloat16", DEVICE)
    res = run_greedy(lm, GreedyConfig("Hi", 3, paths=("no_cache", "float64")))
    pair = res.pair("no_cache", "float64")
    assert pair.first_divergence == 0
    row = greedy_figures.greedy_pairs_frame(res).iloc[0]
    assert row["first parting step"] == 0
    assert row["max |Δ logit| up to parting"] == pair.max_abs_logit[0]


def test_results_carry_typed_settings():
    lm = kvviz.load_model("tiny:llama", "bfloat16", DEVICE)
    res = run_split(lm, SplitConfig(PROMPT, split=4), settings=ExecSettings())
    s = res.settings
    assert (s.dtype, s.split, s.model, s.spec_kind) == ("bfloat16", 4, "tiny:llama", "tiny")
    assert s.execution == ExecSettings() and s["dtype"] == "bfloat16"
    assert s.config == SplitConfig(PROMPT, split=4)
    assert res.to_dict()["settings"]["execution"] == {"cache": "dynamic", "compile": "off", "flags": [],
                                                      "invariant": False, "sdpa_as_eager": False}
    assert execution.RunInfo.of(lm).device == str(lm.device)


# ----------------------------------------------------------------------------------------------------------------
# The seam owns the loop: Executor.decode (step policies) and Executor.feed (the known rest through a cache)


def test_decode_policies_agree_in_float64_and_the_user_loop_parts_with_left_padding():
    lm = kvviz.load_model("tiny:llama", "float64", DEVICE)
    from kvviz.core.inputs import build_inputs

    inp = build_inputs(lm, PROMPT, 0, extra_tokens=5)
    ex = Executor(lm, max_len=inp.total + 5)
    with ex.session():
        ref = ex.decode(inp.ids, inp.mask, 5, policy="no_cache", positions=inp.positions)
        cached = ex.decode(inp.ids, inp.mask, 5, policy="cache", positions=inp.positions)
        user = ex.decode(inp.ids, inp.mask, 5, policy="user_loop")
        forced = ex.decode(inp.ids, inp.mask, 3, policy="cache", positions=inp.positions, forced=[7, 8, 9])
    assert len(ref.tokens) == len(ref.logits) == len(ref.hidden) == 5 and ref.cache is None
    assert cached.tokens == ref.tokens == user.tokens  # no padding: the three computations are the same
    assert float((cached.stacked_logits() - ref.stacked_logits()).abs().max()) < 1e-9
    assert cached.hidden[0].shape == (lm.model.config.num_hidden_layers + 1, lm.model.config.hidden_size)
    assert forced.tokens == [7, 8, 9] and cached.cache.get_seq_length() == inp.total + 4
    # left padding: the user loop (no mask, no positions after the prompt) computes another function
    pad = build_inputs(lm, PROMPT, 3, extra_tokens=4)
    with ex.session():
        ref = ex.decode(pad.ids, pad.mask, 4, policy="no_cache", positions=pad.positions)
        cached = ex.decode(pad.ids, pad.mask, 4, policy="cache", positions=pad.positions)
        user = ex.decode(pad.ids, pad.mask, 4, policy="user_loop")
    assert float((cached.stacked_logits() - ref.stacked_logits()).abs().max()) < 1e-9
    assert float((user.stacked_logits() - ref.stacked_logits()).abs().max()) > 1e-3
    with pytest.raises(KvvizError, match="unknown step policy 'beam'"):
        ex.decode(inp.ids, inp.mask, 2, policy="beam")


def test_feed_in_one_chunk_or_one_by_one_grows_the_same_cache():
    lm = kvviz.load_model("tiny:llama", "float64", DEVICE)
    ids = torch.tensor([lm.tokenizer(PROMPT)["input_ids"]], device=lm.device)
    ex = Executor(lm)
    with ex.session():
        pre = ex.forward(ids[:, :4])
        import copy

        chunk = list(ex.feed(ids[:, 4:], copy.deepcopy(output_cache(pre))))
        steps = list(ex.feed(ids[:, 4:], output_cache(pre), one_by_one=True))
    n = ids.shape[1] - 4
    assert [(s, e) for s, e, _ in chunk] == [(0, n)] and [(s, e) for s, e, _ in steps] == [(j, j + 1) for j in range(n)]
    last_chunk, last_step = chunk[-1][2], steps[-1][2]
    assert output_cache(last_step).get_seq_length() == ids.shape[1] == output_cache(last_chunk).get_seq_length()
    assert float((last_chunk.logits[0, -1] - last_step.logits[0, -1]).abs().max()) < 1e-9


def test_no_decode_loop_outside_the_seam():
    """The decode loop exists once (Executor.decode / feed): no other library module calls a forward inside a loop
    (each of the nine hand-written loops this replaced - greedy's three, matrix's two, quant, reuse, loading trap,
    split's and bisect's feeds - was such a loop)."""
    import ast
    from pathlib import Path

    root = Path(kvviz.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if str(path.relative_to(root)) in SEAM:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.For, ast.While)):
                continue
            body = ast.Module(body=node.body, type_ignores=[])
            if any(model_call(n) for n in ast.walk(body)):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == [], f"model calls inside loops outside kvviz/core/execution.py: {offenders}"


# The seam itself (the executor and its one decode loop), and the serving engines: they drive engines that are not
# kvviz's model calls (transformers' continuous batching; vLLM and llama.cpp in their worker processes, which answer
# one request line after another), each with its own scheduler loop.
SEAM = {"core/execution.py", "core/loops.py", "engines/serving.py", "engines/vllm_worker.py", "engines/llamacpp_worker.py",
        "engines/worker_loop.py"}
MODEL_METHODS = {"forward", "generate"}  # a model's (or the executor's) call by name
CACHE_KEYWORDS = {"past_key_values", "cache_params", "use_cache"}  # a model call however it is spelled


def model_call(n) -> bool:
    """A call that runs a model: `.forward(`/`.generate(`, `model(…)`/`lm.model(…)`, or any call handing over a
    cache keyword."""
    if not isinstance(n, ast.Call):
        return False
    f = n.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    keywords = {k.arg for k in n.keywords}
    return (name in MODEL_METHODS or name == "model" or bool(keywords & CACHE_KEYWORDS)
            or ("cache" in keywords and bool(keywords & {"input_ids", "attention_mask", "inputs_embeds"})))


def test_the_loop_check_sees_every_spelling_of_a_model_call():  # so that the test above can fail
    import ast

    for code in ("model.forward(ids)", "lm.model(input_ids=ids)", "model(ids)", "f(ids, past_key_values=c)",
                 "f(input_ids=ids, cache=c)", "ex.generate(ids)"):
        assert model_call(ast.parse(code).body[0].value), code
    assert not model_call(ast.parse("torch.cat(xs)").body[0].value)


@pytest.mark.heavy
@QUANTO  # the quant view's page run uses a quanto cache
def test_every_view_runs_through_the_executor(monkeypatch):
    """Every view with a page (the pages bench's first run of each, on a tiny model) and the bisector: each makes
    its model calls through the executor, and no call reaches a model behind the seam's back."""
    import importlib.util
    from pathlib import Path

    from kvviz import views
    from kvviz.views.bisect.run import run_bisect

    spec = importlib.util.spec_from_file_location("pages_bench", Path(__file__).parents[1] / "bench" / "pages_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls, bypass, inside = _count_executor_calls(monkeypatch)

    current = [""]

    def seen(module, args, kwargs):
        if getattr(inside, "depth", 0) == 0:
            bypass.append(current[0])

    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: seen(m, a, {}) if hasattr(m, "generation_config") else None)  # every top-level model
    try:
        lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
        runs = dict(bench.page_calls(lm, "tiny:llama"))
        runs["bisect"] = lambda: run_bisect(lm, SplitConfig(PROMPT, split=5))
        # a page that starts an engine runs the model inside its process (tests/test_engine_layers.py)
        assert set(runs) >= {v.name for v in views.all_views() if v.page and not v.page.starts_engine} | {"bisect"}
        made = {}
        for name, run in runs.items():
            current[0] = name
            before = len(calls)
            run()
            made[name] = len(calls) - before
        # the views whose model calls bypass the executor: only the serving study, whose transformers engine
        # (continuous batching, kvviz/engines/serving.py) drives the model itself
        assert set(bypass) <= {"serving"}, sorted(set(bypass))
        assert all(n > 0 for n in made.values()), made  # each view called the model, through the executor
    finally:
        hook.remove()
