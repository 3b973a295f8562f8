"""Monitor and record hooks, along the data path: hooks.py (the C++-backed hooks) -> buffers.py (device rows and their
flush; Note [monitor sites] in csrc/monitor/recorder.h) -> block.py (a flush's columnar block and its record dicts)
-> sites.py (the site table) -> summary.py;
compile.py is the torch.compile glue, core.py the Monitor, record.py the standalone record hook."""
from .core import MONITOR_KINDS, Monitor
from .record import record
from .summary import SUMMARY_HEADER, format_summary, summary_cells, summary_from_columns, summary_rows

__all__ = ["MONITOR_KINDS", "Monitor", "record", "SUMMARY_HEADER", "format_summary", "summary_cells",
           "summary_from_columns", "summary_rows"]
