"""hookstats: fused tensor statistics for PyTorch hooks, on CPU and CUDA, with no host sync."""
from ._ops import (
    HAVE_EXTENSION,
    STATS_FIELDS,
    Stats,
    cuda_kernels_built,
    stats,
    stats_buffer,
    stats_into,
)

__version__ = "0.1.0"

__all__ = [
    "HAVE_EXTENSION",
    "STATS_FIELDS",
    "Stats",
    "cuda_kernels_built",
    "stats",
    "stats_buffer",
    "stats_into",
]
