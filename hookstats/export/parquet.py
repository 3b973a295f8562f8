"""Deprecated: hookstats.export.parquet is now hookstats.runlog.parquet. This module goes in the next release; until
then it gives back hookstats.runlog.parquet's own objects (private names included) and warns on import."""
import warnings

from ..runlog import parquet as _new

warnings.warn("hookstats.export.parquet is deprecated and will be removed in the next release: use "
              "hookstats.runlog.parquet", DeprecationWarning, stacklevel=2)

__all__ = list(_new.__all__)


def __getattr__(name):
    return getattr(_new, name)


def __dir__():
    return dir(_new)
