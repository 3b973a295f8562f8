"""Old import paths kept for one release: a module that moved leaves a shim that warns once, when it is imported,
and gives back the new module's own objects (private names included), so `is` still holds."""
from __future__ import annotations

import types
import warnings


def moved(old: str, new: types.ModuleType) -> tuple:
    """(__all__, __getattr__, __dir__) for the shim module `old` of `new`. Called at the shim's top level, so the
    warning points at the line that imported the shim (importlib's frames are not counted)."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release: use {new.__name__}",
                  DeprecationWarning, stacklevel=3)
    return list(getattr(new, "__all__", ())), (lambda name: getattr(new, name)), (lambda: dir(new))
