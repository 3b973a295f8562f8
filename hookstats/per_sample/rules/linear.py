"""nn.Linear (and timm's Linear, the same computation): y = x W^T + b. grad W_b = sum_t g_bt x_bt^T (Outer,
L = output grad, R = input), grad b_b = sum_t g_bt."""
from __future__ import annotations

from torch import nn

from ..registry import Rule, register_rule
from ..terms import Dense, Outer, as_dtype, compute_dtype


def tokens(x, g):
    """[B, T, in] and [B, T, out] in the compute dtype from [B, T..., features] tensors."""
    dt = compute_dtype(x)
    b = x.shape[0]
    if x.dim() != 3:
        x = x.reshape(b, -1, x.shape[-1])
    if g.dim() != 3:
        g = g.reshape(b, -1, g.shape[-1])
    return as_dtype(x, dt), as_dtype(g, dt)


def affine_terms(x, g, attrs, transposed: bool = False) -> dict:
    """The terms of y = x W^T + b (transposed: y = x W + b, W [in, out]): weight sum_t g_bt x_bt^T (or its
    transpose), bias sum_t g_bt."""
    a, g = tokens(x, g)
    out = {}
    if "weight" in attrs:
        out["weight"] = Outer(a, g) if transposed else Outer(g, a)
    if "bias" in attrs:
        out["bias"] = Dense(g.sum(1))
    return out


@register_rule([nn.Linear, "timm.layers.linear.Linear"])  # timm's casts the weight to the input dtype
class LinearRule(Rule):
    rowwise = True
    defer = ("weight",)

    def terms(self, mod, x, g, attrs):
        return affine_terms(x, g, attrs)
