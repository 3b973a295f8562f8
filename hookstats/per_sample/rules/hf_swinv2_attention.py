"""HF Swin V2's self-attention (Swinv2SelfAttention and its copies, matched by the code of their forward): the learned
temperature `logit_scale` and the continuous position-bias MLP, applied inside the cosine attention of every window
(Note [cosine window attention]). The query / key / value projections are Linear children with their own rule; the
output projection (Swinv2SelfOutput.dense) is a Linear fed the attention's window rows, proved batch-major through
F.normalize's norms (Note [batch layouts] in batch.py). Refused: attention dropout in training.

Note [cosine window attention]: Swin V2 computes, per window w (rows of [B * windows, N, C], batch-major) and head h,

  S = cos(q, k) * exp(min(logit_scale_h, log 100)) + 16 sigmoid(table[index]) (+ the shifted-window mask),
  P = softmax(S), O = P V,   table = MLP(coords) = W2 relu(W1 coords + b1) (+ b2),

where cos(q, k) = normalize(q) normalize(k)^T (F.normalize: x / max(||x||, eps)) and coords is a fixed buffer. From the
gradient dO of the attention's output (HF: the module's own output; timm: g W_proj through its output projection), the
probabilities and values the product P V keeps for its backward (read from the graph, as in Note [relative-position
table] in hf_swin_attention.py), and q, k recomputed from the module's input by the projection's own weights, the
rule replays the backward autograd runs, per window: dP = dO V^T, dS = P * (dP - sum_q dP * P), then
  logit_scale_h   sum_pq dS_hpq cos_hpq * exp(l_h) (0 where l_h > log 100: clamp's gradient),
  q, k            dcos = dS * exp(l_h), through normalize's backward (dx = dy / D + [||x|| >= eps] x dD / ||x||,
                  dD = -sum(dy x) / D^2, D = max(||x||, eps)), and v: P^T dO (timm: the fused qkv weight and q / v
                  biases from these, an Outer and Dense terms over the window's rows),
  table           d pre = dS * 16 s (1 - s), s = sigmoid(pre), scattered to the table's rows by the index.
The MLP's parameters get a gradient linear in the table's: a window's would be a [T, hidden] product each, so the
windows of a sample are summed first (rows_to_samples) and the sample's table gradient is then taken through the MLP's
backward (dW2 = dtable^T h, dh = dtable W2, relu's mask, dW1 = dpre1^T coords, the biases their sums): exact, at the
cost of B products instead of B * windows.
"""
from __future__ import annotations

import math
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Rule, register_pattern, same_code
from ..terms import Dense, Term, compute_dtype
from .hf_swin_attention import kept_probabilities
from .refused import Refused

_MAX_LOGIT = math.log(1.0 / 0.01)


class _Swinv2SelfAttention(nn.Module):  # transformers' Swinv2SelfAttention.forward, the reference
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = False,
    ) -> tuple[torch.Tensor]:
        batch_size, dim, num_channels = hidden_states.shape
        query_layer = (
            self.query(hidden_states)
            .view(batch_size, -1, self.num_attention_heads, self.attention_head_size)
            .transpose(1, 2)
        )
        key_layer = (
            self.key(hidden_states)
            .view(batch_size, -1, self.num_attention_heads, self.attention_head_size)
            .transpose(1, 2)
        )
        value_layer = (
            self.value(hidden_states)
            .view(batch_size, -1, self.num_attention_heads, self.attention_head_size)
            .transpose(1, 2)
        )

        # cosine attention
        attention_scores = nn.functional.normalize(query_layer, dim=-1) @ nn.functional.normalize(
            key_layer, dim=-1
        ).transpose(-2, -1)
        logit_scale = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        attention_scores = attention_scores * logit_scale
        relative_position_bias_table = self.continuous_position_bias_mlp(self.relative_coords_table).view(
            -1, self.num_attention_heads
        )
        # [window_height*window_width,window_height*window_width,num_attention_heads]
        relative_position_bias = relative_position_bias_table[self.relative_position_index.view(-1)].view(
            self.window_size[0] * self.window_size[1], self.window_size[0] * self.window_size[1], -1
        )
        # [num_attention_heads,window_height*window_width,window_height*window_width]
        relative_position_bias = relative_position_bias.permute(2, 0, 1).contiguous()  # nH, Wh*Ww, Wh*Ww
        relative_position_bias = 16 * torch.sigmoid(relative_position_bias)
        attention_scores = attention_scores + relative_position_bias.unsqueeze(0)

        if attention_mask is not None:
            # Apply the attention mask is (precomputed for all layers in Swinv2Model forward() function)
            mask_shape = attention_mask.shape[0]
            attention_scores = attention_scores.view(
                batch_size // mask_shape, mask_shape, self.num_attention_heads, dim, dim
            ) + attention_mask.unsqueeze(1).unsqueeze(0)
            attention_scores = attention_scores + attention_mask.unsqueeze(1).unsqueeze(0)
            attention_scores = attention_scores.view(-1, self.num_attention_heads, dim, dim)

        # Normalize the attention scores to probabilities.
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)

        # This is actually dropping out entire tokens to attend to, which might
        # seem a bit unusual, but is taken from the original Transformer paper.
        attention_probs = self.dropout(attention_probs)

        # Mask heads if we want to

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = context_layer.view(new_context_layer_shape)

        outputs = (context_layer, attention_probs) if output_attentions else (context_layer,)

        return outputs


def mlp_check(mlp: nn.Module) -> str | None:
    """A reason to refuse a position-bias MLP other than Sequential(Linear(2, hidden), ReLU, Linear(hidden, heads))."""
    kinds = [type(m) for m in mlp] if isinstance(mlp, nn.Sequential) else []
    if kinds != [nn.Linear, nn.ReLU, nn.Linear]:
        return ("its continuous position-bias MLP is not Sequential(Linear, ReLU, Linear): the rule replays that "
                "MLP's backward only")
    return None


def _normalize_backward(x: torch.Tensor, dy: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """The gradient of F.normalize(x, dim=-1, eps=eps) at x, given the output's gradient dy (Note [cosine window
    attention])."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    d = n.clamp_min(eps)
    dd = -(dy * x).sum(-1, keepdim=True) / (d * d)
    dn = torch.where(n >= eps, dd, torch.zeros_like(dd))
    return dy / d + x * torch.where(n > 0, dn / n, torch.zeros_like(n))


def cosine_window_grads(q, k, kept, d_o, logit_scale, mlp, coords, index, want_qkv: bool):
    """The per-window gradients of Swin V2's cosine window attention (Note [cosine window attention]) from q, k
    [W, H, N, d] (before normalize), the kept probabilities and values and the output's gradient dO [W, H, N, d]:
    {"dq", "dk", "dv" (want_qkv), "logit_scale" [W, H], "table" [W, T, H]}."""
    p, v = kept
    w_, h, n, _ = q.shape
    dt = q.dtype
    p = p.to(dt).reshape(w_, h, n, n)
    v = v.to(dt).reshape(w_, h, n, -1)
    d_p = d_o @ v.transpose(-2, -1)
    d_s = p * (d_p - (d_p * p).sum(-1, keepdim=True))
    qn, kn = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    ls = logit_scale.detach().to(dt).reshape(h)
    scale = ls.clamp(max=_MAX_LOGIT).exp()
    out = {"logit_scale": (d_s * (qn @ kn.transpose(-2, -1))).sum((-2, -1)) * (scale * (ls <= _MAX_LOGIT))}
    table = _mlp_forward(mlp, coords, dt)[-1]  # [T, H]
    pre = table[index.reshape(-1)].reshape(n, n, h).permute(2, 0, 1)
    s = torch.sigmoid(pre)
    d_pre = d_s * (16 * s * (1 - s))  # [W, H, N, N]
    out["table"] = torch.zeros(w_, table.shape[0], h, dtype=dt, device=q.device).index_add_(
        1, index.reshape(-1), d_pre.permute(0, 2, 3, 1).reshape(w_, n * n, h))
    if want_qkv:
        d_cos = d_s * scale.reshape(1, h, 1, 1)
        out["dq"] = _normalize_backward(q, d_cos @ kn)
        out["dk"] = _normalize_backward(k, d_cos.transpose(-2, -1) @ qn)
        out["dv"] = p.transpose(-2, -1) @ d_o
    return out


def _mlp_forward(mlp, coords, dt):
    lin1, _, lin2 = mlp
    c = coords.detach().to(dt).reshape(-1, coords.shape[-1])
    pre1 = F.linear(c, lin1.weight.detach().to(dt), None if lin1.bias is None else lin1.bias.detach().to(dt))
    hid = pre1.clamp_min(0)
    return c, pre1, hid, F.linear(hid, lin2.weight.detach().to(dt), None if lin2.bias is None else
                                  lin2.bias.detach().to(dt))


class MlpTerm(Term):
    """One position-bias MLP parameter's per-sample gradient, from the table's gradient per window [W, T, H]: the
    windows of a sample summed (rows_to_samples), then the MLP's backward on B tables (Note [cosine window
    attention]). The terms of one call share the per-sample result."""

    __slots__ = ("shared", "attr", "samples")

    def __init__(self, shared: "MlpGrads", attr: str):
        self.shared, self.attr = shared, attr
        self.samples = shared.d_table.shape[0]

    def rows_to_samples(self, k):
        return Dense(self.shared.per_sample(k)[self.attr])

    def sq(self):
        return self.rows_to_samples(1).sq()

    def delta(self, w, shape):
        return self.rows_to_samples(1).delta(w, shape)

    @classmethod
    def cat(cls, terms):  # the attention called more than once in one backward: the per-sample gradients summed
        return Dense(sum(t.rows_to_samples(1).D for t in terms))


class MlpGrads:
    def __init__(self, d_table: torch.Tensor, mlp: nn.Module, coords: torch.Tensor, prefix: str):
        self.d_table, self.mlp, self.coords, self.prefix = d_table, mlp, coords, prefix
        self.cache: Dict[int, dict] = {}

    def per_sample(self, k: int) -> dict:
        if k not in self.cache:
            dtab = self.d_table
            dtab = dtab.reshape(-1, k, *dtab.shape[1:]).sum(1)  # [B, T, H]
            c, pre1, hid, _ = _mlp_forward(self.mlp, self.coords, dtab.dtype)
            lin1, _, lin2 = self.mlp
            d_hid = (dtab @ lin2.weight.detach().to(dtab.dtype)) * (pre1 > 0)
            p = self.prefix
            res = {f"{p}2.weight": dtab.transpose(1, 2) @ hid, f"{p}0.weight": d_hid.transpose(1, 2) @ c}
            if lin2.bias is not None:
                res[f"{p}2.bias"] = dtab.sum(1)
            if lin1.bias is not None:
                res[f"{p}0.bias"] = d_hid.sum(1)
            self.cache[k] = res
        return self.cache[k]


def mlp_paths(mlp: nn.Sequential, prefix: str):
    """The MLP's parameters, as paths from the attention module."""
    return tuple(f"{prefix}{i}.{a}" for i in (0, 2) for a in ("weight", "bias") if getattr(mlp[i], a) is not None)


def mlp_terms(grads: dict, mod: nn.Module, mlp: nn.Module, prefix: str, attrs) -> Dict[str, Term]:
    shared = MlpGrads(grads["table"], mlp, mod.relative_coords_table, prefix)
    return {a: MlpTerm(shared, a) for a in attrs if a.startswith(prefix)}


class Swinv2SelfAttentionRule(Rule):
    """logit_scale and the continuous position-bias MLP of an HF Swinv2SelfAttention (Note [cosine window
    attention])."""

    _P = "continuous_position_bias_mlp."

    def param_paths(self, mod):
        return ("logit_scale",) + mlp_paths(mod.continuous_position_bias_mlp, self._P)

    def check(self, mod):
        return mlp_check(mod.continuous_position_bias_mlp)

    def output(self, mod, out):
        return out[0] if isinstance(out, tuple) and isinstance(out[0], torch.Tensor) else None

    def keep_call(self, mod, x, args, kwargs, output):
        if mod.training and mod.dropout.p > 0:
            raise Refused("the attention's dropout is active (training mode, p > 0): a random mask the rule cannot "
                          "replay")
        kept = kept_probabilities(self.output(mod, output), x.shape[0], mod.num_attention_heads, x.shape[1])
        return x, kept

    def terms(self, mod, kept, g, attrs):
        x, pv = kept
        dt = compute_dtype(g)
        w_, n, _ = x.shape
        heads = mod.num_attention_heads
        x = x.to(dt)

        def proj(lin):
            y = F.linear(x, lin.weight.detach().to(dt), None if lin.bias is None else lin.bias.detach().to(dt))
            return y.reshape(w_, n, heads, -1).transpose(1, 2)

        d_o = g.to(dt).reshape(w_, n, heads, -1).transpose(1, 2)
        grads = cosine_window_grads(proj(mod.query), proj(mod.key), pv, d_o, mod.logit_scale,
                                    mod.continuous_position_bias_mlp, mod.relative_coords_table,
                                    mod.relative_position_index, want_qkv=False)
        out: Dict[str, Term] = mlp_terms(grads, mod, mod.continuous_position_bias_mlp, self._P, attrs)
        if "logit_scale" in attrs:
            out["logit_scale"] = Dense(grads["logit_scale"])
        return out


def _match(mod: nn.Module) -> bool:
    return (isinstance(mod._parameters.get("logit_scale"), nn.Parameter)
            and isinstance(getattr(mod, "continuous_position_bias_mlp", None), nn.Sequential)
            and all(isinstance(getattr(mod, a, None), nn.Linear) for a in ("query", "key", "value"))
            and same_code(type(mod).forward, _Swinv2SelfAttention.forward))


register_pattern("HF Swin V2 self-attention (logit scale, continuous position-bias MLP)", _match,
                 Swinv2SelfAttentionRule())
