"""nn.GroupNorm (affine) on [B, C, ...]: grad weight_b[c] = sum over positions of g * xhat (xhat recomputed from the
kept input), grad bias_b[c] = sum of g (Dense)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..registry import Rule, register_rule
from ..terms import Dense, compute_dtype


@register_rule(nn.GroupNorm)
class GroupNormRule(Rule):
    batch_dim_applies = False

    def is_batched(self, mod, x):
        return x.dim() >= 2

    def terms(self, mod, x, g, attrs):
        dt = compute_dtype(x)
        b, c = x.shape[:2]
        g = g.to(dt).reshape(b, c, -1)
        out = {}
        if "weight" in attrs:
            xhat = F.group_norm(x.to(dt), mod.num_groups, None, None, mod.eps).reshape(b, c, -1)
            out["weight"] = Dense((g * xhat).sum(2))
        if "bias" in attrs:
            out["bias"] = Dense(g.sum(2))
        return out
