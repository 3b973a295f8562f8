"""timm StdConv2d / StdConv2dSame: weight standardisation, y = conv(x, (W - mean) / sqrt(var + eps)) per output
channel (F.batch_norm over each filter's C k values, biased variance).

The conv rule gives the per-sample gradient D_b of the standardised weight (as an Outer term); the parameter's is its
vector-Jacobian product through the standardisation, per filter row: (D - mean(D) - What * mean(D * What)) / sigma.
That map is the same for every sample, but not a row scaling, so the per-sample gradient is materialised here
([B, O, C k], a Dense term): B times the layer's weight, as Opacus keeps for every layer.
"""
from __future__ import annotations

import torch

from ..registry import Rule, register_rule
from ..terms import Dense
from .conv import conv_terms
from .timm_conv2d_same import same_pad


class _StdConv(Rule):
    batch_dim_applies = False

    def is_batched(self, mod, x):
        return x.dim() == 4

    def terms(self, mod, x, g, attrs):
        pad = same_pad(x, mod.kernel_size, mod.stride, mod.dilation) if getattr(mod, "same_pad", False) else None
        out = conv_terms(mod, x, g, attrs, pad=pad)
        if "weight" in out:
            t = out["weight"]  # Dense [B, O * C k / G], or Outer L [B, G, L, O/G], R [B, G, L, K]
            if isinstance(t, Dense):
                d = t.D.reshape(t.D.shape[0], mod.out_channels, -1)
            else:
                d = torch.matmul(t.L.transpose(2, 3), t.R).reshape(t.L.shape[0], mod.out_channels, -1)
            w = mod.weight.detach().to(d.dtype).reshape(mod.out_channels, -1)
            mean = w.mean(1, keepdim=True)
            var = w.var(1, unbiased=False, keepdim=True)
            sigma = (var + mod.eps).sqrt()
            what = (w - mean) / sigma
            d = (d - d.mean(2, keepdim=True) - what * (d * what).mean(2, keepdim=True)) / sigma
            out["weight"] = Dense(d)
        return out


@register_rule("timm.layers.std_conv.StdConv2d")
class StdConv2dRule(_StdConv):
    pass


@register_rule("timm.layers.std_conv.StdConv2dSame")
class StdConv2dSameRule(_StdConv):
    pass
