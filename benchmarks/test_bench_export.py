"""Exporters at scale: 2,000 records a step for 500 steps (1M records) through each writer, off the training thread.

The model is cheap on purpose: 1,000 `Affine` modules (x * a_i + b_i, a few us each) in a Sequential (1,001 with
the root) fed a new random 16-element tensor each step, so that the statistics differ from module to module and
from step to step as a training's do (identical records would let zstd squeeze the log to nothing), kinds
forward_pre + forward: 2,002 records a step, flushed every
FLUSH_EVERY steps. What is measured (one torch thread; one run per writer, not interleaved: each case is a whole
run of its writer):
  step_thread_s      the training thread's time in Monitor.step() per step, flushes included
  flush_s            of it, in the flush proper (the device-to-host copy into a Block: hookstats.monitor.buffers and .block,
                     issue #13's flush; timed by wrapping the Monitor's Recorder.take in this run)
  wait_s             of it, waiting for a free place in the export queue (the writer `export_queue` flushes behind;
                     the count is export_waits). This model's "training" is only its hooks (a few ms a step): a
                     writer slower than that makes the loop wait, which a real training step would hide
  export_s           the rest: handing the Block over (step_thread_s - flush_s - wait_s), what exporting costs the
                     training thread when the writer keeps up
  drain_s            detach(): what the export thread still had to write when the loop ended
  writer_rps         records per second the writer sustained (records / (loop + drain time))
  bytes_per_record   the log's size on disk / records (Parquet: the compacted directory; JSONL: the file)
  report_s           `hookstats report` (make_report) of the run: read, summary, plots, report.md/html
Writers: parquet (float32 statistics, the default), parquet64, jsonl: 500 steps; tensorboard and wandb (offline):
100 steps (they write ~10 scalar tags per record: 20,000 a step), scaled per step/record. The issue's targets
(benchmarks/targets.json, reported by benchmarks/report.py, never asserted): Parquet export_s <= 0.3 ms a step, Parquet
bytes/record <= 1/5 of JSONL's, report of the 1M-record run <= 10 s. Smoke mode (--benchmark-disable): 40
modules, 6 steps.
"""
from __future__ import annotations

import os
import shutil
import time

import pytest
import torch
from torch import nn

FLUSH_EVERY = 25
STEPS = {"none": 500, "parquet": 500, "parquet64": 500, "jsonl": 500, "tensorboard": 100, "wandb": 100}
MODULES = 1000
# The report's table (benchmarks/report.py reads this literal; targets in benchmarks/targets.json).
REPORT = [
    {"id": "export", "title": "Exporters off the training thread", "family": "export", "rows": ["writer"],
     "labels": {"none": "no exporter (the flush alone)", "parquet": "ParquetWriter (float32)",
                "parquet64": "ParquetWriter (float64)", "jsonl": "JSONLWriter", "tensorboard": "TensorBoardWriter",
                "wandb": "WandbWriter (offline)"},
     "columns": [["writer", "label(writer)"], ["steps", "steps", "int"], ["records", "records", "int"],
                 ["training thread ms/step", "step_thread_s", "ms"], ["flush ms", "flush_s", "ms"],
                 ["hand-over ms", "export_s if writer != 'none' else None", "ms"],
                 ["queue-full waits", "export_waits", "int"], ["wait ms/step", "wait_s", "ms"], ["drain s", "drain_s", "s"],
                 ["writer records/s", "writer_rps", "int"], ["bytes/record", "bytes_per_record", "f1"],
                 ["report s", "report_s", "s"]],
     "note": "2,002 records a step from a 1,001-module model whose training is only its hooks, a flush every 25 steps, "
             "one torch thread, one run per writer. training thread: what a step costs the training thread (flush + "
             "hand-over + waits); hand-over: giving a flush to the export thread; waits: flushes that found the export "
             "queue full; writer records/s: records over the run's loop and drain; report: `make_report` of the run."},
]


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _writer(name: str, run_dir: str):
    from hookstats.export import JSONLWriter, ParquetWriter

    if name == "none":
        return None, None
    if name in ("parquet", "parquet64"):
        p = os.path.join(run_dir, "log.parquet")
        return ParquetWriter(p, stats_dtype="float64" if name == "parquet64" else "float32"), p
    if name == "jsonl":
        p = os.path.join(run_dir, "log.jsonl")
        return JSONLWriter(p), p
    if name == "tensorboard":
        pytest.importorskip("tensorboard")
        from hookstats.export import TensorBoardWriter

        p = os.path.join(run_dir, "tensorboard")
        return TensorBoardWriter(p), p
    if name == "wandb":
        pytest.importorskip("wandb")
        os.environ.update(WANDB_MODE="offline", WANDB_DIR=run_dir, WANDB_SILENT="true", WANDB_CONSOLE="off")
        from hookstats.export import WandbWriter

        return WandbWriter(project="hookstats-bench", mode="offline", dir=run_dir), os.path.join(run_dir, "wandb")
    raise ValueError(name)


class Affine(nn.Module):
    def __init__(self, i: int):
        super().__init__()
        self.a, self.b = 1.0 + 0.37 / (i + 1), 0.01 * ((i * 7919) % 13 - 6)

    def forward(self, x):
        return x * self.a + self.b


def _run(name: str, run_dir: str, modules: int, steps: int) -> dict:
    import hookstats

    model = nn.Sequential(*[Affine(i) for i in range(modules)])
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, generator=g) for _ in range(steps)]
    writer, path = _writer(name, run_dir)
    mon = hookstats.Monitor(model, kinds=("forward_pre", "forward"), flush_every=FLUSH_EVERY,
                            exporters=[writer] if writer else [], keep_records=writer is None)
    take = mon._rec.take
    in_flush = [0.0]

    def timed_flush(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return take(*args, **kwargs)
        finally:
            in_flush[0] += time.perf_counter() - t0

    mon._rec.take = timed_flush  # this run's flush time (the copy into a Block), beside the hand-over's
    in_step = 0.0
    t_loop = time.perf_counter()
    for x in xs:
        model(x)
        t0 = time.perf_counter()
        mon.step()
        in_step += time.perf_counter() - t0
    loop = time.perf_counter() - t_loop
    records = steps * (modules + 1) * 2
    t0 = time.perf_counter()
    mon.detach()
    drain = time.perf_counter() - t0
    wait = mon.export_wait_seconds
    out = {"writer": name, "steps": steps, "records": records, "records_per_step": (modules + 1) * 2,
           "step_thread_s": in_step / steps, "flush_s": in_flush[0] / steps, "wait_s": wait / steps,
           "export_s": (in_step - in_flush[0] - wait) / steps, "drain_s": drain, "export_waits": mon.export_waits,
           "writer_rps": records / (loop + drain)}
    if path is not None:
        out["bytes_per_record"] = _size(path) / records
    if name in ("parquet", "jsonl"):
        pytest.importorskip("matplotlib")
        from hookstats.export import make_report

        t0 = time.perf_counter()
        make_report(run_dir, fmt=("md", "html"))
        out["report_s"] = time.perf_counter() - t0
    return out


@pytest.mark.parametrize("writer", list(STEPS))
def test_export_writer(benchmark, hookstats, one_thread, writer, tmp_path):
    pytest.importorskip("pyarrow")
    smoke = benchmark.disabled
    modules, steps = (40, 6) if smoke else (MODULES, STEPS[writer])
    run_dir = str(tmp_path / writer)
    os.makedirs(run_dir, exist_ok=True)
    result: dict = {}

    def once():
        if os.path.isdir(run_dir):
            shutil.rmtree(run_dir)
        os.makedirs(run_dir)
        result.update(_run(writer, run_dir, modules, steps))

    benchmark.pedantic(once, rounds=1, iterations=1)
    benchmark.extra_info.update(family="export", smoke=smoke, flush_every=FLUSH_EVERY, **result)

