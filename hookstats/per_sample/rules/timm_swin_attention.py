"""timm Swin's relative-position table (WindowAttention, matched by the code of its forward and _get_rel_pos_bias):
the table's gradient per window from the scores' gradient, as for HF Swin (Note [relative-position table] in
hf_swin_attention.py). The module's qkv and proj are Linear children with their own rule; the table is its own
parameter. Refused: attention or projection dropout in training, a fused kernel that keeps no probabilities."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..registry import Rule, register_pattern, register_refusal, same_code
from .hf_swin_attention import kept_probabilities, table_term
from .refused import _REL_POS, Refused


class _WindowAttention(nn.Module):  # timm.models.swin_transformer.WindowAttention
    def _get_rel_pos_bias(self) -> torch.Tensor:
        relative_position_bias = self.relative_position_bias_table[
            self.relative_position_index.view(-1)].view(self.window_area, self.window_area, -1)  # Wh*Ww,Wh*Ww,nH
        relative_position_bias = relative_position_bias.permute(2, 0, 1).contiguous()  # nH, Wh*Ww, Wh*Ww
        return relative_position_bias.unsqueeze(0)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward pass.

        Args:
            x: Input features with shape of (num_windows*B, N, C).
            mask: (0/-inf) mask with shape of (num_windows, Wh*Ww, Wh*Ww) or None.

        Returns:
            Output features with shape of (num_windows*B, N, C).
        """
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)

        if self.fused_attn:
            attn_mask = self._get_rel_pos_bias()
            if mask is not None:
                num_win = mask.shape[0]
                mask = mask.view(1, num_win, 1, N, N).expand(B_ // num_win, -1, self.num_heads, -1, -1)
                attn_mask = attn_mask + mask.reshape(-1, self.num_heads, N, N)
            x = torch.nn.functional.scaled_dot_product_attention(
                q, k, v,
                attn_mask=attn_mask,
                dropout_p=self.attn_drop.p if self.training else 0.,
            )
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn + self._get_rel_pos_bias()
            if mask is not None:
                num_win = mask.shape[0]
                attn = attn.view(-1, num_win, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
                attn = attn.view(-1, self.num_heads, N, N)
            attn = self.softmax(attn)
            attn = self.attn_drop(attn)
            x = attn @ v

        x = x.transpose(1, 2).reshape(B_, N, -1)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class TimmWindowAttentionTableRule(Rule):
    params = ("relative_position_bias_table",)

    def keep_call(self, mod, x, args, kwargs, output):
        for drop in (mod.attn_drop, mod.proj_drop):
            if mod.training and drop.p > 0:
                raise Refused("the attention's dropout is active (training mode, p > 0): a random mask the rule "
                              "cannot replay")
        if not isinstance(mod.softmax, nn.Softmax) or mod.softmax.dim not in (-1, 3):
            raise Refused("the attention's softmax is not nn.Softmax(dim=-1)")
        return kept_probabilities(output, x.shape[0], mod.num_heads, x.shape[1])

    def terms(self, mod, kept, g, attrs):
        return {"relative_position_bias_table": table_term(kept, g, mod.proj.weight, mod.num_heads,
                                                           mod.relative_position_index,
                                                           mod.relative_position_bias_table.shape[0])}


def timm_window_attention(mod: nn.Module) -> bool:
    cls = type(mod)
    return (isinstance(mod._parameters.get("relative_position_bias_table"), nn.Parameter)
            and isinstance(getattr(mod, "proj", None), nn.Linear)
            and same_code(getattr(cls, "forward", None), _WindowAttention.forward)
            and same_code(getattr(cls, "_get_rel_pos_bias", None), _WindowAttention._get_rel_pos_bias))


register_pattern("timm Swin WindowAttention (the relative-position table)", timm_window_attention,
                 TimmWindowAttentionTableRule())
register_refusal(lambda name, mod: type(mod).__module__.startswith("timm.")
                 and isinstance(mod._parameters.get("relative_position_bias_table"), nn.Parameter)
                 and not timm_window_attention(mod), _REL_POS)
