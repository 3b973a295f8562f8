"""Layers refused by default, with the reason (hookstats.per_sample.register_refusal adds others)."""
from __future__ import annotations

from ..registry import register_refusal


class Refused(Exception):
    """Raised by a rule's keep() for a call it cannot split per sample: the layer is then refused, named in a
    warning, and left out of the total."""


_MOE = ("mixture-of-experts experts: each expert's weights are applied, inside the experts module, to the token rows "
        "the router sends that expert; a per-sample gradient needs each expert's own output gradient per token, "
        "which only the module's internal graph holds (its output is the routing-weighted sum over the experts), "
        "and hookstats has no rule that replays the routing: left out of the total")
register_refusal("*.experts", _MOE)
register_refusal("*.experts.*", _MOE)
register_refusal(lambda name, mod: type(mod).__name__.endswith("Experts"), _MOE)
register_refusal("*relative_attention_bias",
                 "T5-style relative position bias: fed a [T, T] table shared by every sample and broadcast over the "
                 "batch after the layer, so its output gradient is already summed over the samples: left out of the "
                 "total")
_REL_POS = ("a relative-position bias table: gathered into one [heads, N, N] bias that is added to the attention "
            "scores of every window of every sample, so its gradient is summed over the samples by that broadcast "
            "before any module output carries it: no per-sample split is left; left out of the total")
register_refusal(lambda name, mod: type(mod).__name__.endswith("RelativePositionBias")
                 and "relative_position_bias_table" in mod._parameters, _REL_POS)
# timm's tables held by an attention module: refused in rules/timm_swin_attention.py, but Swin's WindowAttention

