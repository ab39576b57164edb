"""Invariant mode's prepacked 16-bit linear (issue 38: a decode step's padded block at about one row's cost)."""
import pytest
import torch

from kvviz import invariant


def test_a_prepacked_weight_gives_a_row_the_bits_of_the_full_forward_and_is_dropped_at_the_runs_end(monkeypatch):
    monkeypatch.setattr(invariant, "PACK_AFTER", 2)  # packed from the second call: the first goes through torch.mm
    g = torch.Generator().manual_seed(5)
    w = torch.randn(384, 320, generator=g).to(torch.bfloat16)
    x = torch.randn(300, 320, generator=g).to(torch.bfloat16)
    with invariant.invariant_mode():
        full = torch.nn.functional.linear(x, w)
        rows = [torch.nn.functional.linear(x[i:i + 1], w) for i in (0, 137, 299)]
        chunk = torch.nn.functional.linear(x[250:], w)
        held = dict(invariant._PACKED.entries or {})
    assert all(torch.equal(r, full[i:i + 1]) for r, i in zip(rows, (0, 137, 299)))
    assert torch.equal(chunk, full[250:])
    assert not invariant._PACKED.entries and invariant._PACKED.bytes == 0
    sizes = invariant.linear_block(torch.bfloat16, w, None, lambda b, w_, c_: torch.mm(b, w_.t()), 320)
    if not held:
        pytest.skip("no prepacked oneDNN linear that gives torch.mm's bits on this CPU: torch.mm blocks run")
    assert len(held) == 1 and sizes and not isinstance(next(iter(held.values())), int)
    # the packed call is torch.mm's computation: the same bits, block for block
    blk = x[:max(sizes)].contiguous()
    assert torch.equal(next(iter(held.values()))[-1](blk), torch.mm(blk, w.t()))


def test_packing_stops_at_its_memory_cap_and_the_rows_keep_their_bits(monkeypatch):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(256, 192, generator=g).to(torch.bfloat16)
    x = torch.randn(70, 192, generator=g).to(torch.bfloat16)
    monkeypatch.setattr(invariant, "PACK_AFTER", 1)
    with invariant.invariant_mode():
        packed = torch.nn.functional.linear(x, w)
    monkeypatch.setattr(invariant, "PACKED_BYTES", 0)
    with invariant.invariant_mode():
        plain = torch.nn.functional.linear(x, w)
        assert all(isinstance(v, int) for v in invariant._PACKED.entries.values())
    assert torch.equal(packed, plain)
