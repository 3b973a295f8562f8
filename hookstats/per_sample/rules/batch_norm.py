"""nn.BatchNorm1d / 2d / 3d (and timm's BatchNormAct2d) in eval mode with running statistics: a per-channel affine
map y = xhat * weight + bias with xhat = (x - running_mean) / sqrt(running_var + eps) the same for every sample:
grad weight_b[c] = sum over the sample's positions of g * xhat, grad bias_b[c] = sum of g (Dense).

In training mode (or without running statistics) BatchNorm normalises with the batch's statistics: every sample's
output depends on every other sample, so a per-sample gradient of the layer is not defined; such a call is refused
at run time (Refused), and the model's other norms then are each sample's share of the batch gradient, not the
gradient of a per-sample loss.

timm's BatchNormAct2d applies BatchNorm, then its own `drop` and `act` modules: the gradient at the BatchNorm output is
the vector-Jacobian product of drop and act at the recomputed BatchNorm output (autograd on those two modules, on a
copy: an in-place activation is left as it runs in the model).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Rule, register_rule
from ..terms import Dense, compute_dtype
from .refused import Refused

TRAINING = ("BatchNorm in training mode (or without running statistics) normalises with the batch's statistics, "
            "mixing the samples: no per-sample gradient is defined (model.eval() makes it a per-channel affine map, "
            "covered; or use GroupNorm / LayerNorm)")


class BatchNormRule(Rule):
    batch_dim_applies = False

    def is_batched(self, mod, x):
        return x.dim() >= 2

    def keep(self, mod, x, args=(), kwargs=None):
        if mod.training or mod.running_mean is None or mod.running_var is None:
            raise Refused(TRAINING)
        return x

    def _gradient_at_norm(self, mod, y, g):
        return g

    def terms(self, mod, x, g, attrs):
        dt = compute_dtype(x)
        b, c = x.shape[:2]
        xhat = F.batch_norm(x.to(dt), mod.running_mean.to(dt), mod.running_var.to(dt), None, None, False, 0.0,
                            mod.eps)
        g = self._gradient_at_norm(mod, x, g).to(dt).reshape(b, c, -1)
        out = {}
        if "weight" in attrs:
            out["weight"] = Dense((g * xhat.reshape(b, c, -1)).sum(2))
        if "bias" in attrs:
            out["bias"] = Dense(g.sum(2))
        return out


register_rule([nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d], BatchNormRule())


@register_rule("timm.layers.norm_act.BatchNormAct2d")
class BatchNormActRule(BatchNormRule):
    def keep(self, mod, x, args=(), kwargs=None):
        x = super().keep(mod, x, args, kwargs)
        if mod.drop.training and not isinstance(mod.drop, nn.Identity):
            raise Refused("BatchNormAct2d with its drop module in training mode: a random mask the rule cannot "
                          "replay")
        return x

    def _gradient_at_norm(self, mod, x, g):
        with torch.enable_grad():
            y = F.batch_norm(x, mod.running_mean, mod.running_var, mod.weight.detach(),
                             None if mod.bias is None else mod.bias.detach(), False, 0.0, mod.eps).requires_grad_()
            z = mod.act(mod.drop(y.clone()))
            return torch.autograd.grad(z, y, g)[0]
