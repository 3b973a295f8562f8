"""Histograms: hookstats.histogram, exp_histogram, stats(x, histogram=...), stats_into(..., hist=...) and format_fit.

Counts are compared exactly: against hookstats.reference.histogram_of (torch.histc on float64, frexp), against an
independent scalar formula for values on and next to bin edges, against closed forms (peaked data, one value per
binade), and format_fit against what a cast to each format actually does. The tests written for one specific bug
found while writing this file are at its end ("Known bugs"), so that `pytest -x` runs the rest first.
"""
from __future__ import annotations

import math
import struct
import zlib

import pytest
import torch

import hookstats
from hookstats import reference

from _testing import DEVICES, DTYPES, assert_bitwise_equal, bits, cuda_ready

H = hookstats.Histogram
NAN = float("nan")
INF = float("inf")

RANGE_HISTS = {
    "64_pm4": H.range(64, -4.0, 4.0),
    "7_odd": H.range(7, -0.5, 3.1),
    "256": H.range(256, -3.0, 5.0),
    "1bin": H.range(1, -1.0, 1.0),
}
HISTS = {**RANGE_HISTS, "exp": H.exponent()}
EXP_LENGTH = {torch.float32: 514, torch.bfloat16: 514, torch.float16: 66, torch.float64: 4098}


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def slot_name(h: H, i: int, dtype: torch.dtype) -> str:
    if h.kind == "range":
        return f"bin {i}" if i < h.bins else ("underflow", "overflow", "nan")[i - h.bins]
    lay = hookstats.exp_layout(dtype)
    if i < lay.pos.start:
        return f"-2^{lay.emin + i}"
    if i < lay.pos.stop:
        return f"+2^{lay.emin + i - lay.pos.start}"
    return ("neg_subnormal", "pos_subnormal", "zero", "neg_inf", "pos_inf", "nan")[i - lay.neg_subnormal]


def assert_counts_equal(got: torch.Tensor, want: torch.Tensor, h: H, dtype: torch.dtype, what: str = "") -> None:
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if torch.equal(got, want):
        return
    diff = (got != want).nonzero().flatten().tolist()
    lines = [f"{slot_name(h, i, dtype)}: got {int(got[i])}, expected {int(want[i])}" for i in diff[:12]]
    raise AssertionError(f"{what} {h} {dtype}: {len(diff)} counts differ:\n  " + "\n  ".join(lines))


def hist_of(x: torch.Tensor, h: H):
    """stats(x, histogram=h), with the counts' dtype, shape, device and total checked. Returns (Stats, counts)."""
    s, c = hookstats.stats(x, histogram=h)
    assert c.dtype == torch.int64, c.dtype
    assert c.shape == (h.length(x.dtype),), (tuple(c.shape), h)
    assert c.device == x.device
    assert int(c.sum()) == x.numel(), f"counts sum to {int(c.sum())}, numel is {x.numel()}"
    return s, c


def expected_range(values, h: H) -> torch.Tensor:
    """The documented rule, one Python float (IEEE float64) at a time: independent of torch.histc."""
    c = [0] * (h.bins + 3)
    for v in values:
        if v != v:
            c[h.bins + 2] += 1
        elif v < h.lo:
            c[h.bins] += 1
        elif v > h.hi:
            c[h.bins + 1] += 1
        else:
            c[min(int((v - h.lo) * h.bins / (h.hi - h.lo)), h.bins - 1)] += 1
    return torch.tensor(c, dtype=torch.int64)


def exp_slot(v: float, dtype: torch.dtype) -> int:
    """The exponent-histogram slot of one value of `dtype`, from math.frexp (independent of the kernel's bit
    twiddling and of the reference's torch.frexp)."""
    lay = hookstats.exp_layout(dtype)
    if v != v:
        return lay.nan
    if math.isinf(v):
        return lay.pos_inf if v > 0 else lay.neg_inf
    if v == 0:
        return lay.zero
    neg = math.copysign(1.0, v) < 0
    if abs(v) < torch.finfo(dtype).tiny:
        return lay.neg_subnormal if neg else lay.pos_subnormal
    e = math.frexp(v)[1] - 1
    assert lay.emin <= e <= lay.emax
    return (lay.neg.start if neg else lay.pos.start) + e - lay.emin


def expected_exp(values, dtype: torch.dtype) -> torch.Tensor:
    c = torch.zeros(hookstats.exp_layout(dtype).length, dtype=torch.int64)
    for v in values:
        c[exp_slot(v, dtype)] += 1
    return c


def as_floats(x: torch.Tensor) -> list:
    return x.detach().cpu().reshape(-1).to(torch.float64).tolist()


# ---------------------------------------------------------------------------------------------------------
# The main sweep: device x dtype x size x layout x CPU code path, every histogram kind, against the reference
# ---------------------------------------------------------------------------------------------------------

SIZES = [0, 1, 7, 4095, 4097, 65537, 2**20 + 3]


def sweep_values(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """randn * 2.5 (some under- and overflow of every range), with every 5th value on an edge of the 64-, 256- and
    1-bin ranges, every 11th on an edge of the 7-bin one, and sparse NaN, +-inf, -0.0, subnormals and +-max."""
    x = torch.randn(n, generator=gen, dtype=torch.float64) * 2.5
    x[::5] = torch.round(x[::5] * 8) / 8
    e7 = RANGE_HISTS["7_odd"].edges()
    k = len(range(3, n, 11))
    x[3::11] = e7[torch.randint(0, 8, (k,), generator=gen)]
    fi = torch.finfo(dtype)
    for start, step, v in ((6, 1009, NAN), (500, 1013, INF), (700, 1019, -INF), (900, 1021, -0.0),
                           (1000, 1031, fi.tiny / 4), (1050, 1049, -fi.tiny / 4), (1100, 1033, -fi.max),
                           (1200, 1039, fi.max)):
        x[start::step] = v
    return x.to(dtype)


def _rows(n: int, c: int) -> int:
    return -(-n // c)


# Each layout builds a tensor of about n elements from mk(m), which returns m fresh values on the test's device.
LAYOUTS = {
    "contiguous": lambda n, mk: mk(n),
    "transposed": lambda n, mk: mk(3 * _rows(n, 3)).reshape(3, _rows(n, 3)).t(),
    "every_other_column": lambda n, mk: mk(6 * _rows(n, 3)).reshape(_rows(n, 3), 6)[:, ::2],
    "misaligned": lambda n, mk: mk(n + 1).view(-1)[1:],
    "expanded": lambda n, mk: mk(_rows(n, 3)).reshape(-1, 1).expand(-1, 3),
    "channels_last": lambda n, mk: mk(12 * _rows(n, 12)).reshape(_rows(n, 12), 3, 2, 2).to(
        memory_format=torch.channels_last),
}

_ORACLE: dict = {}


def _oracle(key, x: torch.Tensor, h: H) -> torch.Tensor:
    """reference.histogram_of, cached: the same input is built again for each CPU code path and device."""
    if key not in _ORACLE:
        _ORACLE[key] = reference.histogram_of(x.cpu(), h)
    return _ORACLE[key]


# 2^20 + 3 runs flat and gathered only (the reference is slow); 65537 already takes two tasks in every layout.
SWEEP = [(n, layout) for n in SIZES for layout in LAYOUTS
         if n < 2**17 or layout in ("contiguous", "every_other_column")]


@pytest.mark.parametrize("n,layout", SWEEP, ids=[f"n{n}-{layout}" for n, layout in SWEEP])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_reference(device, dtype, n, layout, isa):
    gen = seeded("sweep", dtype, n, layout)
    x = LAYOUTS[layout](n, lambda m: sweep_values(m, dtype, gen).to(device))
    if n > 12:  # the layout is what its name says
        assert x.storage_offset() == 1 if layout == "misaligned" else x.is_contiguous() == (layout == "contiguous")
    plain = hookstats.stats(x)
    for name, h in HISTS.items():
        s, c = hist_of(x, h)
        assert_counts_equal(c, _oracle((dtype, n, layout, name), x, h), h, dtype, name)
        assert_bitwise_equal(s, plain)  # the same read gives the same statistics


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("device", DEVICES)
def test_every_half_bit_pattern(device, dtype, isa):
    """All 65,536 fp16 / bf16 values (subnormals, +-0, +-inf, NaNs with any payload), through the SIMD
    conversions and the scalar tail alike."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.randperm(65536, generator=seeded("halfbits", dtype))].to(device)
    lay = hookstats.exp_layout(dtype)
    fi = torch.finfo(dtype)
    hists = [H.exponent(), H.range(64, -4.0, 4.0), H.range(8192, -float(fi.max), float(fi.max)),
             H.range(100, -fi.tiny, fi.tiny), H.range(3, 0.0, 1e-6), H.range(7, -0.5, 3.1)]
    for h in hists:
        _, c = hist_of(x, h)
        assert_counts_equal(c, reference.histogram_of(x.cpu(), h), h, dtype)
    c = hist_of(x, H.exponent())[1].cpu()
    # closed form: each sign has 2^M patterns per normal exponent and 2^M - 1 subnormals; 2^(M+1) - 2 NaNs
    per = 2**lay.mantissa_bits
    assert (c[lay.neg] == per).all() and (c[lay.pos] == per).all()
    assert int(c[lay.neg_subnormal]) == int(c[lay.pos_subnormal]) == per - 1
    assert [int(c[lay.zero]), int(c[lay.neg_inf]), int(c[lay.pos_inf]), int(c[lay.nan])] == [2, 1, 1, 2 * per - 2]


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")])
def test_every_half_bit_pattern_scalar_rule(dtype, isa):
    """The per-value rule of Note [exact bin thresholds] (threshold_ordinal in csrc/core/hist_ops.h), which the CUDA
    kernel runs on every value and the CPU kernel on its scalar tail, on all 65,536 fp16 / bf16 values: tensors of
    3 elements are shorter than any SIMD vector, so the CPU places every value with that scalar rule."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.randperm(65536, generator=seeded("halfbits-scalar", dtype))]
    pieces = list(x.split(3))
    fi = torch.finfo(dtype)
    for h in (H.range(64, -4.0, 4.0), H.range(100, -fi.tiny, fi.tiny), H.range(7, -0.5, 3.1), H.range(3, 0.0, 1e-6)):
        buf = hookstats.stats_buffer(len(pieces))
        hb = hookstats.histogram_buffer(len(pieces), h, dtype=dtype)
        hookstats.stats_multi_into(pieces, buf, range(len(pieces)), hist=hb, histogram=h)
        assert_counts_equal(hb.sum(0), reference.histogram_of(x, h), h, dtype, repr(h))


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")])
def test_random_bit_patterns(dtype, isa):
    """Every exponent of fp32 / fp64 with random mantissas and signs (infs, NaNs and subnormals included)."""
    gen = seeded("bits", dtype)
    if dtype == torch.float32:
        raw = torch.randint(-2**31, 2**31, (2**18,), generator=gen, dtype=torch.int64).to(torch.int32)
    else:
        halves = torch.randint(0, 2**32, (2, 2**17), generator=gen, dtype=torch.int64)
        raw = (halves[0] << 32) | halves[1]  # all 64 bits random: every exponent, both signs
    x = raw.view(dtype)
    for h in (H.exponent(), H.range(64, -4.0, 4.0), H.range(7, -1e30, 1e30), H.range(8192, -1e-30, 1e-30)):
        assert_counts_equal(hist_of(x, h)[1], reference.histogram_of(x, h), h, dtype)


# ---------------------------------------------------------------------------------------------------------
# Values on, next to and far from bin edges, against the documented rule evaluated one Python float at a time
# ---------------------------------------------------------------------------------------------------------

EDGE_RANGES = {
    "64_pm4": (64, -4.0, 4.0),
    "7_odd": (7, -0.5, 3.1),
    "10_unrepresentable": (10, 0.1, 0.7),
    "3_from_zero": (3, 0.0, 1.0),
    "256": (256, -3.0, 5.0),
    "1bin": (1, -1.0, 1.0),
    "8192_narrow": (8192, -1e-3, 1e-3),
    "5_offset": (5, 1000.0, 1000.5),
    "13_tiny": (13, 0.0, 1e-6),
}


def edge_values(h: H, dtype: torch.dtype) -> torch.Tensor:
    """The bins + 1 edges (float64 linspace) rounded to dtype, their neighbours in dtype, the float64 edges'
    own float64 neighbours, bin midpoints, +-0.0 and lo, hi."""
    e = h.edges()
    ed = e.to(dtype)
    up = torch.nextafter(ed, torch.full_like(ed, INF))
    down = torch.nextafter(ed, torch.full_like(ed, -INF))
    e_up = torch.nextafter(e, torch.full_like(e, INF)).to(dtype)
    e_down = torch.nextafter(e, torch.full_like(e, -INF)).to(dtype)
    mids = ((e[1:] + e[:-1]) / 2).to(dtype)
    extra = torch.tensor([0.0, -0.0, h.lo, h.hi], dtype=torch.float64).to(dtype)
    return torch.cat([ed, up, down, e_up, e_down, mids, extra])


@pytest.mark.parametrize("rng", list(EDGE_RANGES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_values_on_and_next_to_edges(device, dtype, rng, isa):
    h = H.range(*EDGE_RANGES[rng])
    vals = edge_values(h, dtype)
    reps = max(1, _rows(100, vals.numel()))
    base = vals.repeat(reps)
    want = expected_range(as_floats(base), h)
    for lead in (0, 1, 3, 7, 13):  # shifts every value through each SIMD lane and the scalar tail
        x = torch.cat([torch.full((lead,), NAN, dtype=dtype), base]).to(device)
        w = want.clone()
        w[h.bins + 2] += lead
        _, c = hist_of(x, h)
        assert_counts_equal(c, w, h, dtype, f"lead {lead}")
        assert_counts_equal(c, reference.histogram_of(x.cpu(), h), h, dtype, f"reference, lead {lead}")


def _single_slot(v: torch.Tensor, h: H) -> int:
    """The one slot that 37 copies of the 0-d value v land in (SIMD lanes and the tail)."""
    c = hist_of(v.reshape(1).expand(37).contiguous(), h)[1].cpu()
    nz = c.nonzero().flatten().tolist()
    assert len(nz) == 1 and int(c[nz[0]]) == 37, f"{float(v)!r} split over {nz}"
    return nz[0]


@pytest.mark.parametrize("rng", ["64_pm4", "7_odd", "3_from_zero", "256", "1bin", "5_offset"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_lo_and_hi_themselves(device, dtype, rng, isa):
    """lo -> bin 0, hi -> the last bin (torch.histc's rule), their outer neighbours -> underflow / overflow."""
    h = H.range(*EDGE_RANGES[rng])
    lo = torch.tensor(h.lo, dtype=dtype, device=device)
    hi = torch.tensor(h.hi, dtype=dtype, device=device)
    if float(lo) != h.lo or float(hi) != h.hi:
        pytest.skip(f"{h.lo} or {h.hi} is not a {dtype} value")
    assert _single_slot(lo, h) == 0
    assert _single_slot(hi, h) == h.bins - 1
    assert _single_slot(torch.nextafter(lo, torch.tensor(-INF, dtype=dtype, device=device)), h) == h.bins
    assert _single_slot(torch.nextafter(hi, torch.tensor(INF, dtype=dtype, device=device)), h) == h.bins + 1
    for inner in (torch.nextafter(lo, hi), torch.nextafter(hi, lo)):  # in bin 0 / the last bin unless bins are tiny
        assert _single_slot(inner, h) == int(expected_range([float(inner)], h).nonzero())


@pytest.mark.parametrize("device", DEVICES)
def test_signed_zeros_at_lo_zero(device, isa):
    h = H.range(3, 0.0, 1.0)
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        assert _single_slot(torch.tensor(0.0, dtype=dt, device=device), h) == 0
        assert _single_slot(torch.tensor(-0.0, dtype=dt, device=device), h) == 0  # -0.0 < 0.0 is false
        neg_sub = -torch.finfo(dt).tiny / 4
        assert _single_slot(torch.tensor(neg_sub, dtype=dt, device=device), h) == h.bins  # underflow
        assert _single_slot(torch.tensor(torch.finfo(dt).tiny / 4, dtype=dt, device=device), h) == 0
    h = H.range(4, -1.0, 0.0)  # 0.0 == hi: the last bin, -0.0 too
    for v in (0.0, -0.0):
        assert _single_slot(torch.tensor(v, device=device), h) == 3


@pytest.mark.parametrize("device", DEVICES)
def test_unrepresentable_edges_fp32(device, isa):
    h = H.range(10, 0.1, 0.7)
    lo32 = torch.tensor(0.1, dtype=torch.float32, device=device)
    hi32 = torch.tensor(0.7, dtype=torch.float32, device=device)
    assert float(lo32) > 0.1 and float(hi32) < 0.7  # the premise: float32 rounds 0.1 up and 0.7 down
    assert _single_slot(lo32, h) == 0
    assert _single_slot(torch.nextafter(lo32, torch.zeros_like(lo32)), h) == 10  # below 0.1: underflow
    assert _single_slot(hi32, h) == 9
    assert _single_slot(torch.nextafter(hi32, torch.ones_like(hi32)), h) == 11  # above 0.7: overflow
    # the float64 edge 0.1 + 0.06 * 5 = 0.4 (approximately): the float32 values around it
    e5 = float(h.edges()[5])
    v = torch.tensor(e5, dtype=torch.float32, device=device)
    for w in (v, torch.nextafter(v, torch.zeros_like(v)), torch.nextafter(v, torch.ones_like(v))):
        assert _single_slot(w, h) == int(expected_range([float(w)], h).nonzero())


def _extreme_values(dtype: torch.dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    mags = [fi.max, float(torch.nextafter(torch.tensor(fi.max, dtype=dtype), torch.tensor(0.0, dtype=dtype))),
            1e38, 3e38, 1e30, 65504.0, 6e4, 1e4, 1e-3, fi.tiny, fi.tiny / 4, fi.tiny * fi.eps, fi.tiny * 1.5,
            1e-30, 1e-40, 1e300, 1e-300]
    vals = [s * m for m in mags for s in (1.0, -1.0)] + [INF, -INF, NAN, 0.0, -0.0]
    x = torch.tensor(vals, dtype=torch.float64).to(dtype)  # out-of-range magnitudes become inf or 0
    int_t = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    nan_neg = (torch.tensor([NAN], dtype=dtype).view(int_t) | torch.iinfo(int_t).min).view(dtype)
    return torch.cat([x, nan_neg])


EXTREME_RANGES = [(64, -4.0, 4.0), (7, 1e-3, 2e-3), (5, -1e-30, 1e-30), (8192, -1.0, 1.0), (4, 0.0, 1e-38),
                  (3, -1e30, 1e30), (9, 1e38, 3e38), (2, -1e300, 1e300), (11, 6e4, 65504.0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_extreme_values(device, dtype, isa):
    """Far out of range, +-inf, NaN of both signs, subnormals, +-max, 1e38 with a small range, and ranges whose
    scale or shift over- or underflows float32."""
    base = _extreme_values(dtype)
    x = base.repeat(4)
    x = x[torch.randperm(x.numel(), generator=seeded("extreme", dtype))]
    for spec in EXTREME_RANGES:
        h = H.range(*spec)
        for lead in (0, 5):
            xx = torch.cat([torch.zeros(lead, dtype=dtype), x]).to(device)
            _, c = hist_of(xx, h)
            assert_counts_equal(c, expected_range(as_floats(xx), h), h, dtype, f"lead {lead}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_nan_inf_and_out_of_range_buckets(device, dtype, isa):
    h = H.range(4, -1.0, 1.0)
    x = torch.tensor([NAN, INF, -INF, -1e4, 1e4, -1.5, 1.5, 0.25, NAN, INF], dtype=dtype, device=device)
    c = hist_of(x, h)[1].cpu().tolist()
    assert c == [0, 0, 1, 0, 3, 4, 2]  # 0.25 -> bin 2; -inf, -1e4, -1.5 under; inf, 1e4, 1.5, inf over; 2 NaN


# ---------------------------------------------------------------------------------------------------------
# Exponent histograms
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_exp_layout_matches_finfo(dtype):
    lay = hookstats.exp_layout(dtype)
    fi = torch.finfo(dtype)
    assert lay.length == EXP_LENGTH[dtype] == H.exponent().length(dtype) == hookstats.Histogram.exponent().length(dtype)
    assert 2.0**lay.emin == fi.tiny
    assert 2.0**-lay.mantissa_bits == fi.eps
    assert (2 - fi.eps) * 2.0**lay.emax == fi.max
    n = lay.emax - lay.emin + 1
    assert (lay.neg.start, lay.neg.stop, lay.pos.start, lay.pos.stop) == (0, n, n, 2 * n)
    assert [lay.neg_subnormal, lay.pos_subnormal, lay.zero, lay.neg_inf, lay.pos_inf, lay.nan, lay.length] == \
        list(range(2 * n, 2 * n + 7))
    edges = H.exponent().edges(dtype)
    assert edges.numel() == n and float(edges[0]) == fi.tiny and float(edges[-1]) == 2.0**lay.emax
    assert torch.equal(edges[1:] / edges[:-1], torch.full((n - 1,), 2.0, dtype=torch.float64))


def _binade_values(dtype: torch.dtype) -> torch.Tensor:
    """For each normal exponent and sign: 2^e, 1.25 * 2^e and the largest value of the binade; the smallest,
    a middle and the largest subnormal of each sign; +-0; +-inf; three NaNs (negative, with a payload)."""
    lay = hookstats.exp_layout(dtype)
    fi = torch.finfo(dtype)
    e = torch.arange(lay.emin, lay.emax + 1, dtype=torch.float64)
    p = torch.pow(2.0, e)
    normals = torch.cat([p, p * 1.25, p * (2 - fi.eps)])
    subs = torch.tensor([fi.tiny * fi.eps, fi.tiny / 4, fi.tiny - fi.tiny * fi.eps], dtype=torch.float64)
    pos = torch.cat([normals, subs])
    x = torch.cat([pos, -pos, torch.tensor([0.0, -0.0, INF, -INF, NAN], dtype=torch.float64)]).to(dtype)
    int_t = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    qnan = torch.tensor([NAN], dtype=dtype)
    neg_nan = (qnan.view(int_t) | torch.iinfo(int_t).min).view(dtype)  # the sign bit set (neg() may drop it)
    payload = (qnan.view(int_t) + 1).view(dtype)  # a NaN with another mantissa
    assert torch.isnan(neg_nan).all() and torch.isnan(payload).all() and bool(torch.signbit(neg_nan))
    x = torch.cat([x, neg_nan, payload])
    assert torch.equal(x.to(torch.float64)[: pos.numel()], pos)  # every value is exact in dtype
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_exp_histogram_closed_form(device, dtype, isa):
    lay = hookstats.exp_layout(dtype)
    x = _binade_values(dtype)
    x = x[torch.randperm(x.numel(), generator=seeded("binades", dtype))].to(device)
    c = hookstats.exp_histogram(x)
    assert c.shape == (lay.length,) and c.dtype == torch.int64 and c.device == x.device
    c = c.cpu()
    want = torch.zeros(lay.length, dtype=torch.int64)
    want[lay.neg] = 3
    want[lay.pos] = 3
    want[[lay.neg_subnormal, lay.pos_subnormal]] = 3
    want[lay.zero] = 2
    want[lay.neg_inf] = want[lay.pos_inf] = 1
    want[lay.nan] = 3
    assert_counts_equal(c, want, H.exponent(), dtype)
    assert_counts_equal(c, expected_exp(as_floats(x), dtype), H.exponent(), dtype, "frexp")
    assert_counts_equal(c, reference.histogram_of(x.cpu(), H.exponent()), H.exponent(), dtype, "reference")


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_subnormals_are_subnormal_in_fp16(device, isa):
    """2^-15 .. 2^-24 are normal floats once converted, but subnormal halfs: counted as subnormal."""
    lay = hookstats.exp_layout(torch.float16)
    vals = [2.0**-15, 2.0**-24, 3 * 2.0**-20, 2.0**-14 - 2.0**-24]
    x = torch.tensor(vals + [-v for v in vals] + [2.0**-14, -(2.0**-14)], dtype=torch.float16).repeat(9).to(device)
    c = hookstats.exp_histogram(x).cpu()
    assert int(c[lay.pos_subnormal]) == int(c[lay.neg_subnormal]) == 36
    assert int(c[lay.pos.start]) == int(c[lay.neg.start]) == 9  # 2^-14 is the smallest normal half
    assert int(c.sum()) == x.numel()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_exp_histogram_randn_scales(device, dtype, isa):
    gen = seeded("exp_scales", dtype)
    fi = torch.finfo(dtype)
    parts = [torch.randn(1500, generator=gen, dtype=torch.float64) * s for s in (1.0, 1e-3, 1e3)]
    parts.append(torch.randn(1000, generator=gen, dtype=torch.float64) * fi.tiny)  # straddles subnormals
    parts.append(torch.randn(1000, generator=gen, dtype=torch.float64) * fi.max / 4)  # some overflow to inf
    x = torch.cat(parts).to(dtype).to(device)
    c = hookstats.exp_histogram(x)
    assert_counts_equal(c, reference.histogram_of(x.cpu(), H.exponent()), H.exponent(), dtype)
    assert_counts_equal(c, expected_exp(as_floats(x), dtype), H.exponent(), dtype, "frexp")


# ---------------------------------------------------------------------------------------------------------
# Peaked data: every value in one slot (a lost or doubled counter copy shows at once)
# ---------------------------------------------------------------------------------------------------------

PEAKS = [0.0, -0.0, 0.5, -4.0, 4.0, 3.9999, NAN, INF, -INF, 1e-6]


@pytest.mark.parametrize("n", [2 * 4096 + 17, 2**17 + 3], ids=lambda n: f"n{n}")  # 1 and 4 tasks
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_peaked(device, dtype, n, isa):
    for v in PEAKS:
        x = torch.full((n,), v, dtype=dtype, device=device)
        xv = float(x[0])
        for name in ("64_pm4", "1bin", "exp"):
            h = HISTS[name]
            _, c = hist_of(x, h)
            c = c.cpu()
            slot = exp_slot(xv, dtype) if h.kind == "exp" else int(expected_range([xv], h).nonzero())
            assert int(c[slot]) == n, f"{v} ({name}): {slot_name(h, slot, dtype)} holds {int(c[slot])} of {n}"
    # expanded: one value read n times
    x = torch.tensor([0.5], dtype=dtype, device=device).expand(n)
    assert int(hist_of(x, HISTS["64_pm4"])[1][36]) == n


# ---------------------------------------------------------------------------------------------------------
# The statistics from the same read
# ---------------------------------------------------------------------------------------------------------

def _stats_values(kind: str, dtype: torch.dtype) -> torch.Tensor:
    gen = seeded("same_pass", kind, dtype)
    n = 3 * 4096 + 5
    fi = torch.finfo(dtype)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    if kind == "nan_inf":
        x[[5, 4097, n - 1]] = torch.tensor([NAN, INF, -INF], dtype=torch.float64)
    elif kind == "inf":
        x[[17, 9000]] = INF
    elif kind == "huge":
        x = x * (fi.max / 1e3)
    elif kind == "subnormal":
        x = torch.randint(-3, 4, (n,), generator=gen).to(torch.float64) * (fi.tiny / 4)
    elif kind == "offset":
        x = x + 1e4
    elif kind == "empty":
        x = x[:0]
    return x.to(dtype)


@pytest.mark.parametrize("kind", ["randn", "nan_inf", "inf", "huge", "subnormal", "offset", "empty"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_same_pass_stats_bitwise(device, dtype, kind, isa):
    x = _stats_values(kind, dtype).to(device)
    plain = hookstats.stats(x)
    for name, h in HISTS.items():
        s, c = hist_of(x, h)
        assert_bitwise_equal(s, plain)
        values, counts, hist = torch.ops.hookstats.stats_hist.default(x, h.mode, h.bins, h.lo, h.hi)
        assert torch.equal(hist, c), name
        assert torch.equal(bits(values), bits(torch.stack([plain.sum, plain.mean, plain.var, plain.std, plain.l1,
                                                           plain.l2, plain.linf, plain.min, plain.max])))
        assert torch.equal(counts.cpu(), torch.stack([plain.numel, plain.nan_count, plain.inf_count,
                                                      plain.zero_count]).cpu())
    for buf_dtype in (torch.float32, torch.float64):
        ref_buf = hookstats.stats_buffer(1, device=device, dtype=buf_dtype)
        hookstats.stats_into(x, ref_buf, 0)
        for name, h in HISTS.items():
            buf = hookstats.stats_buffer(1, device=device, dtype=buf_dtype)
            hb = hookstats.histogram_buffer(1, h, dtype=dtype, device=device)
            hookstats.stats_into(x, buf, 0, hist=hb, histogram=h)
            assert torch.equal(bits(buf), bits(ref_buf)), f"stats_into row with {name} histogram"


# ---------------------------------------------------------------------------------------------------------
# stats_into: a histogram row is written, like a stats row, or added to with accumulate=True
# (Note [histogram rows] in csrc/core/bindings.h)
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("buf_dtype", [pytest.param(torch.float32, id="buf32"), pytest.param(torch.float64, id="buf64")])
@pytest.mark.parametrize("hname", ["7_odd", "exp"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_stats_into_writes_hist_rows(device, dtype, hname, buf_dtype, isa):
    h = HISTS[hname]
    gen = seeded("write", dtype, hname)
    x = sweep_values(70001, dtype, gen).to(device)
    y = sweep_values(5003, dtype, gen).to(device)[::2]
    hx, hy = hist_of(x, h)[1], hist_of(y, h)[1]
    L = h.length(dtype)
    out = hookstats.stats_buffer(4, device=device, dtype=buf_dtype)
    hb = torch.full((4, L), 2**40 + 3, dtype=torch.int64, device=device)  # rows that already hold counts
    keep = hb[0].clone()

    hookstats.stats_into(x, out, 1, hist=hb, histogram=h)
    assert torch.equal(hb[1], hx)
    for r in (0, 2, 3):
        assert torch.equal(hb[r], keep), f"row {r} was touched"
    hookstats.stats_into(x, out, 1, hist=hb, histogram=h)
    assert torch.equal(hb[1], hx), "a second call must leave the same row (written, not added)"
    hookstats.stats_into(y, out, 0, hist=hb, hist_slot=1, histogram=h)
    assert torch.equal(hb[1], hy)
    # the raw op's default writes too, and so does hist_accumulate=False
    torch.ops.hookstats.stats_into.default(x, out, 2, hb, 3, h.mode, h.bins, h.lo, h.hi)
    assert torch.equal(hb[3], hx)
    torch.ops.hookstats.stats_into.default(x, out, 2, hb, 3, h.mode, h.bins, h.lo, h.hi, False)
    assert torch.equal(hb[3], hx)
    # an empty tensor writes a row of zeros
    hookstats.stats_into(x[:0], out, 0, hist=hb, hist_slot=2, histogram=h)
    assert not hb[2].any()
    # the fallback (hookstats.reference) follows the same rule
    fb = torch.full((2, L), 7, dtype=torch.int64, device=device)
    reference.hist_into(x, h, fb, 1)
    assert torch.equal(fb[1], hx) and (fb[0] == 7).all()
    reference.hist_into(x, h, fb, 1, accumulate=True)
    assert torch.equal(fb[1], 2 * hx)


@pytest.mark.parametrize("buf_dtype", [pytest.param(torch.float32, id="buf32"), pytest.param(torch.float64, id="buf64")])
@pytest.mark.parametrize("hname", ["7_odd", "exp"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_stats_into_accumulates(device, dtype, hname, buf_dtype, isa):
    h = HISTS[hname]
    gen = seeded("accumulate", dtype, hname)
    x = sweep_values(70001, dtype, gen).to(device)
    y = sweep_values(5003, dtype, gen).to(device)[::2]
    hx, hy = hist_of(x, h)[1], hist_of(y, h)[1]
    L = h.length(dtype)
    out = hookstats.stats_buffer(4, device=device, dtype=buf_dtype)
    hb = hookstats.histogram_buffer(4, h, dtype=dtype, device=device)
    assert hb.shape == (4, L) and hb.dtype == torch.int64 and hb.device == x.device and not hb.any()
    zero = torch.zeros(L, dtype=torch.int64, device=device)

    hookstats.stats_into(x, out, 1, hist=hb, histogram=h, accumulate=True)
    assert torch.equal(hb[1], hx)
    for r in (0, 2, 3):
        assert torch.equal(hb[r], zero), f"row {r} was touched"
    hookstats.stats_into(x, out, 1, hist=hb, histogram=h, accumulate=True)
    assert torch.equal(hb[1], 2 * hx)
    # another hist_slot than slot: the stats go to row 0, the histogram to row 3
    hookstats.stats_into(y, out, 0, hist=hb, hist_slot=3, histogram=h, accumulate=True)
    assert torch.equal(hb[3], hy) and torch.equal(hb[1], 2 * hx) and torch.equal(hb[0], zero)
    assert torch.isnan(out[2:]).all(), "stats rows 2 and 3 were written"
    # the raw op adds with hist_accumulate=True
    torch.ops.hookstats.stats_into.default(y, out, 2, hb, 1, h.mode, h.bins, h.lo, h.hi, True)
    assert torch.equal(hb[1], 2 * hx + hy)
    # the stats rows are stats_into without a histogram
    ref = hookstats.stats_buffer(4, device=device, dtype=buf_dtype)
    hookstats.stats_into(x, ref, 1)
    hookstats.stats_into(y, ref, 0)
    hookstats.stats_into(y, ref, 2)
    assert torch.equal(bits(out[:3]), bits(ref[:3]))
    # added, not written: a buffer that already holds counts
    pre = torch.full((2, L), 2**40 + 3, dtype=torch.int64, device=device)
    hookstats.stats_into(x, out, 0, hist=pre, hist_slot=1, histogram=h, accumulate=True)
    assert torch.equal(pre[1], hx + (2**40 + 3)) and (pre[0] == 2**40 + 3).all()
    # an empty tensor adds nothing
    hookstats.stats_into(x[:0], out, 0, hist=pre, hist_slot=1, histogram=h, accumulate=True)
    assert torch.equal(pre[1], hx + (2**40 + 3))


@pytest.mark.parametrize("device", DEVICES)
def test_histogram_buffer_with_padded_rows_and_offset(device, isa):
    """Rows with unit stride but a row stride above the length, starting past the storage's beginning: only the
    chosen row's counts change."""
    h = HISTS["7_odd"]
    x = sweep_values(9001, torch.float32, seeded("padded")).to(device)
    hx = hist_of(x, h)[1]
    L = h.length(torch.float32)
    big = torch.full((5, L + 5), -1, dtype=torch.int64, device=device)
    view = big[1:4, :L]
    hookstats.stats_into(x, hookstats.stats_buffer(1, device=device), 0, hist=view, hist_slot=1, histogram=h)
    expect = torch.full((5, L + 5), -1, dtype=torch.int64, device=device)
    expect[2, :L] = hx
    assert torch.equal(big, expect)
    hookstats.stats_into(x, hookstats.stats_buffer(1, device=device), 0, hist=view, hist_slot=1, histogram=h,
                         accumulate=True)
    expect[2, :L] += hx
    assert torch.equal(big, expect)


@pytest.mark.parametrize("device", DEVICES)
def test_spec_spellings_agree(device, isa):
    x = sweep_values(20001, torch.float32, seeded("spellings")).to(device)
    want_r = hist_of(x, H.range(32, -2.0, 2.0))[1]
    for spec in ((32, (-2.0, 2.0)), (32, (-2, 2)), H.range(32, -2, 2)):
        assert torch.equal(hookstats.stats(x, histogram=spec)[1], want_r), spec
    assert torch.equal(hookstats.histogram(x, 32, range=(-2.0, 2.0)), want_r)
    assert torch.equal(hookstats.histogram(x, 32, range=[-2.0, 2.0]), want_r)
    assert hookstats.histogram(x, range=(-2.0, 2.0)).shape == (64 + 3,)  # bins=64 by default
    want_e = hist_of(x, H.exponent())[1]
    for spec in ("exp", "exponent", H.exponent()):
        assert torch.equal(hookstats.stats(x, histogram=spec)[1], want_e), spec
    assert torch.equal(hookstats.exp_histogram(x), want_e)
    assert H.range(5, 0, 1).length(torch.float16) == 8 and H.range(8192, 0, 1).length(torch.float64) == 8195
    e = H.range(5, -1, 1.5).edges()
    assert e.dtype == torch.float64 and e.numel() == 6 and float(e[0]) == -1.0 and float(e[-1]) == 1.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_empty_tensor(device, dtype):
    for shape in ((0,), (3, 0), (0, 4, 5)):
        x = torch.empty(shape, dtype=dtype, device=device)
        for h in HISTS.values():
            s, c = hist_of(x, h)
            assert not c.any() and int(s.numel) == 0


# ---------------------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_does_not_change_bits(dtype, isa, restore_threads):
    xs = [sweep_values(2**20 + 3, dtype, seeded("det", dtype)),
          sweep_values(4099 * 70, dtype, seeded("det2", dtype)).reshape(4099, 70)[:, ::3]]
    for x in xs:
        for h in (HISTS["64_pm4"], HISTS["exp"]):
            results = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                results.append(hist_of(x, h))
            for s, c in results[1:]:
                assert torch.equal(c, results[0][1])
                assert_bitwise_equal(s, results[0][0])
            assert_counts_equal(results[0][1], reference.histogram_of(x, h), h, dtype)


# ---------------------------------------------------------------------------------------------------------
# Errors: raised before any work
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bins", [0, -1, hookstats.MAX_HIST_BINS + 1, 10**12])
def test_rejects_bins_out_of_range(bins):
    assert hookstats.MAX_HIST_BINS == 8192
    x = torch.ones(3)
    with pytest.raises(ValueError, match="bins"):
        hookstats.histogram(x, bins, range=(0, 1))
    with pytest.raises(ValueError, match="bins"):
        H.range(bins, 0.0, 1.0)
    with pytest.raises(ValueError, match="bins"):
        hookstats.stats(x, histogram=(bins, (0.0, 1.0)))
    with pytest.raises(ValueError, match="bins"):
        torch.ops.hookstats.stats_hist.default(x, 1, bins, 0.0, 1.0)


def test_max_bins_accepted():
    x = torch.linspace(-1, 1, 10001)
    c = hookstats.histogram(x, hookstats.MAX_HIST_BINS, range=(-1, 1))
    assert c.shape == (8195,) and int(c.sum()) == 10001
    assert_counts_equal(c, reference.histogram_of(x, H.range(8192, -1.0, 1.0)), H.range(8192, -1.0, 1.0),
                        torch.float32)


@pytest.mark.parametrize("bins", [2.0, True, "4", None], ids=repr)
def test_rejects_non_int_bins(bins):
    with pytest.raises(TypeError, match="int"):
        hookstats.histogram(torch.ones(3), bins, range=(0, 1))
    with pytest.raises(TypeError, match="int"):
        hookstats.stats(torch.ones(3), histogram=(bins, (0, 1)))


BAD_RANGES = [(1.0, 1.0), (2.0, 1.0), (0.0, -0.0), (NAN, 1.0), (0.0, NAN), (0.0, INF), (-INF, 0.0), (-INF, INF),
              (-1e308, 1e308), (-1.7e308, 1.7e308)]


@pytest.mark.parametrize("lo,hi", BAD_RANGES, ids=repr)
def test_rejects_bad_range(lo, hi):
    x = torch.ones(3)
    out = hookstats.stats_buffer(1)
    hb = torch.zeros(1, 7, dtype=torch.int64)
    for call in (lambda: hookstats.histogram(x, 4, range=(lo, hi)), lambda: H.range(4, lo, hi),
                 lambda: hookstats.stats(x, histogram=(4, (lo, hi))),
                 lambda: torch.ops.hookstats.stats_hist.default(x, 1, 4, lo, hi),
                 lambda: torch.ops.hookstats.stats_into.default(x, out, 0, hb, 0, 1, 4, lo, hi)):
        with pytest.raises(ValueError, match="range"):
            call()
    assert torch.isnan(out).all() and not hb.any()


@pytest.mark.parametrize("spec", ["log", "", "EXP"], ids=repr)
def test_rejects_unknown_histogram_name(spec):
    with pytest.raises(ValueError, match="unknown histogram"):
        hookstats.stats(torch.ones(3), histogram=spec)
    with pytest.raises(ValueError, match="unknown histogram"):
        hookstats.histogram_buffer(2, spec)


@pytest.mark.parametrize("spec", [5, [64, (0, 1)], (64, 0, 1), (64, (0, 1, 2)), (64, [0, 1]), {"bins": 4}, 1.5],
                         ids=repr)
def test_rejects_malformed_histogram_spec(spec):
    x = torch.ones(3)
    with pytest.raises(TypeError, match="histogram"):
        hookstats.stats(x, histogram=spec)
    out, hb = hookstats.stats_buffer(1), torch.zeros(1, 7, dtype=torch.int64)
    with pytest.raises(TypeError, match="histogram"):
        hookstats.stats_into(x, out, 0, hist=hb, histogram=spec)
    assert torch.isnan(out).all() and not hb.any()


def test_rejects_bad_mode():
    x = torch.ones(3)
    for mode in (0, 3, -1):
        with pytest.raises(ValueError, match="mode"):
            torch.ops.hookstats.stats_hist.default(x, mode, 4, 0.0, 1.0)
        out, hb = hookstats.stats_buffer(1), torch.zeros(1, 7, dtype=torch.int64)
        with pytest.raises(ValueError, match="mode"):
            torch.ops.hookstats.stats_into.default(x, out, 0, hb, 0, mode, 4, 0.0, 1.0)
        assert torch.isnan(out).all() and not hb.any()
    with pytest.raises(ValueError, match="mode"):
        hookstats.stats(x, histogram=H(3, 4, 0.0, 1.0))


BAD_DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_rejects_non_float_inputs(dtype):
    x = torch.ones(4, dtype=dtype)
    name = str(dtype)
    with pytest.raises(TypeError, match=name):
        hookstats.histogram(x, 4, range=(0, 1))
    with pytest.raises(TypeError, match=name):
        hookstats.exp_histogram(x)
    with pytest.raises(TypeError, match=name):
        hookstats.stats(x, histogram="exp")
    out, hb = hookstats.stats_buffer(1), hookstats.histogram_buffer(1, (4, (0, 1)))
    with pytest.raises(TypeError, match=name):
        hookstats.stats_into(x, out, 0, hist=hb, histogram=(4, (0, 1)))
    for mode in (1, 2):
        with pytest.raises(TypeError, match="floating tensor"):
            torch.ops.hookstats.stats_hist.default(x, mode, 4, 0.0, 1.0)
    with pytest.raises(TypeError, match="floating tensor"):
        torch.ops.hookstats.stats_into.default(x, out, 0, hb, 0, 1, 4, 0.0, 1.0)
    with pytest.raises(TypeError):
        hookstats.exp_layout(dtype)
    assert torch.isnan(out).all() and not hb.any()


def _into_both(x, out, slot, hb, hist_slot, h):
    """stats_into with a histogram through the Python wrapper and through the raw op."""
    yield lambda: hookstats.stats_into(x, out, slot, hist=hb, hist_slot=hist_slot, histogram=h)
    yield lambda: torch.ops.hookstats.stats_into.default(x, out, slot, hb, hist_slot, h.mode, h.bins, h.lo, h.hi)


@pytest.mark.parametrize("hb_dtype", [torch.int32, torch.float32, torch.float64, torch.uint8, torch.bool], ids=str)
def test_rejects_hist_buffer_dtype(hb_dtype):
    h = HISTS["7_odd"]
    out = hookstats.stats_buffer(2)
    hb = torch.zeros(2, h.length(torch.float32), dtype=hb_dtype)
    for call in _into_both(torch.ones(3), out, 0, hb, 0, h):
        with pytest.raises(TypeError, match="int64"):
            call()
    assert torch.isnan(out).all() and not hb.any()


@pytest.mark.parametrize("case", ["short", "long", "1d", "3d", "transposed", "exp_for_fp64", "exp_for_fp16",
                                  "range_other_bins"])
def test_rejects_hist_buffer_shape(case):
    h = HISTS["7_odd"] if case not in ("exp_for_fp64", "exp_for_fp16") else HISTS["exp"]
    L = h.length(torch.float32)
    hb = {
        "short": lambda: torch.zeros(2, L - 1, dtype=torch.int64),
        "long": lambda: torch.zeros(2, L + 1, dtype=torch.int64),
        "1d": lambda: torch.zeros(L, dtype=torch.int64),
        "3d": lambda: torch.zeros(2, L, 1, dtype=torch.int64),
        "transposed": lambda: torch.zeros(L, 2, dtype=torch.int64).t(),
        "exp_for_fp64": lambda: hookstats.histogram_buffer(2, "exp", dtype=torch.float64),
        "exp_for_fp16": lambda: hookstats.histogram_buffer(2, "exp", dtype=torch.float16),
        "range_other_bins": lambda: hookstats.histogram_buffer(2, (8, (-0.5, 3.1))),
    }[case]()
    out = hookstats.stats_buffer(2)
    for call in _into_both(torch.ones(3), out, 0, hb, 0, h):
        with pytest.raises(ValueError, match="shape"):
            call()
    assert torch.isnan(out).all() and not hb.any()


@pytest.mark.parametrize("hist_slot", [-1, 2, 100])
def test_rejects_hist_slot_out_of_range(hist_slot):
    h = HISTS["exp"]
    out, hb = hookstats.stats_buffer(4), hookstats.histogram_buffer(2, h)
    for call in _into_both(torch.ones(3), out, 3, hb, hist_slot, h):
        with pytest.raises(ValueError, match="out of range"):
            call()
    assert torch.isnan(out).all() and not hb.any()
    # the default hist_slot is slot: 3 is a valid stats row but not a histogram row
    with pytest.raises(ValueError, match="out of range"):
        hookstats.stats_into(torch.ones(3), out, 3, hist=hb, histogram=h)
    assert torch.isnan(out).all() and not hb.any()


def test_rejects_hist_buffer_on_other_device():
    h = HISTS["7_odd"]
    out = hookstats.stats_buffer(2)
    hb = hookstats.histogram_buffer(2, h, device="meta")
    with pytest.raises(ValueError, match="meta"):
        hookstats.stats_into(torch.ones(3), out, 0, hist=hb, histogram=h)
    assert torch.isnan(out).all()
    if cuda_ready():
        hb = hookstats.histogram_buffer(2, h, device="cuda")
        for call in _into_both(torch.ones(3), out, 0, hb, 0, h):
            with pytest.raises(ValueError, match="cuda"):
                call()
        assert torch.isnan(out).all() and not hb.any()


def test_hist_without_histogram_spec():
    out, hb = hookstats.stats_buffer(1), hookstats.histogram_buffer(1, "exp")
    with pytest.raises(ValueError, match="histogram="):
        hookstats.stats_into(torch.ones(3), out, 0, hist=hb)
    assert torch.isnan(out).all() and not hb.any()


def test_histogram_buffer_arguments():
    hb = hookstats.histogram_buffer(3, (10, (0, 1)), dtype=torch.float64)
    assert hb.shape == (3, 13) and hb.dtype == torch.int64 and not hb.any()
    for dt in DTYPES:
        dt = dt.values[0]
        assert hookstats.histogram_buffer(2, "exp", dtype=dt).shape == (2, EXP_LENGTH[dt])
    for slots in (0, -1, 2.0):
        with pytest.raises(ValueError, match="slots"):
            hookstats.histogram_buffer(slots, "exp")
    with pytest.raises(TypeError, match="histogram"):
        hookstats.histogram(torch.ones(3), 4, range=1.0)


# ---------------------------------------------------------------------------------------------------------
# Over 2^31 elements (slow)
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_more_than_2_31_elements_expanded(device):
    n = 2**31 + 7
    x = torch.tensor([0.5], device=device).expand(n)  # stride 0: no memory
    h = H.range(64, -3.0, 3.0)  # 0.5 is bin 37, away from an edge
    out = hookstats.stats_buffer(1, device=device, dtype=torch.float64)
    hb = torch.full((1, h.length(torch.float32)), 2**33, dtype=torch.int64, device=device)
    hookstats.stats_into(x, out, 0, hist=hb, histogram=h, accumulate=True)
    want = torch.full((h.length(torch.float32),), 2**33, dtype=torch.int64)
    want[37] += n
    assert torch.equal(hb[0].cpu(), want)
    assert int(out[0, 0]) == n  # numel


# ---------------------------------------------------------------------------------------------------------
# opcheck and torch.compile
# ---------------------------------------------------------------------------------------------------------

OPCHECK_INPUTS = {
    "fp32_contiguous": lambda d: torch.randn(33, 17, device=d),
    "fp64_transposed": lambda d: torch.randn(17, 33, dtype=torch.float64, device=d).t(),
    "fp16_misaligned": lambda d: torch.randn(1001, device=d).half()[1:],
    "bf16_expanded": lambda d: torch.randn(1, 40, device=d).bfloat16().expand(30, 40),
    "fp32_nan": lambda d: torch.tensor([1.0, NAN, INF, 0.5], device=d),
}
OPCHECK_HISTS = {"range": (1, 64, -3.0, 3.0), "exp": (2, 0, 0.0, 0.0)}


@pytest.mark.parametrize("hname", list(OPCHECK_HISTS))
@pytest.mark.parametrize("inp", list(OPCHECK_INPUTS))
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_stats_hist(device, inp, hname):
    x = OPCHECK_INPUTS[inp](device)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if x.numel() < 2 or not torch.isfinite(x).all():
        utils = utils[:-1]  # NaN outputs fail its equal_nan=False comparison by construction (see test_stats.py)
    torch.library.opcheck(torch.ops.hookstats.stats_hist.default, (x, *OPCHECK_HISTS[hname]), test_utils=utils)


def _hist_fn(x):
    s, counts = hookstats.stats(x, histogram=(64, (-3.0, 3.0)))
    return counts.float().sum() + s.l2


def _exp_fn(x):
    s, counts = hookstats.stats(x, histogram="exp")
    return counts[: counts.shape[0] // 2].sum() * 2 + s.nan_count


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_stats_with_histogram(device):
    torch._dynamo.reset()
    for fn in (_hist_fn, _exp_fn):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        for x in (torch.randn(100, 7), torch.tensor([1.0, NAN, 2.0, 10.0]), torch.randn(50, dtype=torch.float64)):
            x = x.to(device)
            torch.testing.assert_close(compiled(x), fn(x), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("hname", list(OPCHECK_HISTS))
@pytest.mark.parametrize("inp", ["fp32_contiguous", "fp16_misaligned"])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_stats_into_with_hist(device, inp, hname):
    x = OPCHECK_INPUTS[inp](device)
    mode, bins, lo, hi = OPCHECK_HISTS[hname]
    h = H.exponent() if mode == 2 else H.range(bins, lo, hi)
    buf = hookstats.stats_buffer(5, device=device)
    hb = hookstats.histogram_buffer(3, h, dtype=x.dtype, device=device)
    torch.library.opcheck(torch.ops.hookstats.stats_into.default, (x, buf, 3, hb, 1, mode, bins, lo, hi))
    torch.library.opcheck(torch.ops.hookstats.stats_into.default, (x, buf, 3, hb, 1, mode, bins, lo, hi, True))


def _into_hist_fn(x, buf, hb):
    hookstats.stats_into(x, buf, 1, hist=hb, histogram="exp")
    hookstats.stats_into(x * 2, buf, 0, hist=hb, hist_slot=1, histogram="exp")
    return hb.sum()


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_stats_into_with_hist(device):
    torch._dynamo.reset()
    compiled = torch.compile(_into_hist_fn, fullgraph=True, backend="aot_eager")
    x = torch.randn(100, 7, device=device)
    b1, b2 = hookstats.stats_buffer(2, device=device), hookstats.stats_buffer(2, device=device)
    h1, h2 = hookstats.histogram_buffer(2, "exp", device=device), hookstats.histogram_buffer(2, "exp", device=device)
    torch.testing.assert_close(compiled(x, b1, h1), _into_hist_fn(x, b2, h2), rtol=0, atol=0)
    assert torch.equal(h1, h2)
    torch.testing.assert_close(b1, b2, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------------------
# Will it fit? format_fit against the casts themselves
# ---------------------------------------------------------------------------------------------------------

TARGETS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn,
           "float8_e5m2": torch.float8_e5m2}


def test_formats_match_finfo():
    assert set(hookstats.FORMATS) == set(TARGETS)
    for name, f in hookstats.FORMATS.items():
        fi = torch.finfo(TARGETS[name])
        assert f.max == fi.max, name
        assert 2.0**f.emin == fi.smallest_normal, name
        assert 2.0**-f.mantissa_bits == fi.eps, name
        assert f.emax == math.floor(math.log2(fi.max)), name


def _actual_fit(x: torch.Tensor, target: torch.dtype) -> dict:
    """Fractions of x's values whose cast to target overflows (finite -> inf/NaN, or clipped to the max: torch
    saturates float8_e4m3fn), underflows (nonzero -> 0), is subnormal, or that are inf/NaN already."""
    y = x.to(target).to(torch.float64)
    xf = x.to(torch.float64)
    fin = torch.isfinite(xf)
    fi = torch.finfo(target)
    n = max(x.numel(), 1)
    clipped = (y.abs() == fi.max) & (xf.abs() > fi.max)
    return {
        "overflow": int((fin & (~torch.isfinite(y) | clipped)).sum()) / n,
        "underflow": int((fin & (xf != 0) & (y == 0)).sum()) / n,
        "subnormal": int((torch.isfinite(y) & (y != 0) & (y.abs() < fi.smallest_normal)).sum()) / n,
        "nonfinite": int((~fin).sum()) / n,
    }


def _input_subnormals(dtype: torch.dtype) -> torch.Tensor:
    """The smallest, a middle and the largest positive subnormal of dtype."""
    fi = torch.finfo(dtype)
    return torch.tensor([fi.tiny * fi.eps, fi.tiny / 4, fi.tiny - fi.tiny * fi.eps], dtype=dtype)


def _subnormal_class(dtype: torch.dtype, target: torch.dtype) -> str:
    """What a cast to target makes of all of dtype's subnormals: "underflow", "subnormal", "normal", or "mixed"
    (the smallest and the largest decide it: the cast is monotonic)."""
    y = _input_subnormals(dtype).to(target).to(torch.float64)
    cls = ["underflow" if v == 0 else ("subnormal" if v < torch.finfo(target).smallest_normal else "normal")
           for v in y[[0, 2]].tolist()]
    return cls[0] if cls[0] == cls[1] else "mixed"


def _fit_values(dtype: torch.dtype, fmt: str) -> torch.Tensor:
    """m * 2^e for every normal exponent of dtype, m in {1, 1.25, 1.5} (so no value lies in a format's top binade
    above its max), both signs, 1 + e % 4 copies each; zeros, infs, NaNs; dtype's subnormals where a cast makes
    them all underflow or all subnormal. Leaves out the binade below the format's smallest subnormal, where
    format_fit's documented one-binade resolution and the cast disagree (test_format_fit_boundary_binades), and
    subnormals that straddle the threshold or become normals (test_format_fit_input_subnormals_*)."""
    lay = hookstats.exp_layout(dtype)
    f = hookstats.FORMATS[fmt]
    vals = []
    for e in range(lay.emin, lay.emax + 1):
        if e == f.emin - f.mantissa_bits - 1:
            continue
        for m in (1.0, 1.25, 1.5):
            vals += [m * 2.0**e, -m * 2.0**e] * (1 + e % 4)
    if _subnormal_class(dtype, TARGETS[fmt]) in ("underflow", "subnormal"):
        subs = as_floats(_input_subnormals(dtype))
        vals += subs * 3 + [-v for v in subs]
    vals += [0.0, -0.0, 0.0, INF, -INF, NAN, NAN]
    return torch.tensor(vals, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("fmt", list(TARGETS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_format_fit_matches_casts(device, dtype, fmt):
    x = _fit_values(dtype, fmt).to(device)
    counts = hookstats.exp_histogram(x)
    fit = hookstats.format_fit(counts, dtype, [fmt])
    assert list(fit) == [fmt]
    want = _actual_fit(x.cpu(), TARGETS[fmt])
    assert set(fit[fmt]) == set(want)
    for k, v in fit[fmt].items():
        assert v.dtype == torch.float64 and v.shape == () and v.device == counts.device
        assert float(v) == want[k], f"{fmt} from {dtype}: {k} is {float(v)!r}, a cast gives {want[k]!r}"
    fits_entirely = {(torch.float32, "bfloat16"), (torch.float16, "bfloat16"), (torch.float16, "float8_e5m2")}
    if (dtype, fmt) not in fits_entirely:  # (their subnormals are left out: see _fit_values)
        assert any(want[k] > 0 for k in ("overflow", "underflow", "subnormal")), want


@pytest.mark.parametrize("device", DEVICES)
def test_format_fit_boundary_binades(device):
    """The documented one-binade resolution, checked directly where a cast says otherwise."""

    def fit_of(values, dtype=torch.float64, fmt=None):
        c = hookstats.exp_histogram(torch.tensor(values, dtype=dtype, device=device))
        return {k: float(v) for k, v in hookstats.format_fit(c, dtype, [fmt])[fmt].items()}

    # the top binade of e4m3fn is [256, 512) but its max is 448: 480 and 500 are beyond it, yet "fit"
    assert fit_of([480.0, 500.0], fmt="float8_e4m3fn")["overflow"] == 0.0
    assert fit_of([512.0, 1.0], fmt="float8_e4m3fn")["overflow"] == 0.5
    # float16: 65520 rounds to inf, but is in the top binade; 65536 is in the next one
    assert torch.isinf(torch.tensor(65520.0).half())
    assert fit_of([65520.0, 1.0], torch.float32, "float16")["overflow"] == 0.0
    assert fit_of([65536.0, 1.0], torch.float32, "float16")["overflow"] == 0.5
    # the binade just below the smallest subnormal counts as underflow, even where the cast rounds up
    for fmt, f in hookstats.FORMATS.items():
        e = f.emin - f.mantissa_bits
        v = 1.75 * 2.0**(e - 1)
        assert float(torch.tensor(v).to(TARGETS[fmt]).double()) == 2.0**e  # the cast rounds it up to nonzero
        r = fit_of([v, 2.0**e, 2.0**(f.emin - 1), 1.0], fmt=fmt)
        assert (r["underflow"], r["subnormal"], r["overflow"]) == (0.25, 0.5, 0.0), fmt
        assert fit_of([2.0**(f.emax + 1), -(2.0**f.emax) * 1.5], fmt=fmt)["overflow"] == 0.5, fmt


@pytest.mark.parametrize("dtype", DTYPES)
def test_format_fit_input_subnormals_counted_once(dtype):
    """dtype's own subnormals have no exponent in the histogram: each is counted once, as underflow when a cast
    makes all of them zero, as subnormal when it keeps all of them subnormal. (float32 -> bfloat16 and
    float16 -> float8_e5m2 straddle the threshold: there only the single count is checked; subnormals that the
    format holds as normals: test_format_fit_input_subnormals_that_are_normal_in_the_format.)"""
    subs = _input_subnormals(dtype)
    x = torch.cat([subs, -subs, torch.ones(2, dtype=dtype)])
    fit = hookstats.format_fit(hookstats.exp_histogram(x), dtype)
    for fmt, target in TARGETS.items():
        r = {k: float(v) for k, v in fit[fmt].items()}
        assert r["overflow"] == 0.0 and r["nonfinite"] == 0.0
        cls = _subnormal_class(dtype, target)
        if cls == "underflow":
            assert (r["underflow"], r["subnormal"]) == (0.75, 0.0), (fmt, r)
        elif cls == "subnormal":
            assert (r["underflow"], r["subnormal"]) == (0.0, 0.75), (fmt, r)
        elif cls == "mixed":
            assert r["underflow"] + r["subnormal"] == 0.75, (fmt, r)


@pytest.mark.parametrize("device", DEVICES)
def test_format_fit_from_a_stats_into_row(device):
    x = _fit_values(torch.float32, "float8_e4m3fn").to(device)
    hb = hookstats.histogram_buffer(3, "exp", dtype=torch.float32, device=device)
    hookstats.stats_into(x, hookstats.stats_buffer(3, device=device), 2, hist=hb, histogram="exp")
    hookstats.stats_into(x, hookstats.stats_buffer(3, device=device), 2, hist=hb, histogram="exp")
    a = hookstats.format_fit(hb[2], torch.float32)
    b = hookstats.format_fit(hookstats.exp_histogram(x), torch.float32)
    assert set(a) == set(hookstats.FORMATS)
    for fmt in a:
        for k in a[fmt]:
            assert float(a[fmt][k]) == float(b[fmt][k]), (fmt, k)  # doubling every count changes no fraction
    assert float(a["float8_e4m3fn"]["overflow"]) > 0


def test_format_fit_arguments():
    c = hookstats.exp_histogram(torch.randn(100))
    with pytest.raises(ValueError, match="514"):
        hookstats.format_fit(c[:-1], torch.float32)
    with pytest.raises(ValueError, match="66"):
        hookstats.format_fit(c, torch.float16)
    with pytest.raises(ValueError):
        hookstats.format_fit(c.reshape(2, 257), torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fnuz"):
        hookstats.format_fit(c, torch.float32, ["float8_e4m3fnuz"])
    with pytest.raises(TypeError):
        hookstats.format_fit(c, torch.int32)
    empty = hookstats.format_fit(torch.zeros(514, dtype=torch.int64), torch.float32)
    assert all(float(v) == 0.0 for d in empty.values() for v in d.values())  # not NaN


# ---------------------------------------------------------------------------------------------------------
# The CPU kernel's shortcuts (issue 14): constant chunks counted at once (Note [cpu constant chunks]), runs of
# equal counter indices (count_indices), the cached edge of near lanes (EdgeCache), and the 16-bit tables (Note
# [16-bit ordinal tables]) beside the threshold path that small 16-bit tensors keep. Each against the reference.
# ---------------------------------------------------------------------------------------------------------

CHUNK = 4096  # the CPU kernel's chunk (kChunk): the constant-chunk test lines its pieces up with it
LUT_MIN = 8192  # kLutMinNumel: fp16/bf16 tensors this long or longer use the tables
SHORTCUT_HISTS = {**HISTS, "64_from_zero": H.range(64, 0.0, 1.0), "64_shifted": H.range(64, -4.1, 3.9)}


def constant_chunks(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Chunk-aligned pieces that are constant, constant but for NaNs, all NaN, +-0.0 mixed, +-inf, a subnormal,
    and the float where the (64, -4, 4) rule moves 0's neighbours to the upper bin, then a random tail."""
    fi = torch.finfo(dtype)
    below = float(torch.tensor(-4.4e-16, dtype=torch.float64).to(dtype))
    pieces = []
    for v in (0.5, NAN, 1.0, 0.0, INF, -INF, fi.tiny / 4, below, -3.0, fi.max):
        p = torch.full((CHUNK,), v, dtype=torch.float64)
        pieces.append(p)
    pieces[2][::3] = NAN  # constant 1.0 with NaNs among it
    pieces[3][torch.rand(CHUNK, generator=gen) < 0.5] = -0.0  # +0.0 and -0.0: one slot, min == max
    pieces[5][-1] = NAN
    pieces.append(torch.randn(100, generator=gen, dtype=torch.float64))
    return torch.cat(pieces).to(dtype)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_constant_chunks(device, dtype, layout, isa):
    base = constant_chunks(dtype, seeded("constant", dtype)).to(device)
    # strided: every other element of a buffer whose other elements are random (gathered chunk by chunk)
    x = base if layout == "contiguous" else torch.stack([base, torch.randn_like(base)], 1)[:, 0]
    assert x.is_contiguous() == (layout == "contiguous")
    plain = hookstats.stats(x)
    for name, h in SHORTCUT_HISTS.items():
        s, c = hist_of(x, h)
        assert_counts_equal(c, reference.histogram_of(x.cpu(), h), h, dtype, name)
        assert_bitwise_equal(s, plain)


def runs_of(dtype: torch.dtype, gen: torch.Generator, pattern: str, n: int) -> torch.Tensor:
    """Runs of equal values (or of values in one bin) of random lengths 1..200, so that some cover whole
    64-value runs of the counting pass and some straddle them; between runs, pieces of spread data."""
    e = H.range(64, -4.0, 4.0).edges()
    out, total = [], 0
    while total < n:
        length = int(torch.randint(1, 201, (1,), generator=gen))
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        if pattern == "one_bin_values" and kind == 0:  # different values, one bin: equal ordinals, unequal bits
            run = 0.51 + 0.1 * torch.rand(length, generator=gen, dtype=torch.float64)
        elif kind in (0, 1):
            v = float(e[int(torch.randint(0, 65, (1,), generator=gen))]) if pattern != "nan_runs" else NAN
            run = torch.full((length,), v, dtype=torch.float64)
        elif kind == 2:
            run = torch.zeros(length, dtype=torch.float64)
        else:
            run = torch.randn(length, generator=gen, dtype=torch.float64) * 2
        out.append(run)
        total += length
    return torch.cat(out)[:n].to(dtype)


@pytest.mark.parametrize("pattern", ["edge_runs", "one_bin_values", "nan_runs"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_runs_of_equal_indices(device, dtype, pattern, isa):
    x = runs_of(dtype, seeded("runs", pattern, dtype), pattern, 3 * CHUNK + 77).to(device)
    plain = hookstats.stats(x)
    for name, h in SHORTCUT_HISTS.items():
        s, c = hist_of(x, h)
        assert_counts_equal(c, reference.histogram_of(x.cpu(), h), h, dtype, f"{pattern} {name}")
        assert_bitwise_equal(s, plain)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
                                   pytest.param(torch.float16, id="fp16")])
def test_near_lanes_at_changing_edges(dtype, isa):
    """Values on and next to edges whose edge changes from vector to vector and within one (the cached edge of
    slot_lanes is right, then stale, then right again), among far values: every lane order the cache meets."""
    h = H.range(64, -4.0, 4.0)
    e = h.edges()
    gen = seeded("near", dtype)
    on = e[torch.randint(0, 65, (6000,), generator=gen)]
    near = torch.nextafter(on, torch.where(torch.rand(6000, generator=gen) < 0.5, -INF, INF) * torch.ones(6000,
                                                                                                    dtype=torch.float64))
    hot = torch.zeros(6000, dtype=torch.float64)  # the edge at 0, the cache's usual hit
    far = torch.randn(6000, generator=gen, dtype=torch.float64) * 2
    pick = torch.randint(0, 4, (6000,), generator=gen)
    x = torch.stack([on, near, hot, far], 1).gather(1, pick[:, None]).flatten().to(dtype)
    for m in (5999, 6000):  # the 16-bit types: below and at the table threshold's side
        y = torch.cat([x, x])[: m if dtype == torch.float32 else (LUT_MIN - 1 if m == 5999 else LUT_MIN)]
        assert_counts_equal(hist_of(y, h)[1], reference.histogram_of(y, h), h, dtype, str(y.numel()))


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")])
def test_every_half_bit_pattern_threshold_path(dtype, isa):
    """All 65,536 fp16 / bf16 values in tensors shorter than the table threshold (the SIMD threshold path) and in
    one tensor (the table): both equal the reference."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.randperm(65536, generator=seeded("halfbits-threshold", dtype))]
    pieces = list(x.split(LUT_MIN - 1))
    fi = torch.finfo(dtype)
    for h in (H.exponent(), H.range(64, -4.0, 4.0), H.range(100, -fi.tiny, fi.tiny), H.range(7, -0.5, 3.1),
              H.range(8192, -float(fi.max), float(fi.max))):
        want = reference.histogram_of(x, h)
        buf = hookstats.stats_buffer(len(pieces))
        hb = hookstats.histogram_buffer(len(pieces), h, dtype=dtype)
        hookstats.stats_multi_into(pieces, buf, range(len(pieces)), hist=hb, histogram=h)
        assert_counts_equal(hb.sum(0), want, h, dtype, f"pieces {h}")
        assert_counts_equal(hist_of(x, h)[1], want, h, dtype, f"whole {h}")


def _double_key(v: float) -> int:
    b = struct.unpack("<Q", struct.pack("<d", v))[0]
    return (~b & (2**64 - 1)) if b >> 63 else b | (1 << 63)


def _key_double(k: int) -> float:
    b = k & (2**63 - 1) if k >> 63 else ~k & (2**64 - 1)
    return struct.unpack("<d", struct.pack("<Q", b))[0]


def _ordinal(v: float, h: H) -> int:
    """0 underflow, 1 + bin, bins + 1 overflow: the documented rule (expected_range's), as one number."""
    if v < h.lo:
        return 0
    if v > h.hi:
        return h.bins + 1
    return 1 + min(int((v - h.lo) * h.bins / (h.hi - h.lo)), h.bins - 1)


def double_thresholds(h: H) -> list:
    """For each m in [0, bins], the smallest double whose ordinal exceeds m, by bisection on the doubles in
    order with the float64 rule in Python: where the rule itself changes, wherever that lies."""
    out = []
    for m, e in enumerate(h.edges().tolist()):
        lo_k = hi_k = _double_key(e)
        step = 1
        while _ordinal(_key_double(hi_k), h) <= m:
            lo_k, hi_k, step = hi_k, hi_k + step, step * 2
        step = 1
        while lo_k == hi_k or _ordinal(_key_double(lo_k), h) > m:
            hi_k, lo_k, step = lo_k, lo_k - step, step * 2
        while hi_k - lo_k > 1:
            mid = (lo_k + hi_k) // 2
            lo_k, hi_k = (lo_k, mid) if _ordinal(_key_double(mid), h) > m else (mid, hi_k)
        out.append(_key_double(hi_k))
    return out


@pytest.mark.parametrize("rng", [(64, -4.0, 4.0), (64, -1.0, 1.0), (7, -0.5, 3.1), (10, 0.1, 0.7), (3, 0.0, 1.0),
                                 (256, -3.0, 5.0), (5, -1e-30, 1e-30), (5, 1000.0, 1000.5)])
def test_every_double_next_to_each_threshold(rng, isa):
    """float64 inputs are placed by a table of double thresholds (Note [exact bin thresholds], transform in
    double): 24 doubles on either side of every point where the float64 rule changes, and of every edge, land
    where expected_range puts them, in SIMD lanes and in the scalar tail."""
    h = H.range(*rng)
    vals = []
    for t in double_thresholds(h) + h.edges().tolist():
        lo_v = hi_v = t
        for _ in range(24):
            lo_v, hi_v = math.nextafter(lo_v, -INF), math.nextafter(hi_v, INF)
            vals += [lo_v, hi_v]
        vals.append(t)
    vals += [-4.4e-16, -2.3e-16, -2.2e-16, -1.1e-16, -1e-300, -5e-324, 5e-324, 0.0, -0.0, NAN, INF, -INF]
    x = torch.tensor(vals, dtype=torch.float64)
    x = x[torch.randperm(x.numel(), generator=seeded("doubles", rng))]
    for y in (x, x[:5]):  # SIMD lanes, and a tensor shorter than one vector
        assert_counts_equal(hist_of(y, h)[1], expected_range(as_floats(y), h), h, torch.float64, str(rng))


def test_ordinal_tables_cache_eviction(isa):
    """More ranges than a thread caches tables for (kRangeCacheEntries = 4: the 16-bit ordinal tables and the
    float and double thresholds), cycled twice, every dtype in turn: an evicted table is rebuilt, never reused
    for another range."""
    ranges = [(64, -4.0, 4.0), (64, -4.1, 3.9), (7, -0.5, 3.1), (256, -3.0, 5.0), (100, 0.0, 1e-3), (3, -1.0, 1.0)]
    xs = {dt: (torch.randn(LUT_MIN + 5, generator=seeded("evict", dt), dtype=torch.float64) * 2).to(dt)
          for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
    for _ in range(2):
        for r in ranges:
            for dt, x in xs.items():
                h = H.range(*r)
                assert_counts_equal(hist_of(x, h)[1], reference.histogram_of(x, h), h, dt, str(r))


# ---------------------------------------------------------------------------------------------------------
# Known bugs (kept failing; see the report): last, so that `pytest -x` runs everything above first
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bins", [2, 7, 8192])
@pytest.mark.parametrize("device", DEVICES)
def test_range_whose_scaled_width_overflows(device, bins, isa):
    """hi - lo is finite but (x - lo) * bins overflows float64 for the upper values of the range: hi must still be
    in the last bin (or the range must be refused with a ValueError, like one whose hi - lo overflows)."""
    lo, hi = -1e308, 7e307
    try:
        h = H.range(bins, lo, hi)
    except ValueError:
        return
    e = h.edges()
    vals = [hi, 6e307, 0.0, float(e[bins // 2]), float(e[-2]), lo]
    x = torch.tensor(vals, dtype=torch.float64, device=device)
    want = [min(math.floor((v - lo) / (hi - lo) * bins), bins - 1) for v in vals]  # no overflow this way round
    got = [_single_slot(x[i], h) for i in range(len(vals))]
    assert got == want, f"bins of {vals}: got {got}, expected {want}"


def test_format_fit_input_subnormals_that_are_normal_in_the_format():
    """float16's subnormals (2^-24 .. 2^-14) are normal bfloat16 values: a cast neither flushes them nor makes
    them subnormal, so they must not count as "subnormal" (nor as underflow) for bfloat16."""
    assert _subnormal_class(torch.float16, torch.bfloat16) == "normal"
    x = torch.cat([_input_subnormals(torch.float16), torch.ones(1, dtype=torch.float16)])
    r = {k: float(v) for k, v in hookstats.format_fit(hookstats.exp_histogram(x), torch.float16,
                                                      ["bfloat16"])["bfloat16"].items()}
    assert r == _actual_fit(x, torch.bfloat16) == {"overflow": 0.0, "underflow": 0.0, "subnormal": 0.0,
                                                   "nonfinite": 0.0}, r


def test_histogram_buffer_rejects_non_float_dtype():
    """The exponent layout depends on the dtype: an integer dtype must be a TypeError (exp_layout's), not a
    KeyError from a dict lookup."""
    with pytest.raises(TypeError, match="int32"):
        hookstats.histogram_buffer(2, "exp", dtype=torch.int32)
    with pytest.raises(TypeError, match="int32"):
        H.exponent().length(torch.int32)


@pytest.mark.parametrize("rng", [(4, 0.0, 1e-38), (100, -1.1754943508222875e-38, 1.1754943508222875e-38),
                                 (3, 1e-39, 2e-39)], ids=["4_0_1e-38", "100_pm_tiny", "3_1e-39_2e-39"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
                                   pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("device", DEVICES)
def test_range_whose_scale_overflows_float32(device, dtype, rng, isa):
    """bins / (hi - lo) above float32's max: the float32 scale is inf, x * scale is +-inf (NaN for 0), and the
    SIMD lanes must still fall back to the exact formula (the scalar tail does)."""
    h = H.range(*rng)
    assert h.bins / (h.hi - h.lo) > torch.finfo(torch.float32).max
    x = torch.zeros(37, dtype=dtype, device=device)
    assert hist_of(x, h)[1].cpu().tolist() == expected_range([0.0] * 37, h).tolist()
    vals = torch.tensor([0.0, -0.0, h.lo, h.hi, (h.lo + h.hi) / 2, h.lo + (h.hi - h.lo) / 3, 1.0, -1.0],
                        dtype=torch.float64).to(dtype).repeat(5).to(device)
    assert_counts_equal(hist_of(vals, h)[1], expected_range(as_floats(vals), h), h, dtype)


# ---------------------------------------------------------------------------------------------------------
# Every distribution on the SIMD path (Note [exact bin thresholds] in csrc/core/hist_ops.h): data on and near
# edges (0 is an edge of symmetric ranges), concentrated in one bin, NaN-laden, out of range
# ---------------------------------------------------------------------------------------------------------

def _distribution(name: str, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    r = torch.randn(n, generator=gen, dtype=torch.float64)
    half = torch.rand(n, generator=gen) < 0.5
    x = {
        "randn": lambda: r,
        "relu": lambda: r.clamp_min(0),
        "grad_1e-5": lambda: r * 1e-5,
        "zeros": lambda: torch.where(half, torch.zeros_like(r), -torch.zeros_like(r)),
        "vanishing_1e-20": lambda: r * 1e-20,
        "huge_1e20": lambda: r * 1e20,
        "mixed_1e30_1e-30": lambda: torch.where(half, r * 1e30, r * 1e-30),
        "half_nan": lambda: torch.where(half, r, torch.full_like(r, NAN)),
        "all_nan": lambda: torch.full((n,), NAN, dtype=torch.float64),
        "uniform": lambda: torch.rand(n, generator=gen, dtype=torch.float64) * 8 - 4,
        "on_edge": lambda: torch.full((n,), 0.5, dtype=torch.float64),
        "edge_grid": lambda: torch.round(r * 8) / 8,  # every value on an edge of (64, -4, 4)
    }[name]()
    return x.to(dtype)


@pytest.mark.parametrize("hname", ["64_pm4", "64_shifted", "7_odd", "exp"])
@pytest.mark.parametrize("name", ["randn", "relu", "grad_1e-5", "zeros", "vanishing_1e-20", "huge_1e20",
                                  "mixed_1e30_1e-30", "half_nan", "all_nan", "uniform", "on_edge", "edge_grid"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_distributions(device, dtype, name, hname, isa):
    h = H.range(64, -4.1, 3.9) if hname == "64_shifted" else HISTS[hname]
    x = _distribution(name, 3 * 4096 + 13, dtype, seeded("dist", name, dtype)).to(device)
    s, c = hist_of(x, h)
    assert_counts_equal(c, reference.histogram_of(x.cpu(), h), h, dtype, name)
    # the same pass's statistics are those of stats(x) alone
    assert torch.equal(bits(torch.stack([t.double() for t in s])),
                       bits(torch.stack([t.double() for t in hookstats.stats(x)])))


@pytest.mark.parametrize("rng", [(64, -4.0, 4.0), (64, -1.0, 1.0), (7, -0.5, 3.1), (10, 0.1, 0.7), (3, 0.0, 1.0),
                                 (256, -3.0, 5.0), (5, -1e-30, 1e-30), (8192, -1.0, 1.0)])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_every_float_next_to_each_threshold(dtype, rng, isa):
    """Around every bin edge, the float64 rule decides far from the edge itself for some ranges (with lo = -4,
    every x > -2^-51 has x - lo == 4 in float64): 64 floats on either side of where the rule changes, found by
    bisection on the reference rule, land where expected_range puts them."""
    h = H.range(*rng)
    edges = h.edges().tolist()
    vals = []
    for e in edges:
        t = torch.tensor([e], dtype=torch.float32)
        lo_v, hi_v = t.clone(), t.clone()
        for _ in range(64):
            lo_v = torch.nextafter(lo_v, torch.tensor([-INF]))
            hi_v = torch.nextafter(hi_v, torch.tensor([INF]))
            vals += [float(lo_v), float(hi_v)]
        vals.append(float(t))
    # and the float just below the value where the rule moves 0's neighbours into the upper bin
    vals += [-4.4e-16, -2.3e-16, -1.1e-16, -1e-30, -1e-45, 1e-45, 0.0, -0.0]
    x = torch.tensor(vals, dtype=torch.float64).to(dtype)
    _, c = hist_of(x, h)
    assert_counts_equal(c, expected_range(as_floats(x), h), h, dtype, str(rng))
