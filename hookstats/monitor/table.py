"""Deprecated: hookstats.monitor.table is now hookstats.runlog.schema. This module goes in the next release; until then
it gives back hookstats.runlog.schema's own objects (private names included) and warns on import."""
import warnings

from ..runlog import schema as _new

warnings.warn("hookstats.monitor.table is deprecated and will be removed in the next release: use "
              "hookstats.runlog.schema", DeprecationWarning, stacklevel=2)

__all__ = list(_new.__all__)


def __getattr__(name):
    return getattr(_new, name)


def __dir__():
    return dir(_new)
