"""nn.LayerNorm (elementwise affine): grad weight_b = sum_t g_bt * xhat_bt, grad bias_b = sum_t g_bt (Dense), xhat from
the statistics the forward saved for autograd (Note [saved norm statistics]) or recomputed from the kept input.
timm's LayerNorm (channels-last, same computation) shares the rule."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Rule, register_rule
from ..terms import Dense, as_dtype, compute_dtype

# Note [saved norm statistics]: native_layer_norm and native_group_norm save their per-row (per-group) mean and
# 1/std for their backward (grad_fn._saved_result1 / _saved_result2). The per-sample terms of the affine weight need
# the normalised input xhat = (x - mean) * rstd; reading those statistics from the call's autograd node instead of
# running the norm again saves its two statistics passes (on the benchmark's CNN and transformer, 3-4x less time in
# these rules), and the values are the ones the layer's own backward uses. They are read in the forward hook, and
# only when no saved-tensor hooks are active (activation checkpointing, save_on_cpu): unpacking a saved tensor there
# would run the hook (non-reentrant checkpointing refuses a second unpack); otherwise the input is normalised again.


def saved_stats(output, node: str) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(mean, rstd) the norm call that made `output` saved for its backward (its autograd node of type `node`), or
    None: no such node, or saved-tensor hooks active (Note [saved norm statistics])."""
    fn = getattr(output, "grad_fn", None)
    if fn is None or type(fn).__name__ != node:
        return None
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None or top(False) is not None:
        return None
    try:
        return fn._saved_result1, fn._saved_result2
    except (AttributeError, RuntimeError):
        return None


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

    def keep_call(self, mod, x, args, kwargs, output):
        st = saved_stats(output, "NativeLayerNormBackward0")
        x0 = self.input(mod, args, kwargs)
        nd = len(mod.normalized_shape)
        # the statistics hold the input's leading dims: used when x is the input itself (not moved by batch_dim=1)
        if st is None or x.shape != x0.shape or x.stride() != x0.stride() or st[0].shape != (
                *x.shape[:-nd], *(1,) * nd):
            return x
        return x, *st

    def terms(self, mod, kept, g, attrs):
        x, st = (kept, None) if isinstance(kept, torch.Tensor) else (kept[0], kept[1:])
        dt = compute_dtype(x)
        b, d = x.shape[0], math.prod(mod.normalized_shape)
        g = as_dtype(g, dt)
        if st is None:
            xhat = F.layer_norm(x.to(dt), mod.normalized_shape, None, None, mod.eps)
            return affine_terms(xhat, g, attrs, b, d)
        out = {}
        if "weight" in attrs:  # (x - mean) * rstd * g, in one temporary, summed over the tokens
            t = (as_dtype(x, dt) - as_dtype(st[0], dt)).mul_(as_dtype(st[1], dt)).mul_(g)
            out["weight"] = Dense(_rows(t, b, d).sum(1))
        if "bias" in attrs:
            out["bias"] = Dense(_rows(g, b, d).sum(1))
        return out


def _rows(t, b, d):
    """t as [b, tokens, d] (a [B, T, d] tensor as it is)."""
    return t if t.dim() == 3 and t.shape[2] == d else t.reshape(b, -1, d)
