"""Correctness of hookstats.stats / stats_into against hookstats.reference (float64) and against values
known in closed form. Tolerances: see tests/_testing.py."""
from __future__ import annotations

import math
import os
import re
import zlib

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import hookstats
from hookstats import reference

from _testing import (
    DEVICES,
    DTYPES,
    assert_bitwise_equal,
    assert_stats_close,
    check_stats_against_reference,
    cuda_ready,
    result_dtype,
    tol_for,
)

F = hookstats.STATS_FIELDS
NAN = float("nan")
INF = float("inf")


def approx(expected, rel, abs=0.0):
    """pytest.approx without its default absolute tolerance of 1e-12 (which would hide errors in tiny values)."""
    return pytest.approx(expected, rel=rel, abs=abs)


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def as_float(t: torch.Tensor) -> float:
    return float(t.detach().to(torch.float64).cpu())


def numel_of(shape) -> int:
    return math.prod(shape)


# ---------------------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------------------

def special_positions(n: int) -> list:
    """First, last, the middle of the first 4096-element chunk, a chunk boundary, the tail, the middle."""
    return sorted({p for p in (0, n - 1, 2048, 4096, n - 3, n // 2) if 0 <= p < n})


def make_values(kind: str, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """n values of `kind`, built in float64 on the CPU and cast to dtype."""
    fi = torch.finfo(dtype)
    randn = lambda: torch.randn(n, generator=gen, dtype=torch.float64)  # noqa: E731
    pos = special_positions(n)
    if n == 0:
        return torch.empty(0, dtype=dtype)
    if kind == "randn":
        x = randn()
    elif kind == "offset":  # |mean| >> std: var must not cancel
        x = randn() * 1e3 + 1e4
    elif kind == "zeros":  # +0 and -0
        x = torch.zeros(n, dtype=torch.float64)
        x[::2] = -0.0
    elif kind == "constant":
        x = torch.full((n,), 3.25, dtype=torch.float64)
    elif kind == "all_nan":
        x = torch.full((n,), NAN, dtype=torch.float64)
    elif kind == "all_inf":
        x = torch.full((n,), INF, dtype=torch.float64)
    elif kind == "all_ninf":
        x = torch.full((n,), -INF, dtype=torch.float64)
    elif kind == "nan_and_inf":  # NaN and +-inf among finite values
        x = randn()
        for i, p in enumerate(pos):
            x[p] = (NAN, INF, -INF)[i % 3]
    elif kind == "pos_inf":  # +inf without NaN: sum inf, min finite
        x = randn()
        x[pos] = INF
    elif kind == "neg_inf":
        x = randn()
        x[pos] = -INF
    elif kind == "pos_and_neg_inf":  # sum +inf + -inf = NaN, l1 inf
        x = randn()
        x[pos[0]] = INF
        x[pos[-1]] = -INF
    elif kind == "huge":  # near the dtype's max; l2 and std still fit the result dtype
        if dtype == torch.float16:  # results are fp32: nothing can overflow
            x = (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * 0.9 * fi.max
            x[pos[:1]] = fi.max
        else:
            # below 2^1023 for fp64: reference._pow2_scale rounds up to a power of two, and 2^1024 is inf
            x = (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * (0.4 * fi.max / math.sqrt(max(n, 1)))
            x[pos[:1]] = 0.45 * fi.max
    elif kind == "tiny":  # squares underflow the accumulation type
        scale = {torch.float32: 1e-30, torch.float64: 1e-300, torch.float16: fi.tiny, torch.bfloat16: 1e-30}[dtype]
        x = randn() * scale
    elif kind == "subnormal":  # multiples of tiny/4 (zeros included; subnormals must not count as zeros)
        x = torch.randint(-3, 4, (n,), generator=gen).to(torch.float64) * (fi.tiny / 4)
    elif kind == "outlier":  # one large value first: the kernel's first shift guess is poor
        x = randn()
        x[pos[:1]] = 1e4
    elif kind == "extremes":  # unique min at the very end, unique max in the middle
        x = randn()
        x[pos[-1]] = -50.0
        if n > 1:
            x[n // 2 if n // 2 != n - 1 else 0] = 50.0
    else:
        raise ValueError(kind)
    return x.to(dtype)


KINDS = [
    "randn", "offset", "zeros", "constant", "all_nan", "all_inf", "all_ninf", "nan_and_inf", "pos_inf",
    "neg_inf", "pos_and_neg_inf", "huge", "tiny", "subnormal", "outlier", "extremes",
]

SHAPES = [
    (0,), (1,), (2,), (7,), (31,), (4096,), (4097,), (65537,), (2**20 + 3,), (3, 5, 7), (2, 3, 4, 5), (1, 1, 1),
]


def shape_id(shape) -> str:
    return "x".join(map(str, shape)) if len(shape) != 1 else f"n{shape[0]}"


# ---------------------------------------------------------------------------------------------------------
# The main sweep: device x dtype x shape x values x CPU code path, against the float64 reference
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_stats_matches_reference(device, dtype, shape, kind, isa):
    x = make_values(kind, numel_of(shape), dtype, seeded(kind, shape, dtype)).reshape(shape).to(device)
    check_stats_against_reference(x)


# ---------------------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------------------
# Each layout is (build, twin): build(dtype, device, gen) makes x; twin(x) is a contiguous tensor holding x's
# elements in the order the CPU kernel reads them (Note [layouts] in csrc/core/layout.h: dense tensors in
# memory order, others in logical order), so on the CPU stats(x) and stats(twin(x)) agree bit for bit.

def _base(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


def _b(shape, view=lambda b: b):
    return lambda dt, dev, g: view(_base(shape, dt, dev, g))


LOGICAL = lambda x: x.contiguous()  # noqa: E731
CLONE = lambda x: x.clone()  # noqa: E731
NHWC = lambda x: x.permute(0, 2, 3, 1).contiguous()  # noqa: E731

LAYOUTS = {
    "contiguous": (_b((65, 130)), CLONE),
    "transposed": (_b((130, 65), lambda b: b.t()), lambda x: x.t().contiguous()),
    "permuted": (_b((3, 5, 7, 11), lambda b: b.permute(2, 0, 3, 1)), lambda x: x.permute(1, 3, 0, 2).contiguous()),
    "channels_last": (_b((2, 3, 5, 7), lambda b: b.to(memory_format=torch.channels_last)), NHWC),
    "channels_last_big": (_b((4, 17, 33, 9), lambda b: b.to(memory_format=torch.channels_last)), NHWC),
    "channels_last_sliced": (_b((2, 8, 5, 7), lambda b: b.to(memory_format=torch.channels_last)[:, ::2]), LOGICAL),
    "every_other_column": (_b((64, 258), lambda b: b[:, ::2]), LOGICAL),
    "misaligned_flat": (_b((2 * 4096 + 9,), lambda b: b[1:]), CLONE),
    "misaligned_rows": (_b((33, 129), lambda b: b[:, 1:]), LOGICAL),
    "step3_1d": (_b((15001,), lambda b: b[::3]), LOGICAL),
    "rows_cross_chunks": (_b((4099, 7), lambda b: b[:, :5]), LOGICAL),
    "nested_slices": (_b((6, 10, 12, 9), lambda b: b[1::2, ::3, 2:11, ::4]), LOGICAL),
    "expand_row": (_b((1, 1000), lambda b: b.expand(64, 1000)), LOGICAL),
    "expand_col": (_b((64, 1), lambda b: b.expand(64, 1000)), LOGICAL),
    "expand_middle": (_b((5, 1, 7), lambda b: b.expand(5, 300, 7)), LOGICAL),
    "expand_scalar": (_b((), lambda b: b.expand(3, 4097)), LOGICAL),
    "overlapping": (_b((200,), lambda b: b.as_strided((100, 50), (1, 1))), LOGICAL),
    "huge_strides": (_b((2**22,), lambda b: b.as_strided((7, 9, 5), (2**19 + 3, 2**13 + 1, 17))), LOGICAL),
    "zero_dim_inside": (_b((3, 0, 5)), CLONE),
    "zero_size_slice": (_b((4, 6), lambda b: b[:, 6:]), LOGICAL),
    "zero_size_expand": (_b((1, 0), lambda b: b.expand(5, 0)), LOGICAL),
    "scalar_0d": (_b(()), lambda x: x.reshape(1).clone()),
}


def _storage_view(x: torch.Tensor) -> torch.Tensor:
    """All of x's storage as a 1-D tensor (writes through it are seen by every view)."""
    return x.as_strided((x.untyped_storage().nbytes() // x.element_size(),), (1,), 0)


@pytest.mark.parametrize("values", ["randn", "with_inf"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_layouts(device, dtype, layout, values, isa):
    build, twin = LAYOUTS[layout]
    x = build(dtype, device, seeded(layout, dtype))
    if values == "with_inf":  # puts many chunks on the counting-only path, and adds zeros to count
        storage = _storage_view(x)
        storage[::97] = INF
        storage[5::101] = 0.0
        storage[7::103] = -0.0
    got, _ = check_stats_against_reference(x)
    if device == "cpu":
        assert_bitwise_equal(got, hookstats.stats(twin(x)))


def test_more_than_25_non_mergeable_dims_is_a_value_error():
    # Note [layouts]: a non-dense tensor is read through at most 25 coalesced dims.
    x = torch.zeros(40).as_strided((2,) * 26, (1,) * 26)  # overlapping: no dim merges with its neighbour
    with pytest.raises(ValueError, match="more than 25 non-mergeable"):
        hookstats.stats(x)


def test_25_non_mergeable_dims(isa):
    # Element (i_0, ..., i_24) sits at offset sum(i_d) of arange(26): its value is its number of ones.
    x = torch.arange(26, dtype=torch.float32).as_strided((2,) * 25, (1,) * 25)
    s = hookstats.stats(x)
    n = 2**25
    assert int(s.numel) == n
    assert int(s.zero_count) == 1
    assert as_float(s.min) == 0 and as_float(s.max) == 25
    # sum of popcounts of 25-bit numbers: 25 * 2^24; sum of squares: 2^23 * 25 * 26
    assert as_float(s.sum) == approx(25 * 2**24, rel=1e-6)
    assert as_float(s.l1) == approx(25 * 2**24, rel=1e-6)
    assert as_float(s.l2) == approx(math.sqrt(2**23 * 25 * 26), rel=1e-6)
    assert as_float(s.var) == approx(25 / 4 * n / (n - 1), rel=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Every SIMD lane and tail position, both code paths
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_every_small_size(device, dtype, isa):
    """n = 0..140 covers the two-vector main loop, the one-vector step and the scalar tail of both paths."""
    gen = seeded("small", dtype)
    for n in range(141):
        x = make_values("randn", n, dtype, gen).to(device)
        if n:
            x[n - 1] = -9.0  # unique min in the tail
        if 0 < (n * 5) // 7 < n - 1:
            x[(n * 5) // 7] = 0.0
        check_stats_against_reference(x)
        check_stats_against_reference(make_values("randn", 2 * n, dtype, gen).to(device)[1::2])


@pytest.mark.parametrize("n", [67, 4096 + 67, 4 * 4096 * 8 + 67], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_special_value_at_every_position(device, dtype, n, isa):
    """A NaN, an inf, a zero, a unique min and a unique max at each position of the first and the last 67
    elements, and around chunk boundaries: every lane, the tail, and the re-reads of a chunk."""
    positions = sorted({*range(67), *range(n - 67, n), *range(4090, min(n, 4102))})
    base = torch.ones(n, dtype=dtype, device=device)
    for i in positions:
        x = base.clone()
        x[i] = -3.0
        x[(i + 1) % n] = 5.0
        x[(i + 2) % n] = -0.0
        s = hookstats.stats(x)
        assert [as_float(s.min), as_float(s.max), int(s.zero_count)] == [-3.0, 5.0, 1], f"position {i}"
        l1 = n - 3 + 3 + 5  # a missed or doubled element moves sum or l1 by >= 1, i.e. by >= 7e-6 * l1
        assert abs(as_float(s.sum) - (n - 3 - 3 + 5)) <= 1e-6 * l1, f"sum, position {i}"
        assert as_float(s.l1) == approx(l1, rel=1e-6), f"l1, position {i}"
        x[(i + 3) % n] = INF
        s = hookstats.stats(x)
        assert [as_float(s.max), int(s.inf_count), as_float(s.min), as_float(s.l2)] == [INF, 1, -3.0, INF], i
        assert math.isnan(as_float(s.var)), i
        x[(i + 4) % n] = NAN
        s = hookstats.stats(x)
        assert [int(s.nan_count), int(s.inf_count), int(s.zero_count), int(s.numel)] == [1, 1, 1, n], i
        assert all(math.isnan(as_float(getattr(s, f))) for f in ("sum", "mean", "min", "max", "l1", "l2", "linf")), i


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("device", DEVICES)
def test_every_half_bit_pattern(device, dtype, isa):
    """All 65,536 fp16 / bf16 bit patterns, one sign-and-exponent per row: the SIMD conversions to fp32 must be
    exact (l1 of one binade's mantissas sums exactly in fp32), including subnormals, infs and NaNs."""
    row = 1024 if dtype == torch.float16 else 128
    allbits = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).reshape(-1, row).to(device)
    for r in range(allbits.shape[0]):
        got, ref = check_stats_against_reference(allbits[r])
        assert as_float(got.l1) == as_float(ref.l1) or math.isnan(as_float(ref.l1)), f"row {r}"


# ---------------------------------------------------------------------------------------------------------
# Every distribution on the SIMD path (Note [stats scaling], Note [stats nonfinite] in csrc/core/stats_ops.h):
# scaled pieces, counted-only pieces, and the state a CPU task carries from chunk to chunk
# ---------------------------------------------------------------------------------------------------------

CHUNK = 4096  # the CPU kernel's piece (csrc/cpu/stats_cpu.cpp kChunk)


def distribution(name: str, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """The distributions of issue 14's tables (and a few harder ones), built in float64 and cast."""
    r = torch.randn(n, generator=gen, dtype=torch.float64)
    half = torch.rand(n, generator=gen) < 0.5
    fi = torch.finfo(dtype)
    if name == "randn":
        x = r
    elif name == "relu":
        x = r.clamp_min(0)
    elif name == "grad_1e-5":
        x = r * 1e-5
    elif name == "zeros":
        x = torch.zeros(n, dtype=torch.float64)
    elif name == "vanishing_1e-20":
        x = r * 1e-20
    elif name == "huge_1e20":
        x = r * 1e20
    elif name == "mixed_1e30_1e-30":  # interleaved: every piece spans 60 decades
        x = torch.where(half, r * 1e30, r * 1e-30)
    elif name == "halves_1e30_1e-30":  # first half huge, second half tiny: the scale changes mid-tensor
        x = torch.cat([r[: n // 2] * 1e30, r[n // 2:] * 1e-30])
    elif name == "half_nan":
        x = torch.where(half, r, torch.full_like(r, NAN))
    elif name == "nan_tail":  # what follows the first NaN
        x = r.clone()
        x[n // 3:] = NAN
    elif name == "all_nan":
        x = torch.full((n,), NAN, dtype=torch.float64)
    elif name == "inf_tail":
        x = r.clone()
        x[n // 3:: 7] = INF
    elif name == "uniform":
        x = torch.rand(n, generator=gen, dtype=torch.float64) * 8 - 4
    elif name == "on_edge":
        x = torch.full((n,), 0.5, dtype=torch.float64)
    elif name == "near_max":  # l1 of a piece overflows the accumulation type
        # (fp64: below 2^1023, the reference's own limit, see make_values' "huge")
        top = 0.4 if dtype == torch.float64 else 0.9
        x = (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * (top * fi.max)
    elif name == "subnormal_then_big":  # a tiny scale carried into a chunk of large values
        x = r * fi.tiny / 8
        x[n // 2:] = r[n // 2:] * 1e4
    else:
        raise ValueError(name)
    if dtype == torch.float16:  # fp16 cannot hold 1e+-20: keep the shape of the distribution, not its scale
        x = torch.where(torch.isfinite(x) & (x.abs() > fi.max), torch.sign(x) * fi.max, x)
    return x.to(dtype)


DISTRIBUTIONS = [
    "randn", "relu", "grad_1e-5", "zeros", "vanishing_1e-20", "huge_1e20", "mixed_1e30_1e-30", "halves_1e30_1e-30",
    "half_nan", "nan_tail", "all_nan", "inf_tail", "uniform", "on_edge", "near_max", "subnormal_then_big",
]


@pytest.mark.parametrize("n", [3 * CHUNK + 17, 2**18 + 5], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("name", DISTRIBUTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_distributions(device, dtype, name, n, isa):
    """Statistics and norms of every distribution against the float64 reference; 2^18 + 5 elements make 8
    CPU tasks, so scales and NaN states start afresh per task."""
    x = distribution(name, n, dtype, seeded(name, n, dtype)).to(device)
    check_stats_against_reference(x)
    for p in (1.0, 2.0, INF):
        got, _ = hookstats.norms([x], p)
        want, _ = reference.norms([x], p)
        g, w = as_float(got[0]), as_float(want[0])
        if math.isnan(w) or math.isinf(w):
            assert g == w or (math.isnan(g) and math.isnan(w)), (p, g, w)
        else:
            assert g == approx(w, rel=tol_for(dtype).norm_rtol), (p, g, w)


PIECE_EDGES = [0, 1, CHUNK - 1, CHUNK, 2 * CHUNK - 1, 2 * CHUNK, 3 * CHUNK - 1]


@pytest.mark.parametrize("special", ["nan", "inf", "ninf", "huge", "tiny_piece"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_special_on_piece_edges(device, dtype, special, isa):
    """A NaN, an inf, a huge value or a piece of tiny values at the first / last element of a 4096-chunk, in
    otherwise healthy data: the value is seen whichever lane and pass reads it, and the chunks after it are
    read with the right state (counted only after a NaN/Inf, rescaled after a huge or tiny piece)."""
    n = 3 * CHUNK
    big = {torch.float16: 6e4, torch.bfloat16: 1e35, torch.float32: 1e35, torch.float64: 1e300}[dtype]
    tiny = {torch.float16: 1e-7, torch.bfloat16: 1e-35, torch.float32: 1e-35, torch.float64: 1e-300}[dtype]
    for pos in PIECE_EDGES:
        x = torch.randn(n, generator=seeded(special, pos, dtype), dtype=torch.float64)
        if special == "nan":
            x[pos] = NAN
        elif special == "inf":
            x[pos] = INF
        elif special == "ninf":
            x[pos] = -INF
        elif special == "huge":
            x[pos] = big
        else:  # the piece holding pos is tiny, the others healthy
            c = pos // CHUNK
            x[c * CHUNK:(c + 1) * CHUNK] *= tiny
        x = x.to(dtype).to(device)
        check_stats_against_reference(x)
        for p in (1.0, 2.0, INF):
            g, w = as_float(hookstats.norms([x], p)[0][0]), as_float(reference.norms([x], p)[0][0])
            if math.isfinite(w):
                assert g == approx(w, rel=tol_for(dtype).norm_rtol), (pos, p, g, w)
            elif math.isnan(w):
                assert math.isnan(g), (pos, p, g)
            else:
                assert g == w, (pos, p, g, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_pieces(device, dtype, isa):
    """Chunks of very different magnitudes in a row, so each one starts with the previous one's scale: tiny after
    huge, huge after tiny (the scaled values overflow the first pass), healthy after both, then an Inf, and
    finite chunks after it (counted only)."""
    fi = torch.finfo(dtype)
    scales = {
        torch.float16: [1e-7, 5e3, 1.0, 1e-3, 1e4],
        torch.bfloat16: [1e-30, 1e30, 1.0, 1e-38, 1e36],
        torch.float32: [1e-30, 1e30, 1.0, 1e-38, 1e36],
        torch.float64: [1e-300, 1e300, 1.0, 1e-308, 1e306],
    }[dtype]
    g = seeded("mixed", dtype)
    parts = [torch.randn(CHUNK, generator=g, dtype=torch.float64) * s for s in scales]
    x = torch.cat(parts + parts[::-1]).to(dtype).to(device)
    assert torch.isfinite(x).all() and fi.max > 0
    check_stats_against_reference(x)
    for p in (1.0, 2.0):
        g_, w = as_float(hookstats.norms([x], p)[0][0]), as_float(reference.norms([x], p)[0][0])
        assert g_ == approx(w, rel=tol_for(dtype).norm_rtol), (p, g_, w)
    y = x.clone()
    y[CHUNK + 5] = INF
    got, _ = check_stats_against_reference(y)
    assert int(got.inf_count) == 1 and as_float(got.min) == as_float(x.min())


# ---------------------------------------------------------------------------------------------------------
# Semantics, in closed form (not only "same as the reference")
# ---------------------------------------------------------------------------------------------------------

def expect(s, **want):
    for f, v in want.items():
        got = getattr(s, f)
        g = as_float(got)
        if isinstance(v, float) and math.isnan(v):
            assert math.isnan(g), f"{f}: got {g!r}, expected NaN"
        else:
            assert g == approx(v, rel=1e-6), f"{f}: got {g!r}, expected {v!r}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_nan_makes_every_value_nan(device, dtype, isa):
    for n in (5, 4096 + 5):
        x = torch.ones(n, dtype=dtype, device=device)
        x[1], x[2], x[3] = NAN, -INF, 0.0
        s = hookstats.stats(x)
        expect(s, numel=n, nan_count=1, inf_count=1, zero_count=1, sum=NAN, mean=NAN, var=NAN, std=NAN, l1=NAN,
               l2=NAN, linf=NAN, min=NAN, max=NAN)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_inf_without_nan(device, dtype, isa):
    x = torch.tensor([1.0, INF, -2.0, 0.0], dtype=dtype, device=device)
    expect(hookstats.stats(x), numel=4, nan_count=0, inf_count=1, zero_count=1, sum=INF, mean=INF, var=NAN,
           std=NAN, l1=INF, l2=INF, linf=INF, min=-2.0, max=INF)
    x = torch.tensor([1.0, -INF, -2.0], dtype=dtype, device=device)
    expect(hookstats.stats(x), inf_count=1, sum=-INF, mean=-INF, var=NAN, std=NAN, l1=INF, l2=INF, linf=INF,
           min=-INF, max=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_pos_and_neg_inf(device, dtype, isa):
    x = torch.tensor([INF, 3.0, -INF], dtype=dtype, device=device)
    expect(hookstats.stats(x), numel=3, inf_count=2, nan_count=0, sum=NAN, mean=NAN, var=NAN, std=NAN, l1=INF,
           l2=INF, linf=INF, min=-INF, max=INF)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 5)], ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_empty(device, dtype, shape):
    s = hookstats.stats(torch.empty(shape, dtype=dtype, device=device))
    expect(s, numel=0, nan_count=0, inf_count=0, zero_count=0, sum=0.0, l1=0.0, l2=0.0, linf=0.0, mean=NAN,
           var=NAN, std=NAN, min=NAN, max=NAN)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_single_element_and_correction_1(device, dtype):
    expect(hookstats.stats(torch.tensor([-2.5], dtype=dtype, device=device)), numel=1, sum=-2.5, mean=-2.5,
           var=NAN, std=NAN, l1=2.5, l2=2.5, linf=2.5, min=-2.5, max=-2.5)
    expect(hookstats.stats(torch.tensor(4.0, dtype=dtype, device=device)), numel=1, sum=4.0, var=NAN)
    expect(hookstats.stats(torch.tensor([1.0, 3.0], dtype=dtype, device=device)), mean=2.0, var=2.0,
           std=math.sqrt(2.0), l2=math.sqrt(10.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_zero_count_signed_zeros_not_subnormals(device, dtype, isa):
    sub = torch.finfo(dtype).tiny / 4
    for n_ones in (0, 4096):  # alone (scalar tail), then in a SIMD chunk (fast path for fp16)
        x = torch.tensor([0.0, -0.0, sub, -sub] + [1.0] * n_ones, dtype=dtype, device=device)
        s = hookstats.stats(x)
        assert int(s.zero_count) == 2
        assert as_float(s.min) == -sub and as_float(s.max) == (1.0 if n_ones else sub)
        assert as_float(s.l1) == approx(2 * sub + n_ones, rel=1e-6)


@pytest.mark.parametrize("value", [3.25, -7.0, 0.1, 1e4, 1e30, 6e4, 1e300, 1e-300])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_constant_has_zero_variance(device, dtype, value, isa):
    fi = torch.finfo(dtype)
    if not (fi.tiny <= abs(value) <= fi.max):
        pytest.skip(f"{value} is not a normal {dtype}")
    n = 3 * 4096 + 5
    x = torch.full((n,), value, dtype=dtype, device=device)
    c = as_float(x[0])
    s = hookstats.stats(x)
    eps = torch.finfo(result_dtype(dtype)).eps
    # a sum-of-squares formula gives std ~ sqrt(eps) * |c|; a shifted or two-pass one gives ~eps * |c|
    assert 0 <= as_float(s.std) <= 4 * eps * abs(c)
    assert as_float(s.min) == as_float(s.max) == c
    assert as_float(s.mean) == approx(c, rel=tol_for(dtype).sum_rtol)


# ---------------------------------------------------------------------------------------------------------
# Magnitudes: l2 and std never overflow or underflow when the true value fits (the spec's regressions)
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_fp32_1e30_l2_does_not_overflow(device, isa):
    x = torch.full((1000,), 1e30, device=device)  # torch.linalg.vector_norm(x) is inf here
    s = hookstats.stats(x)
    assert as_float(s.l2) == approx(as_float(x[0]) * math.sqrt(1000), rel=1e-6)
    assert as_float(s.l2) == approx(3.1623e31, rel=1e-4)
    assert as_float(s.sum) == approx(1e33, rel=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_6e4_gives_finite_fp32_results(device, isa):
    x = torch.full((1000,), 6e4, dtype=torch.float16, device=device)
    s = hookstats.stats(x)
    assert s.l2.dtype == torch.float32
    expect(s, l2=6e4 * math.sqrt(1000), sum=6e7, l1=6e7, mean=6e4, var=0.0, linf=6e4)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_ones_5120_l1_exact(device, isa):  # pytorch#92164: bf16 ones(5120).norm(1) returned 256
    s = hookstats.stats(torch.ones(5120, dtype=torch.bfloat16, device=device))
    assert as_float(s.l1) == 5120.0 and as_float(s.sum) == 5120.0
    assert as_float(s.l2) == approx(math.sqrt(5120), rel=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_sum_beyond_fp16_max(device, isa):
    n = 100_003  # fp16 max is 65504; results are fp32
    s = hookstats.stats(torch.ones(n, dtype=torch.float16, device=device))
    assert abs(as_float(s.sum) - n) <= 1e-6 * n and as_float(s.l1) == approx(n, rel=1e-6)


@pytest.mark.parametrize("magnitude", [1e150, 1e200, 1e300, 1e-150, 1e-200, 1e-300, 2.0**-1030],
                         ids=lambda m: f"{m:.0e}")
@pytest.mark.parametrize("device", DEVICES)
def test_fp64_extreme_magnitudes(device, magnitude, isa):
    """+-m alternating (mean 0): l2 = m sqrt(n), std = m sqrt(n / (n - 1)), both representable."""
    for n in (1000, 3 * 4096 + 1):
        x = torch.full((n,), magnitude, dtype=torch.float64, device=device)
        x[1::2] = -magnitude
        s = hookstats.stats(x)
        m = as_float(x[0])
        mean = m * (n % 2) / n
        assert as_float(s.l2) == approx(m * math.sqrt(n), rel=1e-12), f"l2, n={n}"
        assert as_float(s.std) == approx(m * math.sqrt((n - n * (mean / m) ** 2) / (n - 1)), rel=1e-12), \
            f"std, n={n}"
        assert as_float(s.linf) == m and as_float(s.max) == m and as_float(s.min) == -m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_values_near_dtype_max(device, dtype, isa):
    """b = 0.6 * max and -b/2 among zeros: l2 = b * sqrt(1.25) and std fit the result dtype and must be right."""
    fi = torch.finfo(dtype)
    n = 1000
    x = torch.zeros(n, dtype=dtype, device=device)
    x[0] = 0.6 * fi.max
    b = as_float(x[0])
    x[500] = -b / 2
    s = hookstats.stats(x)
    rel = tol_for(dtype).norm_rtol
    assert as_float(s.l2) == approx(b * math.sqrt(1.25), rel=rel)
    # m2 = b^2 (1.25 - (1/2)^2 / n); written with b factored out so float64 does not overflow
    assert as_float(s.std) == approx(b * math.sqrt((1.25 - 0.25 / n) / (n - 1)), rel=tol_for(dtype).std_rtol)
    l1 = b * 1.5
    assert abs(as_float(s.sum) - b / 2) <= tol_for(dtype).sum_rtol * l1, \
        f"sum: got {as_float(s.sum)!r}, expected {b / 2!r} within {tol_for(dtype).sum_rtol} * l1"
    assert as_float(s.l1) == approx(l1, rel=rel)
    assert as_float(s.linf) == b and as_float(s.max) == b and as_float(s.min) == -b / 2
    assert (int(s.inf_count), int(s.zero_count)) == (0, n - 2)


# ---------------------------------------------------------------------------------------------------------
# Accuracy (the spec's numbers)
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("offset", [0.0, 10.0], ids=["randn", "randn_plus_10"])
@pytest.mark.parametrize("device", DEVICES)
def test_fp32_accuracy_2_24(device, offset, isa):
    """2^24 fp32 values: l1, l2 and the sum of squares within 1e-6 relative of float64; sum and mean within
    1e-6 * l1 absolute."""
    n = 2**24
    x = (torch.randn(n, generator=seeded("acc", offset)) + offset).to(device)
    xd = x.double()
    l1 = float(xd.abs().sum())
    ssq = float((xd * xd).sum())
    total = float(xd.sum())
    s = hookstats.stats(x)
    assert abs(as_float(s.l1) - l1) <= 1e-6 * l1
    assert abs(as_float(s.l2) - math.sqrt(ssq)) <= 1e-6 * math.sqrt(ssq)
    assert abs(as_float(s.l2) ** 2 - ssq) <= 1e-6 * ssq
    assert abs(as_float(s.sum) - total) <= 1e-6 * l1
    assert abs(as_float(s.mean) - total / n) <= 1e-6 * l1 / n
    assert as_float(s.var) == approx(float(xd.var()), rel=1e-5)
    assert as_float(s.std) == approx(float(xd.std()), rel=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_chunks_with_different_means(device, dtype, isa):
    """Each chunk is shifted by the previous chunk's mean: a jump in the mean must not cost var accuracy."""
    gen = seeded("jump", dtype)
    parts = [torch.randn(4096, generator=gen, dtype=torch.float64) * s + m
             for m, s in ((0, 1), (1e3, 1), (-1e3, 0.01), (5, 1e-3), (0, 1))]
    x = torch.cat(parts).to(dtype).to(device)
    check_stats_against_reference(x)


@pytest.mark.parametrize("n", [32767, 32768, 32769, 65535, 3 * 65536 + 1, 520 * 4096 + 5], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("device", DEVICES)
def test_task_split_sizes(device, dtype, n, isa):
    """Sizes around the CPU kernel's task split (32768 elements per task, at most 64 tasks; with 521 chunks the
    last task gets no chunk at all): extremes and an inf in the last chunk, a NaN-free scaled chunk."""
    x = make_values("extremes", n, dtype, seeded("tasks", n, dtype))
    check_stats_against_reference(x.to(device))
    x[n - 4097] = INF
    check_stats_against_reference(x.to(device))


@pytest.mark.parametrize("value", [0.1, -1.7, 0.6344])
@pytest.mark.parametrize("device", DEVICES)
def test_constant_fp32_sums(device, value, isa):
    """n copies of one fp32 value with a full mantissa: the worst case for rounding in fp32 accumulators (every
    addition rounds the same way). l1 and l2 within the fp32 norm tolerance, sum within 1e-6 * l1."""
    n = 3 * 4096 + 3
    for x in (torch.full((n,), value, device=device), torch.tensor([value], device=device).expand(n)):
        c = as_float(x[0])
        s = hookstats.stats(x)
        rel = tol_for(torch.float32).norm_rtol
        assert as_float(s.l1) == approx(n * abs(c), rel=rel), "l1"
        assert as_float(s.l2) == approx(math.sqrt(n) * abs(c), rel=rel), "l2"
        assert abs(as_float(s.sum) - n * c) <= 1e-6 * n * abs(c), "sum"


# ---------------------------------------------------------------------------------------------------------
# Result types, autograd
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_raw_op_outputs(device, dtype):
    values, counts = torch.ops.hookstats.stats.default(torch.randn(10, device=device).to(dtype))
    assert values.shape == (9,) and values.dtype == result_dtype(dtype) and values.device.type == device
    assert counts.shape == (4,) and counts.dtype == torch.int64 and counts.device.type == device
    assert counts.tolist() == [10, 0, 0, 0]


def test_stats_is_a_namedtuple_in_field_order():
    s = hookstats.stats(torch.tensor([1.0, NAN, 0.0, INF]))
    assert s._fields == F == (
        "numel", "sum", "mean", "var", "std", "l1", "l2", "linf", "min", "max", "nan_count", "inf_count",
        "zero_count")
    d = s.to_dict()
    assert list(d) == list(F)
    assert d["numel"] == 4 and isinstance(d["numel"], int)
    assert (d["nan_count"], d["inf_count"], d["zero_count"]) == (1, 1, 1)
    assert math.isnan(d["sum"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_no_autograd_graph(device, dtype):
    x = torch.randn(100, device=device).to(dtype).requires_grad_()
    y = x * 2  # a non-leaf
    for t in (x, y):
        s = hookstats.stats(t)
        assert all(not v.requires_grad and v.grad_fn is None for v in s)
    buf = hookstats.stats_buffer(2, device=device)
    hookstats.stats_into(y, buf, 1)
    assert not buf.requires_grad
    with torch.inference_mode():
        z = torch.randn(100, device=device).to(dtype)
        assert as_float(hookstats.stats(z).l1) == approx(as_float(z.double().abs().sum()), rel=2e-6)


def test_meta_tensors_use_the_fake_kernel():
    for dt in (torch.float16, torch.float64):
        s = hookstats.stats(torch.empty(5, 3, device="meta", dtype=dt))
        for f in F:
            t = getattr(s, f)
            assert t.device.type == "meta" and t.shape == ()
            assert t.dtype == (torch.int64 if f in hookstats._ops.COUNT_FIELDS else result_dtype(dt))


# ---------------------------------------------------------------------------------------------------------
# stats_into and Stats.from_row
# ---------------------------------------------------------------------------------------------------------

def assert_row_matches(row: torch.Tensor, s) -> None:
    """A stats_into row and a stats() result agree once both are at the lower of the two precisions."""
    low = torch.float32 if torch.float32 in (row.dtype, s.sum.dtype) else torch.float64
    got = row.to(low)
    want = torch.stack([getattr(s, f).to(low) for f in F])
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("buf_dtype", [pytest.param(torch.float32, id="buf32"), pytest.param(torch.float64, id="buf64")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_stats_into_fills_one_row(device, dtype, buf_dtype, isa):
    gen = seeded("into", dtype)
    for x in (torch.randn(4097, generator=gen).to(dtype), torch.randn(64, 30, generator=gen).to(dtype)[:, ::3],
              torch.tensor([1.0, NAN, -INF, 0.0]).to(dtype), torch.empty(0, dtype=dtype)):
        x = x.to(device)
        buf = hookstats.stats_buffer(5, device=device, dtype=buf_dtype)
        assert buf.shape == (5, 13) and buf.dtype == buf_dtype and buf.device.type == device
        assert torch.isnan(buf).all()
        hookstats.stats_into(x, buf, 3)
        assert torch.isnan(buf[[0, 1, 2, 4]]).all(), "rows other than the slot were written"
        assert_row_matches(buf[3], hookstats.stats(x))
        torch.ops.hookstats.stats_into.default(x, buf, 1)
        torch.testing.assert_close(buf[1], buf[3], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_stats_into_many_tensors_one_buffer(device, isa):
    gen = seeded("many")
    xs = [torch.randn(7, generator=gen).to(device), torch.randn(300, 5, generator=gen).to(device).half().t(),
          torch.randn(70000, generator=gen, dtype=torch.float64).to(device),
          torch.full((33,), INF, dtype=torch.bfloat16, device=device)]
    slots = [2, 0, 5, 1]
    buf = hookstats.stats_buffer(6, device=device)
    for x, slot in zip(xs, slots):
        hookstats.stats_into(x, buf, slot)
    for x, slot in zip(xs, slots):
        assert_row_matches(buf[slot], hookstats.stats(x))
        assert_stats_close(hookstats.Stats.from_row(buf[slot]), reference.stats(x), x.dtype)
    assert torch.isnan(buf[[3, 4]]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_stats_into_rows_of_a_wider_tensor(device):
    wide = torch.zeros(3, 20, dtype=torch.float64, device=device)
    buf = wide[:, 2:15]  # row stride 20, unit column stride
    x = torch.randn(1000, device=device)
    hookstats.stats_into(x, buf, 1)
    assert_row_matches(buf[1], hookstats.stats(x))
    assert (wide[:, :2] == 0).all() and (wide[:, 15:] == 0).all() and (wide[[0, 2]] == 0).all()


def test_from_row_views_the_buffer():
    buf = hookstats.stats_buffer(3)
    hookstats.stats_into(torch.tensor([3.0, -4.0]), buf, 2)
    s = hookstats.Stats.from_row(buf[2])
    assert as_float(s.l2) == 5.0 and as_float(s.numel) == 2 and as_float(s.min) == -4.0
    buf[2, F.index("l2")] = 42.0
    assert as_float(s.l2) == 42.0, "from_row must return views, not copies"
    with pytest.raises(ValueError, match="13"):
        hookstats.Stats.from_row(buf[2, :12])
    with pytest.raises(ValueError, match="13"):
        hookstats.Stats.from_row(buf)


def test_stats_buffer_arguments():
    with pytest.raises(ValueError, match="slots"):
        hookstats.stats_buffer(0)
    with pytest.raises(TypeError, match="float16"):
        hookstats.stats_buffer(2, dtype=torch.float16)
    assert hookstats.stats_buffer(2, dtype=torch.float32).dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------------------

def _determinism_input(dtype):
    x = make_values("randn", 2**20 + 3, dtype, seeded("det", dtype))
    x[12345] = INF  # one chunk on the counting-only path
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_same_input_same_bits(device, dtype, isa):
    strided = torch.randn(4099, 70, generator=seeded("det2")).to(dtype)[:, ::3]
    for x in (_determinism_input(dtype).to(device), strided.to(device)):
        assert_bitwise_equal(hookstats.stats(x), hookstats.stats(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_does_not_change_bits(dtype, isa, restore_threads):
    for x in (_determinism_input(dtype), torch.randn(4099, 70, generator=seeded("det2")).to(dtype)[:, ::3]):
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(hookstats.stats(x))
        assert_bitwise_equal(results[0], results[1])
        assert_bitwise_equal(results[0], results[2])


# ---------------------------------------------------------------------------------------------------------
# Memory: no temporaries proportional to the input
# ---------------------------------------------------------------------------------------------------------

def _cpu_bytes_allocated(fn) -> dict:
    """Bytes the c10 CPU allocator handed out inside each hookstats op run by fn, by op name."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    out = {}
    for e in prof.events():
        if e.name.startswith("hookstats::"):
            out[e.name] = out.get(e.name, 0) + e.cpu_memory_usage
    return out


MEMORY_LAYOUTS = {
    "contiguous": lambda: torch.randn(2**22),
    "every_other": lambda: torch.randn(2**11, 2**12)[:, ::2],
    "expanded": lambda: torch.randn(1, 2**12).expand(2**10, 2**12),
    "channels_last": lambda: torch.randn(4, 64, 128, 128).to(memory_format=torch.channels_last),
}


@pytest.mark.parametrize("layout", list(MEMORY_LAYOUTS))
def test_cpu_ops_allocate_only_their_outputs(layout):
    # The profiler sees what goes through the c10 CPU allocator (every at::empty, .contiguous(), .to()),
    # not malloc or stack use inside the kernel.
    x = MEMORY_LAYOUTS[layout]()
    buf = hookstats.stats_buffer(2)
    hookstats.stats(x)  # warm-up

    def run():
        hookstats.stats(x)
        hookstats.stats_into(x, buf, 1)

    mem = _cpu_bytes_allocated(run)
    # stats: a float32 [9] and an int64 [4] output = 68 bytes; seeing them proves the profiler is recording
    assert 0 < mem["hookstats::stats"] <= 1024, mem
    assert mem["hookstats::stats_into"] == 0, mem


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and hookstats built with CUDA kernels")
def test_cuda_ops_allocate_no_input_sized_temporaries():
    x = torch.randn(2**24, device="cuda")
    buf = hookstats.stats_buffer(2, device="cuda")
    hookstats.stats(x)
    torch.cuda.synchronize()
    for fn in (lambda: hookstats.stats(x), lambda: hookstats.stats_into(x.view(2**12, 2**12)[:, ::2], buf, 0)):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before <= 2**20  # 1 MiB for a 64 MiB input


# ---------------------------------------------------------------------------------------------------------
# opcheck and torch.compile
# ---------------------------------------------------------------------------------------------------------

OPCHECK_INPUTS = {
    "fp32_contiguous": lambda d: torch.randn(33, 17, device=d),
    "fp64_transposed": lambda d: torch.randn(17, 33, dtype=torch.float64, device=d).t(),
    "fp16_misaligned": lambda d: torch.randn(1001, device=d).half()[1:],
    "bf16_expanded": lambda d: torch.randn(1, 40, device=d).bfloat16().expand(30, 40),
    "fp32_strided": lambda d: torch.randn(30, 40, device=d)[:, ::3],
    "fp32_empty": lambda d: torch.randn(0, 5, device=d),
    "fp32_nan": lambda d: torch.tensor([1.0, NAN, INF], device=d),
}


@pytest.mark.parametrize("inp", list(OPCHECK_INPUTS))
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_stats(device, inp):
    x = OPCHECK_INPUTS[inp](device)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if x.numel() < 2 or not torch.isfinite(x).all():
        # test_aot_dispatch_dynamic compares eager and AOT outputs with assert_close(equal_nan=False), so any NaN
        # in the outputs (var of < 2 elements, a NaN input) fails it by construction. test_compile_fullgraph
        # checks the same path with equal_nan=True.
        utils = utils[:-1]
    torch.library.opcheck(torch.ops.hookstats.stats.default, (x,), test_utils=utils)


@pytest.mark.parametrize("buf_dtype", [pytest.param(torch.float32, id="buf32"), pytest.param(torch.float64, id="buf64")])
@pytest.mark.parametrize("inp", ["fp32_contiguous", "fp16_misaligned", "fp64_transposed", "bf16_expanded"])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_stats_into(device, inp, buf_dtype):
    buf = hookstats.stats_buffer(5, device=device, dtype=buf_dtype)
    torch.library.opcheck(torch.ops.hookstats.stats_into.default, (OPCHECK_INPUTS[inp](device), buf, 3))


def _stats_fn(x):
    s = hookstats.stats(x)
    return s.l2 * 2 + s.nan_count


def _stats_into_fn(x, buf):
    hookstats.stats_into(x, buf, 2)
    hookstats.stats_into(x * 2, buf, 0)
    return buf[:, F.index("l2")].sum()


def _check_compiled(backend, device, xs):
    torch._dynamo.reset()  # the same functions are compiled by several tests, with several backends
    compiled = torch.compile(_stats_fn, fullgraph=True, backend=backend)
    compiled_into = torch.compile(_stats_into_fn, fullgraph=True, backend=backend)
    for x in xs:
        x = x.to(device)
        torch.testing.assert_close(compiled(x), _stats_fn(x), rtol=0, atol=0, equal_nan=True)
        b1, b2 = hookstats.stats_buffer(3, device=device), hookstats.stats_buffer(3, device=device)
        r1, r2 = compiled_into(x, b1), _stats_into_fn(x, b2)
        torch.testing.assert_close(b1, b2, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(r1, r2, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device, backend):
    _check_compiled(backend, device, [torch.randn(100, 7), torch.tensor([1.0, NAN, 2.0]),
                                      torch.randn(50, dtype=torch.float64)])


@pytest.mark.parametrize("device", DEVICES)
def test_compile_inductor(device):
    _check_compiled("inductor", device, [torch.randn(100, 7), torch.tensor([1.0, NAN, 2.0])])


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------

BAD_DTYPES = [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_rejects_non_float_dtypes(dtype):
    x = torch.ones(4, dtype=dtype)
    with pytest.raises(TypeError, match=re.escape(str(dtype))):
        hookstats.stats(x)
    with pytest.raises(TypeError, match=re.escape(str(dtype))):
        hookstats.stats_into(x, hookstats.stats_buffer(1), 0)
    with pytest.raises(TypeError, match="floating tensor"):
        torch.ops.hookstats.stats.default(x)
    with pytest.raises(TypeError, match="floating tensor"):
        torch.ops.hookstats.stats_into.default(x, hookstats.stats_buffer(1), 0)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_rejects_sparse(layout):
    x = torch.randn(3, 3)
    x = x.to_sparse() if layout == "sparse_coo" else x.to_sparse_csr()
    with pytest.raises(TypeError, match=layout):
        hookstats.stats(x)
    with pytest.raises(TypeError, match=layout):
        hookstats.stats_into(x, hookstats.stats_buffer(1), 0)
    # The raw op has no sparse kernel: the dispatcher refuses it before hookstats' own TypeError check runs.
    with pytest.raises((TypeError, NotImplementedError)):
        torch.ops.hookstats.stats.default(x)


@pytest.mark.parametrize("obj", [[1.0, 2.0], 3.0, np.ones(3, dtype=np.float32), None], ids=lambda o: type(o).__name__)
def test_rejects_non_tensors(obj):
    with pytest.raises(TypeError, match=type(obj).__name__):
        hookstats.stats(obj)
    with pytest.raises(TypeError, match=type(obj).__name__):
        hookstats.stats_into(obj, hookstats.stats_buffer(1), 0)
    with pytest.raises(TypeError, match=type(obj).__name__):
        hookstats.stats_into(torch.ones(3), obj, 0)


def _into_both(x, buf, slot):
    """stats_into through the Python wrapper and through the raw op."""
    yield lambda: hookstats.stats_into(x, buf, slot)
    yield lambda: torch.ops.hookstats.stats_into.default(x, buf, slot)


@pytest.mark.parametrize("buf_dtype", [torch.float16, torch.bfloat16, torch.int64, torch.complex64], ids=str)
def test_stats_into_rejects_buffer_dtype(buf_dtype):
    buf = torch.zeros(2, 13, dtype=buf_dtype)
    for call in _into_both(torch.ones(3), buf, 0):
        with pytest.raises(TypeError, match="float32 or float64 buffer"):
            call()


@pytest.mark.parametrize("shape", [(2, 12), (2, 14), (13,), (2, 13, 1), (13, 2)], ids=shape_id)
def test_stats_into_rejects_buffer_shape(shape):
    for call in _into_both(torch.ones(3), torch.zeros(shape, dtype=torch.float64), 0):
        with pytest.raises(ValueError, match="shape"):
            call()


def test_stats_into_rejects_non_unit_row_stride():
    buf = torch.zeros(13, 2, dtype=torch.float64).t()  # shape (2, 13), strides (1, 2)
    for call in _into_both(torch.ones(3), buf, 0):
        with pytest.raises(ValueError, match="unit stride"):
            call()
    assert (buf == 0).all()


@pytest.mark.parametrize("slot", [-1, 4, 100])
def test_stats_into_rejects_slot_out_of_range(slot):
    buf = hookstats.stats_buffer(4)
    for call in _into_both(torch.ones(3), buf, slot):
        with pytest.raises(ValueError, match="out of range"):
            call()
    assert torch.isnan(buf).all()


def test_stats_into_rejects_buffer_on_other_device():
    with pytest.raises(ValueError, match="meta"):
        hookstats.stats_into(torch.ones(3), hookstats.stats_buffer(2, device="meta"), 0)
    if cuda_ready():
        buf = hookstats.stats_buffer(2, device="cuda")
        for call in _into_both(torch.ones(3), buf, 0):
            with pytest.raises(ValueError, match="cuda"):
                call()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or hookstats.cuda_kernels_built(),
                    reason="needs a GPU and a build of hookstats without CUDA kernels")
def test_cuda_tensor_without_cuda_kernels():
    with pytest.raises(RuntimeError, match="CUDA kernels"):
        hookstats.stats(torch.ones(3, device="cuda"))


def test_cpu_isa_switch():
    before = torch.ops.hookstats._cpu_isa("")
    try:
        assert before in ("avx512", "avx2", "default")
        assert torch.ops.hookstats._cpu_isa("default") == "default"
        assert torch.ops.hookstats._cpu_isa("") == "default"
        assert torch.ops.hookstats._cpu_isa("avx2") in ("avx2", "default")  # capped at what the CPU runs
        assert torch.ops.hookstats._cpu_isa("avx512") in ("avx512", "avx2", "default")
        assert torch.ops.hookstats._cpu_isa("default") == "default"
        with pytest.raises(ValueError, match="avx2"):
            torch.ops.hookstats._cpu_isa("sse4")
        assert torch.ops.hookstats._cpu_isa("") == "default"
    finally:
        torch.ops.hookstats._cpu_isa(before)


# ---------------------------------------------------------------------------------------------------------
# Over 2^31 elements (slow)
# ---------------------------------------------------------------------------------------------------------

def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_more_than_2_31_elements(device):
    n = 2**31 + 17
    if device == "cpu" and _available_bytes() < 12 * 2**30:
        pytest.skip("needs 12 GB of free memory")
    if device == "cuda" and torch.cuda.mem_get_info()[0] < 12 * 2**30:
        pytest.skip("needs 12 GB of free GPU memory")
    x = torch.ones(n, dtype=torch.bfloat16, device=device)
    far = 2**31 + 3  # past every 32-bit index
    x[5] = 0.0
    x[far] = -0.0
    x[2**30] = 4.0
    x[n - 1] = -2.0
    s = hookstats.stats(x)
    assert int(s.numel) == n and int(s.zero_count) == 2 and int(s.nan_count) == 0 and int(s.inf_count) == 0
    assert as_float(s.min) == -2.0 and as_float(s.max) == 4.0 and as_float(s.linf) == 4.0
    assert abs(as_float(s.sum) - (n - 2)) <= 1e-6 * (n + 2)
    assert as_float(s.l1) == approx(n + 2, rel=1e-6)
    assert as_float(s.l2) == approx(math.sqrt(n + 16), rel=1e-6)
    assert as_float(s.mean) == approx((n - 2) / n, rel=1e-6)
    # 64-bit offsets in the strided gather: elements 0, 2^30 + 1 and 2^31 + 2
    x[2**31 + 2] = 7.0
    v = x.as_strided((3,), (2**30 + 1,))
    s = hookstats.stats(v)
    assert [as_float(s.sum), as_float(s.max), int(s.numel)] == [9.0, 7.0, 3]
    x[far + 7] = NAN
    x[1] = INF
    s = hookstats.stats(x)
    assert int(s.nan_count) == 1 and int(s.inf_count) == 1 and int(s.zero_count) == 2 and int(s.numel) == n
    assert math.isnan(as_float(s.sum)) and math.isnan(as_float(s.max))
    del x, v
    # stride 0: no memory
    m = 2**31 + 5
    for dt in (torch.float64, torch.bfloat16):
        s = hookstats.stats(torch.tensor([2.0], dtype=dt, device=device).expand(m))
        assert int(s.numel) == m and int(s.zero_count) == 0
        if dt == torch.float64:  # every partial sum is an integer below 2^53
            assert as_float(s.sum) == 2.0 * m
        else:
            assert as_float(s.sum) == approx(2.0 * m, rel=1e-6)
        assert as_float(s.min) == as_float(s.max) == 2.0 and as_float(s.mean) == approx(2.0, rel=1e-6)
        assert as_float(s.std) <= 4 * torch.finfo(result_dtype(dt)).eps * 2.0
        assert as_float(s.l2) == approx(2.0 * math.sqrt(m), rel=1e-6)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")])
def test_every_half_pattern_loads_exactly(dtype, isa):
    """Each 16-bit value, loaded in SIMD lanes (the AVX2 fp16 load is F16C's vcvtph2ps, the portable one a bit
    method): 65,536 tensors of 8 copies of one pattern (one AVX2 vector each) have min == max == the value that
    torch's own conversion gives, and NaN patterns count 8 NaNs."""
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    xs = list(patterns.repeat_interleave(8).split(8))
    buf = hookstats.stats_buffer(len(xs))
    hookstats.stats_multi_into(xs, buf, range(len(xs)))
    f = hookstats.STATS_FIELDS
    want = patterns.double()
    nan = torch.isnan(want)
    assert torch.equal(buf[:, f.index("nan_count")], torch.where(nan, 8.0, 0.0).double())
    for field in ("min", "max"):
        got = buf[~nan, f.index(field)]
        assert torch.equal(got, want[~nan]), (field, (got != want[~nan]).nonzero()[:8].flatten().tolist())
    assert torch.equal(buf[~nan, f.index("zero_count")], torch.where(want[~nan] == 0, 8.0, 0.0).double())
