"""Monitor and record hooks, along the data path: attach.py puts hooks.py's C++-backed hooks on the model ->
recorder.py (device rows taken out at a flush; Note [monitor sites] in csrc/monitor/recorder.h) -> block.py (a
flush's columnar block and its record dicts; sites.py: the site table) -> merging.py (only with a process group:
every rank's blocks merged, merge.py's math) -> store.py (the kept blocks and the readers over them; scalars.py the
logged scalars) -> export_thread.py -> summary.py; counters.py: what a Monitor counts beside its records;
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
