"""hookstats: fused tensor statistics for PyTorch hooks, on CPU and CUDA, with no host sync."""
from ._ops import (
    HAVE_EXTENSION,
    MAX_HIST_BINS,
    STATS_FIELDS,
    ExpLayout,
    Histogram,
    LocatedStats,
    Stats,
    cuda_kernels_built,
    exp_histogram,
    exp_layout,
    histogram,
    histogram_buffer,
    location_buffer,
    stats,
    stats_buffer,
    stats_into,
    stats_multi_into,
    unravel,
)
from .clip import (
    Norms,
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    clip_norm_,
    clip_value_,
    get_total_norm,
    norm,
    norms,
)
from .formats import FORMATS, format_fit
from ._select import Selection, Site
from .channel import CHANNEL_FIELDS, ChannelCalibrator, ChannelStats, channel_stats, channel_stats_buffer, channel_stats_into
from .per_sample import PerSampleGradNorms
from .hooks import clip_value, fused_clip
from .monitor import MONITOR_KINDS, Monitor, MonitorConfig, record
from .anomaly import NonfiniteGuard, NonfiniteOp, detect_nonfinite
from . import runlog  # hookstats.runlog.read_log, read_run, JSONLWriter, ...: the run log on disk
from . import export  # hookstats.export.JSONLWriter, TensorBoardWriter, ...: optional packages load on first use

from ._version import __version__

__all__ = [
    "FORMATS",
    "ExpLayout",
    "Histogram",
    "MAX_HIST_BINS",
    "MONITOR_KINDS",
    "Monitor",
    "NonfiniteGuard",
    "NonfiniteOp",
    "detect_nonfinite",
    "MonitorConfig",
    "export",
    "runlog",
    "clip_value",
    "fused_clip",
    "record",
    "Norms",
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
    "clip_norm_",
    "clip_value_",
    "get_total_norm",
    "norm",
    "norms",
    "exp_histogram",
    "exp_layout",
    "format_fit",
    "histogram",
    "histogram_buffer",
    "HAVE_EXTENSION",
    "STATS_FIELDS",
    "Stats",
    "cuda_kernels_built",
    "stats",
    "stats_buffer",
    "stats_into",
    "stats_multi_into",
    "LocatedStats",
    "location_buffer",
    "unravel",
    "CHANNEL_FIELDS",
    "ChannelCalibrator",
    "ChannelStats",
    "channel_stats",
    "channel_stats_buffer",
    "channel_stats_into",
    "PerSampleGradNorms",
    "Selection",
    "Site",
]
