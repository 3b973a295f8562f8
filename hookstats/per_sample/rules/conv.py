"""nn.Conv1d / Conv2d / Conv3d: the Linear rule on the unfolded input, one block per group: grad W_b[group] =
sum_l g_bl u_bl^T with u the [C_in k / groups] patch of output position l (Outer, G = groups), or those per-sample
gradients themselves when they are the smaller tensor (Dense); grad b_b = sum_l g_bl.
Any stride, dilation, groups, numeric / "same" / "valid" padding and padding mode."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Rule, register_rule
from ..terms import Dense, Outer, as_dtype, compute_dtype
from ..workspace import scratch


def conv_terms(mod, x, g, attrs, pad=None):
    """Terms of a conv whose input x [B, C, ...] is padded by `pad` (F.pad order) when given, then as the module
    pads it.

    When the per-sample weight gradients are no larger than the patches (out_channels / groups <= output positions,
    the early layers of a CNN), they are computed directly, as a Dense term, by the conv's own weight-gradient
    kernel run with the batch folded into the groups (mkldnn / cuDNN: 1.5-4x faster than unfolding here); otherwise
    the input is unfolded and the weight's term is an Outer one (Gram products, no per-sample gradient)."""
    nd = x.dim() - 2
    dt = compute_dtype(x)
    b, groups = x.shape[0], mod.groups
    length = math.prod(g.shape[2:])
    out = {}
    if "weight" in attrs and mod.out_channels // groups <= length and x.shape[1] // groups <= 4:
        # few input channels per group (a first layer on RGB): the grouped kernel runs B * O tiny convolutions, the
        # products of the gradient with the (small) patches are 2-4x faster
        u = unfold(mod, x.to(dt), nd, pad)  # [B, C_in * K, L]
        ck = u.shape[1]
        a = u.reshape(b * groups, ck // groups, length)
        gg = g.to(dt).reshape(b * groups, mod.out_channels // groups, length)
        # patches as the left factor: [C_in K / G, L] x [L, O / G], 1.3-1.5x faster than the transposed product
        out["weight"] = Dense(torch.bmm(a, gg.transpose(1, 2)).transpose(1, 2).reshape(b, -1))
    elif "weight" in attrs and mod.out_channels // groups <= length:
        xp, p = padded(mod, x.to(dt), nd, pad)
        c = xp.shape[1]
        wshape = (b * mod.out_channels, c // groups, *mod.kernel_size)
        _, gw, _ = torch.ops.aten.convolution_backward(
            g.to(dt).reshape(1, b * mod.out_channels, *g.shape[2:]), xp.reshape(1, b * c, *xp.shape[2:]),
            torch.empty(wshape, dtype=dt, device=x.device), None, mod.stride, p, mod.dilation, False, (0,) * nd,
            b * groups, (False, True, False))
        out["weight"] = Dense(gw.reshape(b, -1))
    elif "weight" in attrs:
        u = unfold(mod, x.to(dt), nd, pad)  # [B, C_in * K, L]
        ck = u.shape[1]
        a = u.reshape(b, groups, ck // groups, length).transpose(2, 3)  # [B, G, L, C_in K / G]
        gg = g.to(dt).reshape(b, groups, mod.out_channels // groups, length).transpose(2, 3)  # [B, G, L, O / G]
        out["weight"] = Outer(gg, a)
    if "bias" in attrs:
        out["bias"] = Dense(as_dtype(g, dt).reshape(b, mod.out_channels, -1).sum(2))
    return out


class ConvRule(Rule):
    batch_dim_applies = False
    # the bias too (Note [book-keeping]): a conv's backward on the CPU (mkldnn) computes the weight gradient whenever
    # the bias's is asked for, so deferring the weight alone saves nothing there
    defer = ("weight", "bias")
    nd = 2

    def is_batched(self, mod, x):
        return x.dim() == self.nd + 2

    def terms(self, mod, x, g, attrs):
        return conv_terms(mod, x, g, attrs)


@register_rule(nn.Conv1d)
class Conv1dRule(ConvRule):
    nd = 1


@register_rule(nn.Conv2d)
class Conv2dRule(ConvRule):
    nd = 2


@register_rule(nn.Conv3d)
class Conv3dRule(ConvRule):
    nd = 3


def padded(mod, x: torch.Tensor, nd: int, pad=None):
    """(x padded by `pad` and by the module when that is not a plain zero padding, the zero padding still to do)."""
    k, d = mod.kernel_size, mod.dilation
    if pad is not None:  # an explicit (dynamic) padding first, then the module's own
        x = F.pad(x, pad)
    if mod.padding_mode != "zeros":
        return F.pad(x, mod._reversed_padding_repeated_twice, mode=mod.padding_mode), (0,) * nd
    if mod.padding == "same":
        pads = []
        for i in reversed(range(nd)):
            total = d[i] * (k[i] - 1)
            pads += [total // 2, total - total // 2]
        return F.pad(x, pads), (0,) * nd
    if mod.padding == "valid":
        return x, (0,) * nd
    return x, tuple(mod.padding)


def unfold(mod, x: torch.Tensor, nd: int, pad=None) -> torch.Tensor:
    """The im2col patches of a conv input, [B, C_in * prod(kernel), L] (channel-major, as the weight flattens), with
    the module's padding (numeric, 'same', 'valid', or a non-zeros padding_mode) or the explicit `pad`, stride and
    dilation."""
    k, s, d = mod.kernel_size, mod.stride, mod.dilation
    x, p = padded(mod, x, nd, pad)
    # Windows by Tensor.unfold (views; dilation by striding inside each window), copied once by the reshape:
    # 2-5x faster on CPU than F.unfold's im2col
    if any(p):  # zeros around a copy, in a workspace buffer
        xp = scratch((*x.shape[:2], *(n + 2 * q for n, q in zip(x.shape[2:], p))), x.dtype, x.device)
        xp.zero_()
        xp[(..., *(slice(q, q + n) for n, q in zip(x.shape[2:], p)))].copy_(x)
        x = xp
    b, c = x.shape[:2]
    for i in range(nd):
        x = x.unfold(2 + i, d[i] * (k[i] - 1) + 1, s[i])
        if d[i] > 1:
            x = x[..., ::d[i]]
    lens = x.shape[2:2 + nd]
    # [B, C, L..., k...] -> [B, C * prod(k), prod(L)], copied into a workspace buffer (no fresh memory to fault in)
    x = x.permute(0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))
    flat = (b, c * math.prod(k), math.prod(lens))
    if x.is_contiguous():
        return x.reshape(flat)
    out = scratch(tuple(x.shape), x.dtype, x.device)
    out.copy_(x)
    return out.view(flat)
