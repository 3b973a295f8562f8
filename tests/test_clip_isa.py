"""The clipping kernels (csrc/cpu/clip_chunk.h) on every CPU SIMD level (Note [cpu dispatch]: baseline, AVX2,
AVX-512): norms / get_total_norm, clip_norm_ and the scale pass (scale_by_norm_, as clip_grads_with_norm_ runs it),
clip_value_ and its count, on each dtype, sizes off the vector widths, the 512-value norm blocks and the 4096-value
chunks, misaligned and non-contiguous views, NaN / Inf, and magnitudes off the float fast path (Note [norm scaling]).

Oracles: the norms against float64 torch.linalg.vector_norm (hookstats.reference.norms: the same after a power-of-two
scaling, so that 1e200 does not overflow); the scaled values against x * coef computed by PyTorch in the kernel's
accumulation type (fp32 for fp32 / fp16 / bf16, fp64 for fp64), bit for bit; clip_value_ against Tensor.clamp_, bit
for bit but NaN payloads, and its count against ((x < lo) | (x > hi)).sum(), exactly.
Across levels: the inf-norm, every scaled and clamped value and every count are the same bits; the 1- and 2-norms
agree within the norm tolerance (their lane sums and the wide levels' fused multiply-adds round differently)."""
from __future__ import annotations

import math

import pytest
import torch

import hookstats
from hookstats import reference

from _testing import DTYPES, bits
from test_cpu_isa import LEVELS, cpu_max_level, each_level

INF = float("inf")
NORM_ORDERS = (1.0, 2.0, INF)


def clip_inputs(dtype: torch.dtype):
    """(name, tensor) pairs. Sizes around the 4, 8 and 16 lanes of the three levels (and their 2-vector unroll),
    the 512-value norm block and the 4096-value chunk; views that are gathered (strided) or read in place at an odd
    address (misaligned); NaN and Inf in a late chunk after finite ones, Inf alone, NaN alone; values outside the
    float fast path's [2^-60, 2^56] (the scaled re-read); a constant; signed zeros and subnormals."""
    g = torch.Generator().manual_seed(3602)
    for n in (1, 3, 7, 8, 15, 17, 31, 33, 63, 65, 511, 513, 1023, 4095, 4097, 3 * 4096 + 5, 2**16 + 13):
        yield f"randn{n}", (torch.randn(n, generator=g) * 2).to(dtype)
    base = (torch.randn(3 * 4096 + 77, generator=g) * 3).to(dtype)
    yield "misaligned", base[1:]
    yield "misaligned3", base[3:9000]
    yield "strided", base[::3]
    yield "transposed", base[: 61 * 97].view(61, 97).t()
    yield "channels_last", (torch.randn(2, 7, 9, 5, generator=g)).to(dtype).contiguous(memory_format=torch.channels_last)
    x = torch.randn(5 * 4096 + 9, generator=g).to(dtype)
    x[[3 * 4096 + 5, 4 * 4096 + 100]] = float("inf")
    x[4 * 4096 + 200] = float("nan")
    yield "inf_then_nan", x
    y = torch.randn(2 * 4096 + 33, generator=g).to(dtype)
    y[[7, 5000]] = -float("inf")
    yield "inf_only", y
    z = torch.randn(777, generator=g).to(dtype)
    z[776] = float("nan")  # in the scalar tail
    yield "nan_in_tail", z
    yield "constant", torch.full((4096 + 515,), -1.25).to(dtype)
    tiny = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    pick = torch.randint(0, 5, (4096 + 45,), generator=g)
    yield "signed_zeros_subnormals", torch.tensor([0.0, -0.0, tiny, -tiny, 0.75], dtype=torch.float64)[pick].to(dtype)
    if dtype in (torch.float32, torch.float64):
        big = torch.randn(3 * 4096 + 11, generator=g, dtype=torch.float64)
        yield "huge", (big * (1e30 if dtype == torch.float32 else 1e200)).to(dtype)
        yield "tiny", (big * (1e-30 if dtype == torch.float32 else 1e-200)).to(dtype)
        mixed = big.clone()
        mixed[4096:8192] *= 1e25 if dtype == torch.float32 else 1e150  # the exponent moves from chunk to chunk
        yield "exponent_moves", mixed.to(dtype)


def norm_rtol(dtype: torch.dtype) -> float:
    return 1e-12 if dtype == torch.float64 else 1e-5


def assert_norm_close(got: float, want: float, p: float, dtype: torch.dtype, what) -> None:
    if not math.isfinite(want) or p == INF:
        assert (math.isnan(got) and math.isnan(want)) or got == want, (what, got, want)
    else:
        assert abs(got - want) <= norm_rtol(dtype) * abs(want), (what, got, want)


def assert_same_bits_but_nan_payloads(a: torch.Tensor, b: torch.Tensor, what) -> None:
    na, nb = a.isnan(), b.isnan()
    assert torch.equal(na, nb), what
    assert torch.equal(bits(a[~na]), bits(b[~nb])), what


def clip_coef(norm: float, max_norm: float, eps: float = 1e-6) -> float:
    """min(1, max_norm / (norm + eps)) in float64 as core/norm_ops.h's clip_coef: NaN for a NaN norm."""
    c = max_norm / (norm + eps)
    return 1.0 if c > 1.0 else c


def scaled_oracle(x: torch.Tensor, coef: float) -> torch.Tensor:
    """x * coef as the kernel computes it: in the accumulation type, then rounded to x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(acc) * torch.tensor(coef, dtype=acc)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_on_every_level_and_levels_agree(dtype):
    """hookstats.norms of each input alone and of all of them in one list (tasks that split tensors, pieces merged
    in order), and get_total_norm, on each level against float64; the levels agree."""
    cases = list(clip_inputs(dtype))
    xs = [x for _, x in cases]
    results = {}
    for level in each_level():
        got = {}
        for p in NORM_ORDERS:
            for name, x in cases:
                per, total = hookstats.norms([x], p)
                want = float(reference.norms([x], p)[1])
                assert_norm_close(float(total), want, p, dtype, (level, p, name))
                assert float(per[0]) == float(total) or (math.isnan(float(per[0])) and math.isnan(float(total)))
                got[p, name] = float(total)
            per, total = hookstats.norms(xs, p)
            ref_per, ref_total = reference.norms(xs, p)
            for (name, _), a, b in zip(cases, per.tolist(), ref_per.tolist()):
                assert_norm_close(a, b, p, dtype, (level, p, "in a list", name))
            assert_norm_close(float(total), float(ref_total), p, dtype, (level, p, "list total"))
            finite = [x for name, x in cases if bool(torch.isfinite(x).all())]
            t = hookstats.get_total_norm(finite, p)  # PyTorch's dtype: the inputs'
            assert t.dtype == dtype
            want = float(reference.norms(finite, p)[1])
            if p == INF or not math.isfinite(float(torch.tensor(want, dtype=torch.float64).to(dtype))):  # fp16 past 65504: inf
                assert float(t) == float(torch.tensor(want, dtype=torch.float64).to(dtype)), (level, "get_total_norm", float(t), want)
            else:
                assert abs(float(t) - want) <= (norm_rtol(dtype) + torch.finfo(dtype).eps) * want, (level, p)
            got[p, "list"] = float(total)
        results[level] = got
    assert set(results) == {lv for lv in LEVELS if LEVELS.index(lv) >= LEVELS.index(cpu_max_level())}
    first_level, first = next(iter(results.items()))
    for level, got in results.items():
        for key, v in got.items():
            v0 = first[key]
            if key[0] == INF or not math.isfinite(v0):
                assert (math.isnan(v) and math.isnan(v0)) or v == v0, (level, first_level, key, v, v0)
            else:
                assert abs(v - v0) <= 2 * norm_rtol(dtype) * abs(v0), (level, first_level, key, v, v0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clip_norm_on_every_level(dtype):
    """clip_norm_ returns the norm (float64 oracle) and scales every value by the coefficient of that norm, as PyTorch
    multiplies in the accumulation type; storage outside a view is left alone."""
    for level in each_level():
        for p in NORM_ORDERS:
            for name, x in clip_inputs(dtype):
                want = float(reference.norms([x], p)[1])
                y = x.clone()  # the same layout (clone keeps the strides of a dense view)
                owner = torch.zeros(y.numel() * 3, dtype=dtype)
                if name == "strided":  # clip a view of a larger tensor: the values between must not move
                    owner[::3] = x
                    y = owner[::3]
                assert y.is_contiguous() == x.is_contiguous(), name
                max_norm = want / 3 if math.isfinite(want) and want > 0 else 1.0
                got = float(hookstats.clip_norm_(y, max_norm, p).double())  # float32 (float64 for float64 x)
                assert_norm_close(got, want, p, dtype, (level, p, name))
                coef = clip_coef(float(hookstats.norms([x], p)[1]), max_norm)
                if coef == 1.0 or (dtype != torch.float64 and float(torch.tensor(coef, dtype=torch.float32)) == 1.0):
                    assert torch.equal(bits(y), bits(x)), (level, p, name)  # Note [coefficient one]: not written
                else:
                    assert_same_bits_but_nan_payloads(y, scaled_oracle(x, coef), (level, p, name))
                if name == "strided":
                    rest = torch.ones(owner.numel(), dtype=torch.bool)
                    rest[::3] = False
                    assert bool((owner[rest] == 0).all()), (level, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_pass_same_bits_on_every_level(dtype):
    """The scale pass alone (scale_by_norm_, as clip_grads_with_norm_ runs it) with one given total over the list of
    every input: the same bits on every level and as PyTorch's product; the zero policy zeroes a non-finite total's
    tensors on every level."""
    cases = list(clip_inputs(dtype))
    outs = {}
    for level in each_level():
        for k, (total, max_norm, policy) in enumerate(((7.5, 1.0, 0), (1e-3, 1.0, 0), (INF, 1.0, 0), (math.nan, 1.0, 1))):
            ys = [x.clone() for _, x in cases]
            t = torch.tensor(total, dtype=torch.float64)
            torch.ops.hookstats.scale_by_norm_(ys, t, max_norm, 1e-6, policy)
            coef = 0.0 if policy == 1 and not math.isfinite(total) else clip_coef(total, max_norm)
            for (name, x), y in zip(cases, ys):
                want = torch.zeros_like(x) if policy == 1 and not math.isfinite(total) else scaled_oracle(x, coef)
                assert_same_bits_but_nan_payloads(y, want, (level, total, name))
            outs[level, k] = ys
    first_level = next(iter(outs))[0]
    for (level, k), ys in outs.items():
        for y, y0 in zip(ys, outs[first_level, k]):
            assert torch.equal(bits(y), bits(y0)), (level, first_level, k)


BOUNDS = ((-0.5, 0.5), (-2.5, 1.0), (0.0, 0.0), (-0.0, 0.0), (0.1, 0.3), (-1e30, 1e30))  # -0.0 stored as -0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_clip_value_on_every_level(dtype):
    """clip_value_ is Tensor.clamp_ with the bounds rounded to the dtype, bit for bit (NaN kept and not counted),
    its count exact; the same bits and counts on every level."""
    results = {}
    for level in each_level():
        rs = []
        for name, x in clip_inputs(dtype):
            for lo, hi in BOUNDS:
                lo_t = torch.tensor(lo, dtype=dtype).item()
                hi_t = torch.tensor(hi, dtype=dtype).item()
                y = x.clone()
                if name == "strided":
                    owner = torch.full((y.numel() * 3,), 7.0, dtype=dtype)
                    owner[::3] = x
                    y = owner[::3]
                count = hookstats.clip_value_(y, lo, hi)
                assert count.dtype == torch.int64 and count.shape == ()
                assert int(count) == int(((x < lo_t) | (x > hi_t)).sum()), (level, name, lo, hi)
                assert_same_bits_but_nan_payloads(y, x.clamp(lo_t, hi_t), (level, name, lo, hi))
                assert torch.equal(y.isnan(), x.isnan()) and torch.equal(bits(y[y.isnan()]), bits(x[x.isnan()]))
                if name == "strided":
                    rest = torch.ones(owner.numel(), dtype=torch.bool)
                    rest[::3] = False
                    assert bool((owner[rest] == 7.0).all()), (level, name)
                rs.append((int(count), y))
        results[level] = rs
    first = next(iter(results.values()))
    for level, rs in results.items():
        for (c, y), (c0, y0) in zip(rs, first):
            assert c == c0 and torch.equal(bits(y), bits(y0)), level


def test_clip_grad_norm_many_tensors_on_every_level():
    """clip_grad_norm_ over 1,000 small odd-sized grads of mixed dtypes (Note [cpu tensor lists]: pieces that span
    tasks) on each level, against torch.nn.utils.clip_grad_norm_ on float64 copies; the levels agree."""
    g = torch.Generator().manual_seed(36020)
    sizes = torch.randint(1, 300, (1000,), generator=g).tolist()
    dts = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    grads = [torch.randn(n, generator=g).to(dts[i % 4]) * 0.01 for i, n in enumerate(sizes)]
    ref_params = [torch.nn.Parameter(torch.zeros(gr.shape, dtype=torch.float64)) for gr in grads]
    for rp, gr in zip(ref_params, grads):
        rp.grad = gr.double().clone()
    ref_total = float(torch.nn.utils.clip_grad_norm_(ref_params, 0.1, 2.0))
    results = {}
    for level in each_level():
        params = [torch.nn.Parameter(torch.zeros(gr.shape, dtype=gr.dtype)) for gr in grads]
        for pr, gr in zip(params, grads):
            pr.grad = gr.clone()
        total = float(hookstats.clip_grad_norm_(params, 0.1, 2.0).double())
        assert abs(total - ref_total) <= (torch.finfo(torch.float16).eps + 1e-5) * ref_total, (level, total, ref_total)
        coef = clip_coef(total, 0.1)  # the float64 total (a float64 grad is in the list) the grads were scaled by
        for pr, gr in zip(params, grads):
            assert torch.equal(bits(pr.grad), bits(scaled_oracle(gr, coef))), level
        results[level] = [pr.grad for pr in params]
    first = next(iter(results.values()))
    for level, gs in results.items():
        # the totals agree within the norm tolerance (their float lane sums round differently per level), so the
        # coefficients do, and the grads within that and one rounding of their dtype (one subnormal step: fp16)
        for a, b in zip(gs, first):
            fi = torch.finfo(a.dtype)
            torch.testing.assert_close(a, b, rtol=2e-5 + fi.eps, atol=fi.tiny * fi.eps)
