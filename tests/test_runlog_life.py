"""A run log over a run's life: detach() when an exporter's close() fails, resuming into a log (the same run
continues, another one is refused), statistics float32 cannot hold, range histogram columns, and compaction in
bounded memory."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import hookstats
from hookstats.monitor.export_thread import ExportError
from hookstats.runlog import JSONLWriter, read_jsonl, read_log, read_run
from hookstats.runlog import schema as T

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pd = pytest.importorskip("pandas")
ds = pytest.importorskip("pyarrow.dataset")

from hookstats.runlog import ParquetWriter  # noqa: E402
from hookstats.runlog.parquet import log_paths  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))


def _train(mon, m, n):
    for _ in range(n):
        m(torch.randn(4, 3)).square().sum().backward()
        m.zero_grad()
        mon.log("loss", 1.0)
        mon.step()


def _hooks(m) -> int:
    return sum(len(x._forward_hooks) + len(x._forward_pre_hooks) + len(x._backward_hooks) for x in m.modules())


# -- detach() when an exporter's close() raises ------------------------------------------------------------------

class _Sink:
    def __init__(self, fail_close=False):
        self.rows, self.closed, self.fail_close = 0, 0, fail_close

    def write_block(self, block, scalars):
        self.rows += len(block)

    def close(self):
        self.closed += 1
        if self.fail_close:
            raise OSError("disk gone")


def test_detach_removes_every_hook_and_closes_the_others_when_a_close_raises(tmp_path):
    m = _net()
    bad, good = _Sink(fail_close=True), _Sink()
    path = tmp_path / "log.parquet"
    mon = hookstats.Monitor(m, kinds=("forward", "grad"), exporters=[bad, ParquetWriter(path), good],
                            flush_every=2)
    assert _hooks(m) > 0
    _train(mon, m, 5)
    with pytest.raises(ExportError, match=r"_Sink failed in close\(\): OSError: disk gone") as e:
        mon.detach()
    assert isinstance(e.value.__cause__, OSError)
    assert _hooks(m) == 0  # every hook removed
    assert good.closed == 1 and bad.closed == 1  # every other exporter closed
    assert len(os.listdir(path)) == 1  # the Parquet log closed: compacted
    recs = mon.records()  # later reads work, and the records are all there
    assert len(recs) == good.rows == read_log(path).num_rows > 0
    assert mon.summary()
    mon.detach()  # the failure was raised once
    assert good.closed == 1
    m(torch.randn(4, 3)).sum().backward()  # the model runs without the Monitor
    assert len(mon.records()) == len(recs)


def test_detach_raises_a_write_error_and_a_close_error_once_together(tmp_path):
    class FailWrite(_Sink):
        def write_block(self, block, scalars):
            raise ValueError("bad block")

    m = _net()
    good = _Sink()
    mon = hookstats.Monitor(m, kinds=("forward",), exporters=[FailWrite(fail_close=True), good])
    _train(mon, m, 1)
    with pytest.raises(ExportError, match=r"on the export thread: ValueError: bad block \(1 more exporter error"):
        mon.detach()
    assert _hooks(m) == 0 and good.closed == 1
    mon.detach()


# -- resuming into a log ----------------------------------------------------------------------------------------

def _parquet_run(path, n, start_step=0, **kw):
    m = _net()
    wkw = {"stats_dtype": kw.pop("stats_dtype")} if "stats_dtype" in kw else {}
    mon = hookstats.Monitor(m, kinds=("forward", "grad"), flush_every=2, start_step=start_step,
                            exporters=[ParquetWriter(path, **wkw)], **kw)
    _train(mon, m, n)
    mon.detach()
    return mon.records()


def _snapshot(path) -> dict:
    out = {}
    for root in (path, log_paths(path).scalars):
        for n in sorted(os.listdir(root)):
            out[os.path.join(root, n)] = open(os.path.join(root, n), "rb").read()
    out["run"] = open(log_paths(path).run, "rb").read()
    return out


@pytest.mark.parametrize("change,why", [
    (dict(stats_dtype="float32"), "holds float64 statistics and this writer was asked for float32"),
    (dict(histogram="exp"), "its histogram is None, this run's is {'kind': 'exp'}"),
    (dict(histogram=hookstats.Histogram.range(8, -1.0, 1.0)), "its histogram is None"),
    (dict(include="0"), "its modules is"),
    (dict(start_step=0), "starts at step 0"),
])
def test_another_run_into_a_parquet_log_is_refused_before_a_step(tmp_path, change, why):
    path = tmp_path / "log.parquet"
    first = _parquet_run(path, 4)
    before = _snapshot(path)
    m = _net()
    change = dict(change)
    start = change.pop("start_step", 4)
    wkw = {"stats_dtype": change.pop("stats_dtype")} if "stats_dtype" in change else {}
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)").replace("{", r"\{")):
        hookstats.Monitor(m, kinds=("forward", "grad"), start_step=start, exporters=[ParquetWriter(path, **wkw)],
                          **change)
    assert _hooks(m) == 0
    assert _snapshot(path) == before  # nothing written
    assert read_log(path).num_rows == len(first)
    import polars as pl

    assert pl.scan_parquet(path).collect().height == len(first)


def test_the_same_run_resumed_continues_the_log_and_keeps_each_header(tmp_path):
    path = tmp_path / "log.parquet"
    first = _parquet_run(path, 4)
    second = _parquet_run(path, 3, start_step=3)  # resumed from a checkpoint at step 3 (step 3 recorded again)
    t = read_log(path)
    assert t.num_rows == len(first) + len(second)
    assert t.schema.field("l2").type == pa.float64()
    info = json.loads(open(log_paths(path).run).read())
    assert info["start_step"] == 0 and [r["start_step"] for r in info["resumed"]] == [3]
    assert T.run_info(t)["resumed"][0]["start_step"] == 3
    for read in (lambda: pd.read_parquet(path), lambda: ds.dataset(path).to_table()):
        assert len(read()) == t.num_rows


def test_a_float32_log_is_continued_as_float32(tmp_path):
    path = tmp_path / "log.parquet"
    first = _parquet_run(path, 4, stats_dtype="float32")
    second = _parquet_run(path, 2, start_step=4)  # stats_dtype unset: the log's
    t = read_log(path)
    assert t.schema.field("l2").type == pa.float32() and t.num_rows == len(first) + len(second)
    import polars as pl

    assert pl.scan_parquet(path).collect().height == t.num_rows


def test_a_parquet_writer_never_writes_into_a_directory_not_its_own(tmp_path):
    d = tmp_path / "data.parquet"
    d.mkdir()
    pq.write_table(pa.table({"a": [1]}), d / "part-0.parquet")
    with pytest.raises(ValueError, match="not a hookstats log"):
        ParquetWriter(d)
    assert os.listdir(d) == ["part-0.parquet"]


# -- values float32 cannot hold ----------------------------------------------------------------------------------

class _Pass(nn.Module):
    def forward(self, x):
        return x * 1


def _extreme_run(path, stats_dtype=None):
    m = nn.Sequential(_Pass(), _Pass())
    wkw = {"stats_dtype": stats_dtype} if stats_dtype else {}
    mon = hookstats.Monitor(m, kinds=("forward",), exporters=[ParquetWriter(path, **wkw)])
    big = torch.full((100,), 9.49e37)  # float32 elements; l2 = 9.49e38, sum = 9.49e39: finite, past float32
    tiny = torch.tensor([1e-30, 3e-30])  # var = 1e-60: nonzero, below float32's smallest subnormal
    huge64 = torch.tensor([1e300, -2e300], dtype=torch.float64)  # every statistic past float32
    for x in (big, tiny, huge64):
        m(x)
        mon.step()
    return mon


def test_finite_statistics_read_back_finite_and_exact(tmp_path):
    path = tmp_path / "log.parquet"
    mon = _extreme_run(path)
    mon.detach()
    want = mon.records()
    tiny = next(r for r in want if r["step"] == 1)
    assert want[0]["stats"]["l2"] > 3.5e38 and 0 < tiny["stats"]["var"] < 1e-45
    t = read_log(path)
    got = T.table_records(t)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for k, v in b["stats"].items():
            assert a["stats"][k] == v or (math.isnan(v) and math.isnan(a["stats"][k])), (k, a["stats"][k], v)
    for name, col in (("pandas", pd.read_parquet(path)["l2"].to_numpy()),
                      ("pyarrow.dataset", ds.dataset(path).to_table().column("l2").to_numpy())):
        assert np.isfinite(col).all() and sorted(col) == sorted(r["stats"]["l2"] for r in want), name
    from hookstats.export.analysis import _matrix, nonfinite_events

    _, _, values, _, bad = _matrix(t, "forward")
    assert not bad.any() and np.isfinite(values).all()  # the report flags no layer
    assert nonfinite_events(t) == []


def test_a_float32_log_writes_what_it_cannot_hold_as_null_and_says_so(tmp_path):
    path = tmp_path / "log.parquet"
    mon = _extreme_run(path, stats_dtype="float32")
    with pytest.raises(ExportError, match=r"sum = 9\.4\d*e\+39 \(step 0, module '0', kind 'forward'\) does not fit"):
        mon.detach()
    want = mon.records()
    t = read_log(path)
    assert t.num_rows == len(want)
    for a, b in zip(T.table_records(t), want):
        for k, v in b["stats"].items():
            x = a["stats"][k]
            if x is None:  # refused: v is finite and float32 cannot hold it
                assert math.isfinite(v) and (abs(v) > 3.4028235e38 or 0 < abs(v) < 1.4e-45), (k, v)
            else:  # never inf for a finite value, never 0 for a nonzero one
                assert (math.isinf(x) == math.isinf(v)) and ((x == 0) == (v == 0)) and \
                    math.isclose(x, v, rel_tol=1e-7), (k, x, v)
    col = pd.read_parquet(path)["l2"]
    assert col.isna().sum() >= 3 and not np.isinf(col.dropna().to_numpy()).any()


# -- range histograms --------------------------------------------------------------------------------------------

def test_a_range_histogram_has_one_column_of_bins_plus_3(tmp_path):
    path = tmp_path / "log.parquet"
    m = _net()
    mon = hookstats.Monitor(m, kinds=("forward",), histogram=hookstats.Histogram.range(8, -1.0, 1.0),
                            flush_every=1, exporters=[ParquetWriter(path)])
    _train(mon, m, 3)
    mon.drain()
    for f in os.listdir(path):
        assert T.hist_columns(pq.read_schema(path / f).names) == ["histogram_11"]
    mon.detach()
    t = ds.dataset(path).to_table()
    assert T.hist_columns(t.column_names) == ["histogram_11"]
    assert t.column("histogram_11").null_count == 0
    want = [r["histogram"] for r in mon.records()]
    assert T.table_records(read_log(path))[0]["histogram"] == want[0] and len(want[0]) == 11


# -- compaction in bounded memory --------------------------------------------------------------------------------

_COMPACT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import pyarrow as pa, pyarrow.parquet as pq
    from hookstats.runlog import ParquetWriter
    from hookstats.runlog import schema as T
    from hookstats.runlog.parquet import records_schema

    path, flushes, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    info = {"histogram": None}
    schema = records_schema(info, "float64")
    rng = np.random.default_rng(0)
    os.makedirs(path)
    for i in range(1, flushes + 1):  # what a Monitor's flushes leave: one file per flush
        cols = {}
        for f in schema:
            if f.name in ("module", "kind", "dtype"):
                cols[f.name] = pa.array(["m%d" % (j % 150) for j in range(rows)]).dictionary_encode()
            elif f.name in ("seq", "step"):
                cols[f.name] = pa.array(np.arange((i - 1) * rows, i * rows), f.type)
            else:
                cols[f.name] = pa.array(rng.standard_normal(rows).astype(f.type.to_pandas_dtype()), f.type)
        pq.write_table(pa.table(cols).cast(schema), os.path.join(path, "records-%06d.parquet" % i))
    one = pq.read_table(os.path.join(path, "records-000001.parquet")).nbytes
    pool = pa.default_memory_pool()
    w = ParquetWriter(path)
    w.begin({**info, "start_step": 5})
    w._first, w._n = 1, flushes  # as if this writer had written them
    base = pool.max_memory()
    w.close()
    print(one, one * flushes, pool.max_memory() - base, len(os.listdir(path)))
""")


def test_compaction_streams_in_bounded_memory(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _COMPACT, str(tmp_path / "log.parquet"), "60", "20000"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    one, total, peak, files = (int(x) for x in out.stdout.split())
    assert files == 1
    assert total > 100e6
    assert peak < 4 * one + 16e6, (one, total, peak)  # a few flushes' worth, not the run's
    t = read_log(tmp_path / "log.parquet")
    assert t.num_rows == 60 * 20000 and (np.diff(t.column("seq").to_numpy()) == 1).all()
