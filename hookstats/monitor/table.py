"""Deprecated: hookstats.monitor.table is now hookstats.runlog.schema. This module goes in the next release; until then
it gives back hookstats.runlog.schema's own objects (private names included) and warns on import."""
from .._deprecated import moved
from ..runlog import schema as _new

__all__, __getattr__, __dir__ = moved(__name__, _new)
