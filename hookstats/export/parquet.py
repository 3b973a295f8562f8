"""Parquet run log (pyarrow): a directory `log.parquet/` holding one Parquet file per flush, made whole on close.

Note [a Parquet log that survives a kill]
A Parquet file is readable only once its footer is written, at close: a writer that appends row groups to one open
file loses everything when the process is killed. So each flush is its own small file, written under a temporary
name, fsynced, and renamed into place (a rename is atomic: a reader sees a whole file or none):
  log.parquet/run.json                    the run header (Monitor.run_info()), written at begin()
  log.parquet/records-000007.parquet      flush 7's records (table schema: hookstats.monitor.table)
  log.parquet/scalars-000007.parquet      flush 7's logged scalars (seq, step, tag, value), when it had any
At close() the writer compacts the flushes it wrote into one file, one row group per flush (pyarrow.parquet.
ParquetWriter): records-000001-000040.parquet (and scalars-...), then removes the per-flush files. A kill during
compaction leaves the per-flush files; a kill between the rename and their removal leaves both, and readers skip
every per-flush file that a compacted range covers, so nothing is read twice. A second writer on the same directory
(a resumed run) numbers its flushes on after the last one there.

The site columns (module, kind, dtype) are dictionary-encoded; the statistics are float32 or float64
(`stats_dtype`; the counts stay int64); zstd compression. `read_log(path)` reads a directory like this, or a JSONL
log, into a pyarrow.Table.
"""
from __future__ import annotations

import json
import os
import re
import time
from typing import Optional, Sequence

from ..monitor import table as _t

_PART = re.compile(r"^(records|scalars)-(\d{6,})(?:-(\d{6,}))?\.parquet$")
RUN_FILE = "run.json"


def _pq():
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("hookstats.ParquetWriter and reading a Parquet log need pyarrow: pip install pyarrow") from e
    return pq


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


def _parts(path: str) -> dict:
    """{kind: [(first, last, file name)]} of the log's files, per-flush files covered by a compacted one left out,
    in flush order."""
    out: dict = {"records": [], "scalars": []}
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return out
    for name in names:
        m = _PART.match(name)
        if m:
            a = int(m.group(2))
            b = int(m.group(3)) if m.group(3) else a
            out[m.group(1)].append((a, b, name))
    for kind, items in out.items():
        compacted = [(a, b) for a, b, n in items if _PART.match(n).group(3)]
        out[kind] = sorted(it for it in items if _PART.match(it[2]).group(3) or
                           not any(a <= it[0] <= b for a, b in compacted))
    return out


def _last_flush(path: str) -> int:
    last = 0
    for items in _parts(path).values():
        for _, b, _ in items:
            last = max(last, b)
    return last


class ParquetWriter:
    """Writes a Monitor's records to a Parquet log directory (Note [a Parquet log that survives a kill]).

    path: the directory (conventionally RUN_DIR/log.parquet); stats_dtype: "float32" (half the bytes; 7 significant
    digits) or "float64" (exact) for the statistics; fsync: make each flush durable (not only in the OS cache);
    compact: merge this writer's flushes into one file (a row group each) at close(); compression: a Parquet codec.
    """

    def __init__(self, path: str | os.PathLike, stats_dtype: str = "float32", fsync: bool = True,
                 compact: bool = True, compression: str = "zstd"):
        _pq()
        if stats_dtype not in ("float32", "float64"):
            raise ValueError(f"hookstats.ParquetWriter: stats_dtype must be 'float32' or 'float64', got "
                             f"{stats_dtype!r}")
        self.path = os.fspath(path)
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"hookstats.ParquetWriter: {self.path!r} exists and is not a directory (a Parquet log "
                             "is a directory of files, one per flush)")
        os.makedirs(self.path, exist_ok=True)
        self.stats_dtype = stats_dtype
        self.fsync = fsync
        self.compact = compact
        self.compression = compression
        self.info: Optional[dict] = None
        self._first = _last_flush(self.path) + 1
        self._n = self._first - 1  # the last flush number written
        self._closed = False

    def _commit(self, tmp: str, final: str) -> None:
        """Moves a written temporary file into place: fsync'd first (and the directory after) when fsync is on."""
        if self.fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, final)
        if self.fsync:
            _fsync_dir(self.path)

    def _write_file(self, name: str, table) -> None:
        pq = _pq()
        final = os.path.join(self.path, name)
        tmp = os.path.join(self.path, f".tmp-{os.getpid()}-{name}")
        pq.write_table(table, tmp, compression=self.compression, use_dictionary=list(_t.SITE_COLUMNS) + ["tag"],
                       write_statistics=["step", "seq"])
        self._commit(tmp, final)

    def begin(self, info: dict) -> None:
        """Writes run.json (a resumed run keeps the first one)."""
        self.info = info
        p = os.path.join(self.path, RUN_FILE)
        if not os.path.exists(p):
            tmp = p + f".tmp-{os.getpid()}"
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
            self._write_file(f"scalars-{n:06d}.parquet", _t.scalars_table(scalars))
        if rec is not None:
            self._write_file(f"records-{n:06d}.parquet", rec)
        self._n = n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.compact and self._n > self._first:
            for kind in ("records", "scalars"):
                self._compact(kind)

    def _compact(self, kind: str) -> None:
        import pyarrow as pa

        pq = _pq()
        mine = [(a, b, n) for a, b, n in _parts(self.path)[kind] if a == b and self._first <= a <= self._n and
                not _PART.match(n).group(3)]
        if len(mine) < 2:
            return
        tables = [pq.read_table(os.path.join(self.path, n)) for _, _, n in mine]
        schema = pa.unify_schemas([t.schema for t in tables], promote_options="default")
        name = f"{kind}-{mine[0][0]:06d}-{mine[-1][0]:06d}.parquet"
        final = os.path.join(self.path, name)
        tmp = os.path.join(self.path, f".tmp-{os.getpid()}-{name}")
        with pq.ParquetWriter(tmp, schema, compression=self.compression,
                              use_dictionary=list(_t.SITE_COLUMNS) + ["tag"], write_statistics=["step", "seq"]) as w:
            for t in tables:  # one row group per flush
                for f in schema:
                    if f.name not in t.column_names:
                        t = t.append_column(f, pa.nulls(t.num_rows, f.type))
                w.write_table(t.select(schema.names).cast(schema), row_group_size=max(1, t.num_rows))
        self._commit(tmp, final)
        for _, _, n in mine:
            os.remove(os.path.join(self.path, n))

    def __enter__(self) -> "ParquetWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_parquet_log(path: str | os.PathLike, columns: Optional[Sequence[str]] = None):
    """(info, records table, scalars table) of a Parquet log directory: every completed flush, in flush order."""
    import pyarrow as pa

    pq = _pq()
    path = os.fspath(path)
    info: dict = {}
    rp = os.path.join(path, RUN_FILE)
    if os.path.isfile(rp):
        with open(rp, encoding="utf-8") as f:
            info = json.load(f)
    parts = _parts(path)
    tabs = {}
    for kind in ("records", "scalars"):
        ts = [pq.read_table(os.path.join(path, n), columns=list(columns) if columns and kind == "records" else None)
              for _, _, n in parts[kind]]
        if kind == "records":
            tabs[kind] = _t.concat(ts) if ts else _t.empty_table()
        else:
            tabs[kind] = pa.concat_tables(ts, promote_options="default") if ts else None
    return info, _t.with_run_info(tabs["records"], info), tabs["scalars"]


__all__ = ["ParquetWriter", "read_parquet_log", "RUN_FILE"]
