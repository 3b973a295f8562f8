"""HF transformers' GPT-2 `Conv1D` (transformers.pytorch_utils.Conv1D): a Linear with a transposed weight,
y = x W + b with W [in, out]: grad W_b = sum_t x_bt g_bt^T (Outer, L = input, R = output grad)."""
from __future__ import annotations

from ..registry import Rule, register_rule
from .linear import affine_terms


@register_rule("transformers.pytorch_utils.Conv1D")
class HFConv1DRule(Rule):
    rowwise = True
    defer = ("weight",)

    def terms(self, mod, x, g, attrs):
        return affine_terms(x, g, attrs, transposed=True)
