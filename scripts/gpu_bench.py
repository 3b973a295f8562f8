"""GPU benchmark for scripts/gpu_check.sh: each op's bandwidth beside a device-to-device copy of the same
tensor in the same run (CUDA events, medians), and a check that the ops never sync with the host."""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

import hookstats


def cuda_time(fn, reps: int = 20) -> float:
    """Median milliseconds of fn over reps, timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# Issue 14's distributions (benchmarks/test_bench_stats.py make_data builds the same ones on the CPU).
DISTRIBUTIONS = ("randn", "relu", "randn_1e-5", "zeros", "randn_1e-20", "randn_1e20", "mixed_1e30_1e-30", "half_nan",
                 "all_nan", "uniform", "on_edge")


def make_distribution(name: str, n: int, dev, dtype) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(20240601 + DISTRIBUTIONS.index(name))
    r = torch.randn(n, device=dev, generator=g)
    half = torch.rand(n, device=dev, generator=g) < 0.5
    x = {
        "randn": lambda: r,
        "relu": lambda: r.clamp_min(0),
        "randn_1e-5": lambda: r * 1e-5,
        "zeros": lambda: torch.zeros_like(r),
        "randn_1e-20": lambda: r * 1e-20,
        "randn_1e20": lambda: r * 1e20,
        "mixed_1e30_1e-30": lambda: torch.where(half, r * 1e30, r * 1e-30),
        "half_nan": lambda: torch.where(half, r, torch.full_like(r, float("nan"))),
        "all_nan": lambda: torch.full_like(r, float("nan")),
        "uniform": lambda: torch.rand(n, device=dev, generator=g) * 8 - 4,
        "on_edge": lambda: torch.full_like(r, 0.5),
    }[name]()
    return x.to(dtype)


def distribution_section(dev) -> list[str]:
    """stats, stats + 64-bin / exponent histogram and norm on every distribution at 256 MB, beside a copy: the
    targets are uniform vs all-in-one-bin (zeros, on_edge) within 1.3x, and stats + 64-bin histogram at >= 75% of
    copy bandwidth. Each histogram is checked against the float64 reference first."""
    from hookstats import reference

    lines = ["", "## By distribution, 256 MB, ms (CUDA events, medians); in parentheses: op / copy bandwidth", ""]
    h64 = hookstats.Histogram.range(64, -4.0, 4.0)
    # more bins than travel by value (kMaxArgThresholds, csrc/core/hist_ops.h): thresholds from a device table
    # (Note [capture-safe tables]), as for every float64 histogram
    h1024 = hookstats.Histogram.range(1024, -4.0, 4.0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        n = 256 * 2**20 // torch.empty((), dtype=dtype).element_size()
        lines += [f"### {str(dtype)[6:]}", "",
                  "| data | copy | stats | stats+hist64 | stats+hist1024 | stats+exp_hist | norm | norm inf | norm 1 "
                  "| clip_norm_ (coef 1) | torch.histc 64 |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        times: dict[str, dict[str, float]] = {}
        for name in DISTRIBUTIONS:
            x = make_distribution(name, n, dev, dtype)
            y = torch.empty_like(x)
            buf = hookstats.stats_buffer(1, device=dev)
            hb = hookstats.histogram_buffer(1, h64, dtype=dtype, device=dev)
            he = hookstats.histogram_buffer(1, "exp", dtype=dtype, device=dev)
            hb1k = hookstats.histogram_buffer(1, h1024, dtype=dtype, device=dev)
            xc = x.clone()
            small = x[: 2**20]  # the reference check, on a slice (float64 on the host)
            assert torch.equal(hookstats.histogram(small, 64, range=(-4.0, 4.0)).cpu(),
                               reference.histogram_of(small.cpu(), h64)), f"{name}: GPU histogram differs"
            assert torch.equal(hookstats.histogram(small, 1024, range=(-4.0, 4.0)).cpu(),
                               reference.histogram_of(small.cpu(), h1024)), f"{name}: GPU 1024-bin histogram differs"
            for p in (1.0, 2.0, float("inf")):  # the norms of issue 14's distributions against float64
                got = float(hookstats.norms([small], p)[1])
                want = float(torch.linalg.vector_norm(small.double().cpu(), p))
                if math.isnan(want):
                    ok = math.isnan(got)
                elif math.isinf(want) or p == float("inf"):
                    ok = got == want
                else:
                    ok = abs(got - want) <= 1e-5 * want
                assert ok, f"{name}: GPU norm p={p} {got!r}, float64 {want!r}"
            cases = {
                "copy": lambda: y.copy_(x),
                "stats": lambda: hookstats.stats_into(x, buf, 0),
                "stats+hist64": lambda: hookstats.stats_into(x, buf, 0, hist=hb, histogram=h64),
                "stats+hist1024": lambda: hookstats.stats_into(x, buf, 0, hist=hb1k, histogram=h1024),
                "stats+exp_hist": lambda: hookstats.stats_into(x, buf, 0, hist=he, histogram="exp"),
                "norm": lambda: hookstats.norms([x], 2.0),
                "norm inf": lambda: hookstats.norms([x], float("inf")),
                "norm 1": lambda: hookstats.norms([x], 1.0),
                # max_norm past any norm: the coefficient is 1 and nothing is written (Note [coefficient one]),
                # so this times the norm pass of clip_norm_; on a copy, since a NaN norm gives a NaN coefficient
                # (that copy is then all NaN after the first call; the kernels read it at the same speed)
                "clip_norm_ (coef 1)": lambda: torch.ops.hookstats.clip_norm_.default(xc, 2.0, 1e300, 1e-6, 0, 0),
                "torch.histc 64": lambda: torch.histc(x.float() if dtype == torch.bfloat16 else x, 64, -4.0, 4.0),
            }
            t = {k: cuda_time(fn, reps=10) for k, fn in cases.items()}
            times[name] = t
            copy_bw = 2 * x.numel() * x.element_size() / t["copy"]
            cells = [f"{t['copy']:.3f}"] + [
                f"{t[k]:.3f} ({x.numel() * x.element_size() / t[k] / copy_bw:.0%})" for k in list(cases)[1:]]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
            del x, y, xc
        for op in ("stats", "stats+hist64", "stats+hist1024", "stats+exp_hist", "norm", "norm inf", "norm 1",
                   "clip_norm_ (coef 1)"):
            ts = [times[d][op] for d in DISTRIBUTIONS]
            lines.append(f"- {op}: slowest / fastest distribution {max(ts) / min(ts):.2f}x")
        one_bin = max(times["zeros"]["stats+hist64"], times["on_edge"]["stats+hist64"])
        lines.append(f"- stats+hist64, all in one bin / uniform: {one_bin / times['uniform']['stats+hist64']:.2f}x "
                     "(target <= 1.3x)")
        # bytes read / time against the copy's bandwidth (a copy reads and writes the bytes: 2x them / its time)
        share = {d: times[d]["copy"] / (2 * times[d]["stats+hist64"]) for d in DISTRIBUTIONS}
        worst = min(share, key=share.get)
        lines.append(f"- stats+hist64 at 256 MB: {share['randn']:.0%} of copy bandwidth on randn, {share[worst]:.0%} "
                     f"at the least ({worst}) (target >= 75%)")
        lines.append("")
    return lines


# name: (title, function), most telling first (the default order). The functions are looked up when run, so that a
# test can replace one (tests/test_gpu_scripts.py).
SECTIONS = {"bandwidth": ("Bandwidth", "bandwidth_section"), "clip": ("Clipping", "clip_section"),
            "monitor": ("Monitor", "monitor_section"), "where": ("Where in the tensor", "where_section"),
            "distribution": ("By distribution", "distribution_section")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_bench.md")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated, run in this order (scripts/gpu_check.sh runs them as stages): "
                         f"{', '.join(SECTIONS)}")
    args = ap.parse_args()
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    dev = torch.device("cuda")
    lines = [f"# hookstats GPU benchmark: {torch.cuda.get_device_name(dev)}"]
    failed = 0
    # Most telling first; each section saved as it finishes (a run cut short keeps what it measured), and each in
    # run_section: a failed assertion is reported and the other sections still run.
    for name in names:
        title, section = SECTIONS[name]
        out, ok = run_section(title, globals()[section], dev)
        lines += out
        failed += not ok
        save(args.out, lines)
    print("\n".join(lines))
    if failed:
        raise SystemExit(f"{failed} gpu_bench section(s) failed (see their FAILED lines)")


def run_section(title: str, section, dev) -> tuple[list[str], bool]:
    """section(dev)'s lines and True, or its failure as a report line (the exception's type, message and where it
    was raised) and False. Frees what the section left on the device either way."""
    t = time.perf_counter()
    try:
        out, ok = section(dev), True
    except Exception as e:  # report it, keep the other sections
        import traceback

        where = traceback.extract_tb(e.__traceback__)[-1]
        at = f"{os.path.basename(where.filename)}:{where.lineno}, {where.name}"
        out, ok = ["", f"## {title}: FAILED: {type(e).__name__}: {e} ({at})"], False
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    print(f"gpu_bench: {title}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t:.1f} s", flush=True)
    return out, ok


def bandwidth_section(dev) -> list[str]:
    """stats_into with and without histograms beside a copy per dtype and size (each result checked), then the
    no-sync and memory checks of the stats ops."""
    lines = ["", "## Bandwidth (stats_into, beside a device copy)", "",
             "| op | dtype | MB | op ms | op GB/s (bytes read) | copy GB/s (read+write) | op / copy bandwidth |",
             "|---|---|---|---|---|---|---|"]
    for dtype in (torch.float32, torch.bfloat16):
        for mb in (1, 16, 256, 1024):
            n = mb * 2**20 // torch.empty((), dtype=dtype).element_size()
            x = torch.randn(n, device=dev, dtype=dtype)
            y = torch.empty_like(x)
            buf = hookstats.stats_buffer(4, device=dev)
            t_copy = cuda_time(lambda: y.copy_(x))
            copy_bw = 2 * x.numel() * x.element_size() / t_copy / 1e6
            h64 = hookstats.Histogram.range(64, -4.0, 4.0)
            h256 = hookstats.Histogram.range(256, -4.0, 4.0)
            hbuf64 = hookstats.histogram_buffer(1, h64, dtype=dtype, device=dev)
            hbuf256 = hookstats.histogram_buffer(1, h256, dtype=dtype, device=dev)
            hbufexp = hookstats.histogram_buffer(1, "exp", dtype=dtype, device=dev)
            cases = [
                ("stats", lambda: hookstats.stats_into(x, buf, 0)),
                ("stats+hist64", lambda: hookstats.stats_into(x, buf, 0, hist=hbuf64, histogram=h64)),
                ("stats+hist256", lambda: hookstats.stats_into(x, buf, 0, hist=hbuf256, histogram=h256)),
                ("stats+exp_hist", lambda: hookstats.stats_into(x, buf, 0, hist=hbufexp, histogram="exp")),
                ("torch.histc 64", lambda: torch.histc(x.float() if dtype == torch.bfloat16 else x, 64, -4.0, 4.0)),
            ]
            for name, fn in cases:
                t = cuda_time(fn)
                op_bw = x.numel() * x.element_size() / t / 1e6
                lines.append(f"| {name} | {str(dtype)[6:]} | {mb} | {t:.3f} | {op_bw:.0f} | {copy_bw:.0f} | "
                             f"{op_bw / copy_bw:.0%} |")
            # The histogram is right: in-range counts equal torch.histc in float64.
            hist = hookstats.histogram(x, 64, range=(-4.0, 4.0))
            ref = torch.histc(x.double(), 64, -4.0, 4.0).long()
            assert torch.equal(hist[:64], ref), "GPU histogram differs from torch.histc"
            assert int(hist.sum()) == x.numel()
            ref = torch.linalg.vector_norm(x.double())
            got = hookstats.Stats.from_row(buf[0]).l2
            assert torch.allclose(got, ref, rtol=1e-5), (got, ref)
            del x, y
    # No host sync inside the ops: the sync debug mode raises on any synchronizing call.
    x = torch.randn(2**20, device=dev)
    buf = hookstats.stats_buffer(8, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(8):
            hookstats.stats_into(x, buf, i)
            hookstats.stats(x)
            hookstats.stats(x, histogram=(64, (-4.0, 4.0)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    lines += ["", "No host sync in stats/stats_into: torch.cuda.set_sync_debug_mode('error') raised nothing."]
    # Memory: nothing proportional to the input.
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    big = torch.randn(2**26, device=dev)
    before = torch.cuda.max_memory_allocated()
    hookstats.stats_into(big, buf, 0)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    lines.append(f"Peak extra memory of stats_into on a 256 MB tensor: {extra} bytes (baseline {base}).")
    return lines


def where_section(dev) -> list[str]:
    """Issue #16 on the GPU: element locations on vs off (target <= 1.10x the stats time), per-channel statistics
    vs copy bandwidth (target >= 70%) and vs the plain-PyTorch calibration hook, at 256 MB; each checked first."""
    from hookstats import reference

    lines = ["", "## Where in the tensor (issue #16), 256 MB, ms (CUDA events, medians)", "",
             "| case | dtype | copy | op | op / copy bandwidth | vs baseline |", "|---|---|---:|---:|---:|---:|"]
    for dtype in (torch.float32, torch.bfloat16):
        n = 256 * 2**20 // torch.empty((), dtype=dtype).element_size()
        x = torch.randn(n, device=dev, dtype=dtype)
        x[n - 12345] = float("nan")
        y = torch.empty_like(x)
        t_copy = cuda_time(lambda: y.copy_(x))
        copy_bw = 2 * x.numel() * x.element_size() / t_copy / 1e6

        def bw(t: float) -> str:
            return f"{x.numel() * x.element_size() / t / 1e6 / copy_bw:.0%}"

        got = hookstats.stats(x, locations=True)
        assert int(got.first_nonfinite_index) == n - 12345, int(got.first_nonfinite_index)
        t_off = cuda_time(lambda: hookstats.stats(x))
        t_on = cuda_time(lambda: hookstats.stats(x, locations=True))
        d = str(dtype)[6:]
        lines.append(f"| stats | {d} | {t_copy:.3f} | {t_off:.3f} | {bw(t_off)} | |")
        lines.append(f"| stats, locations=True | {d} | {t_copy:.3f} | {t_on:.3f} | {bw(t_on)} | {t_on / t_off:.2f}x "
                     f"stats |")
        x2 = x.view(-1, 4096)
        x2 = torch.where(torch.isnan(x2), torch.zeros_like(x2), x2)
        cbuf = hookstats.channel_stats_buffer(4096, device=dev)
        amax = torch.zeros(4096, device=dev, dtype=dtype)
        cs = hookstats.channel_stats(x2, dim=-1)
        assert torch.allclose(cs.absmax.float(), x2.abs().amax(dim=0).float()), "channel absmax differs"
        t_ch = cuda_time(lambda: hookstats.channel_stats_into(x2, cbuf, -1))
        t_pt = cuda_time(lambda: torch.maximum(amax, x2.abs().amax(dim=0), out=amax))
        lines.append(f"| channel_stats_into, [N, 4096], dim -1 | {d} | {t_copy:.3f} | {t_ch:.3f} | {bw(t_ch)} | "
                     f"{t_pt / t_ch:.1f}x faster than x.abs().amax(0) + torch.maximum ({t_pt:.3f} ms) |")
        xt = x2.t()
        t_cht = cuda_time(lambda: hookstats.channel_stats_into(xt, cbuf, 0))
        lines.append(f"| channel_stats_into, the transpose, dim 0 | {d} | {t_copy:.3f} | {t_cht:.3f} | {bw(t_cht)} | |")
        del x, y, x2, xt
        torch.cuda.empty_cache()
    return lines


def save(path: str, lines: list[str]) -> None:
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def monitor_section(dev) -> list[str]:
    """A transformer training step with and without Monitor (every module, outputs and output grads, 64-bin
    histograms), and the no-sync check: steps between flushes must not wait for the GPU."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 128, 256, device=dev)
    target = torch.randn(8, 128, 256, device=dev)

    def step():
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(model(x), target).backward()
        opt.step()

    t_plain = cuda_time(step, reps=30)
    mon = hookstats.Monitor(model, kinds=("forward", "backward_pre"), histogram=(64, (-4.0, 4.0)), slots=8192)

    def mstep():
        step()
        mon.step()

    mstep()
    mon.flush()
    t_mon = cuda_time(mstep, reps=30)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            mstep()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    n = len(mon.records())
    mon.detach()
    return ["", "## Monitor", "",
            f"TransformerEncoder step (d_model 256, 4 layers, batch 8x128): {t_plain:.3f} ms without hooks, "
            f"{t_mon:.3f} ms with Monitor (forward + backward_pre, 64-bin histograms): {t_mon / t_plain:.2f}x "
            f"({n} records). No host sync in 5 monitored steps (set_sync_debug_mode('error') raised nothing)."]


def param_grads(n: int, dev, dtype=torch.float32) -> list[torch.nn.Parameter]:
    """n parameters of a transformer-like mix (weights, biases, norm vectors), about 2^26 elements in all."""
    width = max(64, int((2**26 / max(n, 1) / 3) ** 0.5))
    shapes = [(width, width), (width,), (width,)]
    ps = []
    for i in range(n):
        p = torch.nn.Parameter(torch.empty(shapes[i % 3], device=dev, dtype=dtype))
        p.grad = torch.randn_like(p)
        ps.append(p)
    return ps


def host_us(fn, reps: int) -> float:
    """Microseconds a call of fn(i), host time included, over reps calls synchronized once at the end."""
    fn(0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(reps):
        fn(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def shrinking(start: float, factor: float = 0.9):
    """max_norm for successive calls: factor x the previous one, from factor x start. Every call then really
    scales: with a fixed max_norm only the first call would, the later ones finding norm == max_norm, a coefficient
    that rounds to 1 in float, and writing nothing (Note [coefficient one]). 21 calls end at 0.11 x the norm."""
    state = {"m": start}

    def next_max_norm() -> float:
        state["m"] *= factor
        return state["m"]

    return next_max_norm


def clip_section(dev) -> list[str]:
    """clip_norm_ beside one read + one write (a copy) and beside vector_norm + mul_, its fused path beside its
    two-launch path per size (the data for Note [clip_norm_ paths]'s size window), and clip_grad_norm_ beside
    PyTorch's foreach path."""
    lines = ["", "## Clipping", "",
             "| case | MB | hookstats ms | reference ms | reference | ratio |", "|---|---|---|---|---|---|"]
    op = torch.ops.hookstats.clip_norm_.default
    for mb in (1, 16, 64, 256):
        x = torch.randn(mb * 2**18, device=dev)
        y = torch.empty_like(x)
        norm = torch.linalg.vector_norm(x).item()
        t_copy = cuda_time(lambda: y.copy_(x))
        m = shrinking(norm)  # both sides follow the same schedule, so both really scale on every call
        t_clip = cuda_time(lambda: hookstats.clip_norm_(x, m()))
        x.normal_()
        m = shrinking(norm)
        t_torch = cuda_time(lambda: x.mul_(torch.clamp(m() / (torch.linalg.vector_norm(x) + 1e-6), max=1.0)))
        lines.append(f"| clip_norm_ fp32 vs copy (read+write) | {mb} | {t_clip:.3f} | {t_copy:.3f} | copy | "
                     f"{t_copy / t_clip:.0%} of copy bandwidth |")
        lines.append(f"| clip_norm_ fp32 vs vector_norm + mul_ | {mb} | {t_clip:.3f} | {t_torch:.3f} | torch | "
                     f"{t_torch / t_clip:.2f}x |")
        ref = torch.randn(4096, device=dev) * 3
        got = ref.clone()
        n0 = hookstats.clip_norm_(got, 1.0)
        assert torch.allclose(n0.double(), torch.linalg.vector_norm(ref.double()), rtol=1e-5)
        assert torch.allclose(got, ref * (1.0 / (torch.linalg.vector_norm(ref.double()) + 1e-6)).float(), rtol=1e-5)
        del x, y
    # The fused path (one cooperative launch, x read and written once) against the two-launch path on the same
    # tensor, per size: where the fused path wins sets kFusedAutoMinBytes/kFusedAutoMaxBytes (csrc/core/tensor_list.h).
    lines += ["", "Fused (path 2) vs two-launch (path 1) clip_norm_, same tensor, same schedule (x 0.9 a call):", "",
              "| dtype | MB | fused ms | two-launch ms | two / fused | fused at copy bandwidth |",
              "|---|---|---|---|---|---|"]
    wins = []
    for mb in (0.0625, 0.25, 1, 2, 4, 8, 16, 28):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(int(mb * 2**20) // torch.empty((), dtype=dtype).element_size(), device=dev, dtype=dtype)
            norm = torch.linalg.vector_norm(x.double()).item()
            m = shrinking(norm)
            try:
                t_fused = cuda_time(lambda: op(x, 2.0, m(), 1e-6, 0, 2))
            except ValueError as e:
                lines.append(f"| {str(dtype)[6:]} | {mb:g} | - | - | - | fused path unavailable: {e} |")
                continue
            x.normal_()
            m = shrinking(norm)
            t_two = cuda_time(lambda: op(x, 2.0, m(), 1e-6, 0, 1))
            y = torch.empty_like(x)
            t_copy = cuda_time(lambda: y.copy_(x))
            if t_two / t_fused >= 1.05:
                wins.append(mb)
            lines.append(f"| {str(dtype)[6:]} | {mb:g} | {t_fused:.4f} | {t_two:.4f} | {t_two / t_fused:.2f}x | "
                         f"{t_copy / t_fused:.0%} |")
            del x, y
    lines += ["", f"Fused at least 5% faster at (MB): {sorted(set(wins)) or 'nowhere'}; auto (path 0) now takes the "
              "fused path from 1 to 16 MiB (kFusedAutoMinBytes, kFusedAutoMaxBytes in csrc/core/tensor_list.h).", "",
              "| case | MB | hookstats ms | reference ms | reference | ratio |", "|---|---|---|---|---|---|"]
    for n in (10, 100, 1000, 10000):
        ps = param_grads(n, dev)
        mb = sum(p.numel() for p in ps) * 4 / 2**20
        grads0 = [p.grad.clone() for p in ps]
        total = hookstats.clip_grad_norm_(ps, 1.0)
        got = [p.grad.clone() for p in ps]
        for p, g in zip(ps, grads0):
            p.grad.copy_(g)
        total_ref = torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
        assert torch.allclose(total, total_ref, rtol=1e-5), (total, total_ref)
        assert all(torch.allclose(a, p.grad, rtol=1e-5, atol=1e-12) for a, p in zip(got, ps))
        # Both sides start from the same grads and follow the same shrinking schedule: every call really scales.
        start = float(hookstats.get_total_norm(grads0))
        for p, g in zip(ps, grads0):
            p.grad.copy_(g)
        m = shrinking(start)
        t_hs = cuda_time(lambda: hookstats.clip_grad_norm_(ps, m()))
        for p, g in zip(ps, grads0):
            p.grad.copy_(g)
        m = shrinking(start)
        t_pt = cuda_time(lambda: torch.nn.utils.clip_grad_norm_(ps, m(), foreach=True))
        lines.append(f"| clip_grad_norm_ {n} params vs torch foreach | {mb:.0f} | {t_hs:.3f} | {t_pt:.3f} | "
                     f"foreach | {t_pt / t_hs:.2f}x |")
        del ps, grads0, got
    # The multi-tensor table (Note [capture-safe tables]): cached when the same tensors come back, written by fill
    # launches (one per ~120 tensors) when they do not (70 lists of other views rotate through the 64-entry cache).
    grads = [p.grad for p in param_grads(1000, dev)]
    variants = [[g.view(-1)[k:] for g in grads] for k in range(70)]
    hit = host_us(lambda i: torch.ops.hookstats.norms(grads, 2.0), 70)
    miss = host_us(lambda i: torch.ops.hookstats.norms(variants[i % 70], 2.0), 140)
    lines += ["", f"norms of 1,000 tensors, µs a call (host and device, synchronized at the end): {hit:.1f} with the "
              f"table cached, {miss:.1f} when it is written (a new list every call)."]
    del grads, variants
    # No host sync: the clipping path never waits for the GPU.
    ps = param_grads(100, dev)
    x = torch.randn(2**20, device=dev)
    hookstats.clip_grad_norm_(ps, 1.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            hookstats.clip_norm_(x, 1.0)
            hookstats.clip_value_(x, 0.5)
            hookstats.clip_grad_norm_(ps, 1.0)
            hookstats.clip_grad_norm_(ps, 1.0, nonfinite="zero")
            hookstats.clip_grad_value_(ps, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    lines += ["", "No host sync in clip_norm_/clip_value_/clip_grad_norm_/clip_grad_value_ "
              "(set_sync_debug_mode('error') raised nothing)."]
    torch.cuda.synchronize()
    before = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    hookstats.clip_grad_norm_(ps, 1.0)
    torch.cuda.synchronize()
    lines.append(f"Peak extra memory of clip_grad_norm_ over 100 params: {torch.cuda.max_memory_allocated() - base} "
                 f"bytes (earlier peak {before}).")
    return lines


if __name__ == "__main__":
    main()
