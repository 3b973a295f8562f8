"""Deprecated: hookstats.export._columns is now hookstats.runlog.columns. This module goes in the next release; until
then it gives back hookstats.runlog.columns's own objects (private names included) and warns on import."""
from .._deprecated import moved
from ..runlog import columns as _new

__all__, __getattr__, __dir__ = moved(__name__, _new)
