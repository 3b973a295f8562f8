"""nn.GroupNorm (affine) on [B, C, ...]: grad weight_b[c] = sum over positions of g * xhat, grad bias_b[c] = sum of g
(Dense). With the statistics the forward saved (Note [saved norm statistics] in layer_norm.py), as GroupNorm's own
backward computes its weight gradient: (sum g x - mean sum g) * rstd per channel, no xhat; otherwise xhat
recomputed from the kept input. The difference cancels as in GroupNorm's own backward: with |mean| / std ~ 100 in
float32, 1.2e-5 relative error against 6e-6 for the recomputed xhat (float64 models: ~1e-16)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Rule, register_rule
from ..terms import Dense, compute_dtype
from .layer_norm import saved_stats


@register_rule(nn.GroupNorm)
class GroupNormRule(Rule):
    batch_dim_applies = False

    def is_batched(self, mod, x):
        return x.dim() >= 2

    def keep_call(self, mod, x, args, kwargs, output):
        st = saved_stats(output, "NativeGroupNormBackward0")
        return x if st is None or st[0].shape != (x.shape[0], mod.num_groups) else (x, *st)

    def terms(self, mod, kept, g, attrs):
        x, st = (kept, None) if isinstance(kept, torch.Tensor) else (kept[0], kept[1:])
        dt = compute_dtype(x)
        b, c = x.shape[:2]
        g = g.to(dt).reshape(b, c, -1)
        out = {}
        gs = g.sum(2)
        if "weight" in attrs and st is None:
            xhat = F.group_norm(x.to(dt), mod.num_groups, None, None, mod.eps).reshape(b, c, -1)
            out["weight"] = Dense((g * xhat).sum(2))
        elif "weight" in attrs:
            gr = mod.num_groups
            per = lambda s: s.to(dt).reshape(b, gr, 1).expand(b, gr, c // gr).reshape(b, c)  # noqa: E731
            gx = torch.linalg.vecdot(g, x.to(dt).reshape(b, c, -1), dim=2)
            out["weight"] = Dense((gx - gs * per(st[0])) * per(st[1]))
        if "bias" in attrs:
            out["bias"] = Dense(gs)
        return out
