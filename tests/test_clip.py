"""Norms and clipping (hookstats.norm, norms, clip_norm_, clip_value_ and the torch.nn.utils drop-ins
get_total_norm, clip_grads_with_norm_, clip_grad_norm_, clip_grad_value_) against float64 references and
against torch.nn.utils itself. The contract is the clipping API spec (issue #4).

Tolerances (all comparisons in float64):

  what                                   fp32-acc (fp16, bf16, fp32 in)  fp64 in     why
  norm, p in {1, 2, 0.5, 3, 7.5}         rel 1e-5                        rel 1e-12   accumulation error (p = 1, 2
                                                                                     accumulate in fp32) + the cast
  norm, p = inf                          exact                           exact       max |x| is a value of x
  (plus half an ulp of the result dtype, the final cast). A norm whose true value does not fit the result dtype
  (fp32 for fp32-acc inputs) must come back as inf. The float64 reference scales x by a power of two first, so it
  neither overflows nor underflows (torch's float64 vector_norm of 1e200 is inf); the extreme-magnitude tests use
  the closed form v * n^(1/p) instead.
  clip_norm_ / scaled grads              rtol fp32 2e-6, bf16 1e-2,      1e-12       ~1 ulp of the dtype: the
                                         fp16 2e-3                                   rounding of x * coef
         plus an absolute 2 * smallest subnormal of the dtype (a product that lands among the subnormals).
         The coefficient of the reference is min(1, max_norm / (N + eps)) in float64, where N is the norm the op
         reports (clip_norm_: its returned norm; clip_grad_norm_: hookstats.norms(grads).total, float64), so
         these tests check the scaling; the accuracy of N is checked against the float64 reference by the same
         tests with the norm tolerance above.
  drop-in totals (get_total_norm,        the norm tolerance of the coarsest input dtype + 1 eps of the returned
  clip_grad_norm_) vs float64            dtype (PyTorch's dtype: bf16 for an all-bf16 list)
  vs torch.nn.utils (grads, totals)      the above + 2 eps of the coarsest dtype in the list + the measured
                                         relative error of PyTorch's own total: PyTorch rounds its per-tensor norms,
                                         its total and its coefficient to the grads' dtypes, and accumulates fp32
                                         norms in fp32 (3e-6 off for the L1 norm of a small model's grads).
  clip_value_ / clip_grad_value_         bit-exact against Tensor.clamp_ (so -0.0 stays -0.0); counts exact. NaN
                                         need only stay NaN: PyTorch's own clamp_ changes bf16 NaN payloads in
                                         its vectorized path (0x7fc0 -> 0xffff) but not in its scalar path.
  thread count / repeated calls          bit-exact

A NaN or inf on either side must be matched exactly by the other side.

Where torch.nn.utils cannot be the oracle: PyTorch refuses the inf-norm of a list holding a 0-element grad
("does not have an identity"), so those grads are hidden from PyTorch (pytorch_twin); fp16 totals past 65504 and
fp32 1e30 grads are the spec's documented differences (PyTorch's totals overflow and it zeroes the grads).
"""
from __future__ import annotations

import copy
import math
import re
import warnings
import zlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import hookstats

from _testing import DEVICES, DTYPES, bits, cuda_ready, result_dtype

NAN = float("nan")
INF = float("inf")
NORM_TYPES = [
    pytest.param(1.0, id="p1"),
    pytest.param(2.0, id="p2"),
    pytest.param(INF, id="pinf"),
    pytest.param(0.5, id="p0.5"),
    pytest.param(3.0, id="p3"),
    pytest.param(7.5, id="p7.5"),
]
GRAD_NORM_TYPES = [pytest.param(1.0, id="p1"), pytest.param(2.0, id="p2"), pytest.param(INF, id="pinf"),
                   pytest.param(3.0, id="p3")]
CLIP_RTOL = {torch.float32: 2e-6, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1e-2}
POLICIES = ["propagate", "error", "zero"]


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------

def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def as_float(t: torch.Tensor) -> float:
    return float(t.detach().to(torch.float64).cpu())


def norm_rtol(dtype: torch.dtype, p: float) -> float:
    if p == INF:
        return 0.0
    return 1e-12 if dtype == torch.float64 else 1e-5


def eps_of(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def coarsest(dtypes) -> torch.dtype:
    return max(dtypes, key=eps_of)


def _pow2(e: int) -> float:
    return 2.0 ** (e // 2) * 2.0 ** (e - e // 2)  # 2^e for |e| up to ~2000, inf/0 past double's range


def exact_norm(x: torch.Tensor, p: float) -> float:
    """The p-norm of x in float64 (0 for an empty x, whose inf-norm PyTorch refuses). x is first scaled by a power
    of two that brings max |x| near 1, so that neither the reference nor its intermediate powers overflow or
    underflow (PyTorch's float64 vector_norm of 1e200 is inf)."""
    xd = x.detach().to(torch.float64).cpu().reshape(-1)
    if xd.numel() == 0:
        return 0.0
    if p == INF or not torch.isfinite(xd).all():
        return float(torch.linalg.vector_norm(xd, p))
    m = float(xd.abs().max())
    if m == 0.0:
        return 0.0
    e = math.frexp(m)[1]
    s = -e  # scale by 2^s in two exact steps (2^s alone may not fit a double)
    r = float(torch.linalg.vector_norm(xd * 2.0 ** (s // 2) * 2.0 ** (s - s // 2), p))
    return r * _pow2(e)


def closed_form_norm(value: float, n: int, p: float) -> float:
    """The p-norm of n copies of value, in Python floats (no overflow in the middle)."""
    if n == 0:
        return 0.0
    return abs(value) if p == INF else abs(value) * n ** (1.0 / p)


def cast(v: float, dtype: torch.dtype) -> float:
    """v rounded to dtype (inf when it does not fit)."""
    return float(torch.tensor(v, dtype=torch.float64).to(dtype).to(torch.float64))


def same_nonfinite(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def assert_value_close(got: float, expected: float, rtol: float, what: str = "") -> None:
    if not (math.isfinite(got) and math.isfinite(expected)):
        assert same_nonfinite(got, expected), f"{what}: got {got!r}, expected {expected!r}"
        return
    assert abs(got - expected) <= rtol * abs(expected), \
        f"{what}: got {got!r}, expected {expected!r} (rel error {abs(got - expected) / max(abs(expected), 1e-300):.3g}, " \
        f"allowed {rtol:.3g})"


def check_norm_result(got: torch.Tensor, expected: float, dtype: torch.dtype, p: float, device, what="norm"):
    """A norm returned in result_dtype(dtype): 0-d, on device, within the norm tolerance of expected (which is
    first rounded to the result dtype: a true norm past fp32's max must come back as inf)."""
    rt = result_dtype(dtype)
    assert got.dtype == rt, f"{what}: dtype {got.dtype}, expected {rt}"
    assert got.shape == (), f"{what}: shape {tuple(got.shape)}"
    assert got.device == torch.device(device) or got.device.type == torch.device(device).type, got.device
    exp_cast = cast(expected, rt)
    if math.isfinite(expected) and not math.isfinite(exp_cast):
        assert as_float(got) == INF, f"{what}: true value {expected!r} overflows {rt}, got {as_float(got)!r}"
        return
    assert_value_close(as_float(got), expected, norm_rtol(dtype, p) + eps_of(rt) / 2, what)


def assert_tensor_close(got: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """Elementwise |got - expected| <= rtol |expected| + 2 subnormal ulps; NaN and inf must match exactly.
    (torch.testing.assert_close takes ~1 s on 77k strided doubles; this takes a millisecond.)"""
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(expected.shape)}"
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} vs {expected.dtype}"
    atol = 2 * torch.finfo(expected.dtype).smallest_normal * eps_of(expected.dtype)
    g = got.detach().cpu().double().reshape(-1)
    e = expected.detach().cpu().double().reshape(-1)
    with torch.no_grad():
        ok = (g - e).abs() <= rtol * e.abs() + atol
        ok |= (torch.isnan(g) & torch.isnan(e)) | (torch.isinf(e) & (g == e))
    bad = (~ok).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        rel = ((g - e).abs() / e.abs())[bad].max().item()
        raise AssertionError(f"{what}: {bad.numel()} of {g.numel()} elements differ; first at flat index {i}: got "
                             f"{g[i].item()!r}, expected {e[i].item()!r}; largest relative difference {rel:.3g} "
                             f"(allowed rtol {rtol:.3g}, atol {atol:.3g})")


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    ba, bb = bits(a).reshape(-1), bits(b).reshape(-1)
    diff = (ba != bb).nonzero()
    assert diff.numel() == 0, (f"{what}: {diff.numel()} elements differ bitwise, first at flat index "
                               f"{int(diff[0])}: {a.reshape(-1)[int(diff[0])].item()!r} vs "
                               f"{b.reshape(-1)[int(diff[0])].item()!r}")


def assert_bits_equal_but_nan_payloads(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Bitwise equal (so -0.0 != +0.0), except that a NaN only has to meet a NaN: PyTorch's own clamp_ is not
    consistent about NaN payloads (its vectorized bf16 path turns 0x7fc0 into 0xffff, its scalar path keeps it)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    assert torch.equal(na, nb), f"{what}: NaN positions differ: {na.nonzero().flatten()[:5].tolist()} vs " \
                                f"{nb.nonzero().flatten()[:5].tolist()}"
    assert_bits_equal(a[~na], b[~nb], what)


# Shapes and layouts. Each builds (base, view): the op runs on view; base owns the storage, so that the tests of
# the in-place ops can check that storage outside the view is left alone.
def _flat(n):
    return lambda dt, dev, g: (lambda b: (b, b))(torch.randn(n, generator=g).to(dt).to(dev))


def _viewed(shape, view):
    def make(dt, dev, g):
        base = torch.randn(shape, generator=g).to(dt).to(dev)
        return base, view(base)
    return make


SHAPES = {
    "n0": _flat(0),
    "n1": _flat(1),
    "n7": _flat(7),
    "n4097": _flat(4097),
    "n70000": _flat(70000),
    "transposed": _viewed((300, 257), lambda b: b.t()),
    "slice_from_1": _viewed((4101,), lambda b: b[1:]),
    "step3": _viewed((9001,), lambda b: b[::3]),
    "expanded": _viewed((1, 513), lambda b: b.expand(64, 513)),
    "channels_last": (lambda dt, dev, g: (lambda b: (b, b))(
        torch.randn(2, 5, 17, 13, generator=g).to(dt).to(dev).contiguous(memory_format=torch.channels_last))),
}
# In-place ops refuse overlapping memory (expanded): every other layout.
WRITABLE_SHAPES = [s for s in SHAPES if s != "expanded"]
PARTIAL_VIEWS = {"transposed": lambda b: b.t(), "slice_from_1": lambda b: b[1:], "step3": lambda b: b[::3]}


def check_outside_view(shape, base, base0):
    """The storage of base that the view of `shape` does not cover is bit-identical to base0."""
    if shape in PARTIAL_VIEWS:
        mask = torch.zeros_like(base0, dtype=torch.bool)
        PARTIAL_VIEWS[shape](mask).fill_(True)
        assert_bits_equal(base[~mask], base0[~mask], "storage outside the view")


def make_shape(name, dtype, device, *key):
    base, view = SHAPES[name](dtype, device, seeded(name, dtype, *key))
    return base, view


def _check_layout(name, base, view):
    # guards the fixtures themselves: a layout that silently became contiguous would test nothing
    if name == "transposed":
        assert not view.is_contiguous()
    if name in ("slice_from_1", "step3"):
        assert view.data_ptr() != base.data_ptr() or view.stride() != (1,)
    if name == "expanded":
        assert 0 in view.stride()
    if name == "channels_last":
        assert view.is_contiguous(memory_format=torch.channels_last) and not view.is_contiguous()


# ---------------------------------------------------------------------------------------------------------
# hookstats.norm
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_matches_float64(device, dtype, p, shape):
    base, x = make_shape(shape, dtype, device)
    _check_layout(shape, base, x)
    x = x * 3 if shape == "n70000" else x  # a non-unit scale (the product is a fresh contiguous tensor)
    check_norm_result(hookstats.norm(x, p), exact_norm(x, p), dtype, p, device)


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_default_is_2_and_accepts_int_order(device, p):
    x = torch.randn(1000, generator=seeded("default"), dtype=torch.float64).to(device)
    assert as_float(hookstats.norm(x)) == pytest.approx(exact_norm(x, 2.0), rel=1e-12, abs=0)
    got = hookstats.norm(x, int(p)) if p in (1.0, 2.0, 3.0) else hookstats.norm(x, p)
    assert as_float(got) == pytest.approx(exact_norm(x, p), rel=1e-12, abs=0)


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_nan_and_inf(device, dtype, p):
    n = 9000
    for pos in (0, 4096, n // 2, n - 1):
        for content, want in (((NAN,), NAN), ((INF,), INF), ((-INF,), INF), ((INF, NAN), NAN), ((NAN, -INF), NAN)):
            x = torch.randn(n, generator=seeded("nonfinite", pos)).to(dtype)
            for k, v in enumerate(content):
                x[(pos + 3 * k) % n] = v
            got = hookstats.norm(x.to(device), p)
            assert got.dtype == result_dtype(dtype)
            assert same_nonfinite(as_float(got), want), f"{content} at {pos}: got {as_float(got)!r}, want {want!r}"
    for v, want in ((NAN, NAN), (INF, INF), (-INF, INF)):
        for n in (1, 7, 5000):
            got = as_float(hookstats.norm(torch.full((n,), v, dtype=dtype, device=device), p))
            assert same_nonfinite(got, want), f"all {v} (n={n}): got {got!r}"


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2)], ids=str)
@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_empty_is_zero(device, dtype, p, shape):
    got = hookstats.norm(torch.empty(shape, dtype=dtype, device=device), p)
    assert got.dtype == result_dtype(dtype) and got.shape == () and got.device.type == torch.device(device).type
    assert as_float(got) == 0.0


EXTREME_CASES = {
    # (dtype, value, n): n copies of value; the expected norm comes from the closed form
    "fp32_1e30": (torch.float32, 1e30, 1000),  # PyTorch's fp32 2-norm is inf here; the true one is 3.1623e31
    "fp32_3e38": (torch.float32, 3e38, 7),  # past fp32's max for every finite p: inf
    "bf16_1e30": (torch.bfloat16, 1e30, 1000),
    "fp16_6e4": (torch.float16, 6e4, 1000),
    "fp16_max": (torch.float16, 65504.0, 4097),
    "fp64_1e300": (torch.float64, 1e300, 1000),
    "fp64_1e150": (torch.float64, 1e150, 4097),  # squares overflow double
    "fp32_1e-30": (torch.float32, 1e-30, 1000),
    "fp32_1e-37": (torch.float32, 1e-37, 4097),
    "bf16_1e-30": (torch.bfloat16, 1e-30, 1000),
    "fp16_subnormal": (torch.float16, 1e-7, 1000),
    "fp64_1e-300": (torch.float64, 1e-300, 1000),
    "fp64_1e-160": (torch.float64, 1e-160, 4097),  # squares underflow double
}


@pytest.mark.parametrize("case", list(EXTREME_CASES))
@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_extreme_magnitudes(device, p, case):
    dtype, value, n = EXTREME_CASES[case]
    v = cast(value, dtype)
    assert v != 0.0 and math.isfinite(v)
    x = torch.full((n,), v, dtype=dtype, device=device)
    x[::2] *= -1
    expected = closed_form_norm(v, n, p)
    got = hookstats.norm(x, p)
    if cast(expected, result_dtype(dtype)) != 0.0:
        assert as_float(got) != 0.0, f"{case}: underflowed to 0"
    check_norm_result(got, expected, dtype, p, device, what=case)


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_one_huge_among_small(device, dtype, p):
    big = torch.finfo(dtype).max / 4
    x = torch.randn(5000, generator=seeded("huge1")).to(dtype)
    x[2500] = big
    x[17] = torch.finfo(dtype).smallest_normal
    check_norm_result(hookstats.norm(x.to(device), p), exact_norm(x, p), dtype, p, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_fp16_ones_l1_is_exact(device, dtype):  # pytorch#92164: bf16 ones(5120).norm(1) returned 256
    x = torch.ones(5120, dtype=dtype, device=device)
    assert as_float(hookstats.norm(x, 1)) == 5120.0
    assert as_float(hookstats.norm(x, INF)) == 1.0


# Issue #14's distributions: pieces of vanishing or huge magnitudes are summed in the accumulation type after a
# power-of-two scale, pieces with NaN/Inf only flagged (Note [norm scaling], Note [norm piece] in
# csrc/core/norm_ops.h), on the CPU and in the CUDA kernels (every thread share, the fused clip_norm_ path too).
# 3 * 65536 + 13 values: several CPU tasks and chunks, several CUDA blocks, a scalar tail.
NORM_DIST_N = 3 * 65536 + 13


def norm_distribution(name: str, dtype: torch.dtype, n: int = NORM_DIST_N) -> torch.Tensor:
    g = seeded("normdist", name, str(dtype))
    r = torch.randn(n, generator=g, dtype=torch.float64)
    half = torch.rand(n, generator=g) < 0.5
    x = {
        "randn": lambda: r,
        "vanishing_1e-20": lambda: r * 1e-20,
        "huge_1e20": lambda: r * 1e20,
        "mixed_1e30_1e-30": lambda: torch.where(half, r * 1e30, r * 1e-30),  # every piece spans 60 decades
        "halves_1e30_1e-30": lambda: torch.cat([r[: n // 2] * 1e30, r[n // 2:] * 1e-30]),  # the scale changes
        "tiny_then_normal": lambda: torch.cat([r[: n // 3] * 1e-35, r[n // 3:]]),  # a carried scale must go
        "half_nan": lambda: torch.where(half, r, torch.full_like(r, NAN)),
        "all_inf": lambda: torch.where(half, torch.full_like(r, INF), torch.full_like(r, -INF)),
        "inf_then_nan": lambda: torch.cat([torch.full((n // 2,), INF, dtype=torch.float64),
                                           r[n // 2:].masked_fill(r[n // 2:] > 2.5, NAN)]),
    }[name]()
    return x.to(dtype)


NORM_DISTS = ["randn", "vanishing_1e-20", "huge_1e20", "mixed_1e30_1e-30", "halves_1e30_1e-30", "tiny_then_normal",
              "half_nan", "all_inf", "inf_then_nan"]


@pytest.mark.parametrize("p", GRAD_NORM_TYPES)
@pytest.mark.parametrize("name", NORM_DISTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_issue14_distributions(device, dtype, name, p):
    x = norm_distribution(name, dtype)
    exact = exact_norm(x, p)
    check_norm_result(hookstats.norm(x.to(device), p), exact, dtype, p, device, what=name)
    # as a list: each tensor its own pieces, the total merged across magnitudes
    parts = [x[:1000], x[1000:70001], x[70001:]]
    per, total = torch.ops.hookstats.norms([t.to(device) for t in parts], p)
    for i, t in enumerate(parts):
        assert_value_close(float(per[i]), exact_norm(t, p), norm_rtol(dtype, p) + 1e-15, f"{name} part {i}")
    assert_value_close(float(total), exact, norm_rtol(dtype, p) + 1e-15, f"{name} total")
    # bitwise deterministic
    again = torch.ops.hookstats.norms([t.to(device) for t in parts], p)
    assert_bits_equal(again[0], per, "per-tensor norms, second call")
    assert_bits_equal(again[1], total, "total, second call")


@pytest.mark.parametrize("p", GRAD_NORM_TYPES)
@pytest.mark.parametrize("name", NORM_DISTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_norm_issue14_distributions(device, dtype, name, p):
    """clip_norm_ on every path the device has (CUDA: two launches and the fused cooperative launch)."""
    x0 = norm_distribution(name, dtype).to(device)
    exact = exact_norm(x0, p)
    finite = math.isfinite(exact)
    max_norm = 0.3 * exact if finite and exact > 0 else 1.0
    paths = (1, 2) if x0.is_cuda else (0,)
    for path in paths:
        x = x0.clone()
        policy = 0 if finite else 1  # a NaN / inf norm: the zero policy, so the result has a closed form
        ret = torch.ops.hookstats.clip_norm_.default(x, p, max_norm, 1e-6, policy, path)
        assert ret.dtype == torch.float64
        assert_value_close(as_float(ret), exact, norm_rtol(dtype, p) + 1e-15, f"{name}, path {path}: norm")
        if finite:
            assert_tensor_close(x, clipped_reference(x0, max_norm, as_float(ret)), CLIP_RTOL[dtype],
                                f"{name}, path {path}: clipped x")
        else:
            assert torch.count_nonzero(x) == 0, f"{name}, path {path}: zero policy"
    if x0.is_cuda:  # the two paths agree bit for bit on the norm
        a = torch.ops.hookstats.clip_norm_.default(x0.clone(), p, 1e300, 1e-6, 0, 1)
        b = torch.ops.hookstats.clip_norm_.default(x0.clone(), p, 1e300, 1e-6, 0, 2)
        assert_value_close(as_float(b), as_float(a), 4 * eps_of(torch.float32) if dtype != torch.float64 else 1e-14,
                           f"{name}: fused vs two-launch norm")


# ---------------------------------------------------------------------------------------------------------
# hookstats.norms
# ---------------------------------------------------------------------------------------------------------

ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def many_tensors(device, seed=0, n=300, big=(100_000, 100_001, 131_072)):
    """n tensors of random sizes 0..5000 (every dtype, a few views) plus a few big ones."""
    g = seeded("many", seed)
    sizes = torch.randint(0, 5001, (n,), generator=g).tolist()
    sizes[:4] = [0, 1, 0, 5000]
    out = []
    for i, s in enumerate(sizes):
        dt = ALL_DTYPES[i % 4]
        t = (torch.randn(s, generator=g) * (0.1 + i % 7)).to(dt).to(device)
        if i % 10 == 9 and s > 2:
            t = t[1:]  # misaligned
        elif i % 10 == 5 and s >= 4:
            t = t[: s // 2 * 2].view(-1, 2).t()  # strided
        out.append(t)
    for k, s in enumerate(big):
        out.insert(37 * (k + 1), torch.randn(s, generator=g).to(ALL_DTYPES[k % 4]).to(device))
    return out


def check_norms(got, tensors, p, device):
    assert isinstance(got, tuple) and got._fields == ("per_tensor", "total")
    n = len(tensors)
    assert got.per_tensor.dtype == torch.float64 and got.per_tensor.shape == (n,)
    assert got.total.dtype == torch.float64 and got.total.shape == ()
    assert got.per_tensor.device.type == torch.device(device).type == got.total.device.type
    per = got.per_tensor.cpu().tolist()
    for i, t in enumerate(tensors):
        assert_value_close(per[i], exact_norm(t, p), norm_rtol(t.dtype, p), f"per_tensor[{i}] ({t.dtype}, {tuple(t.shape)})")
    cat = torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors]) if tensors else torch.zeros(0)
    rtol = max((norm_rtol(t.dtype, p) for t in tensors), default=0.0)
    assert_value_close(as_float(got.total), exact_norm(cat, p), rtol, "total")


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_norms_many_mixed_tensors(device, p):
    tensors = many_tensors(device)
    check_norms(hookstats.norms(tensors, p), tensors, p, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_norms_default_order_and_single_tensor(device, dtype):
    x = torch.randn(777, generator=seeded("single")).to(dtype).to(device)
    check_norms(hookstats.norms([x]), [x], 2.0, device)
    check_norms(hookstats.norms((x, x[::2]), 2.0), [x, x[::2]], 2.0, device)
    for p in (1.0, 2.0, INF, 3.0):
        r = hookstats.norms([x], p)
        assert_value_close(as_float(r.total), as_float(r.per_tensor[0]), 1e-15, "one tensor: total vs per_tensor")


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_norms_nonfinite_per_tensor(device, p):
    g = seeded("norms_nf")
    ts = [torch.randn(s, generator=g).to(dt).to(device) for s, dt in
          ((100, torch.float32), (5000, torch.bfloat16), (3, torch.float64), (4097, torch.float16))]
    ts[1][1234] = NAN
    ts[3][4096] = -INF
    got = hookstats.norms(ts, p)
    per = got.per_tensor.cpu().tolist()
    assert math.isnan(per[1]) and per[3] == INF
    for i in (0, 2):
        assert_value_close(per[i], exact_norm(ts[i], p), norm_rtol(ts[i].dtype, p), f"per_tensor[{i}]")
    assert math.isnan(as_float(got.total))
    got = hookstats.norms([ts[0], ts[3], ts[2]], p)  # inf, no NaN
    assert as_float(got.total) == INF and as_float(got.per_tensor[1]) == INF


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_norms_of_zero_size_tensors(device, p):  # pytorch#140066: _foreach_norm was wrong with zero-size tensors
    x = torch.randn(50, generator=seeded("zs"), device=device)
    ts = [torch.zeros(0, device=device), x, torch.zeros(3, 0, dtype=torch.float64, device=device),
          torch.zeros(0, dtype=torch.bfloat16, device=device)]
    check_norms(hookstats.norms(ts, p), ts, p, device)
    check_norms(hookstats.norms(ts[2:], p), ts[2:], p, device)


def test_norms_do_not_depend_on_thread_count(restore_threads):
    tensors = many_tensors("cpu", seed=1)
    big = torch.randn(2**20 + 3, generator=seeded("det"))
    for p in (1.0, 2.0, INF, 3.0):
        results = []
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            r = hookstats.norms(tensors, p)
            results.append((r.per_tensor, r.total, hookstats.norm(big, p), hookstats.norm(big.bfloat16(), p)))
        for other in results[1:]:
            for a, b in zip(results[0], other):
                assert_bits_equal(a, b, f"p={p}")


@pytest.mark.parametrize("device", DEVICES)
def test_norms_same_input_same_bits(device):
    tensors = many_tensors(device, seed=2, n=60)
    a, b = hookstats.norms(tensors, 2.0), hookstats.norms(tensors, 2.0)
    assert_bits_equal(a.per_tensor, b.per_tensor)
    assert_bits_equal(a.total, b.total)


# ---------------------------------------------------------------------------------------------------------
# hookstats.clip_norm_
# ---------------------------------------------------------------------------------------------------------

def clipped_reference(x0: torch.Tensor, max_norm: float, norm: float, eps: float = 1e-6) -> torch.Tensor:
    coef = min(1.0, max_norm / (norm + eps))
    return (x0.detach().double() * coef).to(x0.dtype)


def check_in_place(x, ptr, version, what=""):
    assert x.data_ptr() == ptr, f"{what}: data_ptr changed"
    assert x._version > version, f"{what}: version counter not bumped ({version} -> {x._version})"


@pytest.mark.parametrize("shape", WRITABLE_SHAPES)
@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_norm_scales_by_the_rule(device, dtype, p, shape):
    base, x = make_shape(shape, dtype, device, "clip")
    _check_layout(shape, base, x)
    base0, x0 = base.clone(), x.clone()
    exact = exact_norm(x0, p)
    max_norm = 0.3 * exact if exact > 0 else 1.0
    ptr, version = x.data_ptr(), x._version
    ret = hookstats.clip_norm_(x, max_norm, p)
    check_norm_result(ret, exact, dtype, p, device, what="returned norm")
    check_in_place(x, ptr, version)
    want = clipped_reference(x0, max_norm, as_float(ret))
    assert_tensor_close(x, want, CLIP_RTOL[dtype], "clipped x")
    check_outside_view(shape, base, base0)


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_norm_eps(device, dtype, p):
    for eps in (0.0, 0.5, 3.0):
        x = torch.randn(1000, generator=seeded("eps", eps)).to(dtype).to(device)
        x0 = x.clone()
        max_norm = 0.5 * exact_norm(x0, p)
        ret = hookstats.clip_norm_(x, max_norm, p, eps)
        assert_tensor_close(x, clipped_reference(x0, max_norm, as_float(ret), eps), CLIP_RTOL[dtype], f"eps={eps}")
        x = x0.clone()
        ret = hookstats.clip_norm_(x, max_norm, norm_type=p, eps=eps)
        assert_tensor_close(x, clipped_reference(x0, max_norm, as_float(ret), eps), CLIP_RTOL[dtype], f"eps={eps} kw")


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_norm_coefficient_one_leaves_bits(device, dtype, p):
    x = torch.randn(5000, generator=seeded("coef1")).to(dtype)
    tiny = torch.finfo(dtype).smallest_normal
    x[0], x[1], x[2], x[3] = -0.0, tiny * eps_of(dtype), -tiny / 4, tiny  # -0, subnormals, smallest normal
    x = x.to(device)
    x0 = x.clone()
    n = exact_norm(x0, p)
    for max_norm in (2 * n, 1e30, n + 1.0):
        ptr, version = x.data_ptr(), x._version
        ret = hookstats.clip_norm_(x, max_norm, p)
        assert_bits_equal(x, x0, f"max_norm={max_norm}")
        assert x.data_ptr() == ptr and x._version > version
        check_norm_result(ret, n, dtype, p, device)


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_norm_all_zero_stays_zero(device, dtype, p):
    for shape in ((1,), (4097,), (30, 7)):
        for max_norm in (1.0, 0.0):
            x = torch.zeros(shape, dtype=dtype, device=device)
            ret = hookstats.clip_norm_(x, max_norm, p)
            assert as_float(ret) == 0.0
            assert not torch.isnan(x).any() and (x == 0).all(), f"max_norm={max_norm}: {x.flatten()[:5]}"


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_norm_max_norm_zero_zeroes(device, dtype, p):
    x = torch.randn(4099, generator=seeded("mn0")).to(dtype).to(device)
    x0 = x.clone()
    ret = hookstats.clip_norm_(x, 0.0, p)
    check_norm_result(ret, exact_norm(x0, p), dtype, p, device, "returned norm")
    assert (x == 0).all()


NONFINITE_CONTENT = {
    "nan": (NAN,),
    "inf": (INF,),
    "neg_inf": (-INF,),
    "inf_and_nan": (INF, NAN),
}


def _nonfinite_input(content, dtype, device, n=5000):
    x = torch.randn(n, generator=seeded("nfc", content)).to(dtype)
    for k, v in enumerate(NONFINITE_CONTENT[content]):
        x[1000 + 2222 * k] = v
    return x.to(device)


def pytorch_clip(x0: torch.Tensor, max_norm, p):
    """What torch.nn.utils.clip_grad_norm_ does to a grad equal to x0: (grad after, returned total)."""
    prm = torch.nn.Parameter(torch.zeros_like(x0))
    prm.grad = x0.clone()
    total = torch.nn.utils.clip_grad_norm_([prm], max_norm, p)
    return prm.grad, total


@pytest.mark.parametrize("content", list(NONFINITE_CONTENT))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("p", [2.0, INF, 1.0, 0.5])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_norm_nonfinite_policies(device, dtype, p, policy, content):
    x = _nonfinite_input(content, dtype, device)
    x0 = x.clone()
    want_norm = NAN if "nan" in content else INF
    if policy == "error":
        with pytest.raises(RuntimeError, match="(?i)non-?finite"):
            hookstats.clip_norm_(x, 1.0, p, nonfinite="error")
        assert_bits_equal(x, x0, "x after the error")
        return
    ret = hookstats.clip_norm_(x, 1.0, p, nonfinite=policy)
    assert ret.dtype == result_dtype(dtype) and same_nonfinite(as_float(ret), want_norm), as_float(ret)
    if policy == "zero":
        assert (x == 0).all(), f"nonfinite='zero' left {x[(x != 0)][:5]}"
        return
    # propagate: PyTorch's rule (norm inf -> coef 0: finite values 0, inf values NaN; norm NaN -> all NaN)
    grad, total = pytorch_clip(x0, 1.0, p)
    assert same_nonfinite(as_float(total), as_float(ret))
    torch.testing.assert_close(x.cpu(), grad.cpu(), rtol=0, atol=0, equal_nan=True)
    finite = torch.isfinite(x0)
    if want_norm == INF:
        assert (x[finite] == 0).all() and torch.isnan(x[~finite]).all()
    else:
        assert torch.isnan(x).all()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_norm_policies_agree_on_finite_input(device, dtype, policy):
    x = torch.randn(3000, generator=seeded("fin")).to(dtype).to(device)
    x0 = x.clone()
    ret = hookstats.clip_norm_(x, 0.25, 2.0, nonfinite=policy)
    assert_tensor_close(x, clipped_reference(x0, 0.25, as_float(ret)), CLIP_RTOL[dtype], policy)


@pytest.mark.parametrize("p", [2.0, INF])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_norm_matches_pytorch_clip_grad_norm(device, dtype, p):
    x = torch.randn(2000, generator=seeded("vspt")).to(dtype).to(device)
    x0 = x.clone()
    ret = hookstats.clip_norm_(x, 0.7, p)
    grad, total = pytorch_clip(x0, 0.7, p)
    rtol = CLIP_RTOL[dtype] + 2 * eps_of(dtype)
    assert_tensor_close(x, grad, rtol, "vs torch.nn.utils.clip_grad_norm_")
    assert_value_close(as_float(ret), as_float(total), rtol, "norm vs PyTorch")


@pytest.mark.parametrize("device", DEVICES)
def test_clip_norm_huge_fp32_is_finite(device):
    x = torch.full((1000,), 1e30, device=device)
    ret = hookstats.clip_norm_(x, 1.0)
    v = cast(1e30, torch.float32)
    assert as_float(ret) == pytest.approx(v * math.sqrt(1000), rel=1e-5, abs=0)  # 3.1623e31, PyTorch: inf
    assert_tensor_close(x, torch.full((1000,), v / (v * math.sqrt(1000)), device=device), 2e-6, "x")


@pytest.mark.parametrize("device", DEVICES)
def test_clip_norm_returns_without_autograd_graph(device):
    x = torch.randn(10, device=device)
    ret = hookstats.clip_norm_(x, 0.1)
    assert not ret.requires_grad and ret.grad_fn is None


# ---------------------------------------------------------------------------------------------------------
# hookstats.clip_value_
# ---------------------------------------------------------------------------------------------------------

BOUNDS = {
    "sym_0.5": (0.5, None),
    "sym_0": (0.0, None),
    "asym": (-0.3, 1.7),
    "asym_neg": (-2.0, -1.0),
    "asym_pos": (0.0, 0.75),
    "point": (0.1, 0.1),
    "wide": (-1e4, 1e4),  # clips only the values near the dtype's max (and the infinities)
    "unrounded": (-0.33333333, 0.9999),  # not representable in any input dtype
}


def value_input(dtype, device, n=5003, key="cv"):
    x = torch.randn(n, generator=seeded(key, n)).to(dtype) * 1.5
    specials = [NAN, INF, -INF, -0.0, 0.0, 0.5, -0.5, 1.7, -0.3, 1.0, 0.9999, 0.1,
                torch.finfo(dtype).max, -torch.finfo(dtype).max]
    for k, v in enumerate(specials):
        if k < n:
            x[(k * 37) % n] = v
    return x.to(device)


def bounds_of(lo, hi):
    return (-lo, lo) if hi is None else (lo, hi)


def expected_count(x0, lo, hi) -> int:
    lo_r = torch.tensor(lo, dtype=torch.float64).to(x0.dtype).to(x0.device)
    hi_r = torch.tensor(hi, dtype=torch.float64).to(x0.dtype).to(x0.device)
    return int(((x0 < lo_r) | (x0 > hi_r)).sum())


def call_clip_value(x, lo, hi):
    return hookstats.clip_value_(x, lo) if hi is None else hookstats.clip_value_(x, lo, hi)


@pytest.mark.parametrize("bounds", list(BOUNDS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_value_equals_clamp(device, dtype, bounds):
    lo, hi = BOUNDS[bounds]
    a, b = bounds_of(lo, hi)
    for n in (1, 7, 5003, 70001):
        x = value_input(dtype, device, n)
        x0 = x.clone()
        ptr, version = x.data_ptr(), x._version
        count = call_clip_value(x, lo, hi)
        assert count.dtype == torch.int64 and count.shape == () and count.device.type == torch.device(device).type
        assert_bits_equal_but_nan_payloads(x, x0.clone().clamp_(a, b), f"n={n}")
        assert int(count) == expected_count(x0, a, b), f"n={n}"
        check_in_place(x, ptr, version)


def test_clip_value_bounds_are_rounded_to_the_dtype():
    bf = torch.bfloat16
    # 0.9999 rounds to 1.0 in bf16: 1.0 is not outside, 1.0078125 is
    x = torch.tensor([1.0, -1.0, 1.0078125, -1.0078125, NAN], dtype=bf)
    count = hookstats.clip_value_(x, 0.9999)
    assert int(count) == 2
    assert x[:4].tolist() == [1.0, -1.0, 1.0, -1.0] and math.isnan(x[4].item())
    # fp16: -1.0001 and 1.0001 round to -1.0 and 1.0
    h = torch.tensor([1.0, 1.0009765625, -1.0, -1.0009765625, 0.5], dtype=torch.float16)
    assert int(hookstats.clip_value_(h, -1.0001, 1.0001)) == 2
    assert h.tolist() == [1.0, 1.0, -1.0, -1.0, 0.5]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_value_nan_kept_not_counted(device, dtype):
    x = torch.full((4097,), NAN, dtype=dtype, device=device)
    x0 = x.clone()
    assert int(hookstats.clip_value_(x, 0.0)) == 0
    assert_bits_equal(x, x0, "NaN payloads")
    x = torch.tensor([NAN, 5.0, -5.0, NAN], dtype=dtype, device=device)
    assert int(hookstats.clip_value_(x, -1.0, 2.0)) == 2
    assert torch.isnan(x[[0, 3]]).all() and x[1].item() == 2.0 and x[2].item() == -1.0


@pytest.mark.parametrize("shape", WRITABLE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_value_layouts(device, dtype, shape):
    base, x = make_shape(shape, dtype, device, "cv")
    _check_layout(shape, base, x)
    base0, x0 = base.clone(), x.clone()
    ptr, version = x.data_ptr(), x._version
    count = hookstats.clip_value_(x, -0.4, 0.9)
    assert_bits_equal(x, x0.clone().clamp_(-0.4, 0.9), shape)
    assert int(count) == expected_count(x0, -0.4, 0.9)
    check_in_place(x, ptr, version)
    check_outside_view(shape, base, base0)


# ---------------------------------------------------------------------------------------------------------
# clip_grad_norm_ / get_total_norm / clip_grads_with_norm_ against torch.nn.utils
# ---------------------------------------------------------------------------------------------------------

def make_params(device, specs, seed=0, scale=1.0):
    """Parameters from (shape, dtype, has_grad) specs, with random grads."""
    g = seeded("params", seed)
    out = []
    for shape, dtype, has_grad in specs:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        if has_grad:
            p.grad = (torch.randn(shape, generator=g) * scale * (1 + torch.rand((), generator=g) * 5)).to(dtype).to(device)
        out.append(p)
    return out


def twin(params):
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


def pytorch_twin(params, p):
    """A copy of params for torch.nn.utils. For the inf-norm, 0-element grads become None there: PyTorch's
    _foreach_norm refuses the inf-norm of an empty tensor ("does not have an identity"), while an empty grad adds
    nothing to the max and has nothing to clip."""
    out = twin(params)
    if p == INF:
        for q in out:
            if q.grad is not None and q.grad.numel() == 0:
                q.grad = None
    return out


def pytorch_inputs(tensors, p):
    """tensors for torch.nn.utils.get_total_norm (see pytorch_twin)."""
    return [t for t in tensors if t.numel() > 0] if p == INF and any(t.numel() > 0 for t in tensors) else tensors


def _random_shapes(g, n):
    shapes = [(), (0,), (3, 0), (1,), ()]
    while len(shapes) < n:
        k = int(torch.randint(1, 4, (), generator=g))
        shapes.append(tuple(int(s) for s in torch.randint(1, 40 if k > 1 else 3000, (k,), generator=g)))
    return shapes


def param_case(name, device):
    g = seeded("case", name)
    if name == "fp32_mixed_sizes":
        specs = [(s, torch.float32, True) for s in _random_shapes(g, 60)]
    elif name == "mixed_dtypes":  # fp32 + bf16 + fp64 in one list
        specs = [(s, [torch.float32, torch.bfloat16, torch.float64][i % 3], True)
                 for i, s in enumerate(_random_shapes(g, 40))]
    elif name == "with_none_grads":
        specs = [(s, torch.float32, i % 4 != 1) for i, s in enumerate(_random_shapes(g, 30))]
    elif name == "many_params":
        specs = [(s, torch.float32 if i % 2 else torch.float64, True) for i, s in enumerate(_random_shapes(g, 100))]
    elif name in ("bf16", "fp16", "fp64"):
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[name]
        specs = [(s, dt, True) for s in _random_shapes(g, 20)]
    else:
        raise KeyError(name)
    return make_params(device, specs, seed=name)


PARAM_CASES = ["fp32_mixed_sizes", "mixed_dtypes", "with_none_grads", "many_params", "bf16", "fp16", "fp64"]


def grads_of(params):
    return [p.grad for p in params if p.grad is not None]


def exact_total(grads, p):
    return exact_norm(torch.cat([g.detach().reshape(-1).double().cpu() for g in grads]), p) if grads else 0.0


def pytorch_error(want: torch.Tensor, exact: float) -> float:
    """The relative error of PyTorch's total (its fp32/bf16/fp16 per-tensor norms are rounded and accumulated in
    their dtype): PyTorch's coefficient, and so its clipped grads, are off by that much."""
    w = as_float(want)
    if exact == 0.0 or not (math.isfinite(w) and math.isfinite(exact)):
        return 0.0
    return abs(w - exact) / exact


def check_total_vs_pytorch(got, want, grads, p, what="total"):
    """got (hookstats) against want (PyTorch): dtype and device exact; the value within the norm tolerance of the
    float64 total (rounded to the dtype: inf when it does not fit), and close to PyTorch's up to PyTorch's own
    error."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, PyTorch {want.dtype}"
    assert got.device == want.device, f"{what}: device {got.device}, PyTorch {want.device}"
    assert got.shape == (), f"{what}: shape {tuple(got.shape)}"
    dts = [g.dtype for g in grads] or [torch.float32]
    exact = exact_total(grads, p)
    rtol = max(norm_rtol(d, p) for d in dts) + eps_of(got.dtype)
    if math.isfinite(cast(exact, got.dtype)):
        assert_value_close(as_float(got), exact, rtol, f"{what} vs float64")
    else:
        assert as_float(got) == INF, f"{what}: the true total {exact!r} overflows {got.dtype}, got {as_float(got)!r}"
    assert_value_close(as_float(got), as_float(want), rtol + pytorch_error(want, exact), f"{what} vs PyTorch")


def check_grads_after_clip(params, params0, pt_params, max_norm, total64, pt_total=None, what=""):
    """params (hookstats-clipped) against the float64 rule applied with total64, and against PyTorch's clip
    (pt_params, whose returned total was pt_total) up to 2 eps of the coarsest dtype plus PyTorch's error."""
    dts = [p.grad.dtype for p in params0 if p.grad is not None] or [torch.float32]
    coef = min(1.0, max_norm / (total64 + 1e-6))
    # The coefficient carries the error of the total norm, which for a mixed list is accumulated at the precision of
    # its coarsest member (an fp64 grad in a list with fp32 grads is scaled by a coefficient good to ~1e-7).
    coef_rtol = 0.0 if total64 == 0 or coef == 1.0 else max(norm_rtol(d, 2.0) for d in dts)
    pt_err = 0.0
    if pt_total is not None:
        if not math.isfinite(as_float(pt_total)) and math.isfinite(total64):
            pt_params = [None] * len(params)  # the spec's fp16 difference: PyTorch's total overflowed its dtype
        else:
            pt_err = abs(as_float(pt_total) - total64) / total64 if total64 and math.isfinite(total64) else 0.0
    for i, (p, p0, q) in enumerate(zip(params, params0, pt_params)):
        if p0.grad is None:
            assert p.grad is None, f"{what}: param {i} got a grad"
            continue
        want = (p0.grad.double() * coef).to(p0.grad.dtype)
        assert_tensor_close(p.grad, want, CLIP_RTOL[p0.grad.dtype] + coef_rtol,
                            f"{what} grad {i} ({p0.grad.dtype}) vs float64 rule")
        if q is None:
            continue
        if q.grad is None:  # an empty grad that pytorch_twin hid from PyTorch
            assert p0.grad.numel() == 0
            continue
        assert_tensor_close(p.grad, q.grad, CLIP_RTOL[p0.grad.dtype] + 2 * eps_of(coarsest(dts)) + pt_err,
                            f"{what} grad {i} ({p0.grad.dtype}) vs PyTorch")


@pytest.mark.parametrize("p", GRAD_NORM_TYPES)
@pytest.mark.parametrize("case", PARAM_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_norm_matches_pytorch(device, case, p):
    params = param_case(case, device)
    params0, pt = twin(params), pytorch_twin(params, p)
    grads0 = grads_of(params0)
    internal = hookstats.norms(grads0, p).total  # float64, what the coefficient must be computed from
    exact = exact_total(grads0, p)
    assert_value_close(as_float(internal), exact, max(norm_rtol(g.dtype, p) for g in grads0), "norms().total")
    max_norm = 0.4 * exact
    ptrs = [(g.data_ptr(), g._version) for g in grads_of(params)]
    got = hookstats.clip_grad_norm_(params, max_norm, p)
    want = torch.nn.utils.clip_grad_norm_(pt, max_norm, p)
    check_total_vs_pytorch(got, want, grads0, p)
    check_grads_after_clip(params, params0, pt, max_norm, as_float(internal), want, case)
    for g, (ptr, version) in zip(grads_of(params), ptrs):
        assert g.data_ptr() == ptr and g._version > version


@pytest.mark.parametrize("case", PARAM_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_norm_without_clipping_leaves_bits(device, case):
    params = param_case(case, device)
    params0, pt = twin(params), twin(params)
    max_norm = 2 * exact_total(grads_of(params0), 2.0) + 1.0
    got = hookstats.clip_grad_norm_(params, max_norm)
    want = torch.nn.utils.clip_grad_norm_(pt, max_norm)
    check_total_vs_pytorch(got, want, grads_of(params0), 2.0)
    for a, b, c in zip(grads_of(params), grads_of(params0), grads_of(pt)):
        assert_bits_equal(a, b, "coefficient 1")
        assert_bits_equal(a, c, "coefficient 1 vs PyTorch")


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(16),
        torch.nn.LayerNorm(16), torch.nn.Linear(16, 4),
    ).to(device)


@pytest.mark.parametrize("p", GRAD_NORM_TYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_norm_model_and_generator(device, p):
    m1 = _model(device)
    x = torch.randn(5, 3, 10, 10, generator=seeded("model")).to(device)
    m1(x).square().sum().backward()
    m1[5].bias.grad = None  # a None grad among the params
    m2, m0 = copy.deepcopy(m1), copy.deepcopy(m1)
    for a, b, c in zip(m1.parameters(), m2.parameters(), m0.parameters()):  # deepcopy does not copy .grad
        b.grad = None if a.grad is None else a.grad.clone()
        c.grad = None if a.grad is None else a.grad.clone()
    assert len(grads_of(m0.parameters())) == len(list(m0.parameters())) - 1
    max_norm = 0.1 * exact_total(grads_of(m0.parameters()), p)
    got = hookstats.clip_grad_norm_(m1.parameters(), max_norm, norm_type=p)  # a generator
    want = torch.nn.utils.clip_grad_norm_(m2.parameters(), max_norm, norm_type=p)
    check_total_vs_pytorch(got, want, grads_of(m0.parameters()), p)
    total64 = as_float(hookstats.norms(grads_of(m0.parameters()), p).total)
    check_grads_after_clip(list(m1.parameters()), list(m0.parameters()), list(m2.parameters()), max_norm, total64,
                           want)
    assert m1[5].bias.grad is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_norm_single_tensor(device, dtype):
    [prm] = make_params(device, [((50, 3), dtype, True)], seed="single")
    [p0], [pt] = twin([prm]), twin([prm])
    got = hookstats.clip_grad_norm_(prm, 0.5)
    want = torch.nn.utils.clip_grad_norm_(pt, 0.5)
    check_total_vs_pytorch(got, want, [p0.grad], 2.0)
    check_grads_after_clip([prm], [p0], [pt], 0.5, as_float(hookstats.norms([p0.grad]).total), want)


@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_norm_empty_and_all_none(device):
    for params in ([], [torch.nn.Parameter(torch.ones(3, device=device))]):
        for fn in (hookstats.clip_grad_norm_, torch.nn.utils.clip_grad_norm_):
            r = fn(params, 1.0)
            assert r.dtype == torch.float32 and r.device == torch.device("cpu") and r.shape == () and float(r) == 0.0
    assert params[0].grad is None
    r = hookstats.get_total_norm([])
    assert r.dtype == torch.float32 and r.device.type == "cpu" and float(r) == 0.0
    assert hookstats.clip_grads_with_norm_([], 1.0, torch.tensor(3.0)) is None


def test_clip_grad_norm_empty_generator_warns_like_pytorch():
    with pytest.warns(UserWarning, match="empty generator") as rec:
        r = hookstats.clip_grad_norm_((p for p in []), 1.0)
    assert float(r) == 0.0
    with warnings.catch_warnings(record=True) as pt:
        warnings.simplefilter("always")
        torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
    assert [str(w.message) for w in rec if "generator" in str(w.message)] == [str(w.message) for w in pt]


@pytest.mark.parametrize("p", [2.0, INF, 1.0, 3.0, 2, "inf"], ids=["p2", "pinf", "p1", "p3", "int2", "str_inf"])
@pytest.mark.parametrize("content", ["nan", "inf"])
@pytest.mark.parametrize("device", DEVICES)
def test_error_if_nonfinite_message_matches_pytorch(device, content, p):
    params = make_params(device, [((100,), torch.float32, True), ((7, 3), torch.bfloat16, True)], seed="err")
    params[1].grad[3, 1] = NAN if content == "nan" else INF
    params0, pt = twin(params), twin(params)
    with pytest.raises(RuntimeError) as want:
        torch.nn.utils.clip_grad_norm_(pt, 1.0, p, error_if_nonfinite=True)
    for call in (lambda: hookstats.clip_grad_norm_(params, 1.0, p, error_if_nonfinite=True),
                 lambda: hookstats.clip_grad_norm_(params, 1.0, p, True),
                 lambda: hookstats.get_total_norm(grads_of(params), p, error_if_nonfinite=True)):
        with pytest.raises(RuntimeError) as got:
            call()
        assert str(got.value) == str(want.value)
    with pytest.raises(RuntimeError, match="(?i)non-?finite"):
        hookstats.clip_grad_norm_(params, 1.0, p, nonfinite="error")
    for a, b in zip(grads_of(params), grads_of(params0)):
        assert_bits_equal(a, b, "grads after the error")


@pytest.mark.parametrize("content", ["nan", "inf", "neg_inf"])
@pytest.mark.parametrize("p", GRAD_NORM_TYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_norm_nonfinite_zero_and_propagate(device, p, content):
    specs = [((100,), torch.float32, True), ((7, 3), torch.bfloat16, True), ((0,), torch.float32, True),
             ((5,), torch.float64, True), ((2,), torch.float32, False)]
    params = make_params(device, specs, seed="nfz")
    params[1].grad[3, 1] = {"nan": NAN, "inf": INF, "neg_inf": -INF}[content]
    want_total = NAN if content == "nan" else INF
    # zero
    z = twin(params)
    r = hookstats.clip_grad_norm_(z, 1.0, p, nonfinite="zero")
    assert same_nonfinite(as_float(r), want_total)
    for g in grads_of(z):
        assert (g == 0).all(), f"nonfinite='zero' left {g[g != 0][:5]}"
    assert z[4].grad is None
    # propagate (the default): PyTorch's result exactly
    a, b = twin(params), pytorch_twin(params, p)
    r = hookstats.clip_grad_norm_(a, 1.0, p)
    w = torch.nn.utils.clip_grad_norm_(b, 1.0, p)
    assert r.dtype == w.dtype and same_nonfinite(as_float(r), as_float(w))
    for qa, qb in zip(a, b):
        if qb.grad is not None:
            torch.testing.assert_close(qa.grad.cpu(), qb.grad.cpu(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("p", GRAD_NORM_TYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_norm_all_zero_grads(device, p):
    params = make_params(device, [((100,), torch.float32, True), ((3, 3), torch.bfloat16, True)], seed="z")
    for q in params:
        q.grad.zero_()
    pt = twin(params)
    got = hookstats.clip_grad_norm_(params, 1.0, p)
    want = torch.nn.utils.clip_grad_norm_(pt, 1.0, p)
    assert got.dtype == want.dtype and float(got) == float(want) == 0.0
    for g in grads_of(params):
        assert (g == 0).all() and not torch.isnan(g).any()


@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_norm_huge_fp32_grads(device):
    # PyTorch's fp32 norms overflow (total inf, grads zeroed); hookstats' total is the true 3.16e31, which fits fp32
    params = [torch.nn.Parameter(torch.zeros(100, device=device)) for _ in range(10)]
    for q in params:
        q.grad = torch.full((100,), 1e30, device=device)
    pt = twin(params)
    want = torch.nn.utils.clip_grad_norm_(pt, 1.0)
    assert float(want) == INF and (pt[0].grad == 0).all()  # the documented difference
    got = hookstats.clip_grad_norm_(params, 1.0)
    v = cast(1e30, torch.float32)
    total = v * math.sqrt(1000)
    assert got.dtype == torch.float32 and got.device == want.device
    assert_value_close(as_float(got), total, 1e-5, "total")
    tt = hookstats.get_total_norm([torch.full((100,), 1e30, device=device)] * 10)
    assert tt.dtype == torch.float32
    assert_value_close(as_float(tt), total, 1e-5, "get_total_norm")
    for q in params:
        assert_tensor_close(q.grad, torch.full((100,), v / (total + 1e-6), device=device), 2e-6, "clipped grad")


@pytest.mark.parametrize("layout", ["one_tensor_overflows", "total_overflows"])
@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_norm_fp16_total_past_65504(device, layout):
    # The spec's documented difference: PyTorch's fp16 norm is inf and it zeroes the grads; hookstats returns the
    # same inf (fp16) total but clips with the exact norm.
    if layout == "one_tensor_overflows":
        shapes, value = [(10000,), (10,)], 1000.0  # norm of the first: 1e5 > 65504
    else:
        shapes, value = [(400,)] * 4, 2000.0  # each 40000 (fits fp16), total 80000 (does not)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float16, device=device)) for s in shapes]
    for q in params:
        q.grad = torch.full(q.shape, value, dtype=torch.float16, device=device)
    params0, pt = twin(params), twin(params)
    want = torch.nn.utils.clip_grad_norm_(pt, 1.0)
    got = hookstats.clip_grad_norm_(params, 1.0)
    assert got.dtype == want.dtype == torch.float16 and got.device == want.device
    assert as_float(want) == INF and as_float(got) == INF
    assert all((g == 0).all() for g in grads_of(pt))  # PyTorch zeroed them
    exact = exact_total(grads_of(params0), 2.0)
    for g, g0 in zip(grads_of(params), grads_of(params0)):
        want_g = (g0.double() * (1.0 / (exact + 1e-6))).half()
        assert_tensor_close(g, want_g, CLIP_RTOL[torch.float16], "grad clipped with the exact norm")
        assert (g != 0).all()


# get_total_norm and clip_grads_with_norm_

@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("case", PARAM_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_get_total_norm_matches_pytorch(device, case, p):
    grads = grads_of(param_case(case, device))
    got = hookstats.get_total_norm(grads, p)
    want = torch.nn.utils.get_total_norm(pytorch_inputs(grads, p), p)
    check_total_vs_pytorch(got, want, grads, p)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,), (torch.float16,), (torch.float16, torch.bfloat16),
                                    (torch.float32, torch.float64), (torch.bfloat16, torch.float32)],
                         ids=lambda d: "+".join(str(t).split(".")[1] for t in d))
@pytest.mark.parametrize("device", DEVICES)
def test_get_total_norm_dtype_promotion(device, dtypes):
    ts = [torch.randn(100, generator=seeded("promo", i)).to(dt).to(device) for i, dt in enumerate(dtypes * 2)]
    got, want = hookstats.get_total_norm(ts), torch.nn.utils.get_total_norm(ts)
    check_total_vs_pytorch(got, want, ts, 2.0)
    got, want = hookstats.get_total_norm(ts[0]), torch.nn.utils.get_total_norm(ts[0])  # a single Tensor
    check_total_vs_pytorch(got, want, [ts[0]], 2.0)
    got = hookstats.get_total_norm(t for t in ts)  # any iterable
    check_total_vs_pytorch(got, torch.nn.utils.get_total_norm(ts), ts, 2.0)


TOTAL_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("total_dtype", TOTAL_DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("case", ["mixed_dtypes", "with_none_grads", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_clip_grads_with_norm_matches_pytorch(device, case, total_dtype):
    params0 = param_case(case, device)
    for total_value in (3.0, 0.5 * exact_total(grads_of(params0), 2.0), 1e-3):
        a, b = twin(params0), twin(params0)
        total = torch.tensor(total_value, dtype=total_dtype, device=device)
        versions = [g._version for g in grads_of(a)]
        assert hookstats.clip_grads_with_norm_(a, 1.0, total) is None
        torch.nn.utils.clip_grads_with_norm_(b, 1.0, total)
        total64 = as_float(total)
        dts = [g.dtype for g in grads_of(params0)] + [total_dtype]
        coef = min(1.0, 1.0 / (total64 + 1e-6))
        for i, (ga, g0, gb) in enumerate(zip(grads_of(a), grads_of(params0), grads_of(b))):
            assert_tensor_close(ga, (g0.double() * coef).to(g0.dtype), CLIP_RTOL[g0.dtype], f"grad {i} vs float64")
            assert_tensor_close(ga, gb, CLIP_RTOL[g0.dtype] + 2 * eps_of(coarsest(dts)), f"grad {i} vs PyTorch")
        assert all(g._version > v for g, v in zip(grads_of(a), versions))
        for qa, q0 in zip(a, params0):
            assert (qa.grad is None) == (q0.grad is None)


@pytest.mark.parametrize("device", DEVICES)
def test_clip_grads_with_norm_nonfinite_total(device):
    params = make_params(device, [((100,), torch.float32, True), ((9,), torch.bfloat16, True)], seed="cwn")
    for total, policy in ((INF, "propagate"), (NAN, "propagate"), (INF, "zero"), (NAN, "zero")):
        a, b = twin(params), twin(params)
        t = torch.tensor(total, device=device)
        hookstats.clip_grads_with_norm_(a, 1.0, t, nonfinite=policy)
        if policy == "zero":
            assert all((g == 0).all() for g in grads_of(a)), (total, policy)
        else:
            torch.nn.utils.clip_grads_with_norm_(b, 1.0, t)
            for ga, gb in zip(grads_of(a), grads_of(b)):
                torch.testing.assert_close(ga, gb, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("case", ["mixed_dtypes", "with_none_grads"])
@pytest.mark.parametrize("device", DEVICES)
def test_foreach_argument_is_accepted_and_changes_nothing(device, case):
    params = param_case(case, device)
    max_norm = 0.3 * exact_total(grads_of(params), 2.0)
    results = {}
    for foreach in (None, True, False):
        a, b, c = twin(params), twin(params), twin(params)
        total = hookstats.get_total_norm(grads_of(params), 2.0, False, foreach)
        ret = hookstats.clip_grad_norm_(a, max_norm, 2.0, False, foreach)
        hookstats.clip_grads_with_norm_(b, max_norm, torch.tensor(2.5), foreach)
        count = hookstats.clip_grad_value_(c, 0.4, foreach)
        results[foreach] = [total, ret, count] + grads_of(a) + grads_of(b) + grads_of(c)
    for foreach in (True, False):
        for i, (x, y) in enumerate(zip(results[None], results[foreach])):
            assert_bits_equal(x, y, f"foreach={foreach}, result {i}")
    assert int(results[None][2]) > 0


# ---------------------------------------------------------------------------------------------------------
# clip_grad_value_ against torch.nn.utils.clip_grad_value_
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("clip_value", [0.0, 0.3, 1.7, 1e4])
@pytest.mark.parametrize("case", ["mixed_dtypes", "with_none_grads", "fp16", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_value_matches_pytorch(device, case, clip_value):
    params = param_case(case, device)
    for i, g in enumerate(grads_of(params)):
        flat = g.view(-1)
        if flat.numel() > 3:
            flat[i % flat.numel()] = [NAN, INF, -INF, -0.0][i % 4]
    params0, pt = twin(params), twin(params)
    versions = [g._version for g in grads_of(params)]
    count = hookstats.clip_grad_value_(params, clip_value)
    assert torch.nn.utils.clip_grad_value_(pt, clip_value) is None
    for i, (a, b) in enumerate(zip(grads_of(params), grads_of(pt))):
        assert_bits_equal_but_nan_payloads(a, b, f"grad {i}")
    want = sum(expected_count(g, -clip_value, clip_value) for g in grads_of(params0))
    assert count.dtype == torch.int64 and count.shape == () and count.device.type == torch.device(device).type
    assert int(count) == want
    assert all(g._version > v for g, v in zip(grads_of(params), versions))


@pytest.mark.parametrize("device", DEVICES)
def test_clip_grad_value_single_tensor_and_no_grads(device):
    [prm] = make_params(device, [((1000,), torch.float32, True)], seed="cgv")
    g0 = prm.grad.clone()
    count = hookstats.clip_grad_value_(prm, 0.5)
    assert_bits_equal(prm.grad, g0.clamp(-0.5, 0.5))
    assert int(count) == int((g0.abs() > 0.5).sum()) > 0
    for params in ([], [torch.nn.Parameter(torch.ones(3, device=device))]):
        c = hookstats.clip_grad_value_(params, 1.0)
        assert c.dtype == torch.int64 and c.shape == () and int(c) == 0
    gen_params = make_params(device, [((10,), torch.float64, True)] * 3, seed="gen")
    want = sum(int((q.grad.abs() > 0.1).sum()) for q in gen_params)
    c = hookstats.clip_grad_value_((q for q in gen_params), 0.1)
    assert int(c) == want > 0
    assert all(float(q.grad.abs().max()) <= 0.1 for q in gen_params)


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------

def _grad_params(device="cpu"):
    return make_params(device, [((10,), torch.float32, True)], seed="errs")


@pytest.mark.parametrize("max_norm", [-1.0, -1e-30, NAN], ids=["neg", "tiny_neg", "nan"])
def test_rejects_bad_max_norm(max_norm):
    x = torch.randn(10)
    x0 = x.clone()
    params = _grad_params()
    g0 = params[0].grad.clone()
    for call in (lambda: hookstats.clip_norm_(x, max_norm),
                 lambda: hookstats.clip_grad_norm_(params, max_norm),
                 lambda: hookstats.clip_grads_with_norm_(params, max_norm, torch.tensor(1.0))):
        with pytest.raises(ValueError, match="max_norm"):
            call()
    assert_bits_equal(x, x0)
    assert_bits_equal(params[0].grad, g0)


@pytest.mark.parametrize("norm_type", [NAN, 0.0, 0, -1.0, -2, -INF], ids=["nan", "zero", "int0", "neg", "int_neg", "neg_inf"])
def test_rejects_bad_norm_type(norm_type):
    x = torch.randn(10)
    x0 = x.clone()
    params = _grad_params()
    g0 = params[0].grad.clone()
    for call in (lambda: hookstats.norm(x, norm_type),
                 lambda: hookstats.norms([x], norm_type),
                 lambda: hookstats.clip_norm_(x, 1e-3, norm_type),
                 lambda: hookstats.get_total_norm([x], norm_type),
                 lambda: hookstats.clip_grad_norm_(params, 1e-3, norm_type)):
        with pytest.raises(ValueError, match="norm_type"):
            call()
    assert_bits_equal(x, x0)
    assert_bits_equal(params[0].grad, g0)


BAD_DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_rejects_non_float_dtypes(dtype):
    x = torch.ones(4, dtype=dtype)
    good = torch.ones(4)
    holder = torch.zeros(4, dtype=dtype)
    holder.grad = torch.ones(4, dtype=dtype)
    name = re.escape(str(dtype))
    for call in (lambda: hookstats.norm(x),
                 lambda: hookstats.norms([good, x]),
                 lambda: hookstats.clip_norm_(x, 1.0),
                 lambda: hookstats.clip_value_(x, 1.0),
                 lambda: hookstats.clip_value_(x, -1.0, 1.0),
                 lambda: hookstats.get_total_norm([good, x]),
                 lambda: hookstats.clip_grad_norm_([holder], 1.0),
                 lambda: hookstats.clip_grad_value_([holder], 1.0)):
        with pytest.raises(TypeError, match=name):
            call()
    assert (x == 1).all() and (holder.grad == 1).all()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_rejects_sparse(layout):
    d = torch.randn(3, 3)
    x = d.to_sparse() if layout == "sparse_coo" else d.to_sparse_csr()
    for call in (lambda: hookstats.norm(x),
                 lambda: hookstats.norms([torch.ones(2), x]),
                 lambda: hookstats.clip_norm_(x, 1e-3),
                 lambda: hookstats.clip_value_(x, 0.1),
                 lambda: hookstats.get_total_norm([x])):
        with pytest.raises(TypeError, match=layout):
            call()


@pytest.mark.parametrize("policy", ["Propagate", "raise", "", None, "nan"])
def test_rejects_unknown_nonfinite_policy(policy):
    x = torch.randn(10)
    x0 = x.clone()
    params = _grad_params()
    for call in (lambda: hookstats.clip_norm_(x, 1e-3, nonfinite=policy),
                 lambda: hookstats.clip_grad_norm_(params, 1e-3, nonfinite=policy),
                 lambda: hookstats.clip_grads_with_norm_(params, 1e-3, torch.tensor(1.0), nonfinite=policy)):
        with pytest.raises(ValueError, match="nonfinite"):
            call()
    assert_bits_equal(x, x0)


@pytest.mark.parametrize("lo,hi,what", [
    (1.0, 0.5, "lo > hi"), (NAN, 1.0, "NaN lo"), (0.0, NAN, "NaN hi"), (NAN, None, "NaN symmetric"),
    (-0.5, None, "negative symmetric"), (-INF, None, "-inf symmetric"),
])
def test_clip_value_rejects_bad_bounds(lo, hi, what):
    x = torch.randn(10)
    x0 = x.clone()
    with pytest.raises(ValueError, match=r"(?i)\blo\b|\bhi\b|bound|nan|negative|>= ?0"):
        call_clip_value(x, lo, hi)
    assert_bits_equal(x, x0, what)


@pytest.mark.parametrize("clip_value", [-0.5, -1e-30, -INF])
def test_clip_grad_value_rejects_negative(clip_value):
    params = _grad_params()
    g0 = params[0].grad.clone()
    with pytest.raises(ValueError, match=r"(?i)clip_value|negative"):
        hookstats.clip_grad_value_(params, clip_value)
    assert_bits_equal(params[0].grad, g0)


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_ops_refuse_tensors_that_require_grad(device):
    x = torch.randn(10, device=device, requires_grad=True)
    x0 = x.detach().clone()
    for call in (lambda: hookstats.clip_norm_(x, 1e-3), lambda: hookstats.clip_value_(x, 0.1)):
        with pytest.raises(RuntimeError, match="(?i)grad"):
            call()
    assert_bits_equal(x.detach(), x0)
    with torch.no_grad():  # allowed, like any in-place op under no_grad
        hookstats.clip_norm_(x, 1e-3)
        assert as_float(hookstats.norm(x.detach())) == pytest.approx(1e-3, rel=1e-3)
        assert int(hookstats.clip_value_(x, 1e-5)) > 0
    assert float(x.detach().abs().max()) <= cast(1e-5, torch.float32)
    y = torch.randn(10, device=device)
    hookstats.clip_norm_(y, 1e-3)  # requires_grad False: fine under grad mode
    hookstats.clip_value_(y, 0.1)


@pytest.mark.parametrize("make", [lambda: torch.zeros(1).expand(5), lambda: torch.ones(1).expand(5),
                                  lambda: torch.ones(3, 1).expand(3, 4), lambda: torch.randn(10).as_strided((4, 3), (2, 1))],
                         ids=["zeros_expand", "ones_expand", "expand_2d", "as_strided_overlap"])
def test_in_place_ops_refuse_overlapping_memory(make):
    x = make()
    base0 = x.as_strided((x.untyped_storage().nbytes() // 4,), (1,), 0).clone()
    for call in (lambda: hookstats.clip_norm_(x, 1e-3), lambda: hookstats.clip_value_(x, 1e-4)):
        with pytest.raises(RuntimeError, match="(?i)overlap|same memory"):
            call()
    assert_bits_equal(x.as_strided((x.untyped_storage().nbytes() // 4,), (1,), 0), base0)
    assert as_float(hookstats.norm(x)) == pytest.approx(exact_norm(x, 2.0), rel=1e-5)  # reading is fine


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or hookstats.cuda_kernels_built(),
                    reason="needs a GPU and a build of hookstats without CUDA kernels")
def test_cuda_tensor_without_cuda_kernels():
    x = torch.ones(3, device="cuda")
    for call in (lambda: hookstats.norm(x), lambda: hookstats.clip_norm_(x, 1.0), lambda: hookstats.clip_value_(x, 1.0),
                 lambda: hookstats.norms([x])):
        with pytest.raises(RuntimeError, match="CUDA kernels"):
            call()


# ---------------------------------------------------------------------------------------------------------
# CUDA only: mixed devices, no host sync
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and hookstats built with CUDA kernels")
def test_norms_rejects_mixed_devices():
    with pytest.raises(ValueError, match="(?i)device"):
        hookstats.norms([torch.ones(3), torch.ones(3, device="cuda")])


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and hookstats built with CUDA kernels")
def test_clip_grad_norm_mixed_devices():
    params = make_params("cuda", [((100,), torch.float32, True), ((7,), torch.bfloat16, True)], seed="md")
    params += make_params("cpu", [((50,), torch.float32, True), ((3, 3), torch.float64, True)], seed="md2")
    params0, pt = twin(params), twin(params)
    got = hookstats.clip_grad_norm_(params, 0.5)
    want = torch.nn.utils.clip_grad_norm_(pt, 0.5)
    check_total_vs_pytorch(got, want, grads_of(params0), 2.0)
    total64 = exact_total(grads_of(params0), 2.0)
    check_grads_after_clip(params, params0, pt, 0.5, total64, want)
    # clip_grads_with_norm_ with a total on another device
    a, b = twin(params0[:2]), twin(params0[:2])
    hookstats.clip_grads_with_norm_(a, 0.5, torch.tensor(4.0))
    torch.nn.utils.clip_grads_with_norm_(b, 0.5, torch.tensor(4.0))
    for ga, gb in zip(grads_of(a), grads_of(b)):
        assert_tensor_close(ga, gb, CLIP_RTOL[ga.dtype] + 2 * eps_of(torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and hookstats built with CUDA kernels")
def test_no_host_sync_on_cuda():
    params = make_params("cuda", [((1000,), torch.float32, True), ((33,), torch.bfloat16, True)], seed="sync")
    x = torch.randn(5000, device="cuda")
    hookstats.clip_grad_norm_(params, 1.0)  # warm-up (lazy init may sync)
    hookstats.clip_norm_(x, 1.0)
    hookstats.clip_value_(x, 0.1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hookstats.norm(x)
        hookstats.norms([x, x[::2]])
        hookstats.clip_norm_(x, 0.5)
        hookstats.clip_norm_(x, 0.5, nonfinite="zero")
        hookstats.clip_value_(x, 0.01)
        hookstats.clip_grad_norm_(params, 0.5)
        hookstats.clip_grad_value_(params, 0.01)
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ---------------------------------------------------------------------------------------------------------
# opcheck and torch.compile
# ---------------------------------------------------------------------------------------------------------

OPCHECK_LISTS = {
    "fp32": lambda d: [torch.randn(33, 17, device=d)],
    "fp32_fp64_t": lambda d: [torch.randn(33, 17, device=d), torch.randn(17, 33, dtype=torch.float64, device=d).t()],
    "fp16_bf16_views": lambda d: [torch.randn(1001, device=d).half()[1:],
                                  torch.randn(30, 40, device=d).bfloat16()[:, ::3]],
    "with_empty": lambda d: [torch.randn(0, 5, device=d), torch.randn(7, device=d), torch.randn(0, device=d).double()],
}
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("p", [2.0, INF, 1.0, 3.0])
@pytest.mark.parametrize("inp", list(OPCHECK_LISTS))
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_norms(device, inp, p):
    xs = OPCHECK_LISTS[inp](device)
    torch.library.opcheck(torch.ops.hookstats.norms.default, (xs, p), test_utils=OPCHECK_UTILS)
    xs_bcast = xs + [torch.randn(1, 9, device=device).expand(4, 9)]  # reading an expanded tensor is fine
    torch.library.opcheck(torch.ops.hookstats.norms.default, (xs_bcast, p), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("policy", [0, 1])
@pytest.mark.parametrize("inp", list(OPCHECK_LISTS))
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_scale_by_norm(device, inp, policy):
    xs = OPCHECK_LISTS[inp](device)
    for total in (5.0, 0.01):
        t = torch.tensor(total, dtype=torch.float64, device=device)
        torch.library.opcheck(torch.ops.hookstats.scale_by_norm_.default, (xs, t, 1.0, 1e-6, policy),
                              test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("inp", list(OPCHECK_LISTS))
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_clamp_count(device, inp):
    xs = OPCHECK_LISTS[inp](device)
    torch.library.opcheck(torch.ops.hookstats.clamp_count_.default, (xs, -0.5, 0.7), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("policy", [0, 1])
@pytest.mark.parametrize("inp", list(OPCHECK_LISTS))
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_clip_norm(device, inp, policy):
    for x in OPCHECK_LISTS[inp](device):
        for max_norm in (1.0, 1e9):
            torch.library.opcheck(torch.ops.hookstats.clip_norm_.default, (x, 2.0, max_norm, 1e-6, policy),
                                  test_utils=OPCHECK_UTILS)


# The CUDA clip_norm_ op has two paths (csrc/cuda/kernels/clip_fused.cu, Note [fused clip_norm_]): one cooperative launch for
# tensors that fit in shared memory (path 2), and norms + scale launches (path 1). Both must give the rule's result.
FUSED_CASES = [(n, dt) for n in (1, 7, 4096, 2**20 + 3, 2**22) for dt in (torch.float32, torch.bfloat16)] + \
              [(65537, torch.float64), (65537, torch.float16)]


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and hookstats built with CUDA kernels")
@pytest.mark.parametrize("p", [2.0, 1.0, INF, 3.0])
@pytest.mark.parametrize("n,dtype", FUSED_CASES)
def test_cuda_fused_clip_norm_matches_two_launch_path(n, dtype, p):
    g = seeded("fused", n, str(dtype), p)
    x0 = (torch.randn(n, generator=g) * 3).to(dtype).cuda()
    exact = exact_norm(x0, p)
    results = {}
    for path in (1, 2):
        x = x0.clone()
        total = torch.ops.hookstats.clip_norm_.default(x, p, 1.0, 1e-6, 0, path)
        assert_value_close(as_float(total), exact, norm_rtol(dtype, p), f"path {path} norm")
        want = (x0.double() * min(1.0, 1.0 / (exact + 1e-6))).to(dtype)
        assert_tensor_close(x, want, CLIP_RTOL[dtype] + norm_rtol(dtype, p), f"path {path} clipped")
        results[path] = x
    assert_tensor_close(results[2], results[1], 2 * eps_of(dtype), "fused vs two-launch")
    for bad in (float("nan"), float("inf")):  # policies on the fused path
        x = x0.clone()
        x[n // 2] = bad
        torch.ops.hookstats.clip_norm_.default(x, p, 1.0, 1e-6, 1, 2)
        assert torch.count_nonzero(x) == 0, "nonfinite='zero' on the fused path"


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and hookstats built with CUDA kernels")
def test_cuda_fused_path_refuses_what_does_not_fit():
    big = torch.zeros(2**26, device="cuda")  # 256 MB: more than any GPU's shared memory
    with pytest.raises(ValueError, match="fused path"):
        torch.ops.hookstats.clip_norm_.default(big, 2.0, 1.0, 1e-6, 0, 2)
    sliced = torch.zeros(1001, device="cuda")[1:]  # not 16-byte aligned
    with pytest.raises(ValueError, match="fused path"):
        torch.ops.hookstats.clip_norm_.default(sliced, 2.0, 1.0, 1e-6, 0, 2)
    assert float(torch.ops.hookstats.clip_norm_.default(big, 2.0, 1.0, 1e-6, 0, 0)) == 0.0  # auto: two launches


@pytest.mark.parametrize("device", DEVICES)
def test_raw_ops_semantics(device):
    g = seeded("raw")
    xs = [torch.randn(100, generator=g).to(device), torch.randn(7, 3, generator=g, dtype=torch.float64).to(device).t()]
    per, total = torch.ops.hookstats.norms(xs, 2.0)
    assert per.dtype == total.dtype == torch.float64 and per.shape == (2,) and total.shape == ()
    assert_value_close(as_float(total), exact_total(xs, 2.0), 1e-5)
    x0 = [x.clone() for x in xs]
    assert torch.ops.hookstats.scale_by_norm_(xs, total, 1.0, 1e-6, 0) is None
    coef = min(1.0, 1.0 / (as_float(total) + 1e-6))
    for x, x_0 in zip(xs, x0):
        assert_tensor_close(x, (x_0.double() * coef).to(x.dtype), CLIP_RTOL[x.dtype])
    nan_total = torch.tensor(NAN, dtype=torch.float64, device=device)
    ys = [x.clone() for x in x0]
    torch.ops.hookstats.scale_by_norm_(ys, nan_total, 1.0, 1e-6, 1)  # policy zero
    assert all((y == 0).all() for y in ys)
    ys = [x.clone() for x in x0]
    c = torch.ops.hookstats.clamp_count_(ys, -0.5, 0.25)
    assert c.dtype == torch.int64 and c.shape == ()
    assert int(c) == sum(expected_count(x, -0.5, 0.25) for x in x0)
    for y, x in zip(ys, x0):
        assert_bits_equal(y, x.clone().clamp_(-0.5, 0.25))


def _clip_fn(x, y):
    n = hookstats.clip_norm_(x, 0.5)
    s = hookstats.norms([x, y], 2.0)
    return n * 2, s.total, s.per_tensor


def _clip_value_fn(x, y):
    c = hookstats.clip_value_(x, 0.1)
    c2 = hookstats.clip_value_(y, -0.2, 0.05)
    return c + c2, hookstats.norm(x, INF)


def _check_compiled(backend, device, fn):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for x, y in ((torch.randn(100, 7), torch.randn(33, dtype=torch.float64)),
                 (torch.randn(50, 4).bfloat16(), torch.tensor([1.0, 2.0, NAN]))):
        x, y = x.to(device), y.to(device)
        x1, y1, x2, y2 = x.clone(), y.clone(), x.clone(), y.clone()
        got, want = compiled(x1, y1), fn(x2, y2)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(x1, x2, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(y1, y2, rtol=0, atol=0, equal_nan=True)
        assert not torch.equal(x1, x)  # the functions did clip


@pytest.mark.parametrize("fn", [_clip_fn, _clip_value_fn], ids=["clip_norm_norms", "clip_value"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device, backend, fn):
    _check_compiled(backend, device, fn)


# ---------------------------------------------------------------------------------------------------------
# Memory: the raw ops allocate only their outputs on CPU
# ---------------------------------------------------------------------------------------------------------

def _cpu_allocations(fn) -> dict:
    """The sizes of every allocation from the c10 CPU allocator inside each hookstats op run by fn, by op name.

    Positive allocations one by one: the op events' cpu_memory_usage is net of frees, so a temporary that is
    allocated and freed inside the op would not show there."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = list(prof.profiler.kineto_results.events())
    ops = [(e.name(), e.start_ns(), e.end_ns()) for e in events if e.name().startswith("hookstats::")]
    mem = [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.nbytes() > 0]
    out = {}
    for name, start, end in ops:
        out.setdefault(name, []).extend(nb for t, nb in mem if start <= t <= end)
    for name, _, _ in ops:
        out.setdefault(name, [])
    return out


ALLOC_LISTS = {
    "contiguous": lambda: [torch.randn(2**20), torch.randn(1000, dtype=torch.float64)],
    "strided_and_transposed": lambda: [torch.randn(2**10, 2**11)[:, ::2], torch.randn(300, 500).t()],
    "channels_last_bf16": lambda: [torch.randn(4, 32, 64, 64).bfloat16().contiguous(memory_format=torch.channels_last)],
    "many_small": lambda: [torch.randn(100) for _ in range(200)],
}


@pytest.mark.parametrize("layout", list(ALLOC_LISTS))
def test_cpu_raw_ops_allocate_only_their_outputs(layout):
    xs = ALLOC_LISTS[layout]()
    halve = torch.tensor(2.0, dtype=torch.float64)  # with max_norm 1: coefficient ~0.5, every element written
    keep = torch.tensor(1e-3, dtype=torch.float64)  # coefficient 1

    def run():
        torch.ops.hookstats.norms(xs, 2.0)
        torch.ops.hookstats.norms(xs, 3.0)
        torch.ops.hookstats.scale_by_norm_(xs, halve, 1.0, 1e-6, 0)
        torch.ops.hookstats.scale_by_norm_(xs, keep, 1.0, 1e-6, 1)
        torch.ops.hookstats.clamp_count_(xs, -0.5, 0.5)

    run()  # warm-up

    allocs = _cpu_allocations(run)
    n = len(xs)
    # norms: a float64 [n] and a float64 0-d output; seeing them proves the profiler is recording
    norms_bytes = sorted(allocs["hookstats::norms"])
    assert norms_bytes and sum(norms_bytes) <= 2 * (8 * n + 8), allocs
    assert len(norms_bytes) <= 4, allocs  # two outputs per call, two calls
    assert sum(allocs["hookstats::scale_by_norm_"]) <= 64, allocs  # no outputs: at most a scalar
    assert 0 < sum(allocs["hookstats::clamp_count_"]) <= 64, allocs  # an int64 0-d output


# ---------------------------------------------------------------------------------------------------------
# A coefficient that rounds to 1 writes nothing (csrc/core/tensor_list.h, Note [coefficient one])
# ---------------------------------------------------------------------------------------------------------

# Runs in a child process: tensors live in memory that nobody may write (mprotect on the CPU; on CUDA the same
# pages registered read-only for the device), so a kernel that rewrites them, even with the bits they already hold,
# crashes the child. "control" writes on purpose and must crash, which proves that the detection works.
_NO_WRITE_CHILD = r"""
import ctypes, mmap, sys
import torch, hookstats

device, mode, dtype_name = sys.argv[1], sys.argv[2], sys.argv[3]
dtype = getattr(torch, dtype_name)
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
KEEP = []


def protected(x0):
    nbytes = x0.numel() * x0.element_size()
    size = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    mm = mmap.mmap(-1, size)
    host = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(x0.dtype)
    host.copy_(x0.cpu())
    KEEP.append((mm, host))
    if libc.mprotect(host.data_ptr(), size, mmap.PROT_READ) != 0:
        sys.exit(3)
    if device == "cpu":
        return host
    try:
        if int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), size, 2 | 8)) != 0:  # mapped | read-only
            sys.exit(3)

        class Wrap:
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (host.data_ptr(), False),
                                        "version": 2}

        return torch.as_tensor(Wrap(), device="cuda").view(x0.dtype)
    except Exception as e:  # this platform cannot map read-only host memory for the device
        print("setup failed:", e)
        sys.exit(3)


def near_one(norm):  # a max_norm whose coefficient is 1 - 2^-27: 1 in float, not in double
    return (1.0 - 2.0**-27) * (float(norm) + 1e-6)


torch.manual_seed(0)
x0 = torch.randn(16384).to(dtype).to(device)
x = protected(x0)
print("setup-ok", flush=True)
if mode == "control":
    x.mul_(1.0)
    if device == "cuda":
        torch.cuda.synchronize()
    sys.exit(0)
op = torch.ops.hookstats.clip_norm_.default
paths = (1, 2) if device == "cuda" else (1,)
for path in paths:  # the norm each path computes, from a writable copy (coefficient 1: nothing written)
    n = op(x0.clone(), 2.0, 1e30, 1e-6, 0, path)
    op(x, 2.0, near_one(n), 1e-6, 0, path)
hookstats.clip_norm_(x, near_one(hookstats.norm(x0)))
# A list: the protected tensor is not written, a float64 one (the coefficient is not 1 in double) is.
y = torch.randn(100, dtype=torch.float64, device=device)
y0 = y.clone()
total = torch.tensor(float(hookstats.norms([x0]).total), dtype=torch.float64, device=device)
torch.ops.hookstats.scale_by_norm_([x, y], total, near_one(total), 1e-6, 0)
assert not torch.equal(y, y0), "a float64 tensor must be scaled by 1 - 2^-27"
# clip_grad_norm_ of two parameters whose grads are protected.
ps = [torch.nn.Parameter(torch.empty_like(x)), torch.nn.Parameter(torch.empty(1000, dtype=dtype, device=device))]
ps[0].grad = x
ps[1].grad = protected(torch.randn(1000).to(dtype).to(device))
t = hookstats.norms([p.grad for p in ps]).total
hookstats.clip_grad_norm_(ps, near_one(t))
if device == "cuda":
    torch.cuda.synchronize()
assert torch.equal(x.cpu(), x0.cpu())
print("ok")
"""


def _run_no_write_child(device: str, mode: str, dtype: torch.dtype):
    import subprocess
    import sys

    env = dict(__import__("os").environ)
    return subprocess.run([sys.executable, "-c", _NO_WRITE_CHILD, device, mode, str(dtype)[6:]], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_coefficient_that_rounds_to_one_writes_nothing(device, dtype):
    control = _run_no_write_child(device, "control", dtype)
    if control.returncode == 3:
        pytest.skip(f"cannot make memory read-only for the device here: {control.stdout[-300:]}")
    assert "setup-ok" in control.stdout, f"the child failed before its write: {control.stderr[-2000:]}"
    if control.returncode == 0 and device == "cuda":
        pytest.skip("device writes to read-only registered host memory are not trapped here")
    assert control.returncode != 0, "the control wrote to protected memory and survived: the check would prove nothing"
    r = _run_no_write_child(device, "ops", dtype)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), \
        f"a kernel wrote to a tensor whose coefficient rounds to 1 (rc {r.returncode}): {r.stderr[-2000:]}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_coefficient_that_rounds_to_one_per_dtype(device, dtype):
    """1 - 2^-27 is 1 in float (fp16/bf16/fp32 scale in float: bits kept), not in double (fp64 is scaled)."""
    x0 = torch.randn(5000, generator=seeded("near1")).to(dtype).to(device)
    x = x0.clone()
    n = as_float(torch.ops.hookstats.norms([x0], 2.0)[1])
    total = hookstats.clip_norm_(x, (1.0 - 2.0**-27) * (n + 1e-6))
    assert as_float(total) == pytest.approx(n, rel=1e-12 if dtype == torch.float64 else 1e-7)
    if dtype == torch.float64:
        assert_tensor_close(x, x0 * ((1.0 - 2.0**-27) * (n + 1e-6) / (n + 1e-6)), 1e-15)
        assert not torch.equal(x, x0)
    else:
        assert_bits_equal(x, x0)


# ---------------------------------------------------------------------------------------------------------
# clip_norm_'s paths (csrc/core/tensor_list.h, Note [clip_norm_ paths])
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("numel", [1000, 2**18, 2**18 + 5])  # 2^18 fp32 = 1 MiB: inside auto's fused window
def test_cpu_clip_norm_paths_fall_back_to_two_passes(numel):
    x0 = torch.randn(numel, generator=seeded("paths", numel))
    op = torch.ops.hookstats.clip_norm_.default
    results = []
    for path in (0, 1, 3):  # 3 prefers the fused path and falls back where there is none
        x = x0.clone()
        results.append((op(x, 2.0, 1.0, 1e-6, 0, path), x))
    for total, x in results[1:]:
        assert_bits_equal(total, results[0][0])
        assert_bits_equal(x, results[0][1])
    x = x0.clone()
    with pytest.raises(ValueError, match=r"fused path \(path 2\) is unavailable: the CPU has only the two-pass path"):
        op(x, 2.0, 1.0, 1e-6, 0, 2)
    assert_bits_equal(x, x0)  # refused before anything was written
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="path must be 0"):
            op(x, 2.0, 1.0, 1e-6, 0, bad)


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and hookstats built with CUDA kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_refused_cooperative_launch_falls_back(monkeypatch, dtype):
    x0 = torch.randn(2**21 // torch.empty((), dtype=dtype).element_size(), generator=seeded("refuse")).to(dtype).cuda()
    op = torch.ops.hookstats.clip_norm_.default
    want = x0.clone()
    want_total = op(want, 2.0, 1.0, 1e-6, 0, 1)
    monkeypatch.setenv("HOOKSTATS_TEST_OVERSUBSCRIBE_FUSED", "1")  # the driver now refuses every fused launch
    for path in (0, 3):
        x = x0.clone()
        total = op(x, 2.0, 1.0, 1e-6, 0, path)
        assert_bits_equal(total, want_total, f"path {path}")  # the two-launch path ran
        assert_bits_equal(x, want, f"path {path}")
    x = x0.clone()
    with pytest.raises(ValueError, match="refused the cooperative launch"):
        op(x, 2.0, 1.0, 1e-6, 0, 2)
    assert_bits_equal(x, x0)
    monkeypatch.delenv("HOOKSTATS_TEST_OVERSUBSCRIBE_FUSED")
    torch.cuda.synchronize()  # no error left behind
    x = x0.clone()
    assert_bits_equal(op(x, 2.0, 1.0, 1e-6, 0, 2), op(x0.clone(), 2.0, 1.0, 1e-6, 0, 2))


# ---------------------------------------------------------------------------------------------------------
# Multi-tensor tables on CUDA (csrc/cuda/clip_cuda.cu, Note [capture-safe tables])
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and hookstats built with CUDA kernels")
def test_cuda_cached_tables_follow_the_tensors():
    """A table is cached by the tensors' pointers, sizes, strides and dtypes: calls on other tensors of the same
    shapes, on views of the same storage, in several streams and over many lists must never see a stale table."""
    g = seeded("tables")
    shapes = [(300,), (17, 5), (2**17 + 1,), (64, 33)]
    lists = [[torch.randn(s, generator=g).cuda() for s in shapes] for _ in range(3)]
    lists.append([t.t() if t.dim() == 2 else t[1:] for t in lists[0]])  # same storage, other layouts
    lists.append([t.to(dt) for t, dt in zip(lists[1], (torch.float16, torch.float64, torch.bfloat16,
                                                         torch.float32))])
    side = torch.cuda.Stream()
    for rep in range(3):
        for i, xs in enumerate(lists):
            stream = side if (rep + i) % 2 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                per, total = torch.ops.hookstats.norms(xs, 2.0)
            torch.cuda.current_stream().wait_stream(stream)
            assert_value_close(as_float(total), exact_total(xs, 2.0), 1e-5, f"list {i} rep {rep}")
            for t, v in zip(xs, per.tolist()):
                assert_value_close(v, exact_norm(t, 2.0), 1e-5, f"list {i} rep {rep}")
    for k in range(100):  # more distinct lists than the cache holds
        xs = [torch.full((k + 1,), 1.0, device="cuda"), torch.full((3, k + 2), 2.0, device="cuda").t()]
        assert_value_close(as_float(torch.ops.hookstats.norms(xs, 1.0)[1]), (k + 1) + 2.0 * 3 * (k + 2), 1e-6)


# ---------------------------------------------------------------------------------------------------------
# clip_grads_with_norm_ with a CPU total: no host wait
# ---------------------------------------------------------------------------------------------------------

def test_cpu_total_reaches_the_grads_device_without_a_blocking_copy():
    """Checked on the meta device (no GPU here): the CPU total is read on the host and written on the grads' device;
    it is never copied to that device by a blocking copy and no device value is read on the host."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            self.calls.append((func, args, kwargs))
            return func(*args, **kwargs)

    ps = [torch.nn.Parameter(torch.empty(10, device="meta")) for _ in range(3)]
    for p in ps:
        p.grad = torch.empty(10, device="meta")
    for total in (torch.tensor(3.0), torch.tensor(3.0, dtype=torch.bfloat16), 3.0):
        with Record() as rec:
            hookstats.clip_grads_with_norm_(ps, 1.0, total)
        assert any(func._schema.name == "hookstats::scale_by_norm_" for func, _, _ in rec.calls)
        for func, args, kwargs in rec.calls:
            name = func._schema.name
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if name == "aten::_local_scalar_dense":
                assert tensors[0].device.type == "cpu", "a device value was read on the host"
            if name in ("aten::_to_copy", "aten::copy_"):
                src = tensors[-1] if name == "aten::copy_" else tensors[0]
                dst = tensors[0].device if name == "aten::copy_" else kwargs.get("device", src.device)
                if src.device.type == "cpu" and torch.device(dst).type != "cpu":
                    assert kwargs.get("non_blocking", False), f"blocking host-to-device copy: {func}"


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and hookstats built with CUDA kernels")
def test_cuda_clip_grads_with_norm_cpu_total_does_not_sync():
    g = seeded("cputotal")
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).cuda()) for s in ((100,), (30, 7), (5,))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).cuda()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for q, p in zip(twins, ps):
        q.grad = p.grad.clone()
    hookstats.clip_grads_with_norm_(twins, 1.0, torch.tensor(7.0, dtype=torch.float64, device="cuda"))
    want = [q.grad for q in twins]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hookstats.clip_grads_with_norm_(ps, 1.0, torch.tensor(7.0))
        hookstats.clip_grads_with_norm_(ps, 1e30, 1e9)  # a number: coefficient 1, nothing written
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for p, w in zip(ps, want):
        assert_bits_equal(p.grad, w)


# ---------------------------------------------------------------------------------------------------------
# Big inputs (slow)
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_and_clip_2_25_elements(device, dtype):
    x = torch.randn(2**25 + 3, generator=seeded("big")).to(dtype).to(device)
    for p in (1.0, 2.0, INF, 3.0):
        check_norm_result(hookstats.norm(x, p), exact_norm(x, p), dtype, p, device)
    x0 = x.clone()
    ret = hookstats.clip_norm_(x, 1.0)
    assert_tensor_close(x, clipped_reference(x0, 1.0, as_float(ret)), CLIP_RTOL[dtype])
