"""Property tests: random prompts, splits, paddings, modes and dtypes never crash; float64 stays exact."""
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvviz
from kvviz.core.errors import KvvizError
from kvviz.views.split.run import SplitConfig, run_split
from conftest import DEVICE

CAUSAL = [a for a in kvviz.TINY_ARCHS if a != "roberta"]
text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=40)
common = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def expected_split_error(lm, prompt, split, pad):
    """The message fragment a bad split input must give, or None for a valid input."""
    if pad < 0:  # settings are checked before the prompt
        return "left padding"
    if not prompt.strip():
        return "empty"
    n = len(lm.tokenizer(prompt)["input_ids"])
    if n < 2:
        return "single token"
    if not 1 <= split <= n - 1:
        return "outside the prompt"
    return None


@common
@given(arch=st.sampled_from(kvviz.TINY_ARCHS), dtype=st.sampled_from(kvviz.DTYPE_NAMES), prompt=text,
       split=st.integers(-3, 60), pad=st.integers(-2, 12), mode=st.sampled_from(["chunk", "step"]),
       pos=st.sampled_from(["auto", "omit"]), mask=st.sampled_from(["full", "new-only"]))
def test_split_never_crashes(arch, dtype, prompt, split, pad, mode, pos, mask):
    lm = kvviz.load_model(f"tiny:{arch}", dtype, DEVICE)
    expected = expected_split_error(lm, prompt, split, pad)
    try:
        res = run_split(lm, SplitConfig(prompt, split, mode, pad, pos, mask))
    except KvvizError as e:
        # the only errors are the bad-input messages this input deserves, in one line
        assert expected is not None, f"unexpected error: {e}"
        assert expected in str(e) and "\n" not in str(e)
        return
    assert expected is None, f"expected an error about {expected!r}"
    # the verdict is the one its evidence gives (kvviz.core.verdict's rule), never just any word
    if not res.main.has_cache:
        assert res.verdict == "logic"
        return
    assert res.main.hidden["max_abs"].shape[1] == len(res.tokens) - split
    assert (res.main.hidden["max_abs"] >= 0).all()
    if res.main.identical:
        assert res.verdict == "identical" and res.main.max_abs == 0
        return
    gap64 = res.float64.max_relative
    assert res.verdict == ("precision" if gap64 <= 1e-9 else "logic"), (res.verdict, gap64)


@common
@given(arch=st.sampled_from(CAUSAL), prompt=st.text(min_size=2, max_size=40), data=st.data(),
       pad=st.integers(0, 8), mode=st.sampled_from(["chunk", "step"]))
def test_float64_divergence_stays_below_1e10(arch, prompt, data, pad, mode):
    lm = kvviz.load_model(f"tiny:{arch}", "float64", DEVICE)
    n = len(lm.tokenizer(prompt)["input_ids"])
    assume(n >= 2)  # hypothesis counts a prompt of one token as rejected, never as a pass
    split = data.draw(st.integers(1, n - 1))
    res = run_split(lm, SplitConfig(prompt, split, mode, pad))  # correct positions and mask
    assert res.main.hidden["max_abs"].max() <= 1e-10
    assert res.main.logits["max_abs"].max() <= 1e-10
    assert res.verdict in ("identical", "precision")


@settings(max_examples=25, deadline=None)
@given(arch=st.sampled_from(CAUSAL), dtype=st.sampled_from(["float32", "bfloat16"]), prompt=text,
       n=st.integers(-1, 12), pad=st.integers(0, 4), fast=st.booleans())
def test_greedy_never_crashes(arch, dtype, prompt, n, pad, fast):
    from kvviz.views.greedy.run import GreedyConfig, run_greedy

    lm = kvviz.load_model(f"tiny:{arch}", dtype, DEVICE)
    expected = "new tokens must be between" if n < 1 else "empty" if not prompt.strip() else None
    try:
        res = run_greedy(lm, GreedyConfig(prompt, n, pad, paths=("no_cache", "cache", "user_loop"), fast=fast))
    except KvvizError as e:
        assert expected is not None, f"unexpected error: {e}"
        assert expected in str(e) and "\n" not in str(e)
        return
    assert expected is None, f"expected an error about {expected!r}"
    assert all(len(p.token_ids) == n for p in res.paths.values())
