"""hookstats.integrations.lightning.HookstatsCallback for the `pytorch_lightning` package (a pytorch_lightning
Trainer accepts only pytorch_lightning.Callback subclasses)."""
from __future__ import annotations

from pytorch_lightning import Callback

from .lightning import HookstatsCallbackMixin


class HookstatsCallback(HookstatsCallbackMixin, Callback):
    __doc__ = HookstatsCallbackMixin.__doc__


__all__ = ["HookstatsCallback"]
