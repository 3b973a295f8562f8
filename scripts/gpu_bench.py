"""GPU benchmark for scripts/gpu_check.sh: each op's bandwidth beside a device-to-device copy of the same
tensor in the same run (CUDA events, medians), and a check that the ops never sync with the host."""
from __future__ import annotations

import argparse
import statistics

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_bench.md")
    args = ap.parse_args()
    dev = torch.device("cuda")
    lines = [f"# hookstats GPU benchmark: {torch.cuda.get_device_name(dev)}", "",
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
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
