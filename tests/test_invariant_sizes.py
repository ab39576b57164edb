"""Invariant mode on long prompts: a sliding-window model past its window, the prefix fed through the
cache in one chunk, must be order-identical at every size. The bug: fixed_order_matmul switched to one kernel call
per row above a size limit, so a long full forward and its shorter cached chunk took different paths, and a kernel
call reduces over the keys in an order that depends on how many keys there are. A real Gemma 3 (721 tokens, window
512, head_dim 256) crossed the limit. fixed_order_matmul now has one algorithm and no size limit at all."""
import pytest
import torch

import kvviz
from kvviz.core import invariant
from kvviz.core.execution import ExecSettings
from kvviz.views.split.run import SplitConfig, run_split

from conftest import DEVICE, PROMPT

INV = ExecSettings(invariant=True)


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_an_element_does_not_depend_on_sizes_or_zero_keys(dtype):
    """Row i of p @ v over 40 keys equals row i of a 3-row product over the same keys with 11 masked (p = 0) keys
    before and 5 after them, and row i of a 1-row product."""
    p = _rand(2, 9, 40, dtype=dtype, seed=1).abs()
    v = _rand(2, 40, 6, dtype=dtype, seed=2)
    ref = invariant.fixed_order_matmul(p, v)
    padded_p = torch.cat([torch.zeros(2, 3, 11, dtype=dtype), p[:, 4:7], torch.zeros(2, 3, 5, dtype=dtype)], -1)
    padded_v = torch.cat([_rand(2, 11, 6, dtype=dtype, seed=3), v, _rand(2, 5, 6, dtype=dtype, seed=4)], -2)
    got = invariant.fixed_order_matmul(padded_p, padded_v)
    assert torch.equal(got, ref[:, 4:7])
    assert torch.equal(invariant.fixed_order_matmul(p[:, 2:3], v), ref[:, 2:3])
    exact = (p.double() @ v.double())
    assert torch.allclose(ref.double(), exact, rtol=0.02 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)


def _past_window(lm):
    window = lm.config.sliding_window
    prompt = PROMPT
    while len(lm.tokenizer(prompt)["input_ids"]) < 4 * window + 6:
        prompt += " " + PROMPT
    n = len(lm.tokenizer(prompt)["input_ids"])
    return prompt, n, window


@pytest.mark.parametrize("arch, dtype", [("gemma3", "float32"), ("gemma3", "bfloat16"), ("gemma3", "float64"),
                                         ("mistral", "float32"), ("gemma2", "bfloat16")])
def test_prefix_longer_than_the_window_in_one_chunk(arch, dtype):
    """600 + 121 tokens against a 512 window, scaled down: a prefix of > 2 windows in one chunk, then the rest in
    one chunk. Invariant mode: exactly 0."""
    lm = kvviz.load_model(f"tiny:{arch}", dtype, DEVICE)
    prompt, n, window = _past_window(lm)
    split = n - window - 3  # the prefix is past the window; the rest is longer than it too
    assert split > 2 * window and n - split > window
    res = run_split(lm, SplitConfig(prompt, split=split, mode="chunk"), settings=INV)
    assert res.main.identical, res.main.max_abs
    assert res.verdict == "identical" and all(r["keys_differ"] == 0 for r in res.main.kv)
