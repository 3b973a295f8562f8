"""Range histograms at the edge of the 48 KB shared-memory default (Note [dynamic shared memory opt-in] in
csrc/cuda/kernels/stats_kernel.cuh), through every entry point that launches the stats kernels, against the CPU
kernels. Issue 33: the kernels opted in to more dynamic shared memory only when the dynamic part alone passed
49,152 B, but a block also has 784 B of static shared memory: range histograms of 6,044-6,141 bins (float32,
float16, bfloat16: float32 thresholds) and 4,030-4,093 bins (float64) failed to launch ("invalid argument") from
stats, histogram, stats_into, stats_loc, stats_multi_into and the Monitor. The sizes below are each band's ends and
its neighbours on both sides, computed from the same layout as the kernels' (stats_launch.h), and checked here to
be the band. Runs on the GPU machine (scripts/gpu_check.sh); skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

import hookstats

from _testing import cuda_ready

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and the CUDA kernels")]

H = hookstats.Histogram
DEV = "cuda"  # a CPU dry run of this file's logic sets it to "cpu" (the CPU kernels against themselves)
LO, HI = -3.0, 5.0
STATIC_SMEM = 8 * 96 + 16  # kStaticSmemBytes: kWarps StatsPartials and the last-block flag
DEFAULT_SMEM = 48 * 1024


def dynamic_smem(bins: int, threshold_bytes: int) -> int:
    """A range histogram's dynamic shared memory (stats_cuda.cu: hist_smem_bytes, then the bins + 1 thresholds):
    one sub-histogram of bins + 3 uint32 counts past 1,024 slots, 16-byte aligned."""
    hist_len = bins + 3
    copies = 8 if hist_len * 8 * 4 <= 32 * 1024 else 1
    return (hist_len * copies * 4 + 15) // 16 * 16 + (bins + 1) * threshold_bytes


def band(threshold_bytes: int) -> list[int]:
    return [b for b in range(1, 8193) if DEFAULT_SMEM - STATIC_SMEM < dynamic_smem(b, threshold_bytes) <= DEFAULT_SMEM]


def edge_sizes(threshold_bytes: int) -> list[int]:
    b = band(threshold_bytes)
    return [b[0] - 1, b[0], b[0] + 1, (b[0] + b[-1]) // 2, b[-1], b[-1] + 1]


CASES = [(dt, bins) for dt in (torch.float32, torch.float16, torch.bfloat16) for bins in edge_sizes(4)] + \
        [(torch.float64, bins) for bins in edge_sizes(8)]
IDS = [f"{str(dt).split('.')[-1]}-{bins}" for dt, bins in CASES]
SIZES = {"one_block": 1000, "many_blocks": 300_001}


def test_the_bands_are_the_ones_issue_33_found():
    assert (band(4)[0], band(4)[-1]) == (6044, 6141)
    assert (band(8)[0], band(8)[-1]) == (4030, 4093)


def make_input(dtype: torch.dtype, n: int, bins: int) -> torch.Tensor:
    """Values over the range and past both ends, values on bin edges, and NaN/Inf, on the GPU."""
    g = torch.Generator().manual_seed(bins * 31 + n)
    x = torch.empty(n, dtype=torch.float64).uniform_(LO - 0.5, HI + 0.5, generator=g)
    edges = LO + (HI - LO) * torch.randint(0, bins + 1, (n // 7,), generator=g).double() / bins
    x[: n // 7] = edges
    x[n // 3] = float("nan")
    x[n // 2] = float("inf")
    x[n // 2 + 1] = -float("inf")
    return x.to(dtype).to(DEV)


def assert_same_stats(got: hookstats.Stats, want: hookstats.Stats):
    g, w = got.to_dict(), want.to_dict()
    for k in ("numel", "nan_count", "inf_count", "zero_count", "min", "max"):
        assert g[k] == w[k] or (g[k] != g[k] and w[k] != w[k]), k  # NaN: equal
    for k in ("sum", "l2", "mean"):
        assert g[k] == pytest.approx(w[k], rel=1e-6, abs=1e-9, nan_ok=True), k


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype,bins", CASES, ids=IDS)
def test_stats_and_histogram(dtype, bins, size):
    x = make_input(dtype, SIZES[size], bins)
    h = H.range(bins, LO, HI)
    st, counts = hookstats.stats(x, h)
    cst, ccounts = hookstats.stats(x.cpu(), h)
    assert torch.equal(counts.cpu(), ccounts)
    assert int(counts.sum()) == x.numel()
    assert_same_stats(st, cst)
    assert torch.equal(hookstats.histogram(x, bins, range=(LO, HI)).cpu(), ccounts)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype,bins", CASES, ids=IDS)
def test_stats_with_locations(dtype, bins, size):
    x = make_input(dtype, SIZES[size], bins)
    h = H.range(bins, LO, HI)
    st, counts = hookstats.stats(x, h, locations=True)
    cst, ccounts = hookstats.stats(x.cpu(), h, locations=True)
    assert torch.equal(counts.cpu(), ccounts)
    assert int(st.argmax_abs_index) == int(cst.argmax_abs_index)
    assert int(st.first_nonfinite_index) == int(cst.first_nonfinite_index)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype,bins", CASES, ids=IDS)
def test_stats_into_written_accumulated_and_ring_rows(dtype, bins, size):
    x = make_input(dtype, SIZES[size], bins)
    h = H.range(bins, LO, HI)
    want = hookstats.histogram(x.cpu(), bins, range=(LO, HI))
    out = hookstats.stats_buffer(3, device=DEV)
    hist = hookstats.histogram_buffer(3, h, dtype=dtype, device=DEV)
    hookstats.stats_into(x, out, 1, hist, 2, h)
    assert torch.equal(hist[2].cpu(), want)
    hookstats.stats_into(x, out, 1, hist, 2, h, accumulate=True)
    assert torch.equal(hist[2].cpu(), 2 * want)
    cout = hookstats.stats_buffer(1)
    hookstats.stats_into(x.cpu(), cout, 0)
    assert torch.equal(out[1].cpu(), cout[0]) or torch.allclose(out[1].cpu(), cout[0], rtol=1e-6, equal_nan=True)
    ring = torch.tensor([5], dtype=torch.int64, device=DEV)  # ring slot 5 mod 2 = 1
    rout = hookstats.stats_buffer(2 * 3, device=DEV).view(2, 3, -1)
    rhist = hookstats.histogram_buffer(2 * 3, h, dtype=dtype, device=DEV).view(2, 3, -1)
    hookstats.stats_into(x, rout, 0, rhist, 0, h, ring=ring)
    assert torch.equal(rhist[1, 0].cpu(), want) and int(rhist[0].abs().sum()) == 0


@pytest.mark.parametrize("dtype,bins", CASES, ids=IDS)
def test_stats_multi_into(dtype, bins):
    """One packed launch (flat tensors of one dtype, launch_multi) and a strided one (run on its own)."""
    xs = [make_input(dtype, n, bins) for n in (1000, 300_001, 4097)]
    xs.append(make_input(dtype, 2 * 999, bins).view(999, 2)[:, 0])  # not dense: stats_into's launch
    h = H.range(bins, LO, HI)
    out = hookstats.stats_buffer(len(xs), device=DEV)
    hist = hookstats.histogram_buffer(len(xs), h, dtype=dtype, device=DEV)
    hookstats.stats_multi_into(xs, out, list(range(len(xs))), hist, None, h)
    for i, x in enumerate(xs):
        assert torch.equal(hist[i].cpu(), hookstats.histogram(x.cpu(), bins, range=(LO, HI))), i


@pytest.mark.parametrize("dtype,bins", CASES, ids=IDS)
def test_monitor_records_the_histogram(dtype, bins):
    """The Monitor's recorder (stats_into through the dispatcher) on a module whose output is its input."""
    m = torch.nn.Sequential(torch.nn.Identity())
    mon = hookstats.Monitor(m, kinds=("forward",), histogram=(bins, (LO, HI)))
    x = make_input(dtype, 300_001, bins)
    m(x)
    recs = [r for r in mon.flush() if r["kind"] == "forward"]
    mon.detach()
    assert recs, "the Monitor recorded nothing"
    want = hookstats.histogram(x.cpu(), bins, range=(LO, HI)).tolist()
    for r in recs:
        assert r["stats"]["numel"] == x.numel()
        assert list(r["histogram"]) == want
