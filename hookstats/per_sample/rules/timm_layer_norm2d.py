"""timm LayerNorm2d: a LayerNorm over the channels (dim 1) of NCHW, y = permute back(layer_norm(x.permute(0, 2, 3,
1))): the LayerNorm rule on channels-last values."""
from __future__ import annotations

import torch.nn.functional as F

from ..registry import Rule, register_rule
from ..terms import compute_dtype
from .layer_norm import affine_terms


@register_rule("timm.layers.norm.LayerNorm2d")
class LayerNorm2dRule(Rule):
    batch_dim_applies = False

    def is_batched(self, mod, x):
        return x.dim() == 4

    def terms(self, mod, x, g, attrs):
        dt = compute_dtype(x)
        xl = x.to(dt).permute(0, 2, 3, 1)
        xhat = F.layer_norm(xl, mod.normalized_shape, None, None, mod.eps)
        return affine_terms(xhat, g.to(dt).permute(0, 2, 3, 1), attrs, x.shape[0], x.shape[1])
