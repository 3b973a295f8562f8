"""GPU check of issue #13's targets for scripts/gpu_check.sh: the Monitor on a GPT-style model whose step takes
>= 50 ms (target <= 1.05x the step without hooks), no host sync between flushes, a 1,001-module MLP, and both with
the monitored step captured in a CUDA graph (each replay recording its own step).

Each case is timed over whole flush periods (flush every FLUSH_EVERY steps inside the timed loop), the cases
interleaved, wall clock around a final synchronize: a host-bound Monitor shows up as a longer step.
`python scripts/gpu_large_models.py --out large.md [--quick]`
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import hookstats

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from test_bench_large_models import GPT  # noqa: E402  (the benchmark's nanoGPT layout)

FLUSH_EVERY = 10


def make(name: str, dev, quick: bool):
    torch.manual_seed(0)
    if name == "gpt":
        layers, d = (4, 512) if quick else (12, 1024)
        model = GPT(layers=layers, d=d, heads=16, vocab=32768, block=1024).to(dev)
        idx = torch.randint(0, 32768, (8, 1024), device=dev)
        tgt = torch.randint(0, 32768, (8, 1024), device=dev)
        return model, idx, lambda out: torch.nn.functional.cross_entropy(out.view(-1, out.shape[-1]), tgt.view(-1))
    model = torch.nn.Sequential(*[m for _ in range(500) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())])
    model = model.to(dev)
    x, y = torch.rand(64, 256, device=dev), torch.randn(64, 256, device=dev)
    return model, x, lambda out: torch.nn.functional.mse_loss(out, y)


class Case:
    def __init__(self, name: str, case: str, dev, quick: bool):
        self.model, self.x, self.loss = make(name, dev, quick)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-5)
        self.mon = None
        if case != "none":
            kinds = ("forward", "backward_pre") + (("grad",) if case == "monitor_grads" else ())
            self.mon = hookstats.Monitor(self.model, kinds=kinds, flush_every=FLUSH_EVERY,
                                         optimizer=self.opt if case == "monitor_grads" else None)

    def step(self):
        self.loss(self.model(self.x)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.mon is not None:
            self.mon.step()

    def period(self) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(FLUSH_EVERY):
            self.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / FLUSH_EVERY


def no_sync_between_flushes(c: Case) -> str:
    """Steps 1..FLUSH_EVERY-1 of a period under set_sync_debug_mode('error'): any host sync raises."""
    while c.mon.current_step % FLUSH_EVERY != 0:
        c.step()
    c.step()  # the flush step itself syncs (it copies to the host)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(FLUSH_EVERY - 2):
            c.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return f"no host sync in {FLUSH_EVERY - 2} monitored steps between flushes (set_sync_debug_mode('error'))"


def captured(name: str, dev, quick: bool, replays: int = 30) -> list[str]:
    """A monitored training step captured in a CUDA graph (Note [monitor graph replays]): replay time with and
    without a Monitor (forward + backward_pre + grad at opt.step()), each replay recording its own step."""
    out = {}
    recs_per_replay = steps_seen = 0
    for case in ("none", "monitor"):
        model, x, loss_fn = make(name, dev, quick)
        opt = torch.optim.SGD(model.parameters(), lr=1e-5)
        mon = (hookstats.Monitor(model, kinds=("forward", "backward_pre", "grad"), optimizer=opt, slots=64)
               if case == "monitor" else None)

        def step():
            opt.zero_grad(set_to_none=False)
            loss_fn(model(x)).backward()
            opt.step()

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
                if mon is not None:
                    mon.step()
        torch.cuda.current_stream().wait_stream(s)
        if mon is not None:
            mon.flush()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        if mon is not None:
            mon.step()
        for _ in range(3):
            g.replay()
            if mon is not None:
                mon.step()
        if mon is not None:
            mon.flush()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(replays):
            g.replay()
            if mon is not None:
                mon.step()
                if i % FLUSH_EVERY == FLUSH_EVERY - 1:
                    recs = mon.flush()
                    steps_seen = len({r["step"] for r in recs})
                    recs_per_replay = len(recs) // max(steps_seen, 1)
        torch.cuda.synchronize()
        out[case] = (time.perf_counter() - t0) / replays
        if mon is not None:
            assert mon.dropped_replays == 0
            mon.detach()
        del g, model, opt
        torch.cuda.empty_cache()
    return [f"### {name}, the step captured in a CUDA graph", "", "| case | replay ms | vs no hooks |", "|---|---:|---:|",
            f"| none | {out['none'] * 1e3:.3f} | 1.000x |",
            f"| monitor | {out['monitor'] * 1e3:.3f} | {out['monitor'] / out['none']:.3f}x |", "",
            f"each flush of {FLUSH_EVERY} replays: {steps_seen} steps, {recs_per_replay} records a replay", ""]


def multi_vs_loop(dev, quick: bool, reps: int = 50) -> list[str]:
    """Every parameter grad of the GPT: one stats_multi_into call (one launch per 24 flat grads of a dtype, Note
    [multi-tensor stats launches]) vs a loop of stats_into (one launch each), with a 514-bin exponent histogram;
    rows compared bit for bit."""
    model, idx, loss_fn = make("gpt", dev, quick)
    loss_fn(model(idx)).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    n = len(grads)
    a, b = hookstats.stats_buffer(n, device=dev), hookstats.stats_buffer(n, device=dev)
    ha = hookstats.histogram_buffer(n, "exp", dtype=grads[0].dtype, device=dev)
    hb = ha.clone()

    def multi():
        hookstats.stats_multi_into(grads, a, range(n), ha, None, "exp")

    def loop():
        for i, g in enumerate(grads):
            hookstats.stats_into(g, b, i, hb, i, "exp")

    out = {}
    for f in (multi, loop, multi, loop):
        f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        torch.cuda.synchronize()
        out[f.__name__] = min(out.get(f.__name__, 1e9), (time.perf_counter() - t0) / reps)
    same = torch.equal(a.view(torch.int64), b.view(torch.int64)) and torch.equal(ha, hb)
    del model
    torch.cuda.empty_cache()
    return [f"### every GPT grad ({n} tensors, {sum(g.numel() for g in grads) / 1e6:.0f} M values), exp histogram",
            "", "| call | µs | |", "|---|---:|---:|",
            f"| stats_multi_into | {out['multi'] * 1e6:.0f} | {out['loop'] / out['multi']:.2f}x faster |",
            f"| loop of stats_into | {out['loop'] * 1e6:.0f} | |", "",
            f"rows bit-equal: {same}", ""]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="large_models.md")
    ap.add_argument("--quick", action="store_true", help="a smaller GPT (a smoke run)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device("cuda")
    lines = [f"## Monitor on large models ({torch.cuda.get_device_name(dev)})", ""]

    def emit(new: list[str]) -> None:  # the report so far, rewritten after each section: a timeout loses none
        lines.extend(new)
        print("\n".join(new), flush=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")

    emit([])
    sections = [("mlp1000, captured", lambda: captured("mlp1000", dev, args.quick)),
                ("stats_multi_into vs a loop", lambda: multi_vs_loop(dev, args.quick))]
    sections += [(name, (lambda name=name: eager(name, dev, args))) for name in ("gpt", "mlp1000")]
    sections += [("gpt, captured", lambda: captured("gpt", dev, args.quick))]
    for title, run in sections:
        try:
            emit(run())
        except Exception as e:  # report, do not lose the rest of the report
            emit([f"### {title}: FAILED: {type(e).__name__}: {e}", ""])
            torch.cuda.empty_cache()


def eager(name: str, dev, args) -> list[str]:
    cases = {c: Case(name, c, dev, args.quick) for c in ("none", "monitor", "monitor_grads")}
    for c in cases.values():
        c.period()  # warm
    times = {c: [] for c in cases}
    for _ in range(args.rounds):
        for c, obj in cases.items():
            times[c].append(obj.period())
    med = {c: statistics.median(v) for c, v in times.items()}
    recs = cases["monitor_grads"].mon.records()
    per_step = sum(1 for r in recs if r["step"] == recs[-1]["step"]) if recs else 0
    lines = [f"### {name}: {len(list(cases['none'].model.modules()))} modules", "",
             "| case | step ms | vs no hooks |", "|---|---:|---:|"]
    for c, t in med.items():
        lines.append(f"| {c} | {t * 1e3:.2f} | {t / med['none']:.3f}x |")
    lines += ["", f"records a step (with grads): {per_step}; " + no_sync_between_flushes(cases["monitor"]), ""]
    for c in cases.values():
        if c.mon is not None:
            c.mon.detach()
    del cases
    torch.cuda.empty_cache()
    return lines


if __name__ == "__main__":
    main()
