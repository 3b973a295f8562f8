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
At close() the writer compacts the flushes it wrote into one file per dataset, one row group per flush, streamed a
row group at a time (memory bounded by one flush, not the run): records-000001-000040.parquet replaces them in one
step that a kill cannot leave half done (Note [compaction a kill cannot break] in durable.py). A writer opening a log
finishes or removes what a killed one left (durable.repair), and continues it only when it is the same run (Note
[one run per log] in resume.py): it numbers its flushes on after the last one there.

Logs written before this layout (run.json and scalars-N.parquet inside log.parquet/) are read as they are; a writer
that continues one moves those two out first.

The site columns (module, kind, dtype) are dictionary-encoded; the statistics are float64, or float32 when asked
(`stats_dtype`; Note [statistics that float32 cannot hold] in schema.py; the counts stay int64); zstd compression. `read_log(path)` reads a log like this, or a JSONL log,
into a pyarrow.Table.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from typing import NamedTuple, Optional, Sequence

from . import durable as _durable
from . import schema as _t
from .schema import records_schema  # noqa: F401  (this module's name for it too)
from .resume import check_resume, check_stats_dtype

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


def _files(directory: Optional[str], kind: str) -> list:
    """[(first, last, file path)] of one kind's files in a directory, in flush order; per-flush files that a
    compacted one covers (left by a kill in the compaction of hookstats before 0.x's swap) left out."""
    if directory is None:
        return []
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
    """The per-flush files a compacted file of the same directory covers (left by the compaction before the swap)."""
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
    rec = _durable.resolve(lp.records)  # the records directory, or where a kill in a swap left it
    sc = _files(_durable.resolve(lp.scalars), "scalars") + _files(rec, "scalars")
    return {"records": _files(rec, "records"), "scalars": sorted(sc)}


def is_parquet_log(path) -> bool:
    """Whether path is a Parquet log's records directory (this layout or the old one)."""
    lp = log_paths(path)
    if _durable.resolve(lp.records) is None:
        return False
    return os.path.isfile(lp.run) or os.path.isfile(os.path.join(lp.records, OLD_RUN_FILE)) or \
        any(parts(path).values())


def _last_flush(path: str) -> int:
    return max((b for items in parts(path).values() for _, b, _ in items), default=0)


class ParquetWriter:
    """Writes a Monitor's records to a Parquet log (Note [a Parquet log that survives a kill]).

    path: the records directory (conventionally RUN_DIR/log.parquet; the scalars go to RUN_DIR/log.scalars.parquet
    and the run header to RUN_DIR/log.run.json); stats_dtype: "float64" (exact; the default for a new log) or
    "float32" (half the bytes, 7 significant digits; a value outside float32's range is written as null and
    reported: Note [statistics that float32 cannot hold] in schema.py); unset, a writer continuing a log takes the
    log's. fsync: make each flush durable (not only in the OS cache); compact: merge this writer's flushes into one
    file per dataset (a row group each) at close(); compression: a Parquet codec. A log that holds another run is
    refused (Note [one run per log]).
    """

    def __init__(self, path: str | os.PathLike, stats_dtype: Optional[str] = None, fsync: bool = True,
                 compact: bool = True, compression: str = "zstd"):
        _pq()
        if stats_dtype not in (None, "float32", "float64"):
            raise ValueError(f"hookstats.ParquetWriter: stats_dtype must be 'float32' or 'float64', got "
                             f"{stats_dtype!r}")
        self.paths = log_paths(path)
        self.path = self.paths.records
        for p in (self.paths.records, self.paths.scalars):
            _durable.repair(p, self.paths.tmp)  # what a killed writer left (Note [compaction a kill cannot break])
            if os.path.exists(p) and not os.path.isdir(p):
                raise ValueError(f"hookstats.ParquetWriter: {p!r} exists and is not a directory (a Parquet log "
                                 "is a directory of files, one per flush)")
        _check_own(self.paths)
        os.makedirs(self.path, exist_ok=True)
        self.fsync = fsync
        self.compact = compact
        self.compression = compression
        self.info: Optional[dict] = None
        self._schema = None
        self._migrate()
        self.stats_dtype = check_stats_dtype("ParquetWriter", self.path, stats_dtype, _log_stats_dtype(self.paths))
        self._first = _last_flush(self.path) + 1
        self._n = self._first - 1  # the last flush number written
        self._closed = False
        self.unfit = 0  # float32 statistics written as null (Note [statistics that float32 cannot hold])
        self._unfit_reported = False

    def _migrate(self) -> None:
        """Continuing a log: the old layout's run.json and scalars files moved out of the records directory, and the
        per-flush files a compacted file covers (left by a kill in the compaction before the swap) removed."""
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
            _durable.fsync_file(tmp)
        _durable.kill_point("part-written")
        os.replace(tmp, final)
        if self.fsync:
            _durable.fsync_dir(os.path.dirname(final))

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
        """Writes the run header, or checks that a log being continued holds the same run (Note [one run per log]:
        ValueError otherwise) and adds this writer's header to its "resumed" list; fixes the records' schema."""
        old = read_run_info(self.path)
        has_records = any(parts(self.path).values())
        check_resume("ParquetWriter", self.path, old, info, has_records)
        self.info = info
        self._schema = records_schema(info, self.stats_dtype)
        head = {**info, "time": time.time(), "stats_dtype": self.stats_dtype}
        if old:
            head = {**old, "resumed": list(old.get("resumed", [])) + [
                {k: head[k] for k in ("hookstats", "torch", "time", "start_step", "every", "histogram_every")
                 if k in head}]}
        self._write_head(head)

    def _write_head(self, head: dict) -> None:
        tmp = self._tmp("run.json")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(head, f, default=str)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, self.paths.run)

    def end(self, info: dict) -> None:
        """What the run learned by its end (Monitor.detach(), before close(): nonfinite_ops=True's first non-finite
        op), put into the run header as "end" (read back as read_run(path).info["end"]); a resumed run's replaces
        it."""
        self._check()
        self._write_head({**read_run_info(self.path), "end": info})

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError(f"hookstats.ParquetWriter({self.path!r}) is closed")

    def write_block(self, block, scalars: Sequence[dict] = ()) -> None:
        """One flush (a Block of the Monitor's columns) as records-N.parquet (and scalars-N.parquet)."""
        self._check()
        unfit: list = []
        rec = _t.block_table(block, self.stats_dtype, unfit=unfit) if len(block) else None
        self._write(rec, scalars)
        self._report_unfit(rec, unfit)

    def write(self, records: Sequence[dict], scalars: Sequence[dict] = ()) -> None:
        """The same from record dicts (records() or a JSONL log read back)."""
        self._check()
        unfit: list = []
        rec = _t.records_table(records, self.stats_dtype, unfit=unfit) if len(records) else None
        self._write(rec, scalars)
        self._report_unfit(rec, unfit)

    def _report_unfit(self, rec, unfit: list) -> None:
        """Float32 statistics written as null: counted, and the first raised (Note [statistics that float32 cannot
        hold]) once the flush is on disk."""
        if not unfit:
            return
        self.unfit += sum(len(rows) for _, rows, _ in unfit)
        if self._unfit_reported:
            return
        self._unfit_reported = True
        field, rows, values = unfit[0]
        i = int(rows[0])
        where = ", ".join(f"{c} {rec.column(c)[i].as_py()!r}" for c in ("step", "module", "kind"))
        raise ValueError(f"hookstats.ParquetWriter({self.path!r}): {field} = {float(values[0])!r} ({where}) does not "
                         "fit this float32 log (stats_dtype='float32'): it is written as null, never as inf or 0 "
                         f"({self.unfit} such value(s) so far; later ones are counted in .unfit, not raised). Write "
                         "float64 statistics (stats_dtype='float64', the default) to keep every value")

    def _write(self, rec, scalars) -> None:
        if rec is None and not scalars:
            return
        n = self._n + 1
        if scalars:
            self._write_file("scalars", f"scalars-{n:06d}.parquet", _t.scalars_table(scalars))
        if rec is not None:
            if self._schema is not None:
                rec = _t.conform(rec, self._schema)
            self._write_file("records", f"records-{n:06d}.parquet", rec)
        self._n = n

    def close(self) -> None:
        """With compact=True merges this writer's flush files into one file per dataset (readers see either, never
        both: Note [compaction a kill cannot break]); a second close does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.compact and self._n > self._first:
            for kind in ("records", "scalars"):
                self._compact(kind)

    def _compact(self, kind: str) -> None:
        """Streams this writer's flush files of one dataset into one file, a row group per flush (memory: one
        flush), then swaps it in for them."""
        pq = _pq()
        d = self._dir(kind)
        mine = [(a, b, p) for a, b, p in _files(d, kind) if a == b and self._first <= a <= self._n and
                not _PART.match(os.path.basename(p)).group(3)]
        if len(mine) < 2:
            return
        schema = self._schema if kind == "records" and self._schema is not None else None
        if schema is None:
            schema = pq.read_schema(mine[0][2])
        schema = schema.remove_metadata()
        name = f"{kind}-{mine[0][0]:06d}-{mine[-1][0]:06d}.parquet"
        tmp = self._tmp(name)
        try:
            with pq.ParquetWriter(tmp, schema, compression=self.compression,
                                  use_dictionary=list(_t.SITE_COLUMNS) + ["tag"],
                                  write_statistics=["step", "seq"]) as w:
                for i, (_, _, p) in enumerate(mine):  # one row group per flush, one flush in memory at a time
                    f = pq.ParquetFile(p)
                    for g in range(f.num_row_groups):
                        t = _t.conform(f.read_row_group(g), schema)
                        if t.schema.names != schema.names:
                            raise RuntimeError(f"hookstats.ParquetWriter: {p} has columns this log's schema lacks "
                                               f"({sorted(set(t.schema.names) - set(schema.names))}); not compacted")
                        w.write_table(t, row_group_size=max(1, t.num_rows))
                    if i == 0:
                        _durable.kill_point("compact-writing")
            if self.fsync:
                _durable.fsync_file(tmp)
        except BaseException:  # the per-flush files stay: the log is whole, only not compacted
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        _durable.swap_in(d, tmp, name, {os.path.basename(p) for _, _, p in mine}, fsync=self.fsync)

    def __enter__(self) -> "ParquetWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_own(lp: LogPaths) -> None:
    """Refuses a records or scalars directory holding anything but this log's files (Note [one run per log])."""
    for d in (lp.records, lp.scalars):
        try:
            names = os.listdir(d)
        except (FileNotFoundError, NotADirectoryError):
            continue
        foreign = [n for n in names if not _PART.match(n) and n != OLD_RUN_FILE and n[:1] not in "._"]
        if foreign:
            raise ValueError(f"hookstats.ParquetWriter: {d!r} holds files that are not a hookstats log's "
                             f"({', '.join(sorted(foreign)[:3])}{', ...' if len(foreign) > 3 else ''}): a writer "
                             "writes only into its own log; give it a new path")


def _log_stats_dtype(lp: LogPaths) -> Optional[str]:
    """The statistics' type of an existing log (its first records file, else its header); None for a new log."""
    recs = parts(lp.records)["records"]
    if recs:
        t = _pq().read_schema(recs[0][2]).field("l2").type
        return "float32" if str(t) == "float" else "float64"
    return read_run_info(lp.records).get("stats_dtype")


def remove_log(path) -> None:
    """Removes a Parquet log whole: its records and scalars datasets, its header, and what a killed writer left beside
    them (temporary files, staging and old directories, Note [compaction a kill cannot break]), so that a new run can
    take the path (Note [one run per log]). A path that holds none of these is left as it is."""
    lp = log_paths(path)
    parent = os.path.dirname(lp.records) or "."
    hidden = (os.path.basename(lp.tmp),) + tuple(f".{os.path.basename(d)}." for d in (lp.records, lp.scalars))
    names = [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(hidden)] if os.path.isdir(parent) \
        else []
    for p in [lp.records, lp.scalars, lp.run] + names:
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)


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


__all__ = ["ParquetWriter", "read_parquet_log", "read_run_info", "remove_log", "log_paths", "LogPaths", "parts", "is_parquet_log",
           "records_schema"]
