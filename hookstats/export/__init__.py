"""Where Monitor records go: a JSONL log (always available), a Parquet log (pyarrow), TensorBoard event files (the
`tensorboard` package), Weights & Biases (when `wandb` is installed), and plots plus a one-page report (matplotlib)
made from a run directory.

An exporter implements `hookstats.export.Exporter` (protocol.py): `begin(info)` when a Monitor attaches,
`write_block(block, scalars)` per flush (its columns: hookstats.monitor.block.Block), `close()` at Monitor.detach;
a user's own exporter may be a `RecordWriter` instead (`write(records, scalars)` with record dicts; begin and close
optional). Exporters run on the Monitor's export thread (Note [export off the training thread]).
The optional packages (tensorboard, wandb, matplotlib, pyarrow) are imported when an exporter is made or the report
drawn, never at module import, so `import hookstats` never needs them.

The run log's writers (JSONLWriter, ParquetWriter) live in hookstats.runlog with its schema, the run directory
layout and the readers (read_log, read_run, read_jsonl); they are re-exported here as exporters.
"""
import warnings

from .. import runlog as _runlog
from ..runlog import JSONLWriter, ParquetWriter
from ..runlog import JSONL_NAME as LOG_NAME
from .protocol import Exporter, RecordWriter
from .report import REPORT_DIR, make_report
from .tensorboard import TensorBoardWriter
from .wandb import WandbWriter

TENSORBOARD_DIR = "tensorboard"

# The readers lived here in 0.1.0; through hookstats.export they still work, with a DeprecationWarning, for one
# release.
_MOVED_TO_RUNLOG = ("read_log", "read_run", "find_log", "RunTable", "RunLog", "read_jsonl", "PARQUET_NAME")


def __getattr__(name):
    if name in _MOVED_TO_RUNLOG:
        warnings.warn(f"hookstats.export.{name} is deprecated and will be removed in the next release: use "
                      f"hookstats.runlog.{name}", DeprecationWarning, stacklevel=2)
        return getattr(_runlog, name)
    raise AttributeError(f"module 'hookstats.export' has no attribute {name!r}")


__all__ = ["Exporter", "RecordWriter", "JSONLWriter", "ParquetWriter", "TensorBoardWriter", "WandbWriter",
           "make_report", "LOG_NAME", "TENSORBOARD_DIR", "REPORT_DIR"]
