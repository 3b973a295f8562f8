"""hookstats.stats against the same statistics computed the usual PyTorch way, and against a one-read roof.

Each group `stats-{device}-{dtype}-2^{k}` holds three cases on one input:
  fused      hookstats.stats(x): one pass
  composite  the pure-PyTorch statistics as people write them (bf16 upcast to float32 first): 10+ passes
  roof       x.sum() on CPU (the cheapest full read); y.copy_(x) on CUDA (read + write)
`benchmarks/report.py` turns the JSON into GB/s and ratios. No timing is asserted here: speed targets live
in the report. The fused case checks its result against float64 PyTorch before timing, so a broken
kernel cannot post a fast time.
"""
from __future__ import annotations

import functools

import pytest
import torch

from _benching import DTYPES, SEED

CASES = ("fused", "composite", "roof")

# The report's tables (benchmarks/report.py reads this literal; targets in benchmarks/targets.json).
REPORT = [
    {"id": "stats", "title": "hookstats.stats: all 13 statistics in one read", "family": "stats",
     "split": ["device", "dtype"], "rows": ["size_log2"], "pivot": "case",
     "columns": [["size", "'2^%d' % size_log2"], ["hookstats.stats µs", "t.fused", "us"],
                 ["GB/s", "bytes / t.fused / 1e9", "gbps"], ["roof µs", "t.roof", "us"],
                 ["stats / roof", "t.fused / t.roof", "x"], ["composite µs", "t.composite", "us"],
                 ["speedup vs composite", "t.composite / t.fused", "x"]],
     "note": "roof: `x.sum()` on the CPU (one read), `y.copy_(x)` on CUDA. composite: one PyTorch op per statistic "
             "(bfloat16 upcast once), as people write it. GB/s: one read of the input / median time."},
    {"id": "locations", "title": "Element locations: `stats(x, locations=True)` against `stats(x)`, interleaved",
     "family": "locations", "split": ["device"], "rows": ["dtype", "size_log2", "data"],
     "columns": [["dtype", "dtype"], ["size", "'2^%d' % size_log2"], ["data", "data"],
                 ["off µs", "off_us / 1e6", "us"], ["on µs", "on_us / 1e6", "us"], ["on / off", "ratio", "f3"]],
     "note": "The two calls alternate, one torch thread, medians of 300 (2^20) or 60 (2^24) calls. randn: normal "
             "values; late_nan: one NaN half-way and four growing maxima in the last chunks (the chunks re-read)."},
]


def composite_stats(x: torch.Tensor):
    """Everything hookstats.stats returns, the way a careful user writes it: upcast half types once, then
    one PyTorch call per statistic. Results stay on the device (no .item())."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mn, mx = torch.aminmax(xf)
    return (
        xf.sum(),
        xf.mean(),
        xf.var(),
        xf.std(),
        torch.linalg.vector_norm(xf, 1),
        torch.linalg.vector_norm(xf, 2),
        torch.linalg.vector_norm(xf, float("inf")),
        mn,
        mx,
        torch.isnan(xf).sum(),
        torch.isinf(xf).sum(),
        (xf == 0).sum(),
    )


def check_fused(s, x: torch.Tensor) -> None:
    """The fused result against float64 PyTorch: counts/min/max exact, sums and norms to 1e-5."""
    xd = x.double()
    l1 = torch.linalg.vector_norm(xd, 1).item()
    l2 = torch.linalg.vector_norm(xd, 2).item()
    assert s.numel.item() == x.numel()
    assert abs(s.l2.item() - l2) <= 1e-5 * l2, (s.l2.item(), l2)
    assert abs(s.l1.item() - l1) <= 1e-5 * l1, (s.l1.item(), l1)
    assert abs(s.sum.item() - xd.sum().item()) <= 1e-5 * l1, (s.sum.item(), xd.sum().item())
    var = xd.var().item()
    assert abs(s.var.item() - var) <= 1e-5 * var, (s.var.item(), var)
    assert s.min.item() == xd.min().item() and s.max.item() == xd.max().item()
    assert s.linf.item() == xd.abs().max().item()
    assert (s.nan_count.item(), s.inf_count.item()) == (0, 0)
    assert s.zero_count.item() == (x == 0).sum().item() > 0


@pytest.mark.parametrize("case", CASES)
def test_stats(benchmark, measure, hookstats, device, dtype_name, size_log2, x, case):
    if case == "fused":
        check_fused(hookstats.stats(x), x)
        op = lambda: hookstats.stats(x)  # noqa: E731
    elif case == "composite":
        op = lambda: composite_stats(x)  # noqa: E731
    elif device == "cuda":
        y = torch.empty_like(x)
        op = lambda: y.copy_(x)  # noqa: E731
    else:
        op = lambda: x.sum()  # noqa: E731

    benchmark.group = f"stats-{device}-{dtype_name}-2^{size_log2}"
    benchmark.extra_info.update(
        family="stats",
        device=device,
        dtype=dtype_name,
        numel=x.numel(),
        size_log2=size_log2,
        bytes=x.numel() * x.element_size(),  # one read of x; the CUDA copy roof moves twice this
        roof="copy" if device == "cuda" else "sum",
        torch_threads=torch.get_num_threads(),
    )
    measure(op, case, device)


# ---------------------------------------------------------------------------------------------------------
# Every distribution at the fast path's speed (issue 14). Group `bydata-stats-{device}-{dtype}-2^20-{data}`:
#   stats   hookstats.stats(x)
#   norm    hookstats.norms([x], 2.0): the per-tensor L2 norm kernel of clip_grad_norm_
#   sum     x.sum(): the one-read roof
# on each of DATA, 2^20 elements. benchmarks/report.py prints one table per device and dtype with every
# distribution's times and the slowest / fastest ratio per op (targets: <= 1.5x for stats and norm).
# ---------------------------------------------------------------------------------------------------------

DATA = (
    "randn", "relu", "randn_1e-5", "zeros", "randn_1e-20", "randn_1e20", "mixed_1e30_1e-30", "half_nan", "all_nan",
    "uniform", "on_edge",
)
DATA_SIZE_LOG2 = 20
DATA_LO, DATA_HI = -4.0, 4.0  # the histogram range of test_bench_hist.py's distribution groups
DATA_CASES = ("stats", "norm", "sum")


@functools.lru_cache(maxsize=4)
def make_data(name: str, size_log2: int, dtype_name: str, device: str) -> torch.Tensor:
    """The distributions of issue 14's tables, seeded. mixed_1e30_1e-30 and half_nan pick each element's side at
    random (every 4096-element piece holds both); uniform covers [DATA_LO, DATA_HI]; on_edge is 0.5, a bin edge
    of the 64-bin range."""
    n = 2**size_log2
    g = torch.Generator().manual_seed(SEED + size_log2 + DATA.index(name))
    r = torch.randn(n, generator=g)
    half = torch.rand(n, generator=g) < 0.5
    x = {
        "randn": lambda: r,
        "relu": lambda: r.clamp_min(0),
        "randn_1e-5": lambda: r * 1e-5,
        "zeros": lambda: torch.zeros(n),
        "randn_1e-20": lambda: r * 1e-20,
        "randn_1e20": lambda: r * 1e20,
        "mixed_1e30_1e-30": lambda: torch.where(half, r * 1e30, r * 1e-30),
        "half_nan": lambda: torch.where(half, r, torch.full_like(r, float("nan"))),
        "all_nan": lambda: torch.full((n,), float("nan")),
        "uniform": lambda: torch.rand(n, generator=g) * (DATA_HI - DATA_LO) + DATA_LO,
        "on_edge": lambda: torch.full((n,), 0.5),
    }[name]()
    return x.to(device=device, dtype=getattr(torch, dtype_name))  # DTYPES' names, and float64 / float16


def check_against_reference(hookstats, s, x: torch.Tensor) -> None:
    """hookstats.stats on any distribution against hookstats.reference (float64): counts, min and max exact, sums
    and norms to 1e-5 (NaN and inf where the reference has them)."""
    from hookstats import reference

    ref = reference.stats(x.cpu())
    for f in hookstats.STATS_FIELDS:
        got, want = float(getattr(s, f)), float(getattr(ref, f))
        if want != want:
            assert got != got, (f, got, want)
        elif f in ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "linf") or abs(want) == float("inf"):
            assert got == want, (f, got, want)
        else:
            tol = 1e-5 * (float(ref.l1) if f in ("sum", "mean") else abs(want))
            if f == "mean":
                tol /= max(x.numel(), 1)
            assert abs(got - want) <= tol + 1e-300, (f, got, want)


@pytest.mark.parametrize("case", DATA_CASES)
@pytest.mark.parametrize("data", DATA)
def test_stats_by_data(benchmark, measure, hookstats, device, dtype_name, data, case):
    x = make_data(data, DATA_SIZE_LOG2, dtype_name, device)
    if case == "stats":
        check_against_reference(hookstats, hookstats.stats(x), x)
        op = lambda: hookstats.stats(x)  # noqa: E731
    elif case == "norm":
        from hookstats import reference

        got, want = float(hookstats.norms([x], 2.0)[0][0]), float(reference.norms([x.cpu()], 2.0)[0][0])
        assert (got != got and want != want) or abs(got - want) <= 1e-5 * want, (got, want)
        op = lambda: hookstats.norms([x], 2.0)  # noqa: E731
    else:
        op = lambda: x.sum()  # noqa: E731
    benchmark.group = f"bydata-stats-{device}-{dtype_name}-2^{DATA_SIZE_LOG2}-{data}"
    benchmark.extra_info.update(
        family="bydata",
        device=device,
        dtype=dtype_name,
        data=data,
        numel=x.numel(),
        size_log2=DATA_SIZE_LOG2,
        bytes=x.numel() * x.element_size(),
        torch_threads=torch.get_num_threads(),
    )
    measure(op, case, device, kind="hist")


# ---------------------------------------------------------------------------------------------------------
# Element locations on vs off (Note [element locations]). Group `locations-{device}-{dtype}-2^{k}-{data}`:
# hookstats.stats(x) and hookstats.stats(x, locations=True) timed call by call, alternately, on one torch thread,
# medians in extra_info (off_us, on_us, ratio = on / off; target <= 1.10 at 2^24 on the CPU). data: randn, and
# randn with one NaN and a few growing maxima late in the tensor (the chunks that are re-read).
# ---------------------------------------------------------------------------------------------------------

LOC_SIZES = (20, 24)
LOC_DATA = ("randn", "late_nan")


@pytest.mark.parametrize("data", LOC_DATA)
@pytest.mark.parametrize("size_log2", LOC_SIZES, ids=[f"2^{k}" for k in LOC_SIZES])
def test_locations_on_off(benchmark, hookstats, device, dtype_name, size_log2, data):
    import statistics

    from _benching import DTYPES as _DT, interleaved_timer

    n = 2**size_log2
    g = torch.Generator().manual_seed(SEED + size_log2)
    x = torch.randn(n, generator=g)
    if data == "late_nan":
        x[n // 2] = float("nan")
        for k, i in enumerate(range(n - 4096 * 4, n, 4096)):
            x[i] = 10.0 + k
    x = x.to(device=device, dtype=_DT[dtype_name])
    s = hookstats.stats(x, locations=True)
    want = torch.where(torch.isnan(x.double()), -1.0, x.double().abs())
    assert int(s.argmax_abs_index) == int((want == want.max()).nonzero()[0, 0])
    assert int(s.first_nonfinite_index) == (n // 2 if data == "late_nan" else -1)
    fns = {"off": lambda: hookstats.stats(x), "on": lambda: hookstats.stats(x, locations=True)}
    times, timed = interleaved_timer(fns, device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reps = 2 if benchmark.disabled else (300 if size_log2 <= 20 else 60)
        for f in fns.values():
            f()
        for r in range(reps):
            for c in (("off", "on") if r % 2 == 0 else ("on", "off")):
                timed(c)
    finally:
        torch.set_num_threads(threads)
    med = {c: statistics.median(ts) for c, ts in times.items()}
    benchmark.group = f"locations-{device}-{dtype_name}-2^{size_log2}-{data}"
    benchmark.extra_info.update(family="locations", device=device, dtype=dtype_name, data=data, numel=n,
                                size_log2=size_log2, torch_threads=1, off_us=round(med["off"] * 1e6, 1),
                                on_us=round(med["on"] * 1e6, 1), ratio=med["on"] / med["off"])
    benchmark.pedantic(fns["on"], rounds=1, iterations=1)
