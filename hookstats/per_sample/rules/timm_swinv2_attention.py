"""timm Swin V2's WindowAttention (matched by the code of its forward): every parameter the module holds or applies
itself, from the gradient of its output and the probabilities and values its attention product keeps (Note [cosine
window attention] in hf_swinv2_attention.py): the fused qkv weight (applied by F.linear with the biases
cat(q_bias, k_bias, v_bias), not by calling the qkv Linear), q_bias, v_bias, logit_scale, the continuous
position-bias MLP, and the output projection (its input is the attention product of the window's rows, which the rule
recomputes from the kept probabilities and values: covered here rather than by the Linear rule, whose input would have
to be proved batch-major through the fused qkv map). The window rows [B * windows, N, C] of the module's input are a
view of the contiguous window partition (Note [flattened batches]). Refused: attention or projection dropout in
training, a softmax other than nn.Softmax(dim=-1)."""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Rule, register_pattern, same_code
from ..terms import Dense, Outer, Term, compute_dtype
from .hf_swin_attention import kept_probabilities
from .hf_swinv2_attention import cosine_window_grads, mlp_check, mlp_paths, mlp_terms
from .refused import Refused


class _WindowAttention(nn.Module):  # timm.models.swin_transformer_v2.WindowAttention
    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward pass of window attention.

        Args:
            x: Input features with shape of (num_windows*B, N, C).
            mask: Attention mask with shape of (num_windows, Wh*Ww, Wh*Ww) or None.

        Returns:
            Output features with shape of (num_windows*B, N, C).
        """
        B_, N, C = x.shape

        if self.q_bias is None:
            qkv = self.qkv(x)
        else:
            qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
            if self.qkv_bias_separate:
                qkv = self.qkv(x)
                qkv += qkv_bias
            else:
                qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)

        # cosine attention
        attn = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1))
        logit_scale = torch.clamp(self.logit_scale, max=math.log(1. / 0.01)).exp()
        attn = attn * logit_scale

        relative_position_bias_table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        relative_position_bias = relative_position_bias_table[self.relative_position_index.view(-1)].view(
            self.window_size[0] * self.window_size[1], self.window_size[0] * self.window_size[1], -1)  # Wh*Ww,Wh*Ww,nH
        relative_position_bias = relative_position_bias.permute(2, 0, 1).contiguous()  # nH, Wh*Ww, Wh*Ww
        relative_position_bias = 16 * torch.sigmoid(relative_position_bias)
        attn = attn + relative_position_bias.unsqueeze(0)

        if mask is not None:
            num_win = mask.shape[0]
            attn = attn.view(-1, num_win, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
            attn = self.softmax(attn)
        else:
            attn = self.softmax(attn)

        attn = self.attn_drop(attn)

        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class TimmSwinV2WindowAttentionRule(Rule):
    _P = "cpb_mlp."

    def param_paths(self, mod):
        own = tuple(a for a in ("q_bias", "v_bias", "logit_scale") if getattr(mod, a, None) is not None)
        lins = tuple(f"{c}.{a}" for c in ("qkv", "proj") for a in ("weight", "bias")
                     if getattr(getattr(mod, c), a) is not None)
        return lins + own + mlp_paths(mod.cpb_mlp, self._P)

    def check(self, mod):
        if not isinstance(mod.softmax, nn.Softmax) or mod.softmax.dim not in (-1, 3):
            return "the attention's softmax is not nn.Softmax(dim=-1)"
        return mlp_check(mod.cpb_mlp)

    def keep_call(self, mod, x, args, kwargs, output):
        for drop in (mod.attn_drop, mod.proj_drop):
            if mod.training and drop.p > 0:
                raise Refused("the attention's dropout is active (training mode, p > 0): a random mask the rule "
                              "cannot replay")
        return x, kept_probabilities(output, x.shape[0], mod.num_heads, x.shape[1])

    def terms(self, mod, kept, g, attrs):
        x, pv = kept
        dt = compute_dtype(g)
        w_, n, c = x.shape
        heads = mod.num_heads
        x, g = x.to(dt), g.to(dt)
        bias = mod.qkv.bias
        if mod.q_bias is not None:
            qb = torch.cat((mod.q_bias, mod.k_bias, mod.v_bias)).detach()
            bias = qb if bias is None else bias.detach() + qb
        qkv = F.linear(x, mod.qkv.weight[:2 * c].detach().to(dt), None if bias is None else bias[:2 * c].to(dt))
        q, k = qkv.reshape(w_, n, 2, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        w_o = mod.proj.weight.detach().to(dt)
        d_o = (g @ w_o).reshape(w_, n, heads, -1).transpose(1, 2)
        grads = cosine_window_grads(q, k, pv, d_o, mod.logit_scale, mod.cpb_mlp, mod.relative_coords_table,
                                    mod.relative_position_index, want_qkv=True)
        d_qkv = torch.stack((grads["dq"], grads["dk"], grads["dv"])).permute(1, 3, 0, 2, 4).reshape(w_, n, 3 * c)
        out: Dict[str, Term] = mlp_terms(grads, mod, mod.cpb_mlp, self._P, attrs)
        if "logit_scale" in attrs:
            out["logit_scale"] = Dense(grads["logit_scale"])
        if "q_bias" in attrs:
            out["q_bias"] = Dense(d_qkv[:, :, :c].sum(1))
        if "v_bias" in attrs:
            out["v_bias"] = Dense(d_qkv[:, :, 2 * c:].sum(1))
        if "qkv.weight" in attrs:
            out["qkv.weight"] = Outer(d_qkv, x)
        if "qkv.bias" in attrs:
            out["qkv.bias"] = Dense(d_qkv.sum(1))
        if "proj.weight" in attrs:
            p, v = pv
            ctx = torch.bmm(p.to(dt), v.to(dt)).reshape(w_, heads, n, -1).transpose(1, 2).reshape(w_, n, c)
            out["proj.weight"] = Outer(g, ctx)
        if "proj.bias" in attrs:
            out["proj.bias"] = Dense(g.sum(1))
        return out


def timm_v2_window_attention(mod: nn.Module) -> bool:
    return (isinstance(mod._parameters.get("logit_scale"), nn.Parameter)
            and isinstance(getattr(mod, "qkv", None), nn.Linear) and isinstance(getattr(mod, "proj", None), nn.Linear)
            and isinstance(getattr(mod, "cpb_mlp", None), nn.Sequential)
            and same_code(getattr(type(mod), "forward", None), _WindowAttention.forward))


register_pattern("timm Swin V2 WindowAttention (qkv, biases, logit scale, position-bias MLP, projection)",
                 timm_v2_window_attention, TimmSwinV2WindowAttentionRule())
