"""HF ViT / DeiT embeddings (ViTEmbeddings, DeiTEmbeddings and their copies), matched by the code of their forward
(Note [exact-type rules]): the class token (and DeiT's distillation token) is concatenated before the patches, the
position embeddings are added, then dropout. With g the output's gradient [B, k + N, d] (k = 1 or 2 leading tokens):

  cls_token [1, 1, d]            grad_b = g_b[0]                                   (Dense)
  distillation_token [1, 1, d]   grad_b = g_b[1]
  position_embeddings [1, k+N, d] grad_b = g_b
  mask_token [1, 1, d]           grad_b = sum_t mask_bt g_b[k + t] (bool_masked_pos given; 0 otherwise)

A call with interpolate_pos_encoding=True (the table resampled to another image size) or an active dropout (a random
mask the rule cannot replay) is refused. The patch projection is a Conv2d child with its own rule.
"""
from __future__ import annotations

import torch
from torch import nn

from ..registry import Rule, register_pattern, same_code
from ..terms import Dense, compute_dtype
from .refused import Refused


# The references, in class bodies like the code they are compared with.
class _ViT(nn.Module):
    def forward(
        self,
        pixel_values: torch.Tensor,
        bool_masked_pos: torch.BoolTensor | None = None,
        interpolate_pos_encoding: bool = False,
    ) -> torch.Tensor:
        batch_size, num_channels, height, width = pixel_values.shape
        embeddings = self.patch_embeddings(pixel_values)

        if bool_masked_pos is not None:
            seq_length = embeddings.shape[1]
            mask_tokens = self.mask_token.expand(batch_size, seq_length, -1)
            # replace the masked visual tokens by mask_tokens
            mask = bool_masked_pos.unsqueeze(-1).type_as(mask_tokens)
            embeddings = embeddings * (1.0 - mask) + mask_tokens * mask

        # add the [CLS] token to the embedded patch tokens
        cls_tokens = self.cls_token.expand(batch_size, -1, -1)
        embeddings = torch.cat((cls_tokens, embeddings), dim=1)

        if interpolate_pos_encoding:
            embeddings = embeddings + self.interpolate_pos_encoding(embeddings, height, width)
        else:
            if height != self.image_size[0] or width != self.image_size[1]:
                raise ValueError(
                    f"Input image size ({height}*{width}) doesn't match model"
                    f" ({self.image_size[0]}*{self.image_size[1]})."
                )
            embeddings = embeddings + self.position_embeddings

        embeddings = self.dropout(embeddings)

        return embeddings


class _DeiT(nn.Module):
    def forward(
        self,
        pixel_values: torch.Tensor,
        bool_masked_pos: torch.BoolTensor | None = None,
        interpolate_pos_encoding: bool = False,
    ) -> torch.Tensor:
        _, _, height, width = pixel_values.shape
        embeddings = self.patch_embeddings(pixel_values)

        batch_size, seq_length, _ = embeddings.size()

        if bool_masked_pos is not None:
            mask_tokens = self.mask_token.expand(batch_size, seq_length, -1)
            # replace the masked visual tokens by mask_tokens
            mask = bool_masked_pos.unsqueeze(-1).type_as(mask_tokens)
            embeddings = embeddings * (1.0 - mask) + mask_tokens * mask

        cls_tokens = self.cls_token.expand(batch_size, -1, -1)
        distillation_tokens = self.distillation_token.expand(batch_size, -1, -1)
        embeddings = torch.cat((cls_tokens, distillation_tokens, embeddings), dim=1)

        if interpolate_pos_encoding:
            embeddings = embeddings + self.interpolate_pos_encoding(embeddings, height, width)
        else:
            if height != self.image_size[0] or width != self.image_size[1]:
                raise ValueError(
                    f"Input image size ({height}*{width}) doesn't match model"
                    f" ({self.image_size[0]}*{self.image_size[1]})."
                )
            embeddings = embeddings + self.position_embeddings

        embeddings = self.dropout(embeddings)
        return embeddings


class ViTEmbeddingsRule(Rule):
    params = ("cls_token", "distillation_token", "position_embeddings", "mask_token")
    batch_dim_applies = False

    def is_batched(self, mod, x):
        return x.dim() == 4

    def keep(self, mod, x, args=(), kwargs=None):
        kw = dict(kwargs or {})
        rest = list(args[1:])
        mask = rest.pop(0) if rest else kw.get("bool_masked_pos")
        interpolate = rest.pop(0) if rest else kw.get("interpolate_pos_encoding", False)
        if interpolate:
            raise Refused("interpolate_pos_encoding=True: the position table is resampled to the image size; no "
                          "per-sample rule for that resampling")
        if mod.dropout.training and mod.dropout.p > 0:
            raise Refused("the embeddings' dropout is active (training mode, p > 0): a random mask the rule cannot "
                          "replay")
        return None if mask is None else mask.detach()

    def terms(self, mod, mask, g, attrs):
        dt = compute_dtype(g)
        g = g.to(dt)
        k = 2 if getattr(mod, "distillation_token", None) is not None else 1
        out = {}
        if "cls_token" in attrs:
            out["cls_token"] = Dense(g[:, 0])
        if "distillation_token" in attrs:
            out["distillation_token"] = Dense(g[:, 1])
        if "position_embeddings" in attrs:
            out["position_embeddings"] = Dense(g.reshape(g.shape[0], -1))
        if "mask_token" in attrs:
            if mask is None:
                out["mask_token"] = Dense(torch.zeros(g.shape[0], g.shape[-1], dtype=dt, device=g.device))
            else:
                m = mask.reshape(g.shape[0], -1, 1).to(dt)
                out["mask_token"] = Dense((g[:, k:] * m).sum(1))
        return out


def _match(ref):
    def match(mod: nn.Module) -> bool:
        return (isinstance(getattr(mod, "cls_token", None), nn.Parameter) and isinstance(getattr(mod, "dropout", None),
                                                                                          nn.Dropout)
                and same_code(type(mod).forward, ref))
    return match


register_pattern("HF ViT-style embeddings (class token, position table)", _match(_ViT.forward), ViTEmbeddingsRule())
register_pattern("HF DeiT-style embeddings (class and distillation tokens, position table)", _match(_DeiT.forward),
                 ViTEmbeddingsRule())
