"""HF transformers' GPT-2 `Conv1D` (transformers.pytorch_utils.Conv1D): a Linear with a transposed weight,
y = x W + b with W [in, out]: grad W_b = sum_t x_bt g_bt^T (Outer, L = input, R = output grad)."""
from __future__ import annotations

from ..registry import Rule, register_rule
from ..terms import Dense, Outer
from .linear import tokens


@register_rule("transformers.pytorch_utils.Conv1D")
class HFConv1DRule(Rule):
    def terms(self, mod, x, g, attrs):
        a, g = tokens(x, g)
        out = {}
        if "weight" in attrs:
            out["weight"] = Outer(a, g)
        if "bias" in attrs:
            out["bias"] = Dense(g.sum(1))
        return out
