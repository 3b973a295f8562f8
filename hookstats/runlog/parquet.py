"""Parquet run log (pyarrow): a directory of records that pandas, pyarrow, DuckDB and Polars read as it is, with the
scalars and the run header beside it; one file per flush, made whole on close.

Note [a Parquet log that survives a kill]
A Parquet file is readable only once its footer is written, at close: a writer that appends row groups to one open
file loses everything when the process is killed. So each flush is its own small file, written under a temporary
name, fsynced, and renamed into place (a rename is atomic: a reader sees a whole file or none).
ParquetWriter("RUN_DIR/log.parquet") writes:
  RUN_DIR/log.parquet/                      the records: Parquet files and nothing else (table schema:
      records-000007.parquet                hookstats.runlog.schema), one per flush
  RUN_DIR/log.scalars.parquet/              the logged scalars (seq, step, tag, value): a dataset of its own, so no
      scalars-000007.parquet                reader merges the two schemas
  RUN_DIR/log.run.json                      the run header (Monitor.run_info()), written at begin()
  RUN_DIR/.log.parquet.tmp-PID-...          a file being written (hidden, outside both datasets)
Every records file of one writer has the same schema: every histogram column the run's histogram spec can give
(one per float dtype for "exp") and the location columns when the run has them, null where a flush has none; so
a reader that takes the first file's schema (pyarrow.dataset, DuckDB, Polars) reads every file whole.
At close() the writer compacts the flushes it wrote into one file per dataset, one row group per flush (pyarrow.
parquet.ParquetWriter): records-000001-000040.parquet, then removes the per-flush files. A kill during compaction
leaves the per-flush files; a kill between the rename and their removal leaves both: read_log skips every per-flush
file that a compacted range covers, and the next writer on the directory removes them (another reader sees those
rows twice until then). A second writer on the same directory (a resumed run) numbers its flushes on after the last
one there.

Logs written before this layout (run.json and scalars-N.parquet inside log.parquet/) are read as they are; a writer
that continues one moves those two out first.

The site columns (module, kind, dtype) are dictionary-encoded; the statistics are float32 or float64
(`stats_dtype`; the counts stay int64); zstd compression. `read_log(path)` reads a log like this, or a JSONL log,
into a pyarrow.Table.
"""
from __future__ import annotations

import json
import os
import re
import time
from typing import NamedTuple, Optional, Sequence

import torch

from .._ops import exp_layout
from . import schema as _t

_PART = re.compile(r"^(records|scalars)-(\d{6,})(?:-(\d{6,}))?\.parquet$")
OLD_RUN_FILE = "run.json"  # the run header inside the records directory (logs written before the sidecar files)


def _pq():
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("hookstats.ParquetWriter and reading a Parquet log need pyarrow: pip install pyarrow") from e
    return pq


class LogPaths(NamedTuple):
    """Where the parts of a Parquet log live (Note [a Parquet log that survives a kill])."""

    records: str  # the records dataset directory: the path given
    scalars: str  # the scalars dataset directory
    run: str  # the run header (JSON)
    tmp: str  # the prefix of temporary files (in the parent directory)


def log_paths(path) -> LogPaths:
    """records path "RUN_DIR/log.parquet" -> RUN_DIR/log.scalars.parquet, RUN_DIR/log.run.json, RUN_DIR/.log.parquet.tmp-"""
    path = os.path.normpath(os.fspath(path))
    parent, name = os.path.split(path)
    stem = name[:-len(".parquet")] if name.endswith(".parquet") and len(name) > len(".parquet") else name
    return LogPaths(path, os.path.join(parent, f"{stem}.scalars.parquet"), os.path.join(parent, f"{stem}.run.json"),
                    os.path.join(parent, f".{name}.tmp-"))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _files(directory: str, kind: str) -> list:
    """[(first, last, file path)] of one kind's files in a directory, per-flush files covered by a compacted one left
    out, in flush order."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    items = []  # (first, last, path, compacted)
    for name in names:
        m = _PART.match(name)
        if m and m.group(1) == kind:
            a = int(m.group(2))
            items.append((a, int(m.group(3)) if m.group(3) else a, os.path.join(directory, name), bool(m.group(3))))
    ranges = [(a, b) for a, b, _, c in items if c]
    return sorted((a, b, p) for a, b, p, c in items if c or not any(x <= a <= y for x, y in ranges))


def _covered(directory: str, kind: str) -> list:
    """The per-flush files a compacted file of the same directory covers (a kill between the compacted file's rename
    and their removal)."""
    keep = {p for _, _, p in _files(directory, kind)}
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [os.path.join(directory, n) for n in names if (m := _PART.match(n)) and m.group(1) == kind and
            not m.group(3) and os.path.join(directory, n) not in keep]


def parts(path) -> dict:
    """{"records": [...], "scalars": [...]}: (first flush, last flush, file path) of every file a reader reads, in
    flush order; the scalars of an old-layout log (inside the records directory) included."""
    lp = log_paths(path)
    sc = _files(lp.scalars, "scalars") + _files(lp.records, "scalars")
    return {"records": _files(lp.records, "records"), "scalars": sorted(sc)}


def is_parquet_log(path) -> bool:
    """Whether path is a Parquet log's records directory (this layout or the old one)."""
    lp = log_paths(path)
    if not os.path.isdir(lp.records):
        return False
    return os.path.isfile(lp.run) or os.path.isfile(os.path.join(lp.records, OLD_RUN_FILE)) or \
        any(parts(path).values())


def _last_flush(path: str) -> int:
    return max((b for items in parts(path).values() for _, b, _ in items), default=0)


def _exp_lengths() -> list:
    return sorted({exp_layout(d).length for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)})


def records_schema(info: dict, stats_dtype: str):
    """The schema of every records file of a run: the table columns, the location and merge columns when the run
    has them, and every histogram column its histogram spec can give."""
    pa = _t._pa()
    fields = list(_t.empty_table(stats_dtype).schema)
    if info.get("locations"):
        fields += [pa.field(c, pa.list_(pa.int64())) for c in _t.LOCATION_COLUMNS]
    if info.get("merged"):  # Note [merging records across ranks]
        fields += [pa.field("ranks", pa.int32()), pa.field("nonfinite_ranks", pa.list_(pa.int32()))]
        if info.get("locations"):
            fields.append(pa.field("location_rank", pa.int32()))
    h = info.get("histogram")
    lengths = [] if not h else (_exp_lengths() if h["kind"] == "exp" else [int(h["bins"]) + 2])
    fields += [pa.field(_t.hist_column(n), pa.list_(pa.int64())) for n in lengths]
    return pa.schema(fields)


def _conform(table, schema):
    """table with schema's columns in schema's order (missing ones as nulls) and its types; columns the schema lacks
    are kept at the end (nothing is dropped)."""
    import pyarrow as pa

    cols, fields = [], []
    for f in schema:
        if f.name in table.column_names:
            c = table.column(f.name)
            cols.append(c if c.type == f.type else c.cast(f.type))
        else:
            cols.append(pa.nulls(table.num_rows, f.type))
        fields.append(f)
    for name in table.column_names:
        if schema.get_field_index(name) < 0:
            cols.append(table.column(name))
            fields.append(table.schema.field(name))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


class ParquetWriter:
    """Writes a Monitor's records to a Parquet log (Note [a Parquet log that survives a kill]).

    path: the records directory (conventionally RUN_DIR/log.parquet; the scalars go to RUN_DIR/log.scalars.parquet
    and the run header to RUN_DIR/log.run.json); stats_dtype: "float32" (half the bytes; 7 significant digits) or
    "float64" (exact) for the statistics; fsync: make each flush durable (not only in the OS cache); compact: merge
    this writer's flushes into one file per dataset (a row group each) at close(); compression: a Parquet codec.
    """

    def __init__(self, path: str | os.PathLike, stats_dtype: str = "float32", fsync: bool = True,
                 compact: bool = True, compression: str = "zstd"):
        _pq()
        if stats_dtype not in ("float32", "float64"):
            raise ValueError(f"hookstats.ParquetWriter: stats_dtype must be 'float32' or 'float64', got "
                             f"{stats_dtype!r}")
        self.paths = log_paths(path)
        self.path = self.paths.records
        for p in (self.paths.records, self.paths.scalars):
            if os.path.exists(p) and not os.path.isdir(p):
                raise ValueError(f"hookstats.ParquetWriter: {p!r} exists and is not a directory (a Parquet log "
                                 "is a directory of files, one per flush)")
        os.makedirs(self.path, exist_ok=True)
        self.stats_dtype = stats_dtype
        self.fsync = fsync
        self.compact = compact
        self.compression = compression
        self.info: Optional[dict] = None
        self._schema = None
        self._migrate()
        self._first = _last_flush(self.path) + 1
        self._n = self._first - 1  # the last flush number written
        self._closed = False

    def _migrate(self) -> None:
        """Continuing a log: the old layout's run.json and scalars files moved out of the records directory, and the
        per-flush files a compacted file covers (left by a kill during compaction) removed."""
        lp = self.paths
        old_run = os.path.join(lp.records, OLD_RUN_FILE)
        if os.path.isfile(old_run):
            if os.path.exists(lp.run):
                os.remove(old_run)
            else:
                os.replace(old_run, lp.run)
        old_scalars = [n for n in os.listdir(lp.records) if (m := _PART.match(n)) and m.group(1) == "scalars"]
        if old_scalars:
            os.makedirs(lp.scalars, exist_ok=True)
            for n in old_scalars:
                os.replace(os.path.join(lp.records, n), os.path.join(lp.scalars, n))
        for d, kind in ((lp.records, "records"), (lp.scalars, "scalars")):
            for p in _covered(d, kind):
                os.remove(p)

    def _commit(self, tmp: str, final: str) -> None:
        """Moves a written temporary file into place: fsync'd first (and the directory after) when fsync is on."""
        if self.fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, final)
        if self.fsync:
            _fsync_dir(os.path.dirname(final))

    def _tmp(self, name: str) -> str:
        return f"{self.paths.tmp}{os.getpid()}-{name}.tmp"

    def _dir(self, kind: str) -> str:
        d = self.paths.records if kind == "records" else self.paths.scalars
        os.makedirs(d, exist_ok=True)
        return d

    def _write_file(self, kind: str, name: str, table) -> None:
        pq = _pq()
        final = os.path.join(self._dir(kind), name)
        tmp = self._tmp(name)
        pq.write_table(table, tmp, compression=self.compression, use_dictionary=list(_t.SITE_COLUMNS) + ["tag"],
                       write_statistics=["step", "seq"])
        self._commit(tmp, final)

    def begin(self, info: dict) -> None:
        """Writes the run header (a resumed run keeps the first one) and fixes the records files' schema."""
        self.info = info
        self._schema = records_schema(info, self.stats_dtype)
        p = self.paths.run
        if not os.path.exists(p):
            tmp = self._tmp("run.json")
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({**info, "time": time.time(), "stats_dtype": self.stats_dtype}, f, default=str)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, p)

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError(f"hookstats.ParquetWriter({self.path!r}) is closed")

    def write_block(self, block, scalars: Sequence[dict] = ()) -> None:
        """One flush (a Block of the Monitor's columns) as records-N.parquet (and scalars-N.parquet)."""
        self._check()
        rec = _t.block_table(block, self.stats_dtype) if len(block) else None
        self._write(rec, scalars)

    def write(self, records: Sequence[dict], scalars: Sequence[dict] = ()) -> None:
        """The same from record dicts (records() or a JSONL log read back)."""
        self._check()
        rec = _t.records_table(records, self.stats_dtype) if len(records) else None
        self._write(rec, scalars)

    def _write(self, rec, scalars) -> None:
        if rec is None and not scalars:
            return
        n = self._n + 1
        if scalars:
            self._write_file("scalars", f"scalars-{n:06d}.parquet", _t.scalars_table(scalars))
        if rec is not None:
            if self._schema is not None:
                rec = _conform(rec, self._schema)
            self._write_file("records", f"records-{n:06d}.parquet", rec)
        self._n = n

    def close(self) -> None:
        """With compact=True merges this writer's flush files into one file per dataset (readers see either);
        a second close does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.compact and self._n > self._first:
            for kind in ("records", "scalars"):
                self._compact(kind)

    def _compact(self, kind: str) -> None:
        import pyarrow as pa

        pq = _pq()
        d = self._dir(kind)
        mine = [(a, b, p) for a, b, p in _files(d, kind) if a == b and self._first <= a <= self._n and
                not _PART.match(os.path.basename(p)).group(3)]
        if len(mine) < 2:
            return
        tables = [pq.read_table(p) for _, _, p in mine]
        schema = pa.unify_schemas([t.schema for t in tables], promote_options="default")
        name = f"{kind}-{mine[0][0]:06d}-{mine[-1][0]:06d}.parquet"
        tmp = self._tmp(name)
        with pq.ParquetWriter(tmp, schema, compression=self.compression,
                              use_dictionary=list(_t.SITE_COLUMNS) + ["tag"], write_statistics=["step", "seq"]) as w:
            for t in tables:  # one row group per flush
                w.write_table(_conform(t, schema), row_group_size=max(1, t.num_rows))
        self._commit(tmp, os.path.join(d, name))
        for _, _, p in mine:
            os.remove(p)

    def __enter__(self) -> "ParquetWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_run_info(path) -> dict:
    """The run header of a Parquet log ({} when it has none): RUN_DIR/log.run.json, or run.json inside the records
    directory (the old layout)."""
    lp = log_paths(path)
    for p in (lp.run, os.path.join(lp.records, OLD_RUN_FILE)):
        if os.path.isfile(p):
            with open(p, encoding="utf-8") as f:
                return json.load(f)
    return {}


def read_parquet_log(path: str | os.PathLike, columns: Optional[Sequence[str]] = None):
    """(info, records table, scalars table) of a Parquet log: every completed flush, in flush order."""
    import pyarrow as pa

    pq = _pq()
    info = read_run_info(path)
    ps = parts(path)
    rec = [pq.read_table(p, columns=list(columns) if columns else None) for _, _, p in ps["records"]]
    sc = [pq.read_table(p) for _, _, p in ps["scalars"]]
    records = _t.concat(rec) if rec else _t.empty_table()
    scalars = pa.concat_tables(sc, promote_options="default") if sc else None
    return info, _t.with_run_info(records, info), scalars


__all__ = ["ParquetWriter", "read_parquet_log", "read_run_info", "log_paths", "LogPaths", "parts", "is_parquet_log",
           "records_schema"]
