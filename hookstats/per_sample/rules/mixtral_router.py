"""The top-k routers of HF mixture-of-experts blocks, matched by their code (Note [exact-type rules]): router_logits =
F.linear(x.reshape(-1, d), weight), returned first of a tuple (MixtralTopKRouter; Qwen2MoeTopKRouter, OlmoeTopKRouter
and their copies, which differ only after the logits). The Linear rule on the token rows: a batch-major [B * T, d]
view of the block's input, split per sample by the core."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..registry import Rule, register_pattern, same_code
from ..terms import Outer
from .linear import tokens


def _mixtral(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)  # (seq_len, num_experts)
    router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)  # (seq_len, top_k)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_scores = router_top_value
    return router_logits, router_scores, router_indices


def _qwen2_moe(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)  # (seq_len, num_experts)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)  # (seq_len, top_k)
    if self.norm_topk_prob:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    router_scores = router_top_value
    return router_logits, router_scores, router_indices


class TopKRouterRule(Rule):
    rowwise = True
    params = ("weight",)

    def output(self, mod, out):
        return out[0] if isinstance(out, tuple) else None

    def terms(self, mod, x, g, attrs):
        a, g = tokens(x, g)
        return {"weight": Outer(g, a)}


def _router(ref):
    def match(mod: nn.Module) -> bool:
        w = mod._parameters.get("weight")
        return (isinstance(w, nn.Parameter) and w.dim() == 2 and [k for k, p in mod._parameters.items()
                                                                  if p is not None] == ["weight"]
                and same_code(type(mod).forward, ref))
    return match


register_pattern("HF Mixtral-style top-k router", _router(_mixtral), TopKRouterRule())
register_pattern("HF Qwen2-MoE-style top-k router", _router(_qwen2_moe), TopKRouterRule())
