"""nn.LayerNorm (elementwise affine): grad weight_b = sum_t g_bt * xhat_bt (xhat recomputed from the kept input),
grad bias_b = sum_t g_bt (Dense). timm's LayerNorm (channels-last, same computation) shares the rule."""
from __future__ import annotations

import math

import torch.nn.functional as F
from torch import nn

from ..registry import Rule, register_rule
from ..terms import Dense, compute_dtype


def affine_terms(xhat, g, attrs, b, d):
    """Terms of y = weight * xhat + bias over [b, tokens, d] values."""
    xhat, g = xhat.reshape(b, -1, d), g.reshape(b, -1, d)
    out = {}
    if "weight" in attrs:
        out["weight"] = Dense((g * xhat).sum(1))
    if "bias" in attrs:
        out["bias"] = Dense(g.sum(1))
    return out


@register_rule([nn.LayerNorm, "timm.layers.norm.LayerNorm"])
class LayerNormRule(Rule):
    rowwise = True
    def is_batched(self, mod, x):
        return x.dim() > len(mod.normalized_shape)

    def terms(self, mod, x, g, attrs):
        dt = compute_dtype(x)
        xhat = F.layer_norm(x.to(dt), mod.normalized_shape, None, None, mod.eps)
        return affine_terms(xhat, g.to(dt), attrs, x.shape[0], math.prod(mod.normalized_shape))
