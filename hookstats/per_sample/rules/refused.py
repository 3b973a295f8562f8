"""Layers refused by default, with the reason (hookstats.per_sample.register_refusal adds others)."""
from __future__ import annotations

import fnmatch

from ..registry import register_refusal


class Refused(Exception):
    """Raised by a rule's keep() for a call it cannot split per sample: the layer is then refused, named in a
    warning, and left out of the total."""


# Matchers of the experts modules a rule covers (hf_moe_experts.py appends its own): not refused here.
MOE_COVERED: list = []
_MOE = ("mixture-of-experts experts that the routed-experts rule does not match (Note [routed experts] in "
        "rules/hf_moe_experts.py: the eager loop of Qwen2MoeExperts and its copies): each expert's weights are "
        "applied, inside the experts module, to the token rows the router sends that expert, and a per-sample "
        "gradient needs the routing and each expert's output gradient per token, which only a rule replaying that "
        "module's own forward has; this module's forward is not that code (another weight layout, biases, or one "
        "module per expert): left out of the total")


def _moe(match):
    return lambda name, mod: match(name, mod) and not any(m(mod) for m in MOE_COVERED)


register_refusal(_moe(lambda name, mod: fnmatch.fnmatchcase(name, "*.experts")), _MOE)
register_refusal(_moe(lambda name, mod: fnmatch.fnmatchcase(name, "*.experts.*")), _MOE)
register_refusal(_moe(lambda name, mod: type(mod).__name__.endswith("Experts")), _MOE)
register_refusal("*relative_attention_bias",
                 "T5-style relative position bias: fed a [T, T] table shared by every sample and broadcast over the "
                 "batch after the layer, so its output gradient is already summed over the samples: left out of the "
                 "total")
_REL_POS = ("held by (or in) an attention with a relative-position bias table that no rule covers (HF and timm Swin's "
            "are, Note [relative-position table]): the table's [heads, N, N] bias is added to the attention scores of "
            "every sample, so its gradient is summed over the samples before any module output carries it, and only "
            "a rule that replays the scores' gradient from that attention's output can split it per sample; the "
            "module holding the table is refused, its parameters left out of the total")
register_refusal(lambda name, mod: type(mod).__name__.endswith("RelativePositionBias")
                 and "relative_position_bias_table" in mod._parameters, _REL_POS)
# timm's tables held by an attention module: refused in rules/timm_swin_attention.py, but Swin's WindowAttention

