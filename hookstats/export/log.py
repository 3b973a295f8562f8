"""Deprecated: hookstats.export.log is now hookstats.runlog.read. This module goes in the next release; until then it
gives back hookstats.runlog.read's own objects (private names included) and warns on import."""
from .._deprecated import moved
from ..runlog import read as _new

__all__, __getattr__, __dir__ = moved(__name__, _new)
