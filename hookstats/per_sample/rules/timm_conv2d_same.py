"""timm Conv2dSame: TensorFlow "SAME" padding computed from each input's size (pad_same), then a conv with padding
0: the conv rule on the input padded the same way."""
from __future__ import annotations

from ..registry import Rule, register_rule
from .conv import conv_terms


def same_pad(x, k, s, d):
    """F.pad amounts of timm's pad_same for x [B, C, H, W]."""
    pads = []
    for i in (1, 0):
        size = x.shape[2 + i]
        total = max((-(size // -s[i]) - 1) * s[i] + (k[i] - 1) * d[i] + 1 - size, 0)
        pads += [total // 2, total - total // 2]
    return pads


@register_rule("timm.layers.conv2d_same.Conv2dSame")
class Conv2dSameRule(Rule):
    batch_dim_applies = False

    def is_batched(self, mod, x):
        return x.dim() == 4

    def terms(self, mod, x, g, attrs):
        return conv_terms(mod, x, g, attrs, pad=same_pad(x, mod.kernel_size, mod.stride, mod.dilation))
