"""Where Monitor records go: a JSONL log (always available), TensorBoard event files (the `tensorboard` package),
Weights & Biases (when `wandb` is installed), and plots plus a one-page report (matplotlib) made from a run directory.

An exporter is any object with `write(records, scalars)`; `begin(info)` (called when a Monitor attaches) and
`close()` (called by Monitor.detach) are optional. The optional packages are imported when an exporter is made, so
`import hookstats` never needs them.

Run directory layout (what `python -m hookstats demo` writes and `python -m hookstats report` reads):
  RUN_DIR/log.jsonl       JSONLWriter
  RUN_DIR/tensorboard/    TensorBoardWriter (tensorboard --logdir RUN_DIR/tensorboard)
  RUN_DIR/report/         make_report: PNG plots, report.md, report.html
"""
from .jsonl import JSONLWriter, RunLog, read_jsonl

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
    if name == "make_report":
        from .report import make_report

        return make_report
    raise AttributeError(f"module 'hookstats.export' has no attribute {name!r}")


__all__ = ["JSONLWriter", "RunLog", "read_jsonl", "TensorBoardWriter", "WandbWriter", "make_report", "LOG_NAME",
           "TENSORBOARD_DIR", "REPORT_DIR"]
