"""Deprecated: hookstats.export.log is now hookstats.runlog.read. This module goes in the next release; until then it
gives back hookstats.runlog.read's own objects (private names included) and warns on import."""
import warnings

from ..runlog import read as _new

warnings.warn("hookstats.export.log is deprecated and will be removed in the next release: use "
              "hookstats.runlog.read", DeprecationWarning, stacklevel=2)

__all__ = list(_new.__all__)


def __getattr__(name):
    return getattr(_new, name)


def __dir__():
    return dir(_new)
