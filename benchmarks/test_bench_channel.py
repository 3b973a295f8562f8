"""hookstats.channel_stats_into (per-channel absmax, sum|x|, sum x^2, min, max, non-finite count in one read) beside
the plain-PyTorch calibration hooks, and beside a one-read roof.

Each group `channel-{device}-{dtype}-{layout}-2^{k}` holds four cases on one input:
  hookstats     channel_stats_into(x, buf, dim): every statistic, accumulated into a float64 device buffer
  plain_absmax  what SmoothQuant-style calibration hooks do: torch.maximum(buf, x.abs().amax(dim=reduced dims))
  plain_all     the same statistics as hookstats in plain PyTorch (bf16 upcast once), one op per statistic, into
                buffers (torch.maximum / minimum / add_)
  roof          x.sum() (CPU), a device copy (CUDA)
Layouts: `btc` = a Linear's input [B, T, C], dim=-1 (channels innermost); `nchw` = a conv activation, dim=1. The
hookstats case checks its buffer against float64 PyTorch before timing. `test_channel_interleaved` times the
hookstats and plain_absmax cases interleaved (one call each, alternately; plain_all after, on its own) and records
the median ratios in extra_info["speedup_vs_absmax"] / ["speedup_vs_all"] (REPORT below). Run with
HOOKSTATS_BENCH_THREADS=1 for the single-thread figures.
"""
from __future__ import annotations

import statistics

import pytest
import torch

CASES = ("hookstats", "plain_absmax", "plain_all", "roof")
LAYOUTS = ("btc", "nchw")
SIZES = (16, 20, 24)


# The report's tables (benchmarks/report.py reads this literal; targets in benchmarks/targets.json).
REPORT = [
    {"id": "channel", "title": "Per-channel statistics (`channel_stats_into`)", "family": "channel",
     "where": "size_log2 is not None", "split": ["device", "dtype"], "rows": ["layout", "size_log2"], "pivot": "case",
     "columns": [["layout", "layout"], ["size", "'2^%d' % size_log2"], ["hookstats µs", "t.hookstats", "us"],
                 ["absmax hook µs", "t.plain_absmax", "us"], ["vs absmax hook", "t.plain_absmax / t.hookstats", "x"],
                 ["all statistics, plain µs", "t.plain_all", "us"], ["vs plain", "t.plain_all / t.hookstats", "x"],
                 ["hookstats / roof", "t.hookstats / t.roof", "x"]],
     "note": "btc: a Linear input `[B, T, 1024]`, dim=-1; nchw: `[N, 64, 16, 16]`, dim=1. absmax hook: "
             "`torch.maximum(buf, x.abs().amax(dims))`, SmoothQuant-style calibration, which computes the absmax "
             "alone; plain: the same six statistics as hookstats in plain PyTorch. roof: `x.sum()` (CPU), a copy (CUDA)."},
    {"id": "channel_interleaved", "title": "Per-channel statistics at 2^20, interleaved call by call",
     "family": "channel", "where": "size_log2 is None", "split": ["device"], "rows": ["dtype", "layout"],
     "columns": [["dtype", "dtype"], ["layout", "layout"], ["hookstats µs", "hookstats_us / 1e6", "us"],
                 ["absmax hook µs", "plain_absmax_us / 1e6", "us"], ["vs absmax hook", "speedup_vs_absmax", "x"],
                 ["all statistics, plain µs", "plain_all_us / 1e6", "us"], ["vs plain", "speedup_vs_all", "x"]]},
]


def make(layout: str, size_log2: int, dtype: torch.dtype, device: str, smoke: bool):
    k = 12 if smoke else size_log2
    n = 2**k
    g = torch.Generator().manual_seed(1234 + k)
    if layout == "btc":
        c = 1024 if n >= 2**16 else 64
        x = torch.randn(n // c // 8, 8, c, generator=g)
        dim = -1
    else:
        c = 64 if n >= 2**16 else 8
        x = torch.randn(n // (c * 256), c, 16, 16, generator=g)
        dim = 1
    return x.to(device=device, dtype=dtype), dim


def reduced(x: torch.Tensor, dim: int) -> tuple:
    d = dim % x.dim()
    return tuple(i for i in range(x.dim()) if i != d)


def plain_absmax(x, dim, buf):
    torch.maximum(buf, x.abs().amax(dim=reduced(x, dim)), out=buf)


def plain_all(x, dim, bufs):
    """The statistics hookstats computes, as a careful user writes them with PyTorch ops (finite values only)."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    dims = reduced(x, dim)
    fin = torch.isfinite(xf)
    a = torch.where(fin, xf.abs(), 0)
    absmax, s1, s2, mn, mx, nf = bufs
    torch.maximum(absmax, a.amax(dims), out=absmax)
    s1.add_(a.sum(dims))
    s2.add_(a.square().sum(dims))
    torch.minimum(mn, torch.where(fin, xf, float("inf")).amin(dims), out=mn)
    torch.maximum(mx, torch.where(fin, xf, float("-inf")).amax(dims), out=mx)
    nf.add_((~fin).sum(dims))


def check(hookstats, x, dim):
    buf = hookstats.channel_stats_buffer(x.shape[dim], device=x.device)
    hookstats.channel_stats_into(x, buf, dim)
    xd = x.double()
    dims = reduced(x, dim)
    s = hookstats.ChannelStats.from_buffer(buf)
    assert torch.equal(s.absmax, xd.abs().amax(dims))
    assert torch.equal(s.min, xd.amin(dims)) and torch.equal(s.max, xd.amax(dims))
    torch.testing.assert_close(s.sum_sq, xd.square().sum(dims), rtol=2e-6, atol=0)
    torch.testing.assert_close(s.sum_abs, xd.abs().sum(dims), rtol=2e-6, atol=0)


def ops(hookstats, x, dim, case):
    c = x.shape[dim]
    if case == "hookstats":
        buf = hookstats.channel_stats_buffer(c, device=x.device)
        return lambda: hookstats.channel_stats_into(x, buf, dim)
    if case == "plain_absmax":
        buf = torch.zeros(c, dtype=x.dtype, device=x.device)
        return lambda: plain_absmax(x, dim, buf)
    if case == "plain_all":
        f = torch.float32 if x.dtype != torch.float64 else torch.float64
        bufs = [torch.zeros(c, dtype=f, device=x.device) for _ in range(3)] + [
            torch.full((c,), float("inf"), dtype=f, device=x.device),
            torch.full((c,), float("-inf"), dtype=f, device=x.device), torch.zeros(c, dtype=torch.int64,
                                                                                     device=x.device)]
        return lambda: plain_all(x, dim, bufs)
    if x.is_cuda:
        y = torch.empty_like(x)
        return lambda: y.copy_(x)
    return lambda: x.sum()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size_log2", SIZES, ids=[f"2^{k}" for k in SIZES])
def test_channel(benchmark, measure, hookstats, device, dtype_name, size_log2, layout, case):
    from _benching import DTYPES

    x, dim = make(layout, size_log2, DTYPES[dtype_name], device, benchmark.disabled)
    if case == "hookstats":
        check(hookstats, x, dim)
    benchmark.group = f"channel-{device}-{dtype_name}-{layout}-2^{size_log2}"
    benchmark.extra_info.update(family="channel", device=device, dtype=dtype_name, layout=layout, numel=x.numel(),
                                size_log2=size_log2, channels=x.shape[dim], bytes=x.numel() * x.element_size(),
                                torch_threads=torch.get_num_threads())
    measure(ops(hookstats, x, dim, case), case, device, kind="roof" if case in ("hookstats", "roof") else
            "composite")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_channel_interleaved(benchmark, hookstats, device, dtype_name, layout):
    """hookstats vs both plain hooks at 2^20, interleaved call by call: the ratio the README reports."""
    from _benching import DTYPES, interleaved_timer

    x, dim = make(layout, 20, DTYPES[dtype_name], device, benchmark.disabled)
    fns = {case: ops(hookstats, x, dim, case) for case in ("hookstats", "plain_absmax", "plain_all")}
    times, timed = interleaved_timer(fns, device)

    reps = 3 if benchmark.disabled else 60
    for case in fns:
        fns[case]()  # warm
    for _ in range(reps):  # the two sides alternate; x stays in cache as for a hook reading a fresh activation
        timed("hookstats")
        timed("plain_absmax")
    for _ in range(max(1, reps // 6)):  # its temporaries would evict x: timed on its own, after
        timed("plain_all")
    med = {case: statistics.median(ts) for case, ts in times.items()}
    benchmark.group = f"channel-interleaved-{device}-{dtype_name}-{layout}"
    benchmark.extra_info.update(family="channel", device=device, dtype=dtype_name, layout=layout, numel=x.numel(),
                                torch_threads=torch.get_num_threads(),
                                **{f"{c}_us": round(t * 1e6, 1) for c, t in med.items()},
                                speedup_vs_absmax=med["plain_absmax"] / med["hookstats"],
                                speedup_vs_all=med["plain_all"] / med["hookstats"])
    benchmark.pedantic(fns["hookstats"], rounds=1, iterations=1)
