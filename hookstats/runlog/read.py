"""Reading a run log back as tables: `read_log(path)` (records, a pyarrow.Table) and `read_run(path)` (the run
header, records and scalars), from a Parquet log (ParquetWriter: its records directory; logs of the layout before
the sidecar files too) or a JSONL log (JSONLWriter), or a run directory holding either (log.parquet first)."""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

from . import schema as _t
from .jsonl import read_jsonl
from .parquet import _pq, is_parquet_log, read_parquet_log

PARQUET_NAME = "log.parquet"
JSONL_NAME = "log.jsonl"


class RunTable(NamedTuple):
    info: dict  # the run header ({} when the log has none)
    records: object  # pyarrow.Table (the schema of hookstats.runlog.schema)
    scalars: list  # dicts: seq, step, tag, value
    bad_lines: int  # JSONL lines that were not valid JSON (a last line cut short by a kill); 0 for Parquet
    path: str  # the log read
    format: str  # "parquet" or "jsonl"


def find_log(path) -> str:
    """The log file or directory that `path` names: itself when it is a log, else RUN_DIR/log.parquet, else
    RUN_DIR/log.jsonl. Raises FileNotFoundError naming what was looked for."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path
    if is_parquet_log(path):
        return path  # a Parquet log's records directory itself (or where a kill in its compaction left it)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"hookstats: {path!r} does not exist")
    for name in (PARQUET_NAME, JSONL_NAME):
        p = os.path.join(path, name)
        if os.path.exists(p) or (name == PARQUET_NAME and is_parquet_log(p)):
            return p
    raise FileNotFoundError(f"hookstats: {path} has no {PARQUET_NAME} or {JSONL_NAME}")


def read_run(path) -> RunTable:
    """Reads a run log (see find_log) into tables: every completed flush (Parquet) or complete line (JSONL)."""
    p = find_log(path)
    if not os.path.isfile(p):
        info, records, scalars = read_parquet_log(p)
        return RunTable(info, records, _t.table_scalars(scalars), 0, p, "parquet")
    if p.endswith(".parquet"):  # one file of a Parquet log
        t = _pq().read_table(p)
        return RunTable(_t.run_info(t), t, [], 0, p, "parquet")
    log = read_jsonl(p)
    records = _t.records_table(log.records)
    if log.info:  # the run's columns, as its Parquet log has them (Note [record fields])
        records = _t.with_run_info(_t.conform(records, _t.records_schema(log.info)), log.info)
    return RunTable(log.info, records, list(log.scalars), log.bad_lines, p, "jsonl")


def read_log(path, columns: Optional[list] = None):
    """The records of a run log (a Parquet log directory, a JSONL file, or a run directory holding one) as a
    pyarrow.Table: seq, step, module, kind, index, dtype, the statistics, histogram_{L} columns (the run's columns,
    whichever the format: schema.records_schema of its header, Note [record fields]); the run header in the schema
    metadata (hookstats.runlog.schema.run_info(table)). `columns` reads only those (Parquet)."""
    p = find_log(path)
    if not os.path.isfile(p):
        return read_parquet_log(p, columns)[1]
    if p.endswith(".parquet"):
        return _pq().read_table(p, columns=columns)
    t = read_run(p).records
    return t.select(columns) if columns else t


__all__ = ["read_log", "read_run", "find_log", "RunTable", "PARQUET_NAME", "JSONL_NAME"]
