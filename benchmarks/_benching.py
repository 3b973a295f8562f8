"""Shared pieces of the hookstats benchmarks: the size/dtype/device grid, seeded inputs, round planning and the
interleaved timer. Benchmark files import them with `from _benching import ...`; benchmarks/conftest.py holds the
fixtures and collection hooks.

Run with `python -m pytest benchmarks --benchmark-only --benchmark-json=bench.json`, then
`python benchmarks/report.py bench.json`.
"""
from __future__ import annotations

import functools
import math
import os
import statistics
import time
from typing import Callable

import pytest
import torch

try:
    import hookstats as _hookstats

    _IMPORT_ERROR: BaseException | None = None
except Exception as e:  # a broken build must skip the benchmarks with a reason, not error at collection
    _hookstats = None
    _IMPORT_ERROR = e

SIZES_LOG2 = (10, 16, 20, 24)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICES = (
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")),
)
SEED = 20240601

# On a shared machine a busy core stalls every parallel region of a multi-threaded op for a scheduler tick;
# HOOKSTATS_BENCH_THREADS=1 trades absolute speed for stable ratios. The thread count goes into extra_info.
if os.environ.get("HOOKSTATS_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["HOOKSTATS_BENCH_THREADS"]))

# Time given to one case (seconds of timed work, after warmup), and its bounds in rounds. The composite gets
# less: it is 10+ passes, and at 2^24 on a 2-core CPU one call costs a large fraction of a second, so it
# must not dominate the run. Fused and roof get more: their ratio is the number the report is about.
#
# The histogram benchmarks (test_bench_hist.py) time 6 cases in each of twice as many groups, so they budget by
# kind rather than by case: "hist" (the hookstats cases and their roof) and "baseline" (torch.histc and
# torch.histogram: ~0.2-0.3 s a call at 2^24 here, so a few rounds only).
BUDGET_S = {"fused": 1.0, "roof": 1.0, "composite": 0.4, "hist": 0.5, "baseline": 0.25}
MIN_ROUNDS = {"fused": 15, "roof": 15, "composite": 5, "hist": 10, "baseline": 3}
MAX_ROUNDS = 400
MIN_ROUND_S = 200e-6  # batch calls of tiny ops into rounds of at least this long, so timer overhead vanishes


# glibc told to keep what is freed (no trimming of the heap's top, no separate mappings for large blocks): what a
# caching allocator (jemalloc, tcmalloc) gives. Set in the environment of a fresh process, before its first malloc.
# With glibc's defaults a CPU training step hands freed blocks back to the system and faults them in again, as often
# as the order of everything allocated before makes it: hundreds to thousands of minor page faults a step, which
# moves a step's time by several percent between processes that run the same code (test_bench_per_sample.py,
# test_bench_large_models.py run their comparisons both ways).
KEEP_FREED = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(1 << 30)}


def run_keeping_freed(script: str, *args: str, timeout: float = 900) -> dict:
    """The JSON dict that `python script *args` prints as its last line, run in a fresh process whose C allocator
    keeps freed memory (KEEP_FREED), with the benchmarks' folder on its path."""
    import json
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = dict(os.environ, **KEEP_FREED, PYTHONPATH=path)
    out = subprocess.run([sys.executable, os.path.abspath(script), *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the keep-freed run of {os.path.basename(script)} failed ({out.returncode}):\n"
                           f"{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def minor_faults() -> int | None:
    """This process's minor page faults so far (None where the platform does not count them)."""
    try:
        import resource
    except ImportError:  # pragma: no cover
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ---------------------------------------------------------------------------------------------------------------
# Smoke mode (`--benchmark-disable`, which `make test` runs): each benchmarked function runs once, untimed, so a
# benchmark that breaks fails CI instead of rotting; cases parametrized by a size above SMOKE_MAX_SIZE_LOG2 are
# deselected (the smaller sizes of each grid still run). Files whose inputs are not sized by `size_log2` read
# `benchmark.disabled` (or the bench_smoke fixture) and build small inputs themselves.
SMOKE_MAX_SIZE_LOG2 = 20


@functools.lru_cache(maxsize=2)
def make_input(size_log2: int, dtype_name: str, device: str) -> torch.Tensor:
    """Standard normal values (seeded, so every run times the same data), with ~1% exact zeros so that
    zero_count has work to do. Cached: the three cases of one group share their input."""
    g = torch.Generator().manual_seed(SEED + size_log2)
    x = torch.randn(2**size_log2, generator=g)
    x[torch.rand(x.shape, generator=g) < 0.01] = 0
    return x.to(device=device, dtype=DTYPES[dtype_name])


def plan_rounds(fn: Callable[[], object], case: str) -> tuple[int, int]:
    """(rounds, iterations) for benchmark.pedantic, from the time of one warm call of `fn`; `case` is a key of
    BUDGET_S and MIN_ROUNDS.

    Rounds are sized by measured cost rather than by tensor size, so the plan holds on a faster or slower
    machine: small ops get many rounds of batched calls, the 2^24 composite gets MIN_ROUNDS single calls.
    """
    fn()  # warm: first-call allocations, lazy init
    samples: list[float] = []
    while len(samples) < 3 and sum(samples) < BUDGET_S[case] / 4:  # one sample when a call is expensive
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    t = max(statistics.median(samples), 1e-7)
    iterations = max(1, math.ceil(MIN_ROUND_S / t))
    rounds = int(BUDGET_S[case] / (t * iterations))
    return max(MIN_ROUNDS[case], min(MAX_ROUNDS, rounds)), iterations


def synced(op: Callable[[], object], device: str) -> Callable[[], object]:
    """op, ending with a CUDA synchronize on CUDA: pytest-benchmark reads the host clock."""
    if device != "cuda":
        return op

    def fn():
        op()
        torch.cuda.synchronize()

    return fn


def cuda_event_seconds(fn: Callable[[], object], reps: int = 15, min_s: float = 2e-3) -> float:
    """Median device time of one call of `fn`, from CUDA events around back-to-back launches.

    Back-to-back launches measure max(device time, host launch time) per call, without the ~10 us of a host
    synchronize that the wall-clock benchmark includes. Inputs that fit the L2 cache (50 MB on H100/H200: up
    to 2^23 fp32) stay there across launches, as for a hook reading an activation just written; only 2^24
    measures HBM bandwidth.
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    inner = max(1, math.ceil(min_s / max(start.elapsed_time(end) / 1e3, 1e-7)))
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def interleaved_timer(fns: dict, device: str):
    """(times, timed) for the benchmarks that alternate cases call by call: timed(case) calls fns[case] once
    (synchronized on CUDA, since the host clock is read) and appends its seconds to times[case]."""
    times: dict = {case: [] for case in fns}

    def timed(case) -> None:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fns[case]()
        if device == "cuda":
            torch.cuda.synchronize()
        times[case].append(time.perf_counter() - t0)

    return times, timed
