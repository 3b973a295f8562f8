"""Monitor and record hooks, along the data path: hooks.py (the C++-backed hooks) -> buffers.py (device rows and their
flush; Note [monitor sites] in csrc/monitor/recorder.h) -> block.py (a flush's columnar block and its record dicts)
-> sites.py (the site table) -> summary.py;
compile.py is the torch.compile glue, core.py the Monitor (its options: config.py), record.py the standalone record
hook; feature.py is the protocol of what a Monitor records besides its sites, features/ the built-in ones."""
from . import features  # noqa: F401  (registers the built-in features' options)
from .config import GROUPS, MONITOR_KINDS, MonitorConfig
from .core import Monitor
from .feature import Feature, FeatureContext, Shortcut, register_feature
from .record import record
from .summary import SUMMARY_HEADER, format_summary, summary_cells, summary_from_columns, summary_rows

__all__ = ["GROUPS", "MONITOR_KINDS", "Monitor", "MonitorConfig", "Feature", "FeatureContext", "Shortcut",
           "register_feature", "record", "SUMMARY_HEADER", "format_summary", "summary_cells",
           "summary_from_columns", "summary_rows"]
