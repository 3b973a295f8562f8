"""The hookstats command line: `python -m hookstats demo|report|bench`."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence

import torch

import hookstats
from .demo import MODELS, train
from .export import make_report

_SHOWN = ("numel", "mean", "std", "l2", "min", "max", "nan_count", "inf_count", "zero_count")


def _fmt(v) -> str:
    if isinstance(v, int):
        return str(v)
    if v != v:
        return "nan"
    if v in (float("inf"), float("-inf")):
        return str(v)
    return f"{v:.4g}"


def _examples():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 256, generator=g)
    act = torch.relu(torch.randn(64, 1024, generator=g))
    grad = torch.randn(4096, generator=g) * 1e-3
    grad[17] = float("nan")
    grad[99] = float("inf")
    big = torch.full((1000,), 6e4).half()
    shifted = torch.randn(100_000, generator=g) * 1e-2 + 1e3
    image = torch.randn(8, 3, 32, 32, generator=g).to(memory_format=torch.channels_last)
    return [
        ("weight (randn 512x256)", w),
        ("ReLU activations", act),
        ("grad with a NaN and an Inf", grad),
        ("fp16, 1000 x 6e4", big),
        ("bf16 weight", w.bfloat16()),
        ("mean 1e3, std 1e-2", shifted),
        ("channels_last image batch", image),
        ("every other column", w[:, ::2]),
        ("empty", torch.empty(0)),
    ]


def _table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *[line(r) for r in rows]])


def _time(fn: Callable[[], object], device: torch.device, min_time: float = 0.2) -> float:
    """Median seconds per call of fn over repeats lasting about min_time."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn(); sync()
    t0 = time.perf_counter(); fn(); sync()
    once = max(time.perf_counter() - t0, 1e-7)
    reps = max(3, min(200, int(min_time / once / 5)))
    samples: List[float] = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / reps)
    samples.sort()
    return samples[len(samples) // 2]


def _composite(x: torch.Tensor):
    """The statistics as people write them with plain PyTorch: one pass (at least) each."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (
        xf.sum(), xf.mean(), xf.var(), xf.std(),
        torch.linalg.vector_norm(xf, 1), torch.linalg.vector_norm(xf, 2), torch.linalg.vector_norm(xf, float("inf")),
        torch.aminmax(xf), torch.isnan(xf).sum(), torch.isinf(xf).sum(), (xf == 0).sum(),
    )


def quick_bench(device: torch.device, sizes=(2**16, 2**20, 2**24), dtypes=(torch.float32, torch.bfloat16)) -> str:
    rows = []
    for dtype in dtypes:
        for n in sizes:
            x = torch.randn(n, device=device).to(dtype)
            t_fused = _time(lambda: hookstats.stats(x), device)
            t_comp = _time(lambda: _composite(x), device)
            if device.type == "cuda":
                y = torch.empty_like(x)
                t_roof = _time(lambda: y.copy_(x), device)
                roof_name = "copy"
            else:
                t_roof = _time(lambda: x.sum(), device)
                roof_name = "x.sum()"
            gbs = n * x.element_size() / t_fused / 1e9
            h64 = hookstats.Histogram.range(64, -4.0, 4.0)
            t_sh = _time(lambda: hookstats.stats(x, histogram=h64), device)
            xh = x.float() if dtype == torch.bfloat16 else x
            t_histc = _time(lambda: torch.histc(xh, 64, -4.0, 4.0), device, min_time=0.05)
            rows.append([
                str(dtype).replace("torch.", ""), f"2^{n.bit_length() - 1}", f"{t_fused * 1e6:.1f}", f"{gbs:.1f}",
                f"{t_fused / t_roof:.2f}x {roof_name}", f"{t_comp / t_fused:.1f}x", f"{t_sh * 1e6:.1f}",
                f"{t_histc / t_sh:.1f}x",
            ])
    return _table(rows, ["dtype", "numel", "stats us", "GB/s", "stats time vs roof", "speedup vs composite",
                         "stats+hist64 us", "speedup vs histc"])


def _check_device(device: torch.device, prog: str) -> Optional[str]:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"{prog}: --device cuda but no CUDA GPU is visible to torch (torch {torch.__version__})"
        if not hookstats.cuda_kernels_built():
            return (f"{prog}: --device cuda but hookstats was built without CUDA kernels; rebuild with a CUDA "
                    "toolkit (CUDA_HOME) and a CUDA build of torch")
    return None


def _tensor_examples(device: torch.device) -> None:
    print("\nStatistics of example tensors, one fused read each (hookstats.stats):\n")
    examples = _examples()
    rows = []
    for name, t in examples:
        t = t.to(device)
        d = hookstats.stats(t).to_dict()
        rows.append([name, str(t.dtype).replace("torch.", "")] + [_fmt(d[k]) for k in _SHOWN])
    print(_table(rows, ["tensor", "dtype", *_SHOWN]))
    fp16 = examples[3][1].to(device)
    print(f"\nfp16 1000 x 6e4: torch.linalg.vector_norm gives {torch.linalg.vector_norm(fp16).item()}, "
          f"hookstats l2 gives {hookstats.stats(fp16).l2.item():.6g} (true: {6e4 * 1000 ** 0.5:.6g})")
    g = torch.Generator().manual_seed(1)
    acts = (torch.randn(1 << 16, generator=g) * 300).to(device)
    s, h = hookstats.stats(acts, histogram="exp")
    fit = hookstats.format_fit(h, acts.dtype)
    print("\nWould activations with std 300 fit low-precision formats? (exponent histogram, same read as the stats)")
    print(_table([[name, f"{float(v['overflow']):.2%}", f"{float(v['underflow']):.2%}", f"{float(v['subnormal']):.2%}"]
                  for name, v in fit.items()], ["format", "overflow", "underflow (to 0)", "subnormal"]))


def _write_report(run_dir: str, out_dir: Optional[str] = None) -> dict:
    return make_report(run_dir, out_dir)


def demo(args) -> int:
    device = torch.device(args.device)
    err = _check_device(device, "hookstats demo")
    if err:
        print(err, file=sys.stderr)
        return 2
    if args.steps < 1:
        print(f"hookstats demo: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        print(f"hookstats demo: --out {out!r} exists and is not a directory", file=sys.stderr)
        return 2
    print(f"hookstats {hookstats.__version__} | torch {torch.__version__} | device {device} | "
          f"CPU code path {torch.ops.hookstats._cpu_isa('')} | CUDA kernels built: {hookstats.cuda_kernels_built()}")
    if not args.no_examples:
        _tensor_examples(device)
    what = (f"a deep MLP ({2 * 500} modules)" if args.model == "deep" else f"a small {args.model}")
    print(f"\nTraining {what} on synthetic data for {args.steps} steps: hookstats.Monitor on every layer "
          "(outputs, grad_outputs, parameter grads, with exponent histograms), fused_clip(1.0) on each block's "
          "grad_input, clip_grad_norm_(1.0, nonfinite='zero') on the parameters, a NaN batch at step "
          f"{(3 * args.steps) // 4 if args.steps > 1 else 'never'}. Writing {out}/\n")
    try:
        r = train(args.model, steps=args.steps, device=device, out=out, progress=not args.no_progress,
                  log_format=args.log)
    except ImportError as e:
        print(f"hookstats demo: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"hookstats demo: cannot write the run directory {out!r}: {e}", file=sys.stderr)
        return 2
    print(f"\n{r['records']} records of {r['modules']} modules in {r['seconds']:.1f} s "
          f"({r['seconds'] / r['steps'] * 1e3:.0f} ms/step), read back in one copy per buffer every {r['flush_every']} "
          f"steps, written on the export thread (the training waited for it {r['export_waits']} times).\n")
    lines = r["summary"].splitlines()
    most = 40
    print("\n".join(lines[:most + 2]))
    if len(lines) > most + 2:
        print(f"... ({len(lines) - most - 2} more rows: the report has them all)")
    bad = r["first_nonfinite"]
    if bad is not None:
        print(f"\nfirst NaN/Inf: step {bad['step']}, module {bad['module'] or '<model>'!r}, kind {bad['kind']} "
              f"({bad['stats']['nan_count']} NaN) -- the bad batch; clip_grad_norm_ zeroed that step's grads")
    losses = r["loss"]
    if losses:
        print(f"loss: {losses[0]:.4g} at step 0 -> {losses[-1]:.4g} at step {len(losses) - 1}")
    try:
        paths = _write_report(out)
    except ImportError as e:
        print(f"hookstats demo: no plots or report ({e})", file=sys.stderr)
        paths = {}
    print(f"\nRun directory {out}/:")
    print(f"  {r['log']}  " + ("(JSONL, one record per line)" if r["log_format"] == "jsonl" else
                               "(Parquet: a file per flush, compacted at the end; hookstats.runlog.read_log reads it)"))
    if r["tensorboard"]:
        print(f"  {r['tensorboard']}/  (tensorboard --logdir {r['tensorboard']})")
    for name, p in paths.items():
        print(f"  {p}")
    if not args.no_bench:
        print("\nBenchmark (median of repeats; roof = one read of the tensor):\n")
        print(quick_bench(device, sizes=(2**16, 2**20, 2**24) if not args.quick else (2**16, 2**20)))
        print("\nFull benchmarks: make bench, or python -m hookstats bench")
    return 0


def report(args) -> int:
    if not os.path.exists(args.run_dir):
        print(f"hookstats report: {args.run_dir!r} does not exist (give a run directory holding log.parquet or "
              "log.jsonl, or the log itself; python -m hookstats demo --out DIR makes one)", file=sys.stderr)
        return 2
    try:
        paths = _write_report(args.run_dir, args.out)
    except (FileNotFoundError, ValueError, ImportError) as e:
        msg = str(e)
        print(msg if msg.startswith("hookstats") else f"hookstats report: {msg}", file=sys.stderr)
        return 2
    for name, p in paths.items():
        print(p)
    return 0


def bench(args) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bench_dir = os.path.join(root, "benchmarks")
    if not os.path.isdir(bench_dir):
        print(f"hookstats bench: no benchmarks/ folder at {bench_dir} (run it from a source checkout)", file=sys.stderr)
        return 2
    out = args.json
    rc = subprocess.call([sys.executable, "-m", "pytest", bench_dir, "--benchmark-only", "-q",
                          f"--benchmark-json={out}", *args.pytest_args])
    if rc != 0:
        return rc
    return subprocess.call([sys.executable, os.path.join(bench_dir, "report.py"), out])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hookstats", description="Fused tensor statistics for PyTorch hooks")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train a small model with a Monitor on every layer; write logs, plots, report")
    p.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="transformer", choices=list(MODELS))
    p.add_argument("--out", default=os.path.join("runs", "demo"),
                   help="run directory (default runs/demo; its log.jsonl, log.parquet/, tensorboard/ and report/ are "
                        "replaced)")
    p.add_argument("--log", default=None, choices=["jsonl", "parquet"],
                   help="the run log: log.jsonl or log.parquet/ (default: parquet for --model deep, else jsonl)")
    p.add_argument("--no-bench", action="store_true", help="skip the quick benchmark")
    p.add_argument("--quick", action="store_true", help="smaller benchmark sizes")
    p.add_argument("--no-examples", action="store_true", help="skip the example tensors")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(fn=demo)
    p = sub.add_parser("report", help="plots and a one-page report (report.md, report.html) of a run directory "
                                      "(its log.parquet or log.jsonl)")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="where to write (default RUN_DIR/report)")
    p.set_defaults(fn=report)
    p = sub.add_parser("bench", help="run the pytest-benchmark suite and print the summary table")
    p.add_argument("--json", default="bench.json")
    p.add_argument("pytest_args", nargs="*")
    p.set_defaults(fn=bench)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
