"""hookstats clipping of FSDP2-sharded grads beside torch.nn.utils on the same model, 2 CPU ranks (gloo), in one run.

Group dist_clip-cpu-float32-2ranks, one benchmark:
  the model   BLOCKS pre-LayerNorm blocks of width WIDTH (LayerNorm, qkv Linear, output Linear, LayerNorm, MLP up
              and down Linears: 12 parameter tensors a block, 288 in all, ~4.7M float32 elements), fully_shard per
              block and the root on init_device_mesh("cpu", (2,)); one forward/backward gives every parameter a
              sharded DTensor grad, kept aside and copied back before every timed call
  ops, timed inside each rank, interleaved (the order alternates every repeat), each call after a barrier:
    clip_grad_norm   hookstats.clip_grad_norm_(params, max_norm)  vs  torch.nn.utils.clip_grad_norm_(params, max_norm)
    total_norm       hookstats.get_total_norm(grads)  vs  torch.nn.utils.get_total_norm(grads).full_tensor() (the
                     global value: PyTorch's total of DTensor grads is a DTensor; hookstats' is a plain tensor)

pytest-benchmark cannot time inside spawned ranks: the benchmarked callable is the whole launch (both ranks, from
process start to exit: one round), and the numbers that matter go into extra_info, per rank and combined:
  family "dist_clip", world_size, backend, device, dtype, n_tensors, numel, bytes (of all the grads), local_numel
  (a list: each rank's shard), blocks, width, warmup, repeats, torch_threads (per rank), launch_s (the launch, as
  timed by pytest-benchmark), and for each op OP in (clip_grad_norm, total_norm):
    {OP}_hookstats_s, {OP}_torch_s     the slowest rank's median (a step waits for its slowest rank)
    {OP}_speedup                       {OP}_torch_s / {OP}_hookstats_s (above 1: hookstats is faster)
    {OP}_rank_hookstats_s, {OP}_rank_torch_s, {OP}_rank_speedup   lists, one entry per rank
Before timing, each rank checks hookstats' total and clipped grads against PyTorch's on the same sharded grads, so a
broken op cannot post a fast time. No timing is asserted.

Group dist_monitor-cpu-float32-2ranks, one benchmark (test_monitor_merge_flush): the cost of a Monitor's merged
flush (Note [merging records across ranks] in hookstats/distributed.py) against the training step.
  the model   DDP over MERGE_LAYERS Linear(MERGE_WIDTH) + Tanh pairs (48 modules with the root: 96 records a step for
              kinds forward and backward_pre), batch MERGE_BATCH per rank, SGD; four copies, one per case
  cases, each a sample of MERGE_STEPS training steps (forward, backward, optimizer step, mon.step()), interleaved
  (the order rotates every repeat), after a barrier:
    none          no Monitor
    local_1       Monitor without process_group, flush_every=1 (the host copy alone)
    merged_1      Monitor(process_group="world", flush_every=1): one all_gather a step, started by step()
    merged_10     Monitor(process_group="world", flush_every=10)
  and the synchronous merged flush alone (flush_s: mon.flush() after one step's records, timed directly).
  extra_info: family "dist_monitor", world_size, backend, records_per_step, steps, repeats, and per case CASE
  {CASE}_step_s (the slowest rank's median per step), {CASE}_ratio ({CASE}_step_s / none_step_s), {CASE}_flush_cost_s
  ({CASE}_step_s - none_step_s: the Monitor's cost per step, recording and flush), flush_s (the slowest rank's median
  of a synchronous merged flush of one step's records) and flush_collectives (collectives per flush, counted).
  Before timing, each rank checks that the merged records of one step hold both ranks' batches (numel 2x local).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

WORLD = 2
BLOCKS, WIDTH = 24, 128
WARMUP, REPEATS = 5, 30
MAX_NORM_FACTOR = 0.5  # every timed call clips: the grads are restored to norm N before it, max_norm is N / 2
OPS = ("clip_grad_norm", "total_norm")
CASES = ("hookstats", "torch")
DEADLINE_S = 400.0


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(q * k + v)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


# ---------------------------------------------------------------------------------------------------------------
# The ranks (this file run as a script by dist_helpers.launch)


# The report's table (benchmarks/report.py reads this literal).
REPORT = [
    {"id": "dist_clip", "title": "Distributed clipping: FSDP2, DTensor grads, timed inside the ranks",
     "family": "dist_clip", "rows": ["world_size", "backend"],
     "columns": [["setup", "'%s %s ranks, %s, %s %s tensors, %.2fM values' % (world_size, backend, device, n_tensors, "
                  "dtype, numel / 1e6)"],
                 ["`clip_grad_norm_` hookstats ms", "clip_grad_norm_hookstats_s", "ms"],
                 ["`torch.nn.utils` ms", "clip_grad_norm_torch_s", "ms"], ["speedup", "clip_grad_norm_speedup", "x"],
                 ["`get_total_norm` hookstats ms", "total_norm_hookstats_s", "ms"],
                 ["`torch.nn.utils` ms ", "total_norm_torch_s", "ms"], ["speedup ", "total_norm_speedup", "x"]],
     "note": "The slowest rank's median of interleaved repeats. hookstats issues one all_reduce of one float64 scalar "
             "per call; PyTorch reduces a DTensor norm per tensor."},
]


def _rank_main(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hookstats

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(WIDTH) for _ in range(BLOCKS)])
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 8, WIDTH, generator=torch.Generator().manual_seed(1 + rank))
    model(x).square().mean().backward()
    params = [p for p in model.parameters() if p.grad is not None]
    assert len(params) == 12 * BLOCKS
    saved = [p.grad._local_tensor.clone() for p in params]
    grads = [p.grad for p in params]

    def restore() -> None:
        for p, s in zip(params, saved):
            p.grad._local_tensor.copy_(s)

    # Check both sides on the same grads before timing anything.
    total = float(hookstats.get_total_norm(grads))
    torch_total = float(torch.nn.utils.get_total_norm(grads).full_tensor())
    max_norm = MAX_NORM_FACTOR * torch_total
    hookstats.clip_grad_norm_(params, max_norm)
    mine = [p.grad.full_tensor() for p in params]
    restore()
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    theirs = [p.grad.full_tensor() for p in params]
    restore()
    worst = max(float((a - b).abs().max()) for a, b in zip(mine, theirs) if a.numel())
    scale = max(float(b.abs().max()) for b in theirs if b.numel())
    check = {"total": total, "torch_total": torch_total, "max_grad_error": worst, "grad_scale": scale}

    ops = {
        ("clip_grad_norm", "hookstats"): lambda: hookstats.clip_grad_norm_(params, max_norm),
        ("clip_grad_norm", "torch"): lambda: torch.nn.utils.clip_grad_norm_(params, max_norm),
        ("total_norm", "hookstats"): lambda: hookstats.get_total_norm(grads),
        ("total_norm", "torch"): lambda: torch.nn.utils.get_total_norm(grads).full_tensor(),
    }
    times: dict = {k: [] for k in ops}
    for i in range(WARMUP + REPEATS):
        for op in OPS:
            for case in (CASES if i % 2 == 0 else CASES[::-1]):
                restore()
                dist.barrier()
                t0 = time.perf_counter()
                ops[(op, case)]()
                t = time.perf_counter() - t0
                if i >= WARMUP:
                    times[(op, case)].append(t)
    restore()
    result = {"check": check, "numel": sum(p.numel() for p in params), "n_tensors": len(params),
              "local_numel": sum(s.numel() for s in saved), "torch_threads": torch.get_num_threads(),
              "median_s": {f"{op}/{case}": statistics.median(ts) for (op, case), ts in times.items()},
              "times_s": {f"{op}/{case}": ts for (op, case), ts in times.items()}}
    (out / f"bench_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# The benchmark


def _launcher():
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.append(tests)  # appended: the benchmarks' own modules come first
    import dist_helpers

    return dist_helpers


def test_fsdp_clip_grad_norm(benchmark, hookstats, tmp_path):
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("needs torch.distributed with the gloo backend")
    helpers = _launcher()
    launches = []

    def run():
        launches.append(helpers.launch(Path(__file__), ["clip", str(tmp_path)], tmp_path, world=WORLD,
                                       timeout=DEADLINE_S))

    benchmark.group = f"dist_clip-cpu-float32-{WORLD}ranks"
    benchmark.pedantic(run, rounds=1, iterations=1)
    launch = launches[-1]
    assert launch.returncodes == [0] * WORLD and not launch.timed_out, launch.describe()
    ranks = [json.loads((tmp_path / f"bench_rank{r}.json").read_text()) for r in range(WORLD)]
    for r, res in enumerate(ranks):
        c = res["check"]
        assert c["total"] == pytest.approx(c["torch_total"], rel=1e-5), f"rank {r}: total norms differ: {c}"
        assert c["max_grad_error"] <= 1e-5 * c["grad_scale"], f"rank {r}: clipped grads differ: {c}"

    info = dict(family="dist_clip", world_size=WORLD, backend="gloo", device="cpu", dtype="float32",
                n_tensors=ranks[0]["n_tensors"], numel=ranks[0]["numel"], blocks=BLOCKS, width=WIDTH,
                warmup=WARMUP, repeats=REPEATS, torch_threads=ranks[0]["torch_threads"], launch_s=launch.seconds,
                local_numel=[r["local_numel"] for r in ranks], bytes=4 * ranks[0]["numel"])
    for op in OPS:
        per = {case: [r["median_s"][f"{op}/{case}"] for r in ranks] for case in CASES}
        mine, theirs = max(per["hookstats"]), max(per["torch"])
        info.update({
            f"{op}_hookstats_s": mine, f"{op}_torch_s": theirs, f"{op}_speedup": theirs / mine,
            f"{op}_rank_hookstats_s": per["hookstats"], f"{op}_rank_torch_s": per["torch"],
            f"{op}_rank_speedup": [t / m for t, m in zip(per["torch"], per["hookstats"])],
        })
    benchmark.extra_info.update(info)


# ---------------------------------------------------------------------------------------------------------------
# The merged flush's cost per step


MERGE_LAYERS, MERGE_WIDTH, MERGE_BATCH, MERGE_STEPS = 24, 128, 32, 10
MERGE_WARMUP, MERGE_REPEATS = 2, 20
MERGE_CASES = ("none", "local_1", "merged_1", "merged_10")


def _monitor_main(out: Path, repeats: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hookstats

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = []
    for _ in range(MERGE_LAYERS):
        layers += [nn.Linear(MERGE_WIDTH, MERGE_WIDTH), nn.Tanh()]
    base = nn.Sequential(*layers[:-1])
    x = torch.randn(MERGE_BATCH, MERGE_WIDTH, generator=torch.Generator().manual_seed(1 + rank))
    runs = {}
    for case in MERGE_CASES:
        model = DDP(copy_module(base))
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        mon = None
        if case != "none":
            every = int(case.split("_")[1])
            mon = hookstats.Monitor(model.module, kinds=("forward", "backward_pre"), flush_every=every,
                                    keep_records=True, process_group="world" if case.startswith("merged") else None)
        runs[case] = (model, opt, mon)

    def train(case: str) -> None:
        model, opt, mon = runs[case]
        for _ in range(MERGE_STEPS):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            if mon is not None:
                mon.step()
        if mon is not None:
            mon.first_nonfinite()  # a cheap read: the last merge ends inside the sample
            mon._store.blocks.clear()  # keep memory flat across samples

    # check: a merged step's records hold both ranks' batches
    mon = runs["merged_1"][2]
    model, opt, _ = runs["merged_1"]
    for _ in range(MERGE_STEPS):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        mon.step()
    recs = mon.records()
    per_step = len(recs) // MERGE_STEPS if recs else 0
    fwd = [r for r in recs if r["kind"] == "forward" and r["module"] == "0"]
    check = {"records_per_step": per_step, "numel": fwd[0]["stats"]["numel"] if fwd else -1,
             "want_numel": world * MERGE_BATCH * MERGE_WIDTH}
    mon._store.blocks.clear()
    times: dict = {c: [] for c in MERGE_CASES}
    for i in range(MERGE_WARMUP + repeats):
        k = i % len(MERGE_CASES)
        for case in MERGE_CASES[k:] + MERGE_CASES[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            train(case)
            t = (time.perf_counter() - t0) / MERGE_STEPS
            if i >= MERGE_WARMUP:
                times[case].append(t)
    # the synchronous merged flush alone, of one step's records
    model, opt, _ = runs["merged_10"]
    sync = hookstats.Monitor(model.module, kinds=("forward", "backward_pre"), process_group="world")
    flush_times = []
    calls: list = []
    gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    orig = getattr(dist, gather_name)

    def counting(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    for i in range(MERGE_WARMUP + repeats):
        model(x).square().mean().backward()
        opt.zero_grad(set_to_none=False)
        dist.barrier()
        n0 = len(calls)
        setattr(dist, gather_name, counting)
        t0 = time.perf_counter()
        sync.flush()
        t = time.perf_counter() - t0
        setattr(dist, gather_name, orig)
        sync.step()
        if i >= MERGE_WARMUP:
            flush_times.append(t)
            check["flush_collectives"] = len(calls) - n0
    sync.detach()
    for _, _, m in runs.values():
        if m is not None:
            m.detach()
    result = {"check": check, "median_s": {c: statistics.median(ts) for c, ts in times.items()},
              "times_s": times, "flush_s": statistics.median(flush_times), "torch_threads": torch.get_num_threads()}
    (out / f"merge_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def copy_module(m: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(m)


def test_monitor_merge_flush(benchmark, hookstats, tmp_path):
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("needs torch.distributed with the gloo backend")
    helpers = _launcher()
    launches = []
    repeats = 1 if benchmark.disabled else MERGE_REPEATS

    def run():
        launches.append(helpers.launch(Path(__file__), ["monitor", str(tmp_path), str(repeats)], tmp_path,
                                       world=WORLD, timeout=DEADLINE_S))

    benchmark.group = f"dist_monitor-cpu-float32-{WORLD}ranks"
    benchmark.pedantic(run, rounds=1, iterations=1)
    launch = launches[-1]
    assert launch.returncodes == [0] * WORLD and not launch.timed_out, launch.describe()
    ranks = [json.loads((tmp_path / f"merge_rank{r}.json").read_text()) for r in range(WORLD)]
    for r, res in enumerate(ranks):
        c = res["check"]
        assert c["records_per_step"] == 2 * 2 * MERGE_LAYERS, f"rank {r}: {c}"  # 2 kinds x (2 L - 1 modules + root)
        assert c["numel"] == c["want_numel"], f"rank {r}: merged records are not both ranks' batches: {c}"
    info = dict(family="dist_monitor", world_size=WORLD, backend="gloo", device="cpu", dtype="float32",
                records_per_step=ranks[0]["check"]["records_per_step"], steps=MERGE_STEPS, repeats=repeats,
                layers=MERGE_LAYERS, width=MERGE_WIDTH, batch=MERGE_BATCH, launch_s=launch.seconds,
                torch_threads=ranks[0]["torch_threads"], flush_s=max(r["flush_s"] for r in ranks),
                flush_collectives=ranks[0]["check"]["flush_collectives"])
    none = max(r["median_s"]["none"] for r in ranks)
    for case in MERGE_CASES:
        t = max(r["median_s"][case] for r in ranks)
        info.update({f"{case}_step_s": t, f"{case}_ratio": t / none, f"{case}_flush_cost_s": t - none,
                     f"{case}_rank_step_s": [r["median_s"][case] for r in ranks]})
    benchmark.extra_info.update(info)


if __name__ == "__main__":
    if sys.argv[1] == "monitor":
        _monitor_main(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        _rank_main(Path(sys.argv[2]))
