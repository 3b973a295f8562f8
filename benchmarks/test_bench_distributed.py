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
        launches.append(helpers.launch(Path(__file__), [str(tmp_path)], tmp_path, world=WORLD, timeout=DEADLINE_S))

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


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
