"""Shared test helpers: parameters (DEVICES, DTYPES), per-dtype tolerances and the stats comparison helpers. Test
files import them with `from _testing import ...` (tests/conftest.py holds fixtures and hooks only).

Tolerances (every value is compared in float64, after converting both sides). "fp32-acc" is fp16, bf16 and
fp32 input (accumulated in fp32, fp32 results); fp64 input is accumulated and returned in float64.

  field                         fp32-acc               fp64          rule
  numel, counts, min, max, linf exact                  exact         NaN equals NaN; inf must have its sign
  l1, l2                        rel 2e-6               rel 1e-12     the spec's 1e-6 (the 2^24 accuracy test)
                                                                     plus slack for small tensors
  sum                           abs 1e-6 * l1          abs 1e-12*l1  the spec's rule; mean: the same / numel
  std                           rel 1e-5 + 1e-7 linf   rel 1e-10 + 1e-15 linf
  var                           twice std's rel, std's absolute part propagated to std^2

Sum and mean also get two ulps of the result dtype (the final cast). The absolute part of std covers the
reference's own noise on constant tensors (~1e-16 * linf in float64). A NaN or inf on either side must be
matched exactly by the other side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from torch import nn

import hookstats
from hookstats import reference

EXACT_FIELDS = ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "linf")


def cuda_ready() -> bool:
    return torch.cuda.is_available() and hookstats.cuda_kernels_built()


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and hookstats built with CUDA kernels"),
        ],
    ),
]

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float64, id="fp64"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]


@dataclass(frozen=True)
class Tol:
    norm_rtol: float  # l1, l2 (relative)
    sum_rtol: float  # sum: absolute, in units of l1; mean: in units of l1 / numel
    std_rtol: float  # std relative (var gets twice that)
    std_atol: float  # std absolute, in units of linf
    out_eps: float  # machine epsilon of the result dtype (rounding of the final cast)


FP32_ACC = Tol(norm_rtol=2e-6, sum_rtol=1e-6, std_rtol=1e-5, std_atol=1e-7, out_eps=2.0**-24)
FP64_ACC = Tol(norm_rtol=1e-12, sum_rtol=1e-12, std_rtol=1e-10, std_atol=1e-15, out_eps=2.0**-53)


def tol_for(dtype: torch.dtype) -> Tol:
    return FP64_ACC if dtype == torch.float64 else FP32_ACC


def result_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _f(t: torch.Tensor) -> float:
    return float(t.detach().to(torch.float64).cpu())


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def stats_mismatches(got, ref, dtype: torch.dtype, *, tol: Optional[Tol] = None,
                     sum_atol: Optional[float] = None) -> list:
    """The fields of `got` that are not close to `ref` (see the module docstring), as message lines.

    `sum_atol` is the allowed sum error (default: tol.sum_rtol * ref.l1; see sum_atol_of when ref.l1
    overflowed its result dtype).
    """
    tol = tol or tol_for(dtype)
    std_rtol = tol.std_rtol
    g = {f: _f(getattr(got, f)) for f in hookstats.STATS_FIELDS}
    r = {f: _f(getattr(ref, f)) for f in hookstats.STATS_FIELDS}
    n = r["numel"]
    if sum_atol is None:
        sum_atol = tol.sum_rtol * r["l1"]
    bad = []

    def check(field: str, allowed: float) -> None:
        a, b = g[field], r[field]
        if not (math.isfinite(a) and math.isfinite(b)):
            ok = _same(a, b)
        else:
            ok = abs(a - b) <= allowed
        if not ok:
            bad.append(f"{field}: got {a!r}, expected {b!r} (allowed error {allowed:.3g})")

    for f in EXACT_FIELDS:
        check(f, 0.0)
    eps = tol.out_eps
    if math.isfinite(sum_atol):
        check("sum", sum_atol + 2 * eps * abs(r["sum"]))
        check("mean", (sum_atol / n if n else 0.0) + 2 * eps * abs(r["mean"]))
    else:  # l1 is inf or NaN: the input has an inf or a NaN, and sum/mean must match exactly
        check("sum", 0.0)
        check("mean", 0.0)
    for f in ("l1", "l2"):
        check(f, tol.norm_rtol * abs(r[f]))
    linf = r["linf"] if math.isfinite(r["linf"]) else 0.0
    std_atol = tol.std_atol * linf
    rs = r["std"]
    check("std", std_rtol * abs(rs) + std_atol + 2 * eps * abs(rs))
    rs_abs = abs(rs) if math.isfinite(rs) else 0.0
    check("var", 2 * std_rtol * abs(r["var"]) + (2 * rs_abs + std_atol) * std_atol + 2 * eps * abs(r["var"]))
    return bad


def assert_stats_close(got, ref, dtype: torch.dtype, **kw) -> None:
    """Asserts `got` (hookstats.stats) matches `ref` (hookstats.reference.stats) within the dtype's tolerance."""
    bad = stats_mismatches(got, ref, dtype, **kw)
    assert not bad, "stats differ from the reference:\n  " + "\n  ".join(bad)


def check_stats_against_reference(x: torch.Tensor, **kw):
    """stats(x) against reference.stats(x), including result dtypes and devices. Returns (got, ref)."""
    got = hookstats.stats(x)
    ref = reference.stats(x)
    rt = result_dtype(x.dtype)
    for f in hookstats.STATS_FIELDS:
        t = getattr(got, f)
        want = torch.int64 if f in hookstats._ops.COUNT_FIELDS else rt
        assert t.dtype == want, f"{f} has dtype {t.dtype}, expected {want}"
        assert t.shape == (), f"{f} has shape {tuple(t.shape)}, expected ()"
        assert t.device == x.device, f"{f} is on {t.device}, expected {x.device}"
    if "sum_atol" not in kw and x.numel() and not torch.isfinite(ref.l1):
        kw["sum_atol"] = sum_atol_of(x)
    assert_stats_close(got, ref, x.dtype, **kw)
    return got, ref


def sum_atol_of(x: torch.Tensor) -> float:
    """sum_rtol * l1(x), computed without overflow: for inputs whose l1 overflows the result dtype (or float64)
    while their sum does not. inf when x holds an inf or a NaN."""
    xd = x.detach().to(torch.float64)
    if not torch.isfinite(xd).all():
        return float("inf")
    scaled = float((xd * 2.0**-600).abs().sum())  # exact scaling by a power of two
    return tol_for(x.dtype).sum_rtol * scaled * 2.0**600


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of t's bytes: equality of bits tells NaN payloads, -0.0 and +0.0 apart."""
    t = t.detach().contiguous().cpu()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise_equal(a, b) -> None:
    for f in hookstats.STATS_FIELDS:
        ta, tb = getattr(a, f), getattr(b, f)
        assert ta.dtype == tb.dtype
        assert torch.equal(bits(ta), bits(tb)), f"{f}: {ta.item()!r} vs {tb.item()!r} (bitwise)"


def flat(obj) -> list:
    """The tensors of a hook argument, depth first (None and non-tensors dropped)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in flat(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in flat(o)]
    return []


class TableOverBatch(nn.Module):
    """x [B, T, 4] -> fc(x) + table(ones(T, 4)): `table` is fed T rows that are not the batch's samples (as T5's
    relative bias or routed experts), which per-sample norms must refuse at run time."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.table = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + self.table(torch.ones(x.shape[1], 4, dtype=x.dtype))
