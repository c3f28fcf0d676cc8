"""rl_kernel_core.digest: equal bits give equal digests; any one-bit change, a swap of two
elements or a sign of zero is seen; row blocks of a stacked tensor are the blocks' digests."""

from __future__ import annotations

import pytest
import torch

from rl_kernel_core.digest import mismatches, named_digests, row_digests


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_any_bit_change_is_seen(dtype):
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(7, 33, generator=gen).to(dtype)
    base = row_digests(t)
    assert torch.equal(base, row_digests(t.clone()))
    flipped = t.clone()
    raw = flipped.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    raw[3, 5] ^= 1  # lowest mantissa bit
    assert (row_digests(flipped) != base).tolist() == [i == 3 for i in range(7)]
    swapped = t.clone()
    swapped[2, [4, 9]] = swapped[2, [9, 4]]
    assert row_digests(swapped)[2] != base[2] or torch.equal(t[2, 4], t[2, 9])
    signed = torch.zeros(2, 3, dtype=dtype)
    signed[1, 1] = -0.0
    assert row_digests(signed)[0] != row_digests(signed)[1]


def test_stacked_rows_are_the_blocks_digests():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 16, generator=gen) for n in (8, 4, 4))
    assert torch.equal(row_digests(torch.cat([q, k, v])), torch.cat([row_digests(q), row_digests(k), row_digests(v)]))
    assert row_digests(torch.arange(5.0)).shape == (5,)
    assert row_digests(torch.empty(0)).shape == (0,)  # an engine may empty a weight it repacked
    with pytest.raises(ValueError, match="0-d"):
        row_digests(torch.tensor(1.0))


def test_blocks_of_rows_give_the_whole_tensors_digests(monkeypatch):
    from rl_kernel_core import digest

    gen = torch.Generator().manual_seed(3)
    t = torch.randn(13, 5, 3, generator=gen)
    whole = row_digests(t)
    for chunk in (1, 15, 16, 40):  # one row (wider than the block), one row exactly, two rows and a bit, several
        monkeypatch.setattr(digest, "CHUNK_ELEMENTS", chunk)
        assert torch.equal(row_digests(t), whole)
        assert torch.equal(row_digests(t, torch.bfloat16), row_digests(t.bfloat16()))
        assert torch.equal(row_digests(t.transpose(1, 2), torch.float16), row_digests(t.transpose(1, 2).half()))


def test_mismatches_name_each_problem():
    a = named_digests([("w", torch.ones(3, 2)), ("b", torch.ones(3)), ("gone", torch.ones(1))])
    changed = torch.ones(3, 2)
    changed[2, 0] = 2.0
    b = named_digests([("w", changed), ("b", torch.ones(4)), ("new", torch.ones(1))])
    assert mismatches(a, a) == []
    assert mismatches(a, b) == ["b: 3 rows in the reference, 4 checked", "gone: missing on the checked side",
                                "new: not in the reference", "w: bits differ (first at row 2)"]
