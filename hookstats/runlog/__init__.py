"""The run log: what a Monitor run leaves on disk, written by the exporters and read back by the report and by you.
Both directions import this package, and it imports neither (no hookstats.export, no Monitor).

Run directory layout (what `python -m hookstats demo` writes and `python -m hookstats report` reads):
  RUN_DIR/log.jsonl       JSONLWriter (jsonl.py): one JSON object per line, the run header, records and scalars
  RUN_DIR/log.parquet/    ParquetWriter (parquet.py): the records, Parquet files only (pandas, pyarrow, DuckDB, Polars
                          read it as is; Note [a Parquet log that survives a kill])
  RUN_DIR/log.scalars.parquet/, RUN_DIR/log.run.json   its logged scalars and run header
  RUN_DIR/tensorboard/    TensorBoardWriter (hookstats.export)
  RUN_DIR/report/         make_report (hookstats.export): PNG plots, report.md, report.html

Schema (schema.py, the same in a Parquet log, `read_log(path)` and `Monitor.table()`): one row per recorded tensor,
seq, step, module, kind, index, dtype (the site columns dictionary-encoded), one column per statistic of
hookstats.STATS_FIELDS (the counts int64, the others float64 or float32), shape / argmax_abs_index /
first_nonfinite_index in runs with Monitor(locations=True), and histogram_{L} (list<int64>) per histogram length L;
the run header (Monitor.run_info()) in the schema metadata (`schema.run_info(table)`).

Reading: `read_log(path)` (the records as a pyarrow.Table), `read_run(path)` (header, records, scalars),
`read_jsonl(path)` (a JSONL log as dicts), `find_log(path)` (which log a run directory holds: log.parquet first).
pyarrow is imported when a table is built or a Parquet log is written or read: `import hookstats` never needs it.
"""
from .jsonl import JSONLWriter, RunLog, read_jsonl
from .parquet import ParquetWriter
from .read import JSONL_NAME, PARQUET_NAME, RunTable, find_log, read_log, read_run

LOG_NAME = JSONL_NAME

__all__ = ["JSONLWriter", "ParquetWriter", "RunLog", "read_jsonl", "read_log", "read_run", "find_log", "RunTable",
           "PARQUET_NAME", "JSONL_NAME", "LOG_NAME"]
