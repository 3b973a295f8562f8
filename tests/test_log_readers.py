"""The Parquet run log opens as it is in pandas, pyarrow, DuckDB and Polars, live (mid-run) and closed; read_log keeps
reading logs of the layout before the sidecar files (tests/data/old_parquet_log: written by that version's
ParquetWriter, with a JSONL log of the same run beside it)."""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import hookstats
from hookstats.runlog import read_log, read_run
from hookstats.runlog import schema as T

pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")
ds = pytest.importorskip("pyarrow.dataset")

from hookstats.runlog.parquet import ParquetWriter, log_paths  # noqa: E402

OLD = Path(__file__).resolve().parent / "data" / "old_parquet_log"


def _net():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    m[2].double()  # a float64 layer: its exponent histograms have another length than float32's
    return m


def _steps(mon, m, n, nan_step=None):
    for s in range(n):
        x = torch.randn(4, 3)
        if s == nan_step:
            x[1, 2] = float("inf")
        m.zero_grad()
        loss = m[2](m[1](m[0](x)).double()).square().sum()
        loss.backward()
        mon.log("loss", loss.detach())
        mon.step()


def _readers():
    """name -> (records dir -> number of rows, the l2 column as float64)"""
    out = {
        "pandas": lambda p: pd.read_parquet(p)["l2"].to_numpy(np.float64),
        "pyarrow.dataset": lambda p: ds.dataset(p).to_table(columns=["l2"]).column("l2").to_numpy().astype(np.float64),
    }
    try:
        import duckdb

        out["duckdb glob"] = lambda p: np.array([r[0] for r in duckdb.sql(f"select l2 from '{p}/*.parquet'").fetchall()],
                                                dtype=np.float64)
        out["duckdb dir"] = lambda p: np.array([r[0] for r in duckdb.sql(f"select l2 from read_parquet('{p}')")
                                                .fetchall()], dtype=np.float64)
    except ImportError:
        pass
    try:
        import polars as pl

        out["polars dir"] = lambda p: pl.scan_parquet(p).select("l2").collect()["l2"].to_numpy().astype(np.float64)
        out["polars glob"] = lambda p: pl.scan_parquet(f"{p}/*.parquet").select("l2").collect()["l2"].to_numpy() \
            .astype(np.float64)
    except ImportError:
        pass
    return out


def _check_readers(path, want_l2, f32=False):
    want = np.asarray(want_l2, dtype=np.float64)  # float64 statistics on disk (the default): exactly the records'
    want = np.sort(want.astype(np.float32).astype(np.float64) if f32 else want)
    for name, read in _readers().items():
        got = np.sort(read(str(path)))
        assert got.shape == want.shape, f"{name}: {got.shape} rows, want {want.shape}"
        np.testing.assert_array_equal(got, want, err_msg=name)


def _check_scalars(path, want):
    sp = log_paths(path).scalars
    df = pd.read_parquet(sp).sort_values("seq")
    assert df["step"].tolist() == [s["step"] for s in want]
    assert set(df["tag"].astype(str)) == {"loss"}
    np.testing.assert_allclose(df["value"].to_numpy(), [s["value"] for s in want], rtol=0, atol=0)
    try:
        import polars as pl

        assert pl.scan_parquet(sp).collect().height == len(want)
    except ImportError:
        pass


def test_every_reader_opens_a_live_and_a_closed_log(tmp_path):
    m = _net()
    path = tmp_path / "log.parquet"
    mon = hookstats.Monitor(m, kinds=("forward", "backward_pre", "grad"), histogram="exp", histogram_every=3,
                            flush_every=1, exporters=[ParquetWriter(path)])
    _steps(mon, m, 4, nan_step=2)
    mon.drain()  # live: one file per flush, nothing compacted
    assert len(os.listdir(path)) == 4 and all(n.endswith(".parquet") for n in os.listdir(path))
    # every file has the same schema (all histogram columns of the spec, null where a flush has none), so readers
    # that take the first file's schema read every file whole
    import pyarrow.parquet as pq

    schemas = {pq.read_schema(path / n).remove_metadata() for n in os.listdir(path)}
    assert len(schemas) == 1
    live = mon.records()
    _check_readers(path, [r["stats"]["l2"] for r in live])
    _check_scalars(path, mon.scalars())
    # the histogram of a row with one reads back the same in pandas as in read_log
    df = pd.read_parquet(path).sort_values("seq")
    col = T.hist_column(hookstats.exp_layout(torch.float32).length)
    row = next(i for i, r in enumerate(live) if r["histogram"] is not None and r["dtype"] == "float32")
    assert df[col].iloc[row].tolist() == live[row]["histogram"]
    _steps(mon, m, 2)
    mon.detach()  # closed: compacted into one file
    assert os.listdir(path) == ["records-000001-000006.parquet"]
    every = mon.records()
    _check_readers(path, [r["stats"]["l2"] for r in every])
    _check_scalars(path, mon.scalars())
    t = read_log(tmp_path)
    assert t.num_rows == len(every) and T.run_info(t)["kinds"] == ["forward", "backward_pre", "grad"]
    inf_rows = pd.read_parquet(path).query("inf_count > 0")
    assert set(inf_rows["step"]) == {2}


@pytest.mark.parametrize("which", ["closed", "live"])
def test_read_log_reads_the_old_layout(tmp_path, which):
    src = OLD / which
    assert (src / "log.parquet" / "run.json").is_file()  # the old layout: the header inside the dataset
    want = read_run(src / "log.jsonl")
    got = read_run(src / "log.parquet")
    assert got.format == "parquet" and got.info["modules"] == want.info["modules"]
    a, b = T.table_records(got.records), T.table_records(want.records)
    assert len(a) == len(b) == 40
    for x, y in zip(a, b):
        assert (x["step"], x["module"], x["kind"], x["histogram"]) == (y["step"], y["module"], y["kind"],
                                                                      y["histogram"])
        for k, v in y["stats"].items():
            assert math.isclose(x["stats"][k], v, rel_tol=1e-6) or (math.isnan(v) and math.isnan(x["stats"][k]))
    assert [(s["step"], repr(s["value"])) for s in got.scalars] == [(s["step"], repr(s["value"])) for s in want.scalars]
    assert read_log(src).num_rows == 40  # the run directory: log.parquet first

    # a writer continuing an old log moves its header and scalars out; then every reader opens it
    run = tmp_path / which
    shutil.copytree(src, run)
    path = run / "log.parquet"
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    mon = hookstats.Monitor(m, kinds=("forward", "grad"), histogram="exp", flush_every=2, start_step=5,
                            exporters=[ParquetWriter(path)])
    for _ in range(2):
        m(torch.randn(2, 3)).sum().backward()
        mon.log("loss", 1.0)
        mon.step()
    mon.detach()
    assert not (path / "run.json").exists() and (run / "log.run.json").is_file()
    assert all(n.startswith("records-") for n in os.listdir(path))
    r = read_run(path)
    assert r.records.num_rows == 40 + len(mon.records())
    assert r.records.column("step").to_pylist()[-1] == 6 and r.info["modules"] == want.info["modules"]
    assert [s["step"] for s in r.scalars] == [s["step"] for s in want.scalars] + [5, 6]
    assert len(pd.read_parquet(path)) == r.records.num_rows
    assert len(pd.read_parquet(log_paths(path).scalars)) == len(r.scalars)


def test_a_kill_during_compaction_is_repaired_by_the_next_writer(tmp_path):
    path = tmp_path / "log.parquet"
    m = _net()
    mon = hookstats.Monitor(m, kinds=("forward",), flush_every=1, exporters=[ParquetWriter(path, compact=False)])
    _steps(mon, m, 3)
    mon.detach()
    n = len(mon.records())
    # as if killed between the compacted file's rename and the removal of the parts: both are there
    import pyarrow.parquet as pq

    t = pa.concat_tables([pq.read_table(path / f"records-00000{i}.parquet") for i in (1, 2, 3)])
    pq.write_table(t, path / "records-000001-000003.parquet")
    assert read_log(path).num_rows == n  # read_log skips the covered parts
    assert len(pd.read_parquet(path)) == 2 * n  # another reader sees them twice ...
    ParquetWriter(path).close()  # ... until the next writer opens the log
    assert sorted(os.listdir(path)) == ["records-000001-000003.parquet"]
    assert len(pd.read_parquet(path)) == n == read_log(path).num_rows


def test_log_paths():
    lp = log_paths("runs/x/log.parquet/")
    assert lp == (os.path.join("runs", "x", "log.parquet"), os.path.join("runs", "x", "log.scalars.parquet"),
                  os.path.join("runs", "x", "log.run.json"), os.path.join("runs", "x", ".log.parquet.tmp-"))
    assert log_paths("mylog").scalars == "mylog.scalars.parquet"
