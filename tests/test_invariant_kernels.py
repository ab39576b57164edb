"""The fixed-shape invariant kernels (kvviz/core/invariant.py): a row's bits depend on the row alone - not on how many rows
come with it, where it sits, where its keys start in the tensor - at library-GEMM speed, and the shape probes refuse
a kernel whose result depends on position (the per-row forms are then used)."""
import pytest
import torch
import torch.nn.functional as F

from kvviz.core import invariant

DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_linear_row_has_the_same_bits_alone_among_many_and_anywhere(dtype):
    w, b = _rand(96, 80, dtype=dtype, seed=1), _rand(96, dtype=dtype, seed=2)
    x = _rand(300, 80, dtype=dtype, seed=3)  # more than a big block: big blocks, then the rest in small ones
    full = invariant.block_linear(x, w, b)
    assert full.shape == (300, 96) and torch.allclose(full.float(), F.linear(x, w, b).float(), rtol=0.05, atol=0.05)
    for r in (0, 1, 31, 255, 256, 299):
        assert torch.equal(invariant.block_linear(x[r:r + 1], w, b), full[r:r + 1])  # a decode step's one row
    assert torch.equal(invariant.block_linear(x[7:140], w, b), full[7:140])  # another offset, another count
    assert torch.equal(invariant.block_linear(x.view(3, 100, 80), w, b), full.view(3, 100, 96))  # batch dims


def test_gpt2_style_addmm_is_blocked_too():
    bias, w = _rand(64, dtype=torch.float32, seed=4), _rand(48, 64, dtype=torch.float32, seed=5)
    a = _rand(70, 48, dtype=torch.float32, seed=6)
    full = invariant.block_addmm(bias, a, w)
    assert torch.allclose(full, torch.addmm(bias, a, w), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(invariant.block_addmm(bias, a[r:r + 1], w), full[r:r + 1]) for r in (0, 33, 69))


def test_addmm_with_a_bias_row_per_row_keeps_each_rows_own_bias():
    """torch.addmm's input may be a full [R, N] matrix (one bias row per row): each row is computed with its own
    row, one kernel call each, alone or among the others (it raised a shape error before)."""
    w, a = _rand(48, 64, dtype=torch.float32, seed=5), _rand(70, 48, dtype=torch.float32, seed=6)
    bias = _rand(70, 64, dtype=torch.float32, seed=7)
    full = invariant.block_addmm(bias, a, w, beta=0.5, alpha=2.0)
    assert full.shape == (70, 64)
    assert torch.allclose(full, torch.addmm(bias, a, w, beta=0.5, alpha=2.0), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(invariant.block_addmm(bias[r:r + 1], a[r:r + 1], w, beta=0.5, alpha=2.0), full[r:r + 1])
               for r in (0, 33, 69))
    with pytest.raises(RuntimeError):  # a bias of another row count: torch's own error, as torch.addmm gives it
        invariant.block_addmm(bias[:5], a[:1], w)


def test_a_position_dependent_kernel_is_refused_and_the_per_row_form_used(monkeypatch):
    """The probe must catch a kernel whose row result depends on where the row sits (AVX2 MKL's sgemm does for
    some row counts): such a family is never used."""
    w = _rand(32, 16, dtype=torch.float32, seed=7)

    def skewed(x, weight, bias):  # row i gets i * 2^-20 added: position-dependent by construction
        return F.linear(x, weight, bias) + torch.arange(x.shape[0], dtype=x.dtype)[:, None] * 2.0 ** -20

    assert invariant.linear_block(torch.float32, w, None, skewed, 16, ("skewed-test",)) == ()
    assert invariant.linear_block(torch.float32, w, None, lambda x, w_, b_: F.linear(x, w_, b_), 16,
                                  ("plain-test",)) != ()
    calls = []
    monkeypatch.setattr(invariant, "linear_block", lambda *a, **k: ())
    monkeypatch.setattr(invariant, "rowwise_linear", lambda *a: calls.append(a) or F.linear(*a))
    invariant.block_linear(_rand(5, 16, dtype=torch.float32, seed=8), w)
    assert len(calls) == 1


@pytest.fixture(params=["native", "slotted", "fixed-shape"])
def attention_path(request, monkeypatch):
    """fast_sdpa's paths: the native fused kernel over fixed key blocks (where its probe passes), the same with every
    call of NATIVE_SLOT_ROWS rows and each row at its slot (where a row's bits depend on its place in the kernel's
    block of rows: AVX2; forced here where its own probe passes) and the fixed-shape GEMMs that mirror eager
    attention (the matrix's, and the fallback)."""
    if request.param == "native":
        if not invariant.native_attention_ok(torch.device("cpu"), torch.float32, 32, 32):
            pytest.skip("the native kernel's probe does not pass on this CPU: fast_sdpa falls back")
        yield request.param
    elif request.param == "slotted":
        for dtype in DTYPES:
            for d in (16, 32):
                if invariant.native_attention_mode(torch.device("cpu"), dtype, d, d, modes=(2,)) != 2:
                    pytest.skip("the slotted native kernel's probe does not pass on this CPU")
        monkeypatch.setattr(invariant, "native_attention_mode", lambda *a, **k: 2)
        yield request.param
    else:
        with invariant._eager_sdpa():
            yield request.param


def _attn(q, k, v, **kw):
    return invariant.fast_sdpa(q, k, v, **kw)


def test_the_native_path_runs_where_its_probe_passes_and_the_fixed_shape_one_where_not(monkeypatch):
    q, k, v = (_rand(1, 2, 40, 16, dtype=torch.float32, seed=s) for s in (40, 41, 42))
    ok = invariant.native_attention_ok(torch.device("cpu"), torch.float32, 16, 16)  # probed before counting calls
    calls = []
    real = invariant._run_plan
    monkeypatch.setattr(invariant, "_run_plan", lambda *a: calls.append(1) or real(*a))
    out = _attn(q, k, v, is_causal=True)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
    assert calls == ([1] if ok else [])
    monkeypatch.setattr(invariant, "native_attention_mode", lambda *a, **k: 0)
    calls.clear()
    assert torch.allclose(_attn(q, k, v, is_causal=True), out, atol=1e-6) and calls == []
    # a float mask that is a bias, not only a hiding mask: the native path would lose it, so it never takes it
    monkeypatch.undo()
    monkeypatch.setattr(invariant, "_run_plan", lambda *a: calls.append(1) or real(*a))
    bias = torch.linspace(-1, 1, 40)[None, None, None].expand(1, 1, 40, 40)
    assert torch.allclose(_attn(q, k, v, attn_mask=bias), F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
                          atol=1e-5) and calls == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_a_query_has_the_same_bits_in_the_full_forward_and_alone_with_its_cache(dtype, attention_path):
    lq, h, hk, d = 150, 4, 2, 32  # more queries than a chunk, grouped heads
    q, k, v = (_rand(1, n, lq, d, dtype=dtype, seed=s) for n, s in ((h, 10), (hk, 11), (hk, 12)))
    full = _attn(q, k, v, is_causal=True, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1),
                                         v.float().repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(full.float(), ref, atol=0.03 if dtype == torch.bfloat16 else 1e-5)
    for t in (0, 1, 63, 64, 149):  # a decode step: one query, the keys so far
        step = _attn(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], enable_gqa=True)
        assert torch.equal(step, full[:, :, t:t + 1]), t
    chunk = _attn(q[:, :, 70:], k, v, is_causal=True, enable_gqa=True)  # the rest through the cache, in one go
    assert torch.equal(chunk, full[:, :, 70:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_a_sliding_window_cache_and_left_padding_group_the_same_terms(dtype, attention_path):
    """A window's cache holds the last keys only, so a cached query's keys start elsewhere in the tensor; left
    padding puts masked keys in front. The weighted sum's blocks start at the query's first visible key, so the
    bits are the full forward's."""
    lq, h, d, win = 700, 2, 16, 600  # past a block of keys, past the window
    q, k, v = (_rand(1, h, lq, d, dtype=dtype, seed=s) for s in (20, 21, 22))
    i = torch.arange(lq)
    window = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - win)
    full = _attn(q, k, v, attn_mask=window[None, None])
    for t in (599, 600, 650, 699):
        lo = t - win + 1
        cached = _attn(q[:, :, t:t + 1], k[:, :, lo:t + 1], v[:, :, lo:t + 1])  # the window's cache, no mask
        assert torch.equal(cached, full[:, :, t:t + 1]), t
    pad = 37  # the same prompt left-padded: masked keys in front
    kp, vp = (torch.cat([torch.zeros(1, h, pad, d, dtype=dtype), x[:, :, :200]], 2) for x in (k, v))
    qp = torch.cat([torch.zeros(1, h, pad, d, dtype=dtype), q[:, :, :200]], 2)
    j = torch.arange(pad + 200)
    mask = (j[None, :] <= j[:, None]) & (j[None, :] >= pad)
    padded = _attn(qp, kp, vp, attn_mask=mask[None, None])
    alone = _attn(q[:, :, :200], k[:, :, :200], v[:, :, :200], is_causal=True)
    assert torch.equal(padded[:, :, pad:], alone)


def test_sdpa_equals_the_eager_steps_in_invariant_mode():
    """Eager attention in invariant mode (tiled matmuls, the fixed-order softmax) and fast_sdpa are the same
    computation, so eager and SDPA models agree bit for bit in invariant mode (the matrix view relies on it: it runs
    under ExecSettings(sdpa_as_eager=True); elsewhere SDPA takes the native kernel, tested below)."""
    q, k, v = (_rand(1, 3, 90, 24, dtype=torch.bfloat16, seed=s) for s in (30, 31, 32))
    scale = 24 ** -0.5  # not a power of two: the scores are rounded to the dtype before scaling, as eager does
    mask = torch.full((90, 90), torch.finfo(torch.bfloat16).min).triu(1).to(torch.bfloat16)
    with invariant.invariant_mode(), invariant._eager_sdpa():
        w = torch.matmul(q, k.transpose(2, 3)) * scale + mask
        p = F.softmax(w, dim=-1, dtype=torch.float32).to(torch.bfloat16)
        eager = torch.matmul(p, v)
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    assert torch.equal(eager, sdpa)


def test_a_forwards_mask_is_analysed_once_for_all_its_layers_and_never_reused_stale(monkeypatch):
    """The native path's plan (each row's first key, key blocks, row groups, the additive masks) depends on the mask
    only: made once a forward and reused by every layer while the mask is the same tensor, never for another mask
    or the same one changed in place (its version; an inference tensor has none: a new forward, which starts with
    its embedding, drops the plan)."""
    if not invariant.native_attention_ok(torch.device("cpu"), torch.float32, 16, 16):
        pytest.skip("the native kernel's probe does not pass on this CPU: fast_sdpa falls back")
    made = []
    real = invariant._native_plan
    monkeypatch.setattr(invariant, "_native_plan", lambda *a: made.append(1) or real(*a))
    q, k, v = (_rand(1, 2, 40, 16, dtype=torch.float32, seed=s) for s in (50, 51, 52))

    def sdpa(mask):  # as a model calls it: the mode hands it to fast_sdpa
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def fresh(mask):  # what the mask gives with a plan of its own
        invariant._PLANS.entry = None
        return sdpa(mask)

    causal = torch.ones(40, 40, dtype=torch.bool).tril()[None, None]
    with invariant.invariant_mode():
        first = sdpa(causal)
        for _ in range(5):  # the layers of one forward: one plan
            assert torch.equal(sdpa(causal[:, :, :, :40]), first)
        assert len(made) == 1
        causal[..., 3, :] = False  # changed in place: a new plan, the new answer
        assert torch.equal(sdpa(causal), fresh(causal)) and len(made) == 3
        other = torch.ones(40, 40, dtype=torch.bool).tril(-1)[None, None] | torch.eye(40, dtype=torch.bool)
        other[..., 10:, :5] = False  # another mask of the same shape
        assert torch.equal(sdpa(other), fresh(other))
        with torch.inference_mode():
            m = torch.ones(1, 1, 40, 40, dtype=torch.bool).tril()
            before = sdpa(m)
            m[..., 20:, :8] = False  # an inference tensor tracks no version: the next forward's embedding drops it
            F.embedding(torch.tensor([[1]]), torch.zeros(4, 2))
            after = sdpa(m)
            assert torch.equal(after, fresh(m)) and not torch.equal(after, before)
    assert invariant._PLANS.entry is None  # not kept past the run


def test_a_tiny_model_makes_one_plan_a_forward():
    import kvviz
    from kvviz.core.execution import Executor, ExecSettings

    if not invariant.native_attention_ok(torch.device("cpu"), torch.float32, 16, 16):
        pytest.skip("the native kernel's probe does not pass on this CPU: fast_sdpa falls back")
    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    ids = torch.arange(3, 43)[None]
    made = []
    real = invariant._native_plan
    with Executor(lm, ExecSettings(invariant=True)).session() as ex:  # the probe for its head size runs first
        ex.forward(ids, torch.ones_like(ids), use_cache=False, hidden=False)
    invariant._native_plan = lambda *a: made.append(a[1:]) or real(*a)
    try:
        with Executor(lm, ExecSettings(invariant=True)).session() as ex:
            ex.forward(ids, torch.ones_like(ids), use_cache=False, hidden=False)
    finally:
        invariant._native_plan = real
    layers = lm.model.config.num_hidden_layers
    assert layers > 1 and len(made) == 1, made


def test_sdpa_as_eager_is_a_setting_of_the_run_not_a_thread_state():
    """ExecSettings(sdpa_as_eager=True) makes invariant mode's SDPA mirror eager attention for that run only (the
    matrix's runs); it travels in the settings' JSON, and an older export without it reads as False."""
    import kvviz
    from kvviz.core.execution import ExecSettings, Executor

    lm = kvviz.load_model("tiny:llama", "float32", "cpu")
    ids = torch.arange(3, 43)[None]
    seen = []
    real = invariant._native_sdpa
    invariant._native_sdpa = lambda *a: seen.append(getattr(invariant._EAGER_EQUAL, "depth", 0)) or real(*a)
    try:
        for s in (ExecSettings(invariant=True, sdpa_as_eager=True), ExecSettings(invariant=True)):
            with Executor(lm, s).session() as ex:
                ex.forward(ids, torch.ones_like(ids), use_cache=False, hidden=False)
    finally:
        invariant._native_sdpa = real
    layers = lm.model.config.num_hidden_layers
    assert seen == [1] * layers + [0] * layers and getattr(invariant._EAGER_EQUAL, "depth", 0) == 0
    s = ExecSettings(invariant=True, sdpa_as_eager=True)
    assert ExecSettings.from_dict(s.to_dict()) == s and "SDPA as eager" in s.label()
    assert ExecSettings.from_dict({"cache": "dynamic", "invariant": True}) == ExecSettings(invariant=True)
