"""nn.RMSNorm (elementwise affine): grad weight_b = sum_t g_bt * x_bt / rms(x_bt) (Dense)."""
from __future__ import annotations

import math

import torch.nn.functional as F
from torch import nn

from ..registry import Rule, register_rule
from ..terms import compute_dtype
from .layer_norm import affine_terms


@register_rule(nn.RMSNorm)
class RMSNormRule(Rule):
    rowwise = True
    params = ("weight",)

    def is_batched(self, mod, x):
        return x.dim() > len(mod.normalized_shape)

    def terms(self, mod, x, g, attrs):
        # eps=None means finfo(input dtype).eps: normalise in the input's dtype as the module does, then widen
        xhat = F.rms_norm(x, mod.normalized_shape, None, mod.eps).to(compute_dtype(x))
        return affine_terms(xhat, g.to(xhat.dtype), attrs, x.shape[0], math.prod(mod.normalized_shape))
