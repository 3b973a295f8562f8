"""timm VisionTransformer's class / register / distillation tokens and position table (VisionTransformer,
VisionTransformerDistilled: DeiT, DeiT III, ViT with registers), matched by the code of their _pos_embed. These are
parameters of the model itself, applied by that method, which ends in self.pos_drop(x): the rule reads the call of
pos_drop (Rule.hook_site), whose output's gradient g [B, prefix + N, D] is the embedded tokens' gradient (dropout
inactive). With P prefix tokens concatenated in the order class, register (or class, distillation) before the patches:

  cls_token [1, 1, D]     grad_b = g_b[0]
  reg_token [1, R, D]     grad_b = g_b[c : c + R]    (c = 1 with a class token)
  dist_token [1, 1, D]    grad_b = g_b[1]
  pos_embed [1, P+N, D]   grad_b = g_b               (no_embed_class: [1, N, D], grad_b = g_b[P:], added before
                                                    the concatenation)

Refused: dynamic_img_size (the table is resampled to each input's grid), a model without a position table
(_pos_embed then returns before pos_drop), pos_drop active in training (a random mask the rule cannot replay)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict

import torch
from torch import nn

from ..registry import Rule, register_pattern, same_code
from ..terms import Dense, Term, compute_dtype
from .refused import Refused

if TYPE_CHECKING:  # never run: the references' global name, compared by name as in timm
    from timm.layers import resample_abs_pos_embed  # noqa: F401


class _VisionTransformer(nn.Module):  # timm.models.vision_transformer.VisionTransformer
    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        """Apply positional embedding to input."""
        to_cat = []
        if self.cls_token is not None:
            to_cat.append(self.cls_token.expand(x.shape[0], -1, -1))
        if self.reg_token is not None:
            to_cat.append(self.reg_token.expand(x.shape[0], -1, -1))

        if self.pos_embed is None:
            return torch.cat(to_cat + [x.view(x.shape[0], -1, x.shape[-1])], dim=1)

        if self.dynamic_img_size:
            B, H, W, C = x.shape
            prev_grid_size = self.patch_embed.grid_size
            pos_embed = resample_abs_pos_embed(
                self.pos_embed,
                new_size=(H, W),
                old_size=prev_grid_size,
                num_prefix_tokens=0 if self.no_embed_class else self.num_prefix_tokens,
            )
            x = x.view(B, -1, C)
        else:
            pos_embed = self.pos_embed

        if self.no_embed_class:
            # deit-3, updated JAX (big vision)
            # position embedding does not overlap with class token, add then concat
            x = x + pos_embed
            if to_cat:
                x = torch.cat(to_cat + [x], dim=1)
        else:
            # original timm, JAX, and deit vit impl
            # pos_embed has entry for class token, concat then add
            if to_cat:
                x = torch.cat(to_cat + [x], dim=1)
            x = x + pos_embed

        return self.pos_drop(x)


class _VisionTransformerDistilled(nn.Module):  # timm.models.deit.VisionTransformerDistilled

    def _pos_embed(self, x):
        if self.dynamic_img_size:
            B, H, W, C = x.shape
            prev_grid_size = self.patch_embed.grid_size
            pos_embed = resample_abs_pos_embed(
                self.pos_embed,
                new_size=(H, W),
                old_size=prev_grid_size,
                num_prefix_tokens=0 if self.no_embed_class else self.num_prefix_tokens,
            )
            x = x.view(B, -1, C)
        else:
            pos_embed = self.pos_embed
        if self.no_embed_class:
            # deit-3, updated JAX (big vision)
            # position embedding does not overlap with class token, add then concat
            x = x + pos_embed
            x = torch.cat((
                self.cls_token.expand(x.shape[0], -1, -1),
                self.dist_token.expand(x.shape[0], -1, -1),
                x),
                dim=1)
        else:
            # original timm, JAX, and deit vit impl
            # pos_embed has entry for class token, concat then add
            x = torch.cat((
                self.cls_token.expand(x.shape[0], -1, -1),
                self.dist_token.expand(x.shape[0], -1, -1),
                x),
                dim=1)
            x = x + pos_embed
        return self.pos_drop(x)



class TimmViTTokensRule(Rule):
    """The tokens and position table a timm VisionTransformer applies in _pos_embed, read at its pos_drop."""

    def __init__(self, distilled: bool):
        self.distilled = distilled

    def param_paths(self, mod):
        names = ("cls_token", "dist_token", "pos_embed") if self.distilled else ("cls_token", "reg_token", "pos_embed")
        return tuple(a for a in names if isinstance(mod._parameters.get(a), nn.Parameter))

    def hook_site(self, mod):
        return mod.pos_drop

    def check(self, mod):
        if getattr(mod, "dynamic_img_size", False):
            return ("dynamic_img_size=True: the position table is resampled to each input's grid; no per-sample rule "
                    "for that resampling")
        if mod.pos_embed is None:
            return ("no position table: _pos_embed returns the tokens without calling pos_drop, where the rule reads "
                    "their gradient")
        return None

    def keep(self, mod, x, args=(), kwargs=None):
        drop = getattr(mod, "pos_drop", None)
        if isinstance(drop, nn.Dropout) and drop.training and drop.p > 0:
            raise Refused("the position dropout is active (training mode, p > 0): a random mask the rule cannot "
                          "replay")
        return None

    def terms(self, mod, kept, g, attrs):
        g = g.to(compute_dtype(g))
        prefix = 2 if self.distilled else mod.num_prefix_tokens
        out: Dict[str, Term] = {}
        if "cls_token" in attrs:
            out["cls_token"] = Dense(g[:, 0])
        if "dist_token" in attrs:
            out["dist_token"] = Dense(g[:, 1])
        if "reg_token" in attrs:
            c = 1 if mod.cls_token is not None else 0
            out["reg_token"] = Dense(g[:, c:c + mod.reg_token.shape[1]])
        if "pos_embed" in attrs:
            out["pos_embed"] = Dense(g[:, prefix:] if mod.no_embed_class else g)
        return out


def _match(ref):
    return lambda mod: (isinstance(getattr(mod, "pos_drop", None), nn.Module)
                        and same_code(getattr(type(mod), "_pos_embed", None), ref))


register_pattern("timm VisionTransformer (tokens and position table, read at pos_drop)",
                 _match(_VisionTransformer._pos_embed), TimmViTTokensRule(distilled=False))
register_pattern("timm VisionTransformerDistilled (tokens and position table, read at pos_drop)",
                 _match(_VisionTransformerDistilled._pos_embed), TimmViTTokensRule(distilled=True))
