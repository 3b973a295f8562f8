"""Records as tables (Monitor.table / to_pandas, hookstats.runlog.schema), the Parquet log (ParquetWriter, read_log,
read_run: round trips in float32 / float64, a resumed run, compaction, a kill), the export thread (order, errors at
the next flush / drain / detach, queue-full waits, drain at detach and at interpreter exit), and the report from a
Parquet log."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
from torch import nn

pa = pytest.importorskip("pyarrow")

import hookstats  # noqa: E402
from hookstats.monitor.export_thread import ExportError  # noqa: E402
from hookstats.runlog import JSONLWriter, ParquetWriter, read_jsonl, read_log, read_run  # noqa: E402
from hookstats.runlog import schema as T  # noqa: E402

NAN = float("nan")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return type(a) is type(b) and a == b


def assert_records_equal(got, want, f32: bool = False):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for k in ("seq", "step", "module", "kind", "index", "dtype", "histogram"):
            assert g[k] == w[k], (k, g[k], w[k])
        for k, v in w["stats"].items():
            gv = g["stats"][k]
            if f32 and isinstance(v, float):
                assert same(gv, float(np.float32(v))), (k, gv, v)
            else:
                assert same(gv, v), (k, gv, v)


class Two(nn.Module):
    def forward(self, x):
        return x * 2, x.double() - 1  # two tensors, two dtypes: index 0 / 1, float32 and float64 histograms


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), Two())


def run(mon, m, steps, nan_step=None):
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        x = torch.randn(3, 4, generator=g)
        if s == nan_step:
            x[0, 0] = NAN
        a, b = m(x)
        (a.sum() + b.sum()).backward()
        mon.log("loss", a.detach().sum())
        mon.step()


@pytest.mark.parametrize("histogram", [None, "exp", ((8, (-2.0, 2.0)))])
def test_table_equals_records(histogram):
    m = net()
    mon = hookstats.Monitor(m, kinds=("forward", "backward_pre", "grad"), histogram=histogram, flush_every=2)
    run(mon, m, 5, nan_step=3)
    t = mon.table()
    recs = mon.records()
    assert t.num_rows == len(recs) > 0
    assert t.column_names[:6] == ["seq", "step", "module", "kind", "index", "dtype"]
    for c in T.SITE_COLUMNS:
        assert pa.types.is_dictionary(t.schema.field(c).type)
    assert t.schema.field("numel").type == pa.int64() and t.schema.field("l2").type == pa.float64()
    hcols = T.hist_columns(t.column_names)
    if histogram is None:
        assert hcols == []
    elif histogram == "exp":
        assert len(hcols) == 2  # one length per dtype
    else:
        assert hcols == ["histogram_11"]
        assert t.schema.field("histogram_11").type == pa.list_(pa.int64())
    assert_records_equal(T.table_records(t), recs)
    assert T.run_info(t) == mon.run_info()
    # grows with further flushes (cached per block), and equals the dicts of records_table()
    run(mon, m, 2)
    t2 = mon.table()
    assert t2.num_rows == len(mon.records()) > t.num_rows
    assert_records_equal(T.table_records(T.records_table(mon.records())), mon.records())
    df = mon.to_pandas()
    assert len(df) == t2.num_rows and list(df["module"].unique())[:2] == ["0", "1"]
    assert np.array_equal(df["l2"].to_numpy(), np.array([r["stats"]["l2"] for r in mon.records()]), equal_nan=True)
    mon.detach()


@pytest.mark.parametrize("stats_dtype", ["float32", "float64"])
def test_parquet_round_trip(tmp_path, stats_dtype):
    m = net()
    path = tmp_path / "log.parquet"
    mon = hookstats.Monitor(m, kinds=("forward", "backward_pre", "grad"), histogram="exp", flush_every=2,
                            exporters=[ParquetWriter(path, stats_dtype=stats_dtype),
                                       JSONLWriter(tmp_path / "log.jsonl")])
    run(mon, m, 5, nan_step=2)
    mon.drain()
    assert sorted(os.listdir(path))[:2] == ["records-000001.parquet", "records-000002.parquet"]  # one per flush
    mon.detach()
    names = sorted(os.listdir(path))
    assert names == ["records-000001-000003.parquet"]  # compacted; nothing but records in the records dataset
    assert sorted(os.listdir(tmp_path / "log.scalars.parquet")) == ["scalars-000001-000003.parquet"]
    assert (tmp_path / "log.run.json").is_file() and not any(n.startswith(".") for n in os.listdir(tmp_path))
    import pyarrow.parquet as pq

    assert pq.ParquetFile(path / names[0]).num_row_groups == 3  # a row group per flush
    t = read_log(path)
    want = mon.records()
    assert_records_equal(T.table_records(t), want, f32=stats_dtype == "float32")
    ft = pa.float32() if stats_dtype == "float32" else pa.float64()
    assert t.schema.field("l2").type == ft and t.schema.field("nan_count").type == pa.int64()
    assert pa.types.is_dictionary(t.schema.field("module").type)
    assert T.run_info(t)["modules"] == mon.run_info()["modules"]
    r = read_run(tmp_path)  # the run directory: log.parquet first
    assert r.format == "parquet" and len(r.scalars) == len(mon.scalars()) == 5
    for a, b in zip(r.scalars, mon.scalars()):
        assert a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    j = read_run(tmp_path / "log.jsonl")
    assert j.format == "jsonl"
    assert_records_equal(T.table_records(read_log(tmp_path / "log.jsonl")), want)
    assert_records_equal(read_jsonl(tmp_path / "log.jsonl").records, want)


def test_parquet_resumed_run_and_uncompacted_reads(tmp_path):
    path = tmp_path / "log.parquet"
    m = net()
    mon = hookstats.Monitor(m, kinds=("forward",), flush_every=1, exporters=[ParquetWriter(path, compact=False)])
    run(mon, m, 3)
    mon.detach()
    first = mon.records()
    assert len([n for n in os.listdir(path) if n.startswith("records-")]) == 3
    m2 = net()
    mon2 = hookstats.Monitor(m2, kinds=("forward",), flush_every=1, start_step=3, exporters=[ParquetWriter(path)])
    run(mon2, m2, 2)
    mon2.detach()
    names = sorted(n for n in os.listdir(path) if n.startswith("records-"))
    assert names == ["records-000001.parquet", "records-000002.parquet", "records-000003.parquet",
                     "records-000004-000005.parquet"]  # the second writer numbers on, compacts its own
    t = read_log(path)
    assert t.num_rows == len(first) + len(mon2.records())
    assert t.column("step").to_pylist()[:len(first)] == [r["step"] for r in first]
    # a kill between the compacted file's rename and the removal of its parts leaves both: the parts are not read
    import shutil

    part1 = t.num_rows
    one = len([r for r in first if r["step"] == 0])
    for name in ("records-000006.parquet", "records-000007.parquet", "records-000006-000007.parquet"):
        shutil.copy(path / "records-000001.parquet", path / name)
    assert read_log(path).num_rows == part1 + one  # the compacted file only
    os.remove(path / "records-000006.parquet")
    os.remove(path / "records-000007.parquet")
    assert read_log(path).num_rows == part1 + one


def test_parquet_writer_checks(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        ParquetWriter(tmp_path / "f")
    with pytest.raises(ValueError, match="stats_dtype"):
        ParquetWriter(tmp_path / "d", stats_dtype="float16")
    w = ParquetWriter(tmp_path / "d")
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.write([], [{"seq": 0, "step": 0, "tag": "x", "value": 1.0}])


def test_parquet_sigkill_keeps_every_drained_flush(tmp_path):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from test_export import _kill_expected_per_step, _train_and_kill
    finally:
        sys.path.pop(0)
    path = tmp_path / "log.parquet"
    expected = _kill_expected_per_step()
    last_done = _train_and_kill(path, "parquet")
    assert not any(n.count("-") == 2 for n in os.listdir(path))  # never closed: nothing compacted
    t = read_log(path)
    steps = t.column("step").to_numpy()
    per_step = np.bincount(steps)
    assert len(per_step) >= last_done + 1
    assert (per_step == expected).all()  # every flush file there is whole (no partial row group)
    r = read_run(path)
    assert [s["step"] for s in r.scalars][:last_done + 1] == list(range(last_done + 1))
    assert r.info["modules"] == ["", "0", "1", "2"]


# ---------------------------------------------------------------------------------------------------------------
# the export thread
# ---------------------------------------------------------------------------------------------------------------

class Recorder:
    """A user exporter with write() only: gets dicts, on the export thread."""

    def __init__(self, gate=None, fail_at=None):
        self.calls, self.threads, self.gate, self.fail_at, self.closed = [], set(), gate, fail_at, 0

    def write(self, records, scalars):
        self.threads.add(threading.get_ident())
        if self.gate is not None:
            self.gate.wait()
        self.calls.append(([r["step"] for r in records], [s["step"] for s in scalars]))
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise ValueError("disk full")

    def close(self):
        self.closed += 1


class Columnar:
    def __init__(self):
        self.blocks = []

    def write_block(self, block, scalars):
        self.blocks.append(len(block))


def test_export_thread_order_and_columnar_entry_point():
    m = net()
    rec, col = Recorder(), Columnar()
    mon = hookstats.Monitor(m, kinds=("forward",), flush_every=1, exporters=[rec, col])
    run(mon, m, 6)
    mon.detach()
    assert [c[0][0] for c in rec.calls] == list(range(6))  # in flush order
    assert all(len(set(c[0])) == 1 for c in rec.calls)
    assert rec.threads and threading.get_ident() not in rec.threads  # off the training thread
    assert col.blocks == [len(c[0]) for c in rec.calls]  # the Block, not dicts
    assert rec.closed == 1 and mon.export_waits == 0


def test_exporter_error_surfaces_at_next_flush_and_detach():
    m = net()
    rec = Recorder(fail_at=2)
    ok = Recorder()
    mon = hookstats.Monitor(m, kinds=("forward",), exporters=[rec, ok])
    run(mon, m, 1)
    mon.flush()
    run(mon, m, 1)
    mon.flush()  # the second write fails, on the thread
    mon.drain.__self__._export.drain()  # wait for it (without raising) ...
    run(mon, m, 1)
    with pytest.raises(ExportError, match="Recorder failed.*disk full") as ei:
        mon.flush()  # ... raised here, at the next flush: this flush's rows were handed over first
    assert isinstance(ei.value.__cause__, ValueError)
    mon.drain()  # raised once
    assert len(ok.calls) == 3 and len(rec.calls) == 3  # the other exporter (and later flushes) still got everything
    rec.fail_at = 4
    run(mon, m, 1)
    with pytest.raises(ExportError, match="disk full"):
        mon.detach()  # flushes, drains, closes, then raises
    assert rec.closed == 1 and ok.closed == 1 and len(ok.calls) == 4


def test_queue_full_waits_are_counted():
    m = net()
    gate = threading.Event()
    rec = Recorder(gate=gate)
    mon = hookstats.Monitor(m, kinds=("forward",), exporters=[rec], export_queue=2, flush_every=1)
    t = threading.Timer(0.3, gate.set)
    t.start()
    run(mon, m, 6)  # the first write blocks on the gate: one in the exporter, two queued, then flushes wait
    assert mon.export_waits >= 1 and mon.export_wait_seconds > 0.05
    mon.detach()
    assert [c[0][0] for c in rec.calls] == list(range(6))
    t.join()
    with pytest.raises(ValueError, match="export_queue"):
        hookstats.Monitor(m, exporters=[rec], export_queue=0)


_EXIT_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from torch import nn
    import hookstats
    from hookstats.export import JSONLWriter

    class Slow(JSONLWriter):
        def write_block(self, block, scalars):
            time.sleep(0.05)
            super().write_block(block, scalars)

    m = nn.Sequential(nn.Linear(3, 3))
    mon = hookstats.Monitor(m, kinds=("forward",), exporters=[Slow(sys.argv[1])], flush_every=1)
    for _ in range(10):
        m(torch.randn(2, 3))
        mon.step()
    # no detach(): the interpreter exits with flushes still queued
""")


def test_interpreter_exit_drains_the_queue(tmp_path):
    path = tmp_path / "log.jsonl"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(path)], check=True, env=env, timeout=120)
    steps = sorted({r["step"] for r in read_jsonl(path).records})
    assert steps == list(range(10))


# ---------------------------------------------------------------------------------------------------------------
# the report from a Parquet log, and at scale
# ---------------------------------------------------------------------------------------------------------------

def test_report_from_parquet_equals_report_from_jsonl(tmp_path):
    pytest.importorskip("matplotlib")
    from hookstats.export import make_report

    m = net()
    mon = hookstats.Monitor(m, kinds=("forward", "backward_pre", "grad"), histogram="exp", flush_every=2,
                            exporters=[ParquetWriter(tmp_path / "p" / "log.parquet", stats_dtype="float64"),
                                       JSONLWriter(tmp_path / "j" / "log.jsonl")])
    run(mon, m, 6, nan_step=4)
    mon.detach()
    pp = make_report(tmp_path / "p", fmt="md")
    pj = make_report(tmp_path / "j", fmt="md")
    assert set(pp) == set(pj) >= {"grad_flow.png", "norm_heatmap.png", "hist_evolution.png", "scalars.png"}

    def body(p):
        return [ln for ln in open(p).read().splitlines()[1:] if "run directory" not in ln and "| log |" not in ln]

    assert body(pp["report.md"]) == body(pj["report.md"])
    text = open(pp["report.md"]).read()
    assert "First non-finite value: step 4" in text and "parquet:" in text


def test_plots_pick_layers_of_a_deep_model(tmp_path):
    pytest.importorskip("matplotlib")
    from hookstats.export import plots

    layers = 300
    m = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    mon = hookstats.Monitor(m, kinds=("backward_pre",))
    g = torch.Generator().manual_seed(0)
    for s in range(4):
        x = torch.randn(2, 4, generator=g)
        if s == 2:
            m[150].register_forward_hook(lambda mod, a, out: out * NAN)  # from step 2 on
        m(x).sum().backward()
        mon.step()
    t = mon.table()
    layers_, steps, values, recorded, bad = plots._matrix(t, "backward_pre")
    keep, note = plots.pick_layers(values, bad, 40)
    assert len(keep) == 40 and keep == sorted(keep) and "40 of 301 layers shown (20 non-finite" in note  # the root too
    bad_rows = set(np.flatnonzero(bad.any(1)))
    assert bad_rows and set(keep) >= set(sorted(bad_rows, key=lambda i: np.argmax(bad[i]))[:20])
    assert plots.grad_flow(t, tmp_path / "g.png") and plots.norm_heatmap(t, tmp_path / "h.png")
    # the columnar matrix equals the one from dicts
    l2, s2, v2 = plots.norm_matrix(mon.records(), "backward_pre")
    assert l2 == layers_ and s2 == steps and np.array_equal(v2, values, equal_nan=True)
    assert plots.nonfinite_events(t) == plots.nonfinite_events(mon.records())
    mon.detach()


@pytest.mark.parametrize("histogram", [None, "exp", ((8, (-1.0, 1.0)))])
def test_jsonl_columnar_lines_equal_the_record_encoding(histogram):
    import json

    from hookstats.runlog.jsonl import encode_block, encode_record

    m = net()
    mon = hookstats.Monitor(m, kinds=("forward", "backward_pre", "grad"), histogram=histogram)
    run(mon, m, 3, nan_step=1)
    mon.flush()
    block = mon._store.blocks[-1]
    want = "".join(json.dumps(encode_record(r), allow_nan=False, separators=(",", ":")) + "\n"
                   for r in block.records())
    assert encode_block(block) == want
    mon.detach()


def _merge_keys(records):
    return [(r["ranks"], r["nonfinite_ranks"], r.get("location_rank")) for r in records]


@pytest.mark.parametrize("locations", [False, True])
def test_merge_columns_of_a_merged_block(locations):
    """A block merged across ranks (Note [merging records across ranks]) carries ranks, nonfinite_ranks and, with
    locations, location_rank into its table, as records() has them; ranks up to 62 in the bitmask."""
    m = net()
    mon = hookstats.Monitor(m, locations=locations)
    run(mon, m, 2, nan_step=1)
    mon.flush()
    block = mon._store.blocks[0]
    n = len(block)
    block.ranks = np.arange(n, dtype=np.int64) % 3 + 1
    block.nonfinite_mask = np.array([[0, 0b101, 1 << 62, (1 << 62) | 2][i % 4] for i in range(n)], dtype=np.int64)
    if locations:
        block.location_rank = np.arange(n, dtype=np.int64) % 2
    block._records = None
    want = block.records()
    assert _merge_keys(want)[:4] == [(1, [], 0 if locations else None), (2, [0, 2], 1 if locations else None),
                                     (3, [62], 0 if locations else None), (1, [1, 62], 1 if locations else None)]
    t = T.block_table(block)
    assert t.schema.field("ranks").type == pa.int32() and t.schema.field("nonfinite_ranks").type == pa.list_(pa.int32())
    assert ("location_rank" in t.column_names) is locations
    got = T.table_records(t)
    assert _merge_keys(got) == _merge_keys(want)
    assert _merge_keys(T.table_records(T.records_table(want))) == _merge_keys(want)  # a JSONL log read back
    mon.detach()


def test_merged_run_logs_keep_the_ranks(tmp_path):
    """A Monitor with a process group (gloo, one rank, in this process): table(), the JSONL log and the Parquet log
    all hold the merge columns, equal to records()."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        m = net()
        mon = hookstats.Monitor(m, process_group="world", locations=True,
                                exporters=[JSONLWriter(str(tmp_path / "log.jsonl")),
                                           ParquetWriter(str(tmp_path / "log.parquet"))])
        run(mon, m, 3, nan_step=1)
        mon.detach()
        want = mon.records()
        assert any(r["nonfinite_ranks"] == [0] for r in want) and all(r["ranks"] == 1 for r in want)
        assert mon.run_info()["merged"] is True
        for table in (mon.table(), read_log(str(tmp_path / "log.jsonl")), read_log(str(tmp_path / "log.parquet"))):
            assert _merge_keys(T.table_records(table)) == _merge_keys(want)
    finally:
        dist.destroy_process_group()
