"""HF ViT / DeiT embeddings (ViTEmbeddings, DeiTEmbeddings and their copies), matched by the code of their forward
(Note [exact-type rules]): the class token (and DeiT's distillation token) is concatenated before the patches, the
position embeddings are added, then dropout. With g the output's gradient [B, k + N, d] (k = 1 or 2 leading tokens):

  cls_token [1, 1, d]            grad_b = g_b[0]                                   (Dense)
  distillation_token [1, 1, d]   grad_b = g_b[1]
  position_embeddings [1, k+N, d] grad_b = g_b
  mask_token [1, 1, d]           grad_b = sum_t mask_bt g_b[k + t] (bool_masked_pos given; 0 otherwise)

A call with interpolate_pos_encoding=True (the table resampled to another image size) or an active dropout (a random
mask the rule cannot replay) is refused. The patch projection is a Conv2d child with its own rule.

HF DINOv2 embeddings (Dinov2Embeddings and copies, by the code of their forward and interpolate_pos_encoding): the same
tokens, the table added as is when interpolate_pos_encoding returns it unchanged (as many patches as the table, a
square image), refused when it resamples it. HF CLIP vision embeddings (CLIPVisionEmbeddings and copies): the class
embedding [d], grad_b = g_b[0]; the position table is an Embedding child with its rule.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..registry import Rule, register_pattern, same_code
from ..terms import Dense, compute_dtype
from .refused import Refused

if TYPE_CHECKING:  # never run: the references' global name, compared by name as in transformers
    from transformers.utils import torch_int  # noqa: F401


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


class _CLIPVision(nn.Module):  # transformers' CLIPVisionEmbeddings
    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding=False) -> torch.Tensor:
        batch_size, _, height, width = pixel_values.shape
        if not interpolate_pos_encoding and (height != self.image_size or width != self.image_size):
            raise ValueError(
                f"Input image size ({height}*{width}) doesn't match model ({self.image_size}*{self.image_size})."
            )
        target_dtype = self.patch_embedding.weight.dtype
        patch_embeds = self.patch_embedding(pixel_values.to(dtype=target_dtype))  # shape = [*, width, grid, grid]
        patch_embeds = patch_embeds.flatten(2).transpose(1, 2)

        class_embeds = self.class_embedding.expand(batch_size, 1, -1)
        embeddings = torch.cat([class_embeds, patch_embeds], dim=1)
        if interpolate_pos_encoding:
            embeddings = embeddings + self.interpolate_pos_encoding(embeddings, height, width)
        else:
            embeddings = embeddings + self.position_embedding(self.position_ids)
        return embeddings



class _Dinov2(nn.Module):  # transformers' Dinov2Embeddings, verbatim (its docstring is part of the code compared)
    def forward(
        self,
        pixel_values: torch.Tensor,
        bool_masked_pos: torch.BoolTensor | None = None,
    ) -> torch.Tensor:
        _, _, height, width = pixel_values.shape
        embeddings = self.patch_embeddings(pixel_values)
        batch_size, seq_len, _ = embeddings.size()

        if bool_masked_pos is not None:
            mask_tokens = self.mask_token.expand(batch_size, seq_len, -1)
            # replace the masked visual tokens by mask_tokens
            mask = bool_masked_pos.unsqueeze(-1).type_as(mask_tokens)
            embeddings = embeddings * (1 - mask) + mask_tokens * mask

        cls_tokens = self.cls_token.expand(batch_size, -1, -1)
        embeddings = torch.cat((cls_tokens, embeddings), dim=1)

        if self.position_embeddings is not None:
            embeddings = embeddings + self.interpolate_pos_encoding(embeddings, height, width)

        embeddings = self.dropout(embeddings)

        return embeddings

    def interpolate_pos_encoding(self, embeddings: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """
        This method allows to interpolate the pre-trained position encodings, to be able to use the model on higher resolution
        images. This method is also adapted to support torch.jit tracing and interpolation at torch.float32 precision.

        Adapted from:
        - https://github.com/facebookresearch/dino/blob/de9ee3df6cf39fac952ab558447af1fa1365362a/vision_transformer.py#L174-L194, and
        - https://github.com/facebookresearch/dinov2/blob/e1277af2ba9496fbadf7aec6eba56e8d882d1e35/dinov2/models/vision_transformer.py#L179-L211
        """

        num_patches = embeddings.shape[1] - 1
        num_positions = self.position_embeddings.shape[1] - 1

        # always interpolate when tracing to ensure the exported model works for dynamic input shapes
        if not torch.jit.is_tracing() and num_patches == num_positions and height == width:
            return self.position_embeddings

        class_pos_embed = self.position_embeddings[:, :1]
        patch_pos_embed = self.position_embeddings[:, 1:]
        dim = embeddings.shape[-1]
        patch_height, patch_width = self.patch_embeddings.patch_size
        new_height = height // patch_height
        new_width = width // patch_width

        sqrt_num_positions = torch_int(num_positions**0.5)
        patch_pos_embed = patch_pos_embed.reshape(1, sqrt_num_positions, sqrt_num_positions, dim)
        patch_pos_embed = patch_pos_embed.permute(0, 3, 1, 2)
        # interpolate in float32; bicubic resampling in half precision shifts the embeddings
        target_dtype = patch_pos_embed.dtype
        patch_pos_embed = nn.functional.interpolate(
            patch_pos_embed.to(torch.float32),
            size=(new_height, new_width),
            mode="bicubic",
            align_corners=False,
        ).to(dtype=target_dtype)
        patch_pos_embed = patch_pos_embed.permute(0, 2, 3, 1).view(1, -1, dim)
        return torch.cat((class_pos_embed, patch_pos_embed), dim=1)


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


class ClassEmbeddingRule(Rule):
    """CLIP's class_embedding [d], concatenated before the patches: grad_b = g_b[0]. The position embedding is an
    Embedding child with its rule, the patch projection a Conv2d child."""

    params = ("class_embedding",)
    batch_dim_applies = False

    def is_batched(self, mod, x):
        return x.dim() == 4

    def keep(self, mod, x, args=(), kwargs=None):
        return None

    def terms(self, mod, kept, g, attrs):
        return {"class_embedding": Dense(g.to(compute_dtype(g))[:, 0])}


class Dinov2EmbeddingsRule(ViTEmbeddingsRule):
    """DINOv2's embeddings: as ViT's, the position table added as is only when interpolate_pos_encoding returns it
    unchanged (as many patches as the table, a square image, not tracing); a resampled table is refused."""

    params = ("cls_token", "position_embeddings", "mask_token")

    def keep(self, mod, x, args=(), kwargs=None):
        kw = dict(kwargs or {})
        rest = list(args[1:])
        mask = rest.pop(0) if rest else kw.get("bool_masked_pos")
        if mod.position_embeddings is not None:
            ph, pw = mod.patch_embeddings.patch_size
            h, w = x.shape[-2:]
            if torch.jit.is_tracing() or h != w or (h // ph) * (w // pw) != mod.position_embeddings.shape[1] - 1:
                raise Refused("the position table is resampled to this image size (interpolate_pos_encoding); no "
                              "per-sample rule for that resampling")
        if mod.dropout.training and mod.dropout.p > 0:
            raise Refused("the embeddings' dropout is active (training mode, p > 0): a random mask the rule cannot "
                          "replay")
        return None if mask is None else mask.detach()


register_pattern("HF CLIP-style vision embeddings (class embedding)",
                 lambda mod: (isinstance(mod._parameters.get("class_embedding"), nn.Parameter)
                              and same_code(type(mod).forward, _CLIPVision.forward)), ClassEmbeddingRule())
register_pattern("HF DINOv2-style embeddings (class and mask tokens, position table)",
                 lambda mod: (_match(_Dinov2.forward)(mod)
                              and same_code(type(mod).interpolate_pos_encoding, _Dinov2.interpolate_pos_encoding)),
                 Dinov2EmbeddingsRule())
