"""hookstats histograms against torch.histc / torch.histogram, and against a one-read roof.

Each group `hist-{device}-{dtype}-{bins}b-2^{k}` holds these cases on one input (the shared seeded randn input,
~1% zeros; range (-4, 4), so a few values fall outside):
  hist             hookstats.histogram(x, bins, range=(lo, hi))
  stats_hist       hookstats.stats(x, histogram=Histogram.range(bins, lo, hi)): statistics + histogram, one read
  stats_exp        hookstats.stats(x, histogram=Histogram.exponent()): 64-bin groups only (it has no bins)
  histc            torch.histc(x, bins, lo, hi)
  torch_histogram  torch.histogram(x, bins, range=(lo, hi)): CPU only
  roof             x.sum() on CPU (the cheapest full read); y.copy_(x) on CUDA (read + write)
For bfloat16 the PyTorch cases time `x.float()` + the op and are recorded as `histc_f32` / `torch_histogram_f32`:
given bf16 they return bf16 counts, which stop growing past 256 (exact counts need the upcast).

`hookstats.histogram` runs the kernel of `stats(x, histogram=...)` (one kernel computes both) and returns its counts
without building the `Stats` (13 0-d views, ~5-10 µs of Python), so `hist` and `stats_hist` time the same kernel and
differ by that wrapper cost alone. `benchmarks/report.py` turns the JSON into the histogram table.
No timing is asserted: speed targets live in the report. Every case checks its result before it is timed, so a
broken kernel cannot post a fast time.
"""
from __future__ import annotations

import pytest
import torch

LO, HI = -4.0, 4.0
SIZES_LOG2 = (16, 20, 24)
# 2^26 float32 is 256 MB, the size of the GPU target (2^24 is the smallest size that leaves the L2
# cache of an H100/H200 at all); on CPU it would only add minutes, so it is a CUDA-only size.
CUDA_SIZES_LOG2 = (26,)
ALL_SIZES_LOG2 = SIZES_LOG2 + (CUDA_SIZES_LOG2 if torch.cuda.is_available() else ())
BINS = (64, 256)
CASES = ("hist", "stats_hist", "stats_exp", "histc", "torch_histogram", "roof")
# The exponent histogram has no bins: time it once per input, in the 64-bin group.
GRID = [(b, c) for b in BINS for c in CASES if c != "stats_exp" or b == BINS[0]]
# Budget kind (conftest.BUDGET_S): the PyTorch baselines cost up to ~0.3 s a call at 2^24 on a 2-core CPU.
KIND = {"histc": "baseline", "torch_histogram": "baseline"}


@pytest.fixture(params=ALL_SIZES_LOG2, ids=[f"2^{k}" for k in ALL_SIZES_LOG2])
def size_log2(request, device) -> int:
    """Overrides conftest's size grid for this file."""
    if request.param in CUDA_SIZES_LOG2 and device != "cuda":
        pytest.skip(f"2^{request.param} is a CUDA-only size")
    return request.param


_REFERENCES: dict[tuple, torch.Tensor] = {}


def reference_counts(x: torch.Tensor, bins: int) -> torch.Tensor:
    """The range histogram of `x` from float64 torch.histc (which bins exactly as hookstats documents) plus
    underflow / overflow / NaN counts: int64, on the CPU. Cached for the last two (input, bins): the cases of a
    group share their input, and a float64 histc at 2^24 costs about a second here."""
    key = (x.data_ptr(), x.dtype, x.device, x.numel(), bins)
    if key not in _REFERENCES:
        if len(_REFERENCES) >= 2:
            _REFERENCES.pop(next(iter(_REFERENCES)))
        xd = x.double()
        inside = torch.histc(xd, bins, LO, HI).to(torch.int64)
        extra = torch.stack([(xd < LO).sum(), (xd > HI).sum(), torch.isnan(xd).sum()])
        _REFERENCES[key] = torch.cat([inside, extra]).cpu()
    return _REFERENCES[key]


def check_range_counts(counts: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> None:
    """hookstats' range histogram: int64, bins + 3 counts summing to numel, equal to the float64 reference."""
    assert counts.dtype == torch.int64 and counts.device == x.device and counts.shape == ref.shape
    counts = counts.cpu()
    assert counts.sum().item() == x.numel()
    assert torch.equal(counts, ref), (counts - ref).nonzero().flatten()[:8].tolist()
    assert 0 < ref[-3].item() + ref[-2].item() < 1e-3 * x.numel()  # the input does test under/overflow


def check_stats(s, x: torch.Tensor) -> None:
    """The statistics that come with the histogram, against float64 PyTorch (full checks: test_bench_stats)."""
    xd = x.double()
    l1 = torch.linalg.vector_norm(xd, 1).item()
    l2 = torch.linalg.vector_norm(xd, 2).item()
    assert s.numel.item() == x.numel()
    assert s.min.item() == xd.min().item() and s.max.item() == xd.max().item()
    assert abs(s.sum.item() - xd.sum().item()) <= 1e-5 * l1, (s.sum.item(), xd.sum().item())
    assert abs(s.l2.item() - l2) <= 1e-5 * l2, (s.l2.item(), l2)
    assert s.zero_count.item() == (x == 0).sum().item() > 0


def check_exp_counts(hookstats, counts: torch.Tensor, x: torch.Tensor) -> None:
    """Exponent histogram: floor(log2|x|) of each nonzero value from torch.frexp, by sign, and the zero count."""
    lay = hookstats.exp_layout(x.dtype)
    xd = x.double().cpu()
    nz = xd[xd != 0]
    assert torch.isfinite(xd).all() and nz.abs().min().item() >= torch.finfo(x.dtype).tiny  # no inf/subnormal
    _, e = torch.frexp(nz)  # nz = m * 2^e with 0.5 <= |m| < 1: floor(log2|nz|) = e - 1
    slot = e.to(torch.int64) - 1 - lay.emin + torch.where(nz < 0, lay.neg.start, lay.pos.start)
    ref = torch.bincount(slot, minlength=lay.length)
    ref[lay.zero] = xd.numel() - nz.numel()
    assert counts.dtype == torch.int64 and counts.shape == (lay.length,)
    assert torch.equal(counts.cpu(), ref), (counts.cpu() - ref).nonzero().flatten()[:8].tolist()


def check_torch_counts(counts: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> None:
    """A PyTorch baseline's float counts: every in-range value counted once; bins as the float64 reference up to
    a few values on bin edges (float32 edge arithmetic)."""
    counts = counts.double().cpu()
    inside = ref[:-3].double()
    assert counts.shape == inside.shape
    assert counts.sum().item() == inside.sum().item()
    assert (counts - inside).abs().sum().item() <= 1e-4 * x.numel()


# The report's tables (benchmarks/report.py reads this literal; targets in benchmarks/targets.json).
REPORT = [
    {"id": "hist", "title": "Histograms: one read, nothing dropped", "family": "hist", "split": ["device", "dtype"],
     "rows": ["bins", "size_log2"], "pivot": "case", "aliases": {"histc_f32": "histc", "torch_histogram_f32": "torch_histogram"},
     "columns": [["size", "'2^%d' % size_log2"], ["bins", "bins"], ["histogram µs", "t.hist", "us"],
                 ["stats + histogram µs", "t.stats_hist", "us"], ["stats + exp histogram µs", "t.stats_exp", "us"],
                 ["`torch.histc` µs", "t.histc", "us"], ["`torch.histogram` µs", "t.torch_histogram", "us"],
                 ["histogram vs histc", "t.histc / t.hist", "x"], ["stats + histogram / roof", "t.stats_hist / t.roof", "x"],
                 ["stats + exp histogram / roof", "t.stats_exp / t.roof", "x"]],
     "note": "histogram: `hookstats.histogram` (bins + underflow, overflow, NaN); stats + histogram: `hookstats.stats(x, "
             "histogram=(bins, (-4, 4)))`; the exponent histogram has no bins and is timed in the 64-bin group. The "
             "PyTorch ops are timed on `x.float()` for bfloat16 (given bf16 they return bf16 counts, which stop at 256). "
             "roof: `x.sum()` on the CPU, a copy on CUDA."},
    {"id": "bydata", "title": "By distribution, 2^20 values, µs", "family": ["bydata", "bydata_hist"],
     "split": ["device", "dtype"], "rows": ["data"], "pivot": "case", "aliases": {"histc_f32": "histc"},
     "columns": [["data", "data"], ["`x.sum()`", "t.sum", "us"], ["`stats`", "t.stats", "us"], ["`norm`", "t.norm", "us"],
                 ["`histogram`", "t.hist", "us"], ["`exp_histogram`", "t.exp_hist", "us"],
                 ["stats + 64 bins", "t.stats_hist", "us"], ["`torch.histc`", "t.histc", "us"],
                 ["`bincount`", "t.bincount", "us"]],
     "note": "64 bins over [-4, 4] (0 and every multiple of 1/8 is an edge). bincount: `torch.bincount` of the "
             "precomputed uint8 slot of each value, the bare loop of one counter increment per value."},
    {"id": "bydata_interleaved", "title": "By distribution, interleaved call by call, 2^20 values, µs",
     "family": "bydata_interleaved", "explode": {"key": "data", "fields": ["rows"]}, "split": ["device", "dtype"],
     "rows": ["data"],
     "columns": [["data", "data"], ["`x.sum()`", "sum / 1e6", "us"], ["`stats`", "stats / 1e6", "us"],
                 ["stats + 64 bins", "stats_hist / 1e6", "us"], ["`exp_histogram`", "exp_hist / 1e6", "us"],
                 ["`torch.histc`", "histc / 1e6", "us"], ["`bincount`", "bincount / 1e6", "us"],
                 ["stats + 64 bins / (stats + bincount)", "stats_hist / (stats + bincount)", "x"],
                 ["one bin", "'yes' if one_bin else ''"]],
     "note": "Each round calls stats, stats + 64 bins, exp_histogram, bincount and sum once on the same input, 60 "
             "rounds, medians; `torch.histc` after, on its own (its float temporaries would evict the input). one bin: "
             "every non-NaN value falls in one bin, which the CPU kernel counts a chunk or 64 values at a time "
             "(Note [cpu constant chunks]): faster than spread data by design, so the spread targets below are "
             "over the other distributions."},
]

@pytest.mark.parametrize("bins,case", GRID, ids=[f"{b}b-{c}" for b, c in GRID])
def test_hist(benchmark, measure, hookstats, device, dtype_name, size_log2, x, bins, case):
    # bf16 counts in torch.histc / torch.histogram stop at 256: time the upcast the user needs for exact counts
    upcast = x.dtype in (torch.float16, torch.bfloat16)
    name = case
    if case in ("hist", "stats_hist"):
        ref = reference_counts(x, bins)
        if case == "hist":
            check_range_counts(hookstats.histogram(x, bins, range=(LO, HI)), ref, x)
            op = lambda: hookstats.histogram(x, bins, range=(LO, HI))  # noqa: E731
        else:
            spec = hookstats.Histogram.range(bins, LO, HI)
            s, counts = hookstats.stats(x, histogram=spec)
            check_stats(s, x)
            check_range_counts(counts, ref, x)
            op = lambda: hookstats.stats(x, histogram=spec)  # noqa: E731
    elif case == "stats_exp":
        spec = hookstats.Histogram.exponent()
        s, counts = hookstats.stats(x, histogram=spec)
        check_stats(s, x)
        check_exp_counts(hookstats, counts, x)
        op = lambda: hookstats.stats(x, histogram=spec)  # noqa: E731
    elif case == "histc":
        name = "histc_f32" if upcast else "histc"
        cvt = (lambda t: t.float()) if upcast else (lambda t: t)  # noqa: E731
        ref = reference_counts(x, bins)
        check_torch_counts(torch.histc(cvt(x), bins, LO, HI), ref, x)
        op = lambda: torch.histc(cvt(x), bins, LO, HI)  # noqa: E731
    elif case == "torch_histogram":
        if device != "cpu":
            pytest.skip("torch.histogram is CPU-only")
        name = "torch_histogram_f32" if upcast else "torch_histogram"
        cvt = (lambda t: t.float()) if upcast else (lambda t: t)  # noqa: E731
        ref = reference_counts(x, bins)
        check_torch_counts(torch.histogram(cvt(x), bins, range=(LO, HI)).hist, ref, x)
        op = lambda: torch.histogram(cvt(x), bins, range=(LO, HI))  # noqa: E731
    elif device == "cuda":
        y = torch.empty_like(x)
        y.copy_(x)
        assert torch.equal(y, x)
        op = lambda: y.copy_(x)  # noqa: E731
    else:
        op = lambda: x.sum()  # noqa: E731

    benchmark.group = f"hist-{device}-{dtype_name}-{bins}b-2^{size_log2}"
    benchmark.extra_info.update(
        family="hist",  # report.summarize (the stats table) skips these: they share the case name "roof"
        device=device,
        dtype=dtype_name,
        numel=x.numel(),
        size_log2=size_log2,
        bytes=x.numel() * x.element_size(),  # one read of x; the CUDA copy roof moves twice this
        bins=bins,
        range=[LO, HI],
        roof="copy" if device == "cuda" else "sum",
        torch_threads=torch.get_num_threads(),
    )
    measure(op, name, device, kind=KIND.get(case, "hist"))


# ---------------------------------------------------------------------------------------------------------
# Every distribution at the fast path's speed (issue 14). Group `bydata-hist-{device}-{dtype}-2^20-{data}`, 64 bins
# over [-4, 4] (0 and every multiple of 1/8 is an edge), on each of test_bench_stats.DATA:
#   hist        hookstats.histogram(x, 64, range=(-4, 4))
#   exp_hist    hookstats.exp_histogram(x)
#   stats       hookstats.stats(x)
#   stats_hist  hookstats.stats(x, histogram=Histogram.range(64, -4, 4)): statistics + histogram, one read
#   histc       torch.histc(x, 64, -4, 4) (bf16: of x.float(), for exact counts)
#   bincount    torch.bincount(idx, minlength=67) on the value's slots, precomputed as uint8: the bare increment
#               loop, one counter increment per element with nothing else (torch's CPU loop is
#               `counts[idx[i]] += 1`, after a min/max scan of the 1-byte indices), so data in one bin is its
#               dependent chain; stats + bincount is what a histogram costs on top of the statistics at best
#   sum         x.sum(): the one-read roof
# Targets (benchmarks/report.py): slowest / fastest distribution <= 1.3x for hist and exp_hist, hist >= 4x faster
# than histc on every distribution, stats_hist <= 1.5x (stats + bincount). On the CPU, data whose every non-NaN
# value is one value (zeros, all_nan, on_edge) is counted a chunk at once from the statistics (Note [cpu constant
# chunks]), so it is the fastest by design: the report gives the spread over the distributions binned value by
# value, and checks that the one-slot ones are no slower than the slowest of those.
# ---------------------------------------------------------------------------------------------------------

from test_bench_stats import DATA, DATA_HI, DATA_LO, DATA_SIZE_LOG2, make_data  # noqa: E402

DATA_BINS = 64
DATA_CASES = ("hist", "exp_hist", "stats", "stats_hist", "histc", "bincount", "sum")
# The dtypes, and float64 / float16 (their own code paths on the CPU: a table of double thresholds and
# 64-bit lanes; the fp16 tables), so that no dtype hides a slow case.
DATA_DTYPES = ("float32", "bfloat16", "float64", "float16")


@pytest.mark.parametrize("case", DATA_CASES)
@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("dtype_name", DATA_DTYPES)
def test_hist_by_data(benchmark, measure, hookstats, device, dtype_name, data, case):
    from hookstats import reference

    x = make_data(data, DATA_SIZE_LOG2, dtype_name, device)
    spec = hookstats.Histogram.range(DATA_BINS, DATA_LO, DATA_HI)
    name = case
    if case in ("hist", "stats_hist", "bincount"):
        want = reference.histogram_of(x.cpu(), spec)
    if case == "hist":
        assert torch.equal(hookstats.histogram(x, DATA_BINS, range=(DATA_LO, DATA_HI)).cpu(), want)
        op = lambda: hookstats.histogram(x, DATA_BINS, range=(DATA_LO, DATA_HI))  # noqa: E731
    elif case == "exp_hist":
        assert torch.equal(hookstats.exp_histogram(x).cpu(), reference.histogram_of(x.cpu(), hookstats.Histogram.exponent()))
        op = lambda: hookstats.exp_histogram(x)  # noqa: E731
    elif case == "stats":
        op = lambda: hookstats.stats(x)  # noqa: E731
    elif case == "stats_hist":
        assert torch.equal(hookstats.stats(x, histogram=spec)[1].cpu(), want)
        op = lambda: hookstats.stats(x, histogram=spec)  # noqa: E731
    elif case == "histc":
        upcast = x.dtype in (torch.float16, torch.bfloat16)
        name = "histc_f32" if upcast else "histc"
        cvt = (lambda t: t.float()) if upcast else (lambda t: t)  # noqa: E731
        op = lambda: torch.histc(cvt(x), DATA_BINS, DATA_LO, DATA_HI)  # noqa: E731
    elif case == "bincount":
        idx = torch.bucketize(x.double().cpu(), spec.edges(), right=True)  # any slot map: the loop is timed
        idx = torch.where(torch.isnan(x.cpu()), DATA_BINS + 2, idx).to(torch.uint8).to(device)
        assert int(torch.bincount(idx, minlength=DATA_BINS + 3).sum()) == x.numel()
        op = lambda: torch.bincount(idx, minlength=DATA_BINS + 3)  # noqa: E731
    else:
        op = lambda: x.sum()  # noqa: E731
    benchmark.group = f"bydata-hist-{device}-{dtype_name}-2^{DATA_SIZE_LOG2}-{data}"
    benchmark.extra_info.update(
        family="bydata_hist",
        device=device,
        dtype=dtype_name,
        data=data,
        numel=x.numel(),
        size_log2=DATA_SIZE_LOG2,
        bytes=x.numel() * x.element_size(),
        bins=DATA_BINS,
        range=[DATA_LO, DATA_HI],
        torch_threads=torch.get_num_threads(),
    )
    measure(op, name, device, kind="baseline" if case == "histc" else "hist")


# ---------------------------------------------------------------------------------------------------------
# The same distributions interleaved call by call (group `bydata-interleaved-{device}-{dtype}`): on a shared
# machine a case timed on its own for half a second can land in a slow spell (hist and stats_hist, one kernel,
# have differed by 1.3x that way), so the report's targets also read these medians, where each round calls
# stats, stats_hist, exp_hist, bincount and sum once each on the same input; torch.histc (whose float
# temporaries would evict the input) is timed after them, on its own. Times go into extra_info["rows"].
# ---------------------------------------------------------------------------------------------------------

INTERLEAVED_CASES = ("stats", "stats_hist", "exp_hist", "bincount", "sum")


@pytest.mark.parametrize("dtype_name", DATA_DTYPES)
def test_hist_by_data_interleaved(benchmark, hookstats, device, dtype_name):
    import statistics

    from _benching import interleaved_timer
    from hookstats import reference

    reps = 1 if benchmark.disabled else 60
    spec = hookstats.Histogram.range(DATA_BINS, DATA_LO, DATA_HI)
    rows: dict[str, dict[str, float]] = {}
    last = None
    for data in DATA:
        x = make_data(data, DATA_SIZE_LOG2, dtype_name, device)
        assert torch.equal(hookstats.stats(x, histogram=spec)[1].cpu(), reference.histogram_of(x.cpu(), spec))
        idx = torch.bucketize(x.double().cpu(), spec.edges(), right=True)
        idx = torch.where(torch.isnan(x.cpu()), DATA_BINS + 2, idx).to(torch.uint8).to(device)
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        fns = {"stats": lambda: hookstats.stats(x), "stats_hist": lambda: hookstats.stats(x, histogram=spec),
               "exp_hist": lambda: hookstats.exp_histogram(x),
               "bincount": lambda: torch.bincount(idx, minlength=DATA_BINS + 3), "sum": lambda: x.sum(),
               "histc": lambda: torch.histc(xf, DATA_BINS, DATA_LO, DATA_HI)}
        times, timed = interleaved_timer(fns, device)

        for f in fns.values():
            f()  # warm: caches, and the range's thresholds and tables
        for _ in range(reps):
            for case in INTERLEAVED_CASES:
                timed(case)
        for _ in range(max(1, reps // 5)):
            timed("histc")
        rows[data] = {c: statistics.median(ts) * 1e6 for c, ts in times.items()}
        # every non-NaN value in one slot, in this dtype (fp16 flushes 1e-20 to zero; in fp32 the edge rule puts
        # all of randn * 1e-20 in one bin): counted a chunk or a run of 64 at once (Note [cpu constant chunks],
        # Note [cpu histogram counters]), so faster than spread data by design
        for flag, counts in (("one_bin", hookstats.stats(x, histogram=spec)[1]), ("one_bin_exp", hookstats.exp_histogram(x))):
            nan_slot = DATA_BINS + 2 if flag == "one_bin" else hookstats.exp_layout(x.dtype).nan
            c = counts.cpu().clone()
            c[nan_slot] = 0
            rows[data][flag] = float(int((c > 0).sum()) <= 1)
        last = fns["stats_hist"]
    benchmark.group = f"bydata-interleaved-{device}-{dtype_name}"
    benchmark.extra_info.update(family="bydata_interleaved", device=device, dtype=dtype_name, rows=rows,
                                numel=2**DATA_SIZE_LOG2, bins=DATA_BINS, range=[DATA_LO, DATA_HI], reps=reps,
                                torch_threads=torch.get_num_threads())
    benchmark.pedantic(last, rounds=1, iterations=1)
