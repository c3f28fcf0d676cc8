"""rl_kernel_core.digest: equal bits give equal digests; any one-bit change, a swap of two
elements or a sign of zero is seen; row blocks of a stacked tensor are the blocks' digests."""

from __future__ import annotations

import random

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
    assert mismatches(a, b) == [
        "b: 3 rows in the reference, 4 checked",
        "gone: missing on the checked side",
        "new: not in the reference",
        "w: bits differ (first at row 2)",
    ]


def _flip_one_bit(t: torch.Tensor, rng: random.Random) -> tuple[torch.Tensor, int]:
    """A copy of ``t`` with one random bit of one random element flipped; the element's row."""
    flipped = t.clone()
    raw = flipped.view(torch.uint8).reshape(t.shape[0], -1)  # the rows' bytes
    row, byte = rng.randrange(raw.shape[0]), rng.randrange(raw.shape[1])
    raw[row, byte] ^= 1 << rng.randrange(8)
    return flipped, row


@pytest.mark.parametrize(
    "dtype", [torch.complex128, torch.complex64, torch.complex32, torch.int8, torch.uint64, torch.float8_e4m3fn]
)
def test_every_dtype_is_digested_by_its_bits(seed, dtype):
    """complex128 (16-byte elements) was a KeyError; its real and imaginary words each count."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (5, 7 * dtype.itemsize), dtype=torch.uint8, generator=gen).view(dtype)
    base = row_digests(t)
    assert base.shape == (5,) and torch.equal(base, row_digests(t.clone()))
    rng = random.Random(seed)
    for _ in range(20):
        flipped, row = _flip_one_bit(t, rng)
        assert (row_digests(flipped) != base).tolist() == [i == row for i in range(5)], f"seed={seed}"
    if dtype == torch.complex128:  # the imaginary word and the real word of an element are not interchangeable
        swapped = t.clone()
        swapped[0, 0] = torch.complex(t[0, 0].imag, t[0, 0].real)
        assert row_digests(swapped)[0] != base[0] or t[0, 0].real == t[0, 0].imag


def test_digest_property_over_dtypes_and_shapes(seed, monkeypatch):
    """Property: for random dtypes (complex128 included), shapes and block sizes, equal bits give
    equal digests, blocks of rows give the whole tensor's digests, and any one-bit flip changes
    exactly its row's digest."""
    from rl_kernel_core import digest

    rng = random.Random(seed)
    dtypes = [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.complex128,
        torch.complex64,
        torch.int32,
        torch.uint8,
    ]
    for _ in range(30):
        dtype = rng.choice(dtypes)
        shape = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
        t = torch.randint(
            0,
            256,
            (*shape[:-1], shape[-1] * dtype.itemsize),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(rng.randrange(2**31)),
        ).view(dtype)
        monkeypatch.setattr(digest, "CHUNK_ELEMENTS", rng.choice([1, 3, 16, 1 << 22]))
        whole = row_digests(t)
        monkeypatch.setattr(digest, "CHUNK_ELEMENTS", 1 << 22)
        assert torch.equal(whole, row_digests(t)), (dtype, shape, f"seed={seed}")
        flipped, row = _flip_one_bit(t, rng)
        assert (row_digests(flipped) != whole).tolist() == [i == row for i in range(shape[0])], (
            dtype,
            shape,
            f"seed={seed}",
        )


@pytest.mark.parametrize(
    "bad, error, message",
    [
        ([[1.0, 2.0]], TypeError, "row_digests: t must be a torch.Tensor, got list"),
        (3.0, TypeError, "row_digests: t must be a torch.Tensor, got float"),
        (torch.eye(3).to_sparse(), TypeError, "row_digests: t must be a dense (strided) tensor, got layout sparse_coo"),
        (
            torch.eye(3).to_sparse_csr(),
            TypeError,
            "row_digests: t must be a dense (strided) tensor, got layout sparse_csr",
        ),
        (
            torch.quantize_per_tensor(torch.eye(3), 0.1, 0, torch.qint8),
            TypeError,
            "row_digests: t must not be quantized",
        ),
        (
            torch.empty(3, 2, device="meta"),
            ValueError,
            "row_digests: t must hold data (its bits are digested), got a meta tensor of shape (3, 2)",
        ),
    ],
)
def test_what_cannot_be_digested_is_named(bad, error, message):
    with pytest.raises(error) as info:
        row_digests(bad)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)
    with pytest.raises(error) as info:
        named_digests([("fine", torch.ones(2)), ("model.layers.0.weight", bad)])
    assert str(info.value).startswith(f"model.layers.0.weight: {message}"), str(info.value)
    with pytest.raises(TypeError, match="as_dtype must be a torch.dtype or None, got str"):
        row_digests(torch.ones(2), "bfloat16")  # type: ignore[arg-type]


def test_a_crafted_collision_exists_so_it_is_a_checksum_not_an_integrity_check():
    """The module says the digest guards against drift, not against crafted weights: the digest is
    linear in the bits, so moving ``3 * k`` from element 0's bits to ``k`` on element 1's (weights
    1 and 3) keeps a row's digest while changing its bits."""
    t = torch.tensor([[10, 20, 30]], dtype=torch.int64)
    forged = torch.tensor([[10 + 3 * 5, 20 - 5, 30]], dtype=torch.int64)
    assert not torch.equal(t, forged) and torch.equal(row_digests(t), row_digests(forged))
