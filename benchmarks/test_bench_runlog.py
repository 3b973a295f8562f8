"""A long run into the run log: memory and step time stay flat over thousands of steps and through close().

The model: 75 `Affine` modules (x * a_i + b_i on a new random 64-element tensor each step) in a Sequential, kinds
forward_pre + forward: 152 sites with the root, 152 records a step (the issue's 150-site run), keep_records=False (the host keeps
nothing once the writer has it), a flush every FLUSH_EVERY steps, one torch thread. One run per writer:
  parquet    ParquetWriter, float64 statistics (the default), compacted at close (streamed a row group at a time)
  parquet32  ParquetWriter(stats_dtype="float32")
  jsonl      JSONLWriter
What is measured:
  step_ms_first / step_ms_last   the mean time of a whole step (the model's forward with its hooks + Monitor.step(),
                                 flushes and hand-overs included) over the first and the last WINDOW steps; their
                                 ratio (step_drift) is 1 when the per-step cost does not grow with the run;
                                 step_ms_windows: every window's mean (extra_info), step_ms_median their median
  wait_ms                        of it, per step, the training thread's waits for a full export queue (a writer
                                 slower than the loop: JSONL's Python formatting here); waits: how many flushes
                                 waited. A loop that starts with an empty queue is faster until the queue fills
  rss_start_mb                   the process's RSS after the first WINDOW steps (everything allocated, warm)
  rss_growth_mb                  RSS at the end of the loop minus rss_start_mb (flat: ~0)
  rss_max_growth_mb              the largest RSS sample over the loop (every 100 steps) minus rss_start_mb
  close_s                        detach(): the last flush, the export thread's drain, the writer's close
                                 (the Parquet log's compaction)
  close_rss_mb                   the RSS peak while detach() runs (sampled every 2 ms on a thread) minus the RSS
                                 before it: what closing costs in memory; with the old compaction it grew with the
                                 run (+421 MB at the end of 20,000 steps x 150 sites)
  bytes_per_record               the log's size on disk / records
Each writer runs in a fresh Python process (this file run as a script), so that its RSS is its own run's.
Smoke mode (--benchmark-disable): 20 modules, 200 steps.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from test_bench_export import Affine, _size  # the same cheap module: x * a_i + b_i
from torch import nn

STEPS = 10000
MODULES = 75
FLUSH_EVERY = 50
WINDOW = 500
WRITERS = ("parquet", "parquet32", "jsonl")
# The report's table (benchmarks/report.py reads this literal).
REPORT = [
    {"id": "runlog_long", "title": "A long run into the run log: memory and step time over the run and close()",
     "family": "runlog_long", "rows": ["writer"],
     "labels": {"parquet": "ParquetWriter (float64, the default)", "parquet32": "ParquetWriter (float32)",
                "jsonl": "JSONLWriter"},
     "columns": [["writer", "label(writer)"], ["steps", "steps", "int"], ["records", "records", "int"],
                 ["step ms, first 500", "step_ms_first", "f3"], ["step ms, last 500", "step_ms_last", "f3"],
                 ["last / first", "step_drift", "x"], ["median window ms", "step_ms_median", "f3"],
                 ["wait ms/step", "wait_ms", "f3"], ["waits", "waits", "int"],
                 ["RSS MB after 500 steps", "rss_start_mb", "f1"],
                 ["RSS growth MB, end of loop", "rss_growth_mb", "f1"],
                 ["RSS growth MB, max over loop", "rss_max_growth_mb", "f1"], ["close() s", "close_s", "s"],
                 ["RSS peak in close() MB", "close_rss_mb", "f1"], ["bytes/record", "bytes_per_record", "f1"]],
     "note": "75 modules and the root x (forward_pre, forward): 152 records a step, keep_records=False, a flush every 50 steps, "
             "one torch thread, each writer in a fresh process. Flat means: last/first near 1x, RSS growth near 0 over the "
             "loop, and a close() whose memory does not grow with the run (the compaction streams a row group at "
             "a time)."},
]


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _writer(name: str, run_dir: str):
    from hookstats.runlog import JSONLWriter, ParquetWriter

    if name == "jsonl":
        p = os.path.join(run_dir, "log.jsonl")
        return JSONLWriter(p), p
    p = os.path.join(run_dir, "log.parquet")
    return ParquetWriter(p, stats_dtype="float32" if name == "parquet32" else "float64"), p


def _run(name: str, run_dir: str, modules: int, steps: int, window: int) -> dict:
    import hookstats

    model = nn.Sequential(*[Affine(i) for i in range(modules)])
    g = torch.Generator().manual_seed(0)
    writer, path = _writer(name, run_dir)
    mon = hookstats.Monitor(model, kinds=("forward_pre", "forward"), flush_every=FLUSH_EVERY, exporters=[writer],
                            keep_records=False)
    times, rss = [], []
    x = torch.empty(64)
    for s in range(steps):
        x.normal_(generator=g)
        t0 = time.perf_counter()
        model(x)
        mon.step()
        times.append(time.perf_counter() - t0)
        if s % 100 == 99:
            rss.append(_rss())
    rss_start = rss[max(0, window // 100 - 1)]
    before = _rss()
    peak = [before]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    mon.detach()
    close_s = time.perf_counter() - t0
    stop.set()
    th.join()
    peak[0] = max(peak[0], _rss())
    records = steps * (modules + 1) * 2
    windows = [sum(times[i:i + window]) / window * 1e3 for i in range(0, steps - window + 1, window)]
    first, last = windows[0], windows[-1]
    mb = 1 / 2**20
    return {"writer": name, "steps": steps, "records": records, "step_ms_first": first, "step_ms_last": last,
            "step_drift": last / first, "step_ms_median": sorted(windows)[len(windows) // 2],
            "step_ms_windows": [round(w, 4) for w in windows], "wait_ms": mon.export_wait_seconds / steps * 1e3,
            "waits": mon.export_waits, "rss_mb_samples": [round(r * mb, 1) for r in rss[::5]],
            "rss_start_mb": rss_start * mb,
            "rss_growth_mb": (rss[-1] - rss_start) * mb, "rss_max_growth_mb": (max(rss) - rss_start) * mb,
            "close_s": close_s, "close_rss_mb": (peak[0] - before) * mb, "bytes_per_record": _size(path) / records,
            "loadavg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


@pytest.mark.parametrize("writer", WRITERS)
def test_runlog_long_run(benchmark, hookstats, one_thread, writer, tmp_path):
    pytest.importorskip("pyarrow")
    smoke = benchmark.disabled
    modules, steps, window = (20, 200, 50) if smoke else (MODULES, STEPS, WINDOW)
    run_dir = str(tmp_path / writer)
    result: dict = {}

    def once():
        if os.path.isdir(run_dir):
            shutil.rmtree(run_dir)
        os.makedirs(run_dir)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's hookstats first
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in sys.path if p]))
        out = subprocess.run([sys.executable, os.path.abspath(__file__), writer, run_dir, str(modules), str(steps),
                              str(window)], capture_output=True, text=True, timeout=3600, env=env)
        assert out.returncode == 0, out.stderr
        result.update(json.loads(out.stdout.strip().splitlines()[-1]))

    benchmark.pedantic(once, rounds=1, iterations=1)
    benchmark.extra_info.update(family="runlog_long", smoke=smoke, flush_every=FLUSH_EVERY, **result)
    from hookstats.runlog import read_log

    assert read_log(run_dir).num_rows == result["records"]  # every record of the run is in the log


if __name__ == "__main__":  # one run in this process: python test_bench_runlog.py WRITER RUN_DIR MODULES STEPS WINDOW
    torch.set_num_threads(1)
    w, d, n_mod, n_steps, win = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    print(json.dumps(_run(w, d, n_mod, n_steps, win)))
