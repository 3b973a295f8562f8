"""nn.Embedding: row v of grad W_b is the sum of the output gradients at the sample's positions holding v
(Index: the one-hot left factor is never built); padding_idx rows get no gradient."""
from __future__ import annotations

from torch import nn

from ..registry import Rule, register_rule
from ..terms import Index, as_dtype, compute_dtype


@register_rule(nn.Embedding)
class EmbeddingRule(Rule):
    rowwise = True
    params = ("weight",)
    defer = ("weight",)  # Note [book-keeping]: the rows' clipped sum costs what autograd's sum does

    def check(self, mod):
        if mod.scale_grad_by_freq:
            raise NotImplementedError(
                "hookstats.PerSampleGradNorms: an Embedding with scale_grad_by_freq=True scales each row's gradient "
                "by its frequency in the whole batch: a per-sample gradient is not defined; exclude it")
        return None

    def is_batched(self, mod, x):
        return x.dim() > 0

    def expands(self, mod, x):  # position ids [1, T], added to the [B, T, d] token embeddings
        return x.dim() > 1

    def terms(self, mod, idx, g, attrs):
        b = idx.shape[0]
        idx = idx.reshape(b, -1)
        g = g.reshape(b, -1, mod.embedding_dim)
        g = as_dtype(g, compute_dtype(g))
        if mod.padding_idx is not None:
            g = g * (idx != mod.padding_idx).unsqueeze(-1).to(g.dtype)
        return {"weight": Index(idx, g, mod.num_embeddings, sparse=mod.sparse)}
