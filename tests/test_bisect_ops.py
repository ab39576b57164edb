"""The bisector down to ops: the first torch op whose output differs between the full forward and the
cached run, with its module path (layer naming rule), shapes and dtypes - in normal and in invariant mode."""
import torch

import kvviz
from kvviz.core import invariant
from kvviz.views.bisect.run import layer_name, run_bisect
from kvviz.core.execution import ExecSettings
from kvviz.views.split.run import SplitConfig

from conftest import DEVICE, PROMPT, RowCountRounding

CFG = SplitConfig(PROMPT * 2, split=20)


def test_layer_naming_rule():
    assert layer_name("model.layers.0.self_attn") == "layer 1 (model.layers.0.self_attn)"
    assert layer_name("transformer.h.3.attn") == "layer 4 (transformer.h.3.attn)"
    assert layer_name("model.embed_tokens").startswith("embeddings")


def test_normal_mode_names_the_attention_op():
    lm = kvviz.load_model("tiny:llama", "float32", DEVICE)
    res = run_bisect(lm, CFG)
    op = res.first_op
    assert op is not None and op.max_abs > 0
    assert op.module.startswith("model.layers.") and op.layer.startswith("layer ")
    assert op.layer == layer_name(op.module)
    assert op.out_dtype == "float32" and op.shapes and all(len(s) >= 2 for s in op.shapes[:1])
    n = len(lm.tokenizer(CFG.prompt)["input_ids"])
    assert n - CFG.split in op.out_shape  # the compared positions
    assert op.text in res.explanation


def test_invariant_mode_nothing_differs_and_a_broken_op_is_named(monkeypatch):
    lm = kvviz.load_model("tiny:gemma3", "bfloat16", DEVICE)
    res = run_bisect(lm, CFG, ExecSettings(invariant=True))
    assert res.first is None and res.first_op is None
    # break one op of invariant mode so that it depends on the cache (its scale moves by 2^-6 where it reads a
    # past): the trace names that op, inside the attention, with bfloat16 inputs
    def broken(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if key.shape[-2] != query.shape[-2]:
            scale = (scale or query.shape[-1] ** -0.5) * (1 + 2.0 ** -6)
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                                                dropout_p=dropout_p, is_causal=is_causal,
                                                                scale=scale, **kw)

    monkeypatch.setattr(invariant, "fast_sdpa", broken)
    res = run_bisect(lm, CFG, ExecSettings(invariant=True))
    assert res.first_op is not None
    assert res.first_op.op == "scaled_dot_product_attention" and "self_attn" in res.first_op.module
    assert "bfloat16" in res.first_op.dtypes


def test_invariant_mode_says_plainly_that_every_op_agrees_and_reports_progress(capsys):
    """An invariant-mode bisect of a real Gemma 3 past its window ended with no output at all - it ran for
    over an hour printing nothing, and where nothing differed it spoke of modules only. Past tiny:gemma3's window
    (8), every stage is reported as it starts and the result says plainly that every op agrees bit for bit, with
    the number of ops compared; the CLI prints the stages on stderr."""
    lm = kvviz.load_model("tiny:gemma3", "bfloat16", DEVICE)
    n = len(lm.tokenizer(CFG.prompt)["input_ids"])
    assert CFG.split > 2 * lm.config.sliding_window and n - CFG.split > lm.config.sliding_window
    seen = []
    res = run_bisect(lm, CFG, ExecSettings(invariant=True), progress=lambda f, m: seen.append((f, m)))
    assert res.first is None and res.first_op is None
    assert res.ops_compared > 100  # every linear, norm, matmul, softmax... of 6 layers on the compared positions
    assert res.explanation.startswith("In invariant mode nothing differs: every torch op agrees bit for bit")
    assert f"({res.ops_compared} ops compared" in res.explanation
    assert [f for f, _ in seen] == sorted(f for f, _ in seen) and seen[-1] == (1.0, "Done")
    assert any("Op trace: cached run" in m for _, m in seen) and "invariant mode" in seen[0][1]
    # normal mode on the same scenario (with a rounding gap built: a linear layer whose summation split depends on
    # its row count, so on any CPU or GPU) names its first op, and counts the ops that agreed before it
    with RowCountRounding():
        res = run_bisect(lm, CFG)
    assert res.first_op is not None and res.ops_compared == res.first_op.ops_compared >= 1
    assert res.explanation.endswith(res.first_op.text)
    # the command line: progress on stderr, the plain sentence on stdout
    from kvviz.cli import main

    rc = main(["bisect", "--model", "tiny:gemma3", "--dtype", "bfloat16", "--device", DEVICE, "--invariant",
               "--prompt", CFG.prompt, "--split", str(CFG.split)])
    out, err = capsys.readouterr()
    assert rc in (0, None)
    assert "every torch op agrees bit for bit" in out and "Op trace: full forward" in err and "Done" in err


def test_fixed_order_matmul_is_a_running_sum_in_index_order():
    """Every element of fixed_order_matmul is ((0 + a0*b0) + a1*b1) + ... in float64 (products in float32 for
    16-bit inputs), rounded once - checked element by element against a plain Python loop."""
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        a = torch.randn(2, 3, 7, generator=g, dtype=torch.float64).to(dtype)
        b = torch.randn(2, 7, 4, generator=g, dtype=torch.float64).to(dtype)
        got = invariant.fixed_order_matmul(a, b)
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        for bi in range(2):
            for i in range(3):
                for j in range(4):
                    acc = torch.zeros((), dtype=torch.float64)
                    for k in range(7):
                        acc = acc + (a[bi, i, k].to(wide) * b[bi, k, j].to(wide)).to(torch.float64)
                    assert got[bi, i, j].item() == acc.to(wide).to(dtype).item()
