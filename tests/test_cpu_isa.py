"""Every CPU SIMD level (Note [cpu dispatch] in csrc/cpu/simd.h: baseline, AVX2, AVX-512) against
hookstats.reference: statistics, locations, range and exponent histograms, stats_into and norms, on odd sizes,
tails, misaligned and non-contiguous inputs, NaN/Inf, each dtype; the level ATen runs at picked from
ATEN_CPU_CAPABILITY in a fresh process; one level's results deterministic across calls and thread counts."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hookstats
from hookstats import reference

from _testing import DTYPES, assert_stats_close, check_stats_against_reference

LEVELS = ("avx512", "avx2", "default")
RANGE = hookstats.Histogram.range(64, -4.0, 4.0)
EXP = hookstats.Histogram.exponent()


def cpu_max_level() -> str:
    """The highest level this CPU runs (the setter caps what it is asked for)."""
    before = torch.ops.hookstats._cpu_isa("")
    try:
        return torch.ops.hookstats._cpu_isa("avx512")
    finally:
        torch.ops.hookstats._cpu_isa(before)


def each_level():
    """The levels this CPU runs, each set in turn; the level before is set again at the end (or on an error)."""
    before = torch.ops.hookstats._cpu_isa("")
    try:
        for level in LEVELS:
            if torch.ops.hookstats._cpu_isa(level) == level:
                yield level
    finally:
        torch.ops.hookstats._cpu_isa(before)


def inputs(dtype: torch.dtype):
    """(name, tensor) pairs: sizes around the vector widths (16/32/64 bytes), the 4096-value chunk and the
    2^15-value task; misaligned and strided views; NaN / Inf / zeros / constants; large magnitudes."""
    g = torch.Generator().manual_seed(36)
    for n in (1, 3, 7, 15, 17, 31, 33, 63, 65, 4095, 4097, 3 * 4096 + 5, 32768 * 2 + 13):
        yield f"randn{n}", (torch.randn(n, generator=g) * 2).to(dtype)
    base = (torch.randn(70001, generator=g) * 3).to(dtype)
    yield "misaligned", base[1:]
    yield "misaligned3", base[3:40003]
    yield "strided", base[::3]
    yield "transposed", base[: 250 * 201].view(250, 201).t()
    yield "expanded", base[:513].view(1, 513).expand(7, 513)
    x = (torch.randn(20000, generator=g)).to(dtype)
    x[[5, 4100, 9000]] = float("nan")
    x[[17, 12000]] = float("inf")
    x[19999] = -float("inf")
    yield "nan_inf", x
    y = (torch.randn(9000, generator=g)).to(dtype)
    y[7000:] = 0.0
    y[100:4300] = 0.5  # a constant run over a whole chunk, on a bin edge
    yield "const_runs", y
    z = torch.full((5000,), 1.25).to(dtype)
    yield "constant", z
    # Zeros of either sign beside the least subnormals and normals, in every position of the 64-value groups whose
    # zeros the AVX-512 entry points count on the raw 16-bit bits, of the block-end vectors and of the scalar tail
    tiny = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # the least subnormal
    pick = torch.randint(0, 6, (2 * 4096 + 1000 + 13,), generator=g)
    zs = torch.tensor([0.0, -0.0, tiny, -tiny, 1.5, -0.25], dtype=torch.float64)[pick]
    yield "signed_zeros_subnormals", zs.to(dtype)
    yield "signed_zeros_strided", zs.to(dtype)[1::2]
    if dtype in (torch.float32, torch.float64):
        big = torch.randn(10000, generator=g, dtype=torch.float64) * (1e30 if dtype == torch.float32 else 1e200)
        yield "huge", big.to(dtype)
        yield "tiny", (big * 1e-60 if dtype == torch.float32 else big * 1e-400).to(dtype)
    yield "mean_offset", (torch.randn(40000, generator=g) * 0.01 + 100.0).to(dtype)
    yield "narrow_window_edges", narrow_window_edges(g, dtype, 12).to(dtype)


def check_all_ops(x: torch.Tensor, what: str) -> None:
    assert_stats_close(hookstats.stats(x), reference.stats(x), x.dtype)
    st, h = hookstats.stats(x, RANGE)
    assert_stats_close(st, reference.stats(x), x.dtype)
    assert torch.equal(h, reference.histogram_of(x, RANGE)), what
    assert torch.equal(hookstats.exp_histogram(x), reference.histogram_of(x, EXP)), what
    loc = hookstats.stats(x, locations=True)
    want = reference.locations(x)
    assert (int(loc.argmax_abs_index), int(loc.first_nonfinite_index)) == (int(want[0]), int(want[1])), what
    out = hookstats.stats_buffer(2)
    hookstats.stats_into(x, out, 1)
    ref_out = hookstats.stats_buffer(2)
    reference.stats_into(x, ref_out, 1)
    assert torch.equal(out[1].isnan(), ref_out[1].isnan()), what
    assert torch.equal(out[1][:1], ref_out[1][:1]), what  # numel
    got, ref = hookstats.norms([x], 2.0), reference.norms([x], 2.0)
    a, b = float(got[0][0]), float(ref[0][0])
    assert (a != a and b != b) or a == b or abs(a - b) <= 2e-6 * abs(b), (what, a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_op_on_every_level(dtype, isa):
    for name, x in inputs(dtype):
        check_all_ops(x, f"{isa} {dtype} {name}")


def test_prefetched_tensors_on_every_level(isa):
    """Flat tensors over 16 MiB take the fast path's prefetching loops (csrc/cpu/stats_chunk.h, kPrefetchMinBytes):
    unshifted, shifted (a large mean) and, beside them, the scaled loops that do not prefetch; a strided view of the
    same data does not prefetch (gathered chunks) and must agree."""
    g = torch.Generator().manual_seed(3616)
    for dtype, n in ((torch.float32, (1 << 22) + 1001), (torch.bfloat16, (1 << 23) + 1001)):
        base = torch.randn(n, generator=g)
        base[torch.rand(n, generator=g) < 0.01] = 0.0
        for name, x in (("randn", base), ("mean_1000", base + 1000.0), ("scaled_1e30", base * 1e30)):
            x = x.to(dtype)
            assert x.numel() * x.element_size() > 16 << 20
            check_stats_against_reference(x)
            assert torch.equal(hookstats.exp_histogram(x), reference.histogram_of(x, EXP)), (isa, dtype, name)
        s = base.to(dtype).view(-1)[: (n // 2) * 2].view(-1, 2)[:, 0]
        check_stats_against_reference(s)


@pytest.mark.parametrize("dtype", DTYPES)
def test_levels_agree_exactly_where_exact(dtype):
    """Counts, min, max and histograms are the same bits on every level; sums within the tolerance."""
    results = {}
    for level in each_level():
        results[level] = [(hookstats.stats(x, RANGE), hookstats.exp_histogram(x)) for _, x in inputs(dtype)]
    first = next(iter(results.values()))
    for level, rs in results.items():
        for (s, h, e), (s0, h0, e0) in zip(((a, b, c) for (a, b), c in rs), ((a, b, c) for (a, b), c in first)):
            for f in ("numel", "nan_count", "inf_count", "zero_count", "min", "max", "linf"):
                assert torch.equal(getattr(s, f).isnan(), getattr(s0, f).isnan())
                if not bool(getattr(s, f).isnan()):
                    assert torch.equal(getattr(s, f), getattr(s0, f)), (level, f)
            assert torch.equal(h, h0) and torch.equal(e, e0), level


def test_deterministic_across_threads(isa, restore_threads):
    """One level's results are the same bits whatever the thread count and however often it runs (fixed tasks,
    fixed-order merges)."""
    x = torch.randn(3 * 2**18 + 77, generator=torch.Generator().manual_seed(5))
    runs = []
    for threads in (1, 2, 1):
        torch.set_num_threads(threads)
        s, h = hookstats.stats(x, RANGE)
        runs.append((torch.stack([v.double() for v in s]), h))
    for v, h in runs[1:]:
        assert torch.equal(v, runs[0][0]) and torch.equal(h, runs[0][1])


def narrow_window_edges(g: torch.Generator, dtype: torch.dtype, k: int) -> torch.Tensor:
    """Note [narrow exponent windows] (AVX-512, float32 and bfloat16): k chunks whose largest |x| has exponent 3, with
    values of either sign at the window's lowest exponent (-12), just below it (-13, -14), at the least normal, as
    subnormals, zeros of either sign, NaN and +-Inf, in counts around kNarrowMaxMissed (256) so that chunks go to
    the wide window and come back; the largest |x| moving by 1, 3, 4 and 5 exponents from chunk to chunk (the
    window kept, then moved); a tail of 45 values (a 32-value group and 13 alone). Other dtypes take it as one more
    input with spread exponents, subnormals and signed zeros."""
    edge = (torch.rand(k * 4096 + 45, generator=g) * 0.99 + 1.0) * torch.exp2(torch.randint(-12, 4, (k * 4096 + 45,), generator=g).float())
    edge = torch.where(torch.rand(edge.shape, generator=g) < 0.5, -edge, edge)
    tops = (3, 3, 4, 3, 6, 7, 3, 2, 8, 3)
    for c in range(k):
        ch = edge[c * 4096:(c + 1) * 4096]
        ch *= 2.0 ** (tops[c % len(tops)] - 3)
        ch[c] = 9.5 * 2.0 ** (tops[c % len(tops)] - 3) * (1 - 2 * (c % 2))  # the largest |x|: exponent top
        low = 2.0 ** (tops[c % len(tops)] - 3 - 12)  # the window's lowest exponent
        many = (0, 1, 2, 255, 256, 257, 300, 3, 0, 4000)[c % 10]
        at = torch.randperm(4096, generator=g)[:many]
        ch[at] = torch.tensor([low * 0.75, -low * 0.6, low / 4, -low * 1.5, low, -low])[torch.arange(many) % 6]
        if c % 5 == 1:
            ch[100:104] = torch.tensor([0.0, -0.0, 1e-40 if dtype != torch.bfloat16 else 1e-39, -1.2e-38])
        if c % 7 == 3:
            ch[200] = float("nan")
        if c % 11 == 5:
            ch[300] = float("inf") * (1 - 2 * (c % 2))
    return edge


def onehot_inputs(dtype: torch.dtype):
    """(name, tensor) pairs for Note [one-hot chunk counts] and Note [narrow exponent windows]: chunks whose
    exponents or bins reach outside the 16- or 32-exponent / 64-index window (tiny values beside large ones, subnormals, infinities, values in under- and overflow
    and in every bin), windows that move from chunk to chunk and back, and counts that outgrow 8 and 16 bits per
    (lane, key) before the carried counts are folded (2^20 values in four slots)."""
    g = torch.Generator().manual_seed(361)
    n = 4096 * 24 + 77
    r = torch.randn(n, generator=g)
    scale = torch.exp2(torch.randint(-60, 40, (n,), generator=g).float())
    yield "many_exponents", (r * scale).to(dtype)
    yield "two_clusters", torch.where(torch.rand(n, generator=g) < 0.5, r * 1e30, r * 1e-30).to(dtype)
    moving = r.clone().view(24 * 4096 + 77)
    for c in range(24):  # the largest |x| jumps between chunks: the exponent window moves, then moves back
        moving[c * 4096:(c + 1) * 4096] *= 2.0 ** (40 * (c % 3) - 40)
    yield "moving_window", moving.to(dtype)
    u = torch.rand(n, generator=g) * 9 - 4.5  # every bin, under- and overflow in most chunks
    u[::997] = float("nan")
    yield "all_bins", u.to(dtype)
    sub = r.clone()
    sub[::50] = 1e-40 if dtype != torch.bfloat16 else 1e-39  # subnormal float32 / bfloat16
    sub[7::501] = float("inf")
    sub[9::503] = -float("inf")
    sub[11::509] = -0.0
    yield "subnormal_inf", sub.to(dtype)
    m = 2**20 + 3
    few = torch.tensor([0.75, -0.75, 3.5, -1.5])[torch.randint(0, 4, (m,), generator=g)]
    yield "few_slots_2^20", few.to(dtype)
    yield "strided_many", (r * scale).to(dtype)[::3]
    # One value outside the window in every chunk, beside zeros (and a NaN in every other chunk), with the window
    # held from chunk to chunk: the chunk's uncounted values are read off the growth of the carried levels'
    # population count, so a stale or misweighted total skips a chunk's recount.
    one = torch.randn(n, generator=g)
    one[torch.rand(n, generator=g) < 0.02] = 0.0
    for c in range(24):
        one[c * 4096 + int(torch.randint(0, 4096, (1,), generator=g))] = 3e-20 * (1 - 2 * (c % 2))
        one[c * 4096 + 2 * c + 1] = 5.0 + 3.0 * (c % 3) if c % 4 else -4.25  # in the range's overflow / underflow
        if c % 2:
            one[c * 4096 + 4 * c + 2] = float("nan")
    yield "one_outside_per_chunk", one.to(dtype)
    # Note [one-hot misses]: chunks that leave most values outside any window (exponents of both clusters, a range's
    # under- and overflow 65 apart) send the next kOneHotWait (8) chunks to the per-value counting, then the window
    # comes back, its carried counts intact: bad chunks at 0-1, 12 and 23, 26 (the wait cut short by the end and by
    # another bad chunk), randn between them, and the range's far-out values on both sides in chunks 5 and 30.
    mix = torch.randn(32 * 4096 + 77, generator=g)
    for c in (0, 1, 12, 23, 26):
        ch = mix[c * 4096:(c + 1) * 4096]
        ch.copy_(torch.where(torch.rand(4096, generator=g) < 0.5, ch * 1e30, ch * 1e-30))
    for c in (5, 30):
        mix[c * 4096:(c + 1) * 4096] *= 1e20
    mix[-77:] *= 1e25
    yield "misses_then_window", mix.to(dtype)
    yield "far_out_both_sides", (torch.randn(6 * 4096 + 5, generator=g) * 1e20).to(dtype)
    # Values on every edge of the 64-, 61- and 5-bin ranges and one ulp either side of them, in runs where the edge
    # changes from vector to vector and runs where it stays (the threshold cache moves, or holds)
    edges = torch.cat([torch.linspace(-4.0, 4.0, 65), torch.linspace(-4.0, 4.0, 62), torch.linspace(-1.0, 1.0, 6)])
    e = edges.to(dtype)[torch.randint(0, len(edges), (3 * 4096,), generator=g)]
    e[4096:8192] = e[4096]
    ups, downs = torch.nextafter(e, e.new_tensor(float("inf"))), torch.nextafter(e, e.new_tensor(-float("inf")))
    which = torch.randint(0, 3, e.shape, generator=g)
    yield "on_and_beside_edges", torch.where(which == 0, e, torch.where(which == 1, ups, downs))
    edge = narrow_window_edges(g, dtype, 24)
    yield "narrow_window_edges", edge.to(dtype)
    yield "narrow_window_edges_strided", edge.to(dtype)[1::2]
    # The narrow window at either end of the normals: a largest |x| of exponent 127 (lo = 112 + 127 = 239, the
    # highest window: a NaN's key byte is then one below a zero's) and of exponent -117 (lo = 1: no normal lies below
    # it), each chunk with values below the window, subnormals, zeros of either sign and a NaN
    ends = torch.randn(4 * 4096 + 45, generator=g) * 2.0 ** 125
    for c, e in enumerate((127, -117, 127, -117)):
        ch = ends[c * 4096:(c + 1) * 4096]
        ch.copy_(torch.randn(4096, generator=g) * 2.0 ** (e - 2))
        ch[c] = 1.5 * 2.0 ** e * (1 - 2 * (c % 2))
        ch[10:16] = torch.tensor([2.0 ** (e - 16), -(2.0 ** (e - 17)), 1e-40 if dtype != torch.bfloat16 else 1e-39,
                                  0.0, -0.0, float("nan")])
    yield "narrow_window_ends", ends.to(dtype)
    yield "randn_2^18", torch.randn(2**18 + 45, generator=g).to(dtype)
    # Chunk tails whose vector count leaves a group of 16 to 31 words (389 values: 24 vectors of 16, 48 of 8) and a
    # group under 16 (77 values), with spread exponents
    for tail in (389, 77):
        t = torch.randn(3 * 4096 + tail, generator=g) * torch.exp2(torch.randint(-20, 8, (3 * 4096 + tail,), generator=g).float())
        t[-tail + 5] = 2e-30
        yield f"tail_{tail}", t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_onehot_counts_on_every_level(dtype, isa):
    """The register-counted histograms (Note [one-hot chunk counts]) against the reference on each level; float64
    takes the same inputs through its own ordinals (range_ordinals_avx512_f64 on AVX-512)."""
    for name, x in onehot_inputs(dtype):
        for spec in (EXP, RANGE, hookstats.Histogram.range(61, -4.0, 4.0), hookstats.Histogram.range(5, -1.0, 1.0)):
            got = hookstats.stats(x, histogram=spec)[1]
            assert torch.equal(got, reference.histogram_of(x, spec)), (isa, dtype, name, spec)


SCRIPT = textwrap.dedent("""
    import sys, torch, hookstats
    from hookstats import reference
    print(torch.ops.hookstats._cpu_isa(""), torch.backends.cpu.get_cpu_capability())
    x = torch.randn(70001, generator=torch.Generator().manual_seed(1))[1:]
    x[100] = float("nan")
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        y = x.to(dt)
        assert torch.equal(hookstats.exp_histogram(y), reference.histogram_of(y, hookstats.Histogram.exponent()))
        h = hookstats.Histogram.range(64, -4.0, 4.0)
        assert torch.equal(hookstats.histogram(y, 64, range=(-4.0, 4.0)), reference.histogram_of(y, h))
        s, r = hookstats.stats(y[200:]), reference.stats(y[200:])
        assert float(s.min) == float(r.min) and float(s.max) == float(r.max)
        assert abs(float(s.l2) - float(r.l2)) <= 2e-6 * float(r.l2)
""")


@pytest.mark.parametrize("level", LEVELS)
def test_aten_cpu_capability_picks_the_level(level):
    """A fresh process follows ATEN_CPU_CAPABILITY as ATen's own kernels do (capped at what the CPU runs), and
    computes the right results there; HOOKSTATS_CPU_ISA, when set, wins."""
    order = {"default": 0, "avx2": 1, "avx512": 2}
    top = cpu_max_level()
    want = level if order[level] <= order[top] else top
    env = {k: v for k, v in os.environ.items() if k != "HOOKSTATS_CPU_ISA"}
    env["ATEN_CPU_CAPABILITY"] = level
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == want, out.stdout
    env["HOOKSTATS_CPU_ISA"] = "default"
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "default", out.stdout


def channel_inputs(dtype: torch.dtype):
    """(name, tensor, dim) for the per-channel kernel (csrc/cpu/channel_chunk.h): rows order (dim=-1 of [B, T, C],
    channels innermost; also channels_last [N, C, H, W]) with channel counts that are not a multiple of any vector
    (16/32/64 bytes) and cross the 256-channel tile, row counts that are not a multiple of the 32-row block or of 4;
    strided channels (gathered); runs order (dim=1 of [N, C, H, W]) with runs of 100 (read in place: 100 is no
    multiple of a vector) and of 35 values (gathered); NaN, +-Inf, zeros of either sign, and magnitudes outside the
    float fast path's [2^-40, 2^40] (re-read in double) in some channels."""
    g = torch.Generator().manual_seed(362)

    def dirty(x: torch.Tensor) -> torch.Tensor:
        f = x.reshape(-1)
        n = f.numel()
        at = torch.randperm(n, generator=g)[: max(8, n // 97)]
        f[at[0::8]] = float("nan")
        f[at[1::8]] = float("inf")
        f[at[2::8]] = -float("inf")
        f[at[3::8]] = 0.0
        f[at[4::8]] = -0.0
        if dtype in (torch.float32, torch.float64):
            f[at[5::8]] *= 1e20  # beyond 2^40: those blocks are re-read in double
            f[at[6::8]] *= 1e-20
        return x

    yield "btc_301", (torch.randn(3, 45, 301, generator=g) * 2).to(dtype), -1
    yield "btc_301_dirty", dirty((torch.randn(3, 45, 301, generator=g) * 2).to(dtype)), -1
    yield "btc_37_const", torch.full((2, 70, 37), -1.25).to(dtype), -1
    yield "btc_strided", (torch.randn(133, 2 * 75 + 1, generator=g)).to(dtype)[:, ::2].reshape(7, 19, 76), -1
    yield "btc_transposed", (torch.randn(83, 97, generator=g)).to(dtype).t(), 0
    x = (torch.randn(5, 61, 10, 10, generator=g) * 3 + 1).to(dtype)
    yield "nchw_runs_100", x, 1
    yield "nchw_runs_100_dirty", dirty(x.clone()), 1
    yield "nchw_runs_35", dirty((torch.randn(9, 29, 5, 7, generator=g)).to(dtype)), 1
    yield "nchw_channels_last", dirty(x.clone()).contiguous(memory_format=torch.channels_last), 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_channel_stats_on_every_level_and_levels_agree(dtype):
    """hookstats.channel_stats and channel_stats_into on each level against the float64 oracle; absmax, min, max and
    the non-finite count and count are the same bits on every level, sums within the tolerance (the runs order's
    lanes and the rows order's vector tail depend on the vector width)."""
    from test_channel_stats import EXACT, FIELDS, assert_channel_close, oracle

    results = {}
    for level in each_level():
        rs = []
        for name, x, dim in channel_inputs(dtype):
            got = hookstats.channel_stats(x, dim)
            assert_channel_close(got, oracle(x, dim), dtype)
            buf = hookstats.channel_stats_buffer(x.shape[dim])
            hookstats.channel_stats_into(x, buf, dim)
            hookstats.channel_stats_into(x, buf, dim)
            twice = torch.cat([x, x], (dim + 1) % x.dim())
            assert_channel_close(hookstats.ChannelStats.from_buffer(buf), oracle(twice, dim), dtype,
                                 out_dtype=torch.float64)
            rs.append((name, got))
        results[level] = rs
    assert set(results) == {lv for lv in LEVELS if LEVELS.index(lv) >= LEVELS.index(cpu_max_level())}
    first_level, first = next(iter(results.items()))
    rel = 1e-12 if dtype == torch.float64 else 4e-6
    for level, rs in results.items():
        for (name, s), (_, s0) in zip(rs, first):
            for f in FIELDS:
                a, b = getattr(s, f), getattr(s0, f)
                if f in EXACT:
                    assert torch.equal(a.isnan(), b.isnan()), (level, first_level, name, f)
                    assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)), (level, first_level, name, f)
                else:
                    torch.testing.assert_close(a, b, rtol=rel, atol=0.0, equal_nan=True,
                                               msg=lambda m: f"{level} vs {first_level} {name} {f}: {m}")
