"""Where Monitor records go: a JSONL log (always available), a Parquet log (pyarrow), TensorBoard event files (the
`tensorboard` package), Weights & Biases (when `wandb` is installed), and plots plus a one-page report (matplotlib)
made from a run directory.

An exporter implements `hookstats.export.Exporter` (protocol.py): `begin(info)` when a Monitor attaches,
`write_block(block, scalars)` per flush (its columns: hookstats.monitor.block.Block), `close()` at Monitor.detach;
a user's own exporter may be a `RecordWriter` instead (`write(records, scalars)` with record dicts; begin and close
optional). Exporters run on the Monitor's export thread (Note [export off the training thread]).
The optional packages are imported when an exporter is made, so `import hookstats` never needs them.

Run directory layout (what `python -m hookstats demo` writes and `python -m hookstats report` reads):
  RUN_DIR/log.jsonl       JSONLWriter
  RUN_DIR/log.parquet/    ParquetWriter: the records, Parquet files only (pandas, pyarrow, DuckDB, Polars read it as is);
  RUN_DIR/log.scalars.parquet/, RUN_DIR/log.run.json   its logged scalars and run header (read_log reads either log)
  RUN_DIR/tensorboard/    TensorBoardWriter (tensorboard --logdir RUN_DIR/tensorboard)
  RUN_DIR/report/         make_report: PNG plots, report.md, report.html
"""
from .jsonl import JSONLWriter, RunLog, read_jsonl
from .log import PARQUET_NAME, RunTable, find_log, read_log, read_run
from .protocol import Exporter, RecordWriter

LOG_NAME = "log.jsonl"
TENSORBOARD_DIR = "tensorboard"
REPORT_DIR = "report"


def __getattr__(name):  # the exporters that need optional packages load on first use
    if name == "TensorBoardWriter":
        from .tensorboard import TensorBoardWriter

        return TensorBoardWriter
    if name == "WandbWriter":
        from .wandb import WandbWriter

        return WandbWriter
    if name == "ParquetWriter":
        from .parquet import ParquetWriter

        return ParquetWriter
    if name == "make_report":
        from .report import make_report

        return make_report
    raise AttributeError(f"module 'hookstats.export' has no attribute {name!r}")


__all__ = ["Exporter", "RecordWriter", "JSONLWriter", "RunLog", "read_jsonl", "ParquetWriter", "read_log", "read_run", "find_log", "RunTable",
           "PARQUET_NAME", "TensorBoardWriter", "WandbWriter", "make_report", "LOG_NAME",
           "TENSORBOARD_DIR", "REPORT_DIR"]
