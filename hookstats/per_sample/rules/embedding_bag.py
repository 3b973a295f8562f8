"""nn.EmbeddingBag, modes "sum" and "mean", with a 2-D input [B, L] (one bag per sample): row v of grad W_b is
sum_{t: idx_bt = v} c_bt g_b, c = per_sample_weights ("sum") or 1 / (non-padding entries of the bag) ("mean")
(Index). Mode "max" is refused (the gradient goes to each dimension's argmax row), and so is a 1-D input with
offsets (ragged bags: pass [B, L] ids with padding_idx instead)."""
from __future__ import annotations

import torch
from torch import nn

from ..registry import Rule, register_rule
from ..terms import Index, compute_dtype
from .refused import Refused


@register_rule(nn.EmbeddingBag)
class EmbeddingBagRule(Rule):
    params = ("weight",)

    def check(self, mod):
        if mod.mode == "max":
            return "EmbeddingBag mode='max': the gradient goes to each dimension's argmax row; no per-sample rule"
        if mod.scale_grad_by_freq:
            return "EmbeddingBag scale_grad_by_freq=True: a per-sample gradient is not defined"
        return None

    def keep(self, mod, idx, args=(), kwargs=None):
        kwargs = kwargs or {}
        offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
        psw = args[2] if len(args) > 2 else kwargs.get("per_sample_weights")
        if idx.dim() != 2 or offsets is not None:
            raise Refused("EmbeddingBag with a 1-D input and offsets (ragged bags): no per-sample rule; pass [B, L] "
                          "ids (with padding_idx for shorter bags)")
        return idx, None if psw is None else psw.detach()

    def terms(self, mod, kept, g, attrs):
        idx, psw = kept
        dt = compute_dtype(g)
        b, length = idx.shape
        keep = torch.ones(b, length, dtype=dt, device=idx.device) if mod.padding_idx is None else \
            (idx != mod.padding_idx).to(dt)
        if mod.mode == "mean":
            c = keep / keep.sum(1, keepdim=True).clamp(min=1)
        else:
            c = keep if psw is None else keep * psw.to(dt)
        return {"weight": Index(idx, c.unsqueeze(-1) * g.to(dt).reshape(b, 1, -1), mod.num_embeddings)}
