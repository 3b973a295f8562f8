"""Per-channel scales (layer scale) applied by multiplication, out = x * gamma over the channel dim, and timm's
GlobalResponseNorm; matched by the code of their forward (Note [exact-type rules]):

  timm LayerScale (channels last), LayerScale2d (NCHW)   grad_b = sum over positions of g_b * x_b   (Dense [B, C])
  HF Dinov2LayerScale and its copies (lambda1)            the same, channels last
  timm ConvNeXtBlock's gamma                              the same, with x the block's MLP output: the operand the
                                                          product x.mul(gamma) keeps for its backward, read from the
                                                          block's output graph (nothing recomputed)
  timm GlobalResponseNorm (ConvNeXt V2)                   out = x + bias + weight * x * n(x), n(x) = ||x||_spatial /
                                                          (mean_c ||x||_spatial + eps), a function of the sample
                                                          alone: weight_b = sum_pos g_b x_b n(x_b), bias_b = sum g_b

Refused: an in-place scale (inplace=True: x.mul_(gamma) overwrites the input the gradient needs), ConvNeXtBlock's
drop path in training (a random per-sample mask the rule cannot replay)."""
from __future__ import annotations

import torch
from torch import nn

from ..registry import Rule, register_pattern, same_code
from ..terms import Dense, compute_dtype
from .hf_swin_attention import graph_nodes
from .refused import Refused


class _LayerScale(nn.Module):  # timm.layers.layer_scale.LayerScale
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class _LayerScale2d(nn.Module):  # timm.layers.layer_scale.LayerScale2d
    def forward(self, x):
        gamma = self.gamma.view(1, -1, 1, 1)
        return x.mul_(gamma) if self.inplace else x * gamma


class _Dinov2LayerScale(nn.Module):  # transformers' Dinov2LayerScale
    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        return hidden_state * self.lambda1


class _ConvNeXtBlock(nn.Module):  # timm.models.convnext.ConvNeXtBlock
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Forward pass."""
        shortcut = x
        x = self.conv_dw(x)
        if self.use_conv_mlp:
            x = self.norm(x)
            x = self.mlp(x)
        else:
            x = x.permute(0, 2, 3, 1)
            x = self.norm(x)
            x = self.mlp(x)
            x = x.permute(0, 3, 1, 2)
        if self.gamma is not None:
            x = x.mul(self.gamma.reshape(1, -1, 1, 1))

        x = self.drop_path(x) + self.shortcut(shortcut)
        return x


class _GlobalResponseNorm(nn.Module):  # timm.layers.grn.GlobalResponseNorm
    def forward(self, x):
        x_g = x.norm(p=2, dim=self.spatial_dim, keepdim=True)
        x_n = x_g / (x_g.mean(dim=self.channel_dim, keepdim=True) + self.eps)
        return x + torch.addcmul(self.bias.view(self.wb_shape), self.weight.view(self.wb_shape), x * x_n)


def _scale_sum(x: torch.Tensor, g: torch.Tensor, channel_dim: int) -> Dense:
    """sum over every dim but the batch and the channel of g * x: [B, C]."""
    dt = compute_dtype(g)
    p = (g.to(dt) * x.to(dt)).movedim(channel_dim, -1)
    return Dense(p.reshape(p.shape[0], -1, p.shape[-1]).sum(1))


class ChannelScaleRule(Rule):
    """out = x * scale, the scale over the last dim (channels_first=False) or dim 1 of NCHW."""

    def __init__(self, param: str, channels_first: bool):
        self.params = (param,)
        self.channels_first = channels_first
        self.batch_dim_applies = not channels_first
        self.rowwise = not channels_first

    def is_batched(self, mod, x):
        return x.dim() == 4 if self.channels_first else x.dim() > 1

    def check(self, mod):
        if getattr(mod, "inplace", False):
            return ("the scale multiplies its input in place (inplace=True): the input its gradient needs is "
                    "overwritten by the product")
        return None

    def terms(self, mod, x, g, attrs):
        return {self.params[0]: _scale_sum(x, g, 1 if self.channels_first else -1)}


def _kept_product(out: torch.Tensor, gamma: nn.Parameter):
    """The other operand of the product by `gamma` (viewed / reshaped) that the block's output graph reached first."""
    for node in graph_nodes(out, 16):
        if type(node).__name__ == "MulBackward0":
            for nxt, _ in node.next_functions:
                while nxt is not None and type(nxt).__name__ in ("ViewBackward0", "ReshapeAliasBackward0",
                                                                  "UnsafeViewBackward0"):
                    nxt = nxt.next_functions[0][0]
                if nxt is not None and getattr(nxt, "variable", None) is gamma:
                    return node._saved_self
    raise Refused("the product by gamma was not found in the block's output graph")


class ConvNeXtGammaRule(Rule):
    params = ("gamma",)
    batch_dim_applies = False

    def is_batched(self, mod, x):
        return x.dim() == 4

    def keep_call(self, mod, x, args, kwargs, output):
        drop = mod.drop_path
        if mod.training and not isinstance(drop, nn.Identity) and getattr(drop, "drop_prob", 1.0) > 0:
            raise Refused("the block's drop path is active (training mode, drop_prob > 0): a random per-sample mask "
                          "the rule cannot replay")
        return _kept_product(output, mod.gamma).detach()

    def terms(self, mod, y, g, attrs):
        return {"gamma": _scale_sum(y, g, 1)}


class GlobalResponseNormRule(Rule):
    batch_dim_applies = False

    def is_batched(self, mod, x):
        return x.dim() == 4

    def terms(self, mod, x, g, attrs):
        dt = compute_dtype(g)
        x, g = x.to(dt), g.to(dt)
        x_g = x.norm(p=2, dim=mod.spatial_dim, keepdim=True)
        x_n = x_g / (x_g.mean(dim=mod.channel_dim, keepdim=True) + mod.eps)
        cd = 1 if mod.channel_dim == 1 else -1
        out = {}
        if "weight" in attrs:
            out["weight"] = _scale_sum(x * x_n, g, cd)
        if "bias" in attrs:
            out["bias"] = _scale_sum(torch.ones_like(x), g, cd)
        return out


def _by_code(ref, param: str, cls=nn.Parameter):
    return lambda mod: (isinstance(mod._parameters.get(param), cls)
                        and same_code(getattr(type(mod), "forward", None), ref))


register_pattern("timm LayerScale (channels last)", _by_code(_LayerScale.forward, "gamma"),
                 ChannelScaleRule("gamma", channels_first=False))
register_pattern("timm LayerScale2d (NCHW)", _by_code(_LayerScale2d.forward, "gamma"),
                 ChannelScaleRule("gamma", channels_first=True))
register_pattern("HF Dinov2LayerScale and its copies", _by_code(_Dinov2LayerScale.forward, "lambda1"),
                 ChannelScaleRule("lambda1", channels_first=False))
register_pattern("timm ConvNeXtBlock (its layer scale gamma)", _by_code(_ConvNeXtBlock.forward, "gamma"),
                 ConvNeXtGammaRule())
register_pattern("timm GlobalResponseNorm", _by_code(_GlobalResponseNorm.forward, "weight"), GlobalResponseNormRule())
