"""Layers refused by default, with the reason (hookstats.per_sample.register_refusal adds others)."""
from __future__ import annotations

from torch import nn

from ..registry import register_refusal


class Refused(Exception):
    """Raised by a rule's keep() for a call it cannot split per sample: the layer is then refused, named in a
    warning, and left out of the total."""


_MOE = ("mixture-of-experts experts see the tokens routed to them, not samples (a per-sample gradient of an expert "
        "is not defined by a layer rule): left out of the total")
register_refusal("*.experts", _MOE)
register_refusal("*.experts.*", _MOE)
register_refusal(lambda name, mod: type(mod).__name__.endswith("Experts"), _MOE)
register_refusal("*relative_attention_bias",
                 "T5-style relative position bias: fed a [T, T] table shared by every sample and broadcast over the "
                 "batch after the layer, so its output gradient is already summed over the samples: left out of the "
                 "total")
register_refusal(lambda name, mod: isinstance(mod, nn.modules.batchnorm._BatchNorm),
                 "BatchNorm mixes the samples through its batch statistics in training (GroupNorm or LayerNorm keep "
                 "them independent): no per-sample rule")
