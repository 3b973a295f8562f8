"""Deprecated: hookstats.export.parquet is now hookstats.runlog.parquet. This module goes in the next release; until
then it gives back hookstats.runlog.parquet's own objects (private names included) and warns on import."""
from .._deprecated import moved
from ..runlog import parquet as _new

__all__, __getattr__, __dir__ = moved(__name__, _new)
