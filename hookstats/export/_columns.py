"""Deprecated: hookstats.export._columns is now hookstats.runlog.columns. This module goes in the next release; until
then it gives back hookstats.runlog.columns's own objects (private names included) and warns on import."""
import warnings

from ..runlog import columns as _new

warnings.warn("hookstats.export._columns is deprecated and will be removed in the next release: use "
              "hookstats.runlog.columns", DeprecationWarning, stacklevel=2)

__all__ = list(_new.__all__)


def __getattr__(name):
    return getattr(_new, name)


def __dir__():
    return dir(_new)
