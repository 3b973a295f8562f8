"""Deprecated: hookstats.export.jsonl is now hookstats.runlog.jsonl. This module goes in the next release; until then
it gives back hookstats.runlog.jsonl's own objects (private names included) and warns on import."""
from .._deprecated import moved
from ..runlog import jsonl as _new

__all__, __getattr__, __dir__ = moved(__name__, _new)
