"""HF Mixtral's MixtralTopKRouter: router_logits = F.linear(x.reshape(-1, d), weight), returned first of a tuple;
the Linear rule on the token rows (a batch-major [B * T, d] view of the block's input, split per sample by the
core)."""
from __future__ import annotations

from ..registry import Rule, register_rule
from ..terms import Outer
from .linear import tokens


@register_rule("transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter")
class TopKRouterRule(Rule):
    params = ("weight",)

    def output(self, mod, out):
        return out[0] if isinstance(out, tuple) else None

    def terms(self, mod, x, g, attrs):
        a, g = tokens(x, g)
        return {"weight": Outer(g, a)}
