"""HF Swin's relative-position table (SwinAttention and its copies, matched by the code of their forward and of their
SwinRelativePositionBias): one [heads, N, N] bias, gathered from the table by a fixed index, added to the attention
scores of every window of every sample. Its gradient for window w is the scores' gradient dS_w scattered back by the
index; the scores' gradient is not a module output, so the rule takes it from what the attention's backward uses
(Note [relative-position table]).

Note [relative-position table]: the SwinAttention's output gradient g [B * windows, N, C] (batch-major rows, proved
as for its q/k/v projections) gives the attention product's gradient dO = g W_o (the output projection's input
gradient), and the product P V kept by autograd for its backward (the bmm's saved operands: the probabilities P
after the softmax and the values V, read from the graph when the call returns, nothing recomputed) gives
dP = dO V^T and the softmax's backward dS = P * (dP - sum_q dP * P), the same products autograd computes. Per window,
table row i gets sum over the (p, q) with index i of dS[h, p, q] (an Index term over N * N positions), and the
windows of a sample are summed (rows_to_samples). A softmax computed in float32 for a float64 model (HF's
eager_attention_forward) is differentiated in float32 by autograd: this rule's float64 products then agree to
float32 rounding. Refused: attention dropout in training (a random mask the rule cannot replay), and an attention
implementation that keeps no probabilities (a fused kernel: flash / memory-efficient SDPA on a GPU).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..registry import Rule, register_pattern, same_code
from ..terms import Index, compute_dtype
from .refused import Refused

if TYPE_CHECKING:  # never run: the name is import-originated, as in transformers, and the compiler then emits the
    # same attribute-then-call bytecode for ALL_ATTENTION_FUNCTIONS.get_interface(...) as in the original
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: F401


class _SwinAttention(nn.Module):  # transformers' SwinAttention.forward, the reference its copies are matched with
    def forward(
        self,
        hidden_states,
        attention_mask=None,
        **kwargs,
    ):
        # hidden_states: (batch_size * num_windows, window_size * window_size, channels)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        # Combine relative position bias with the cyclic-shift attention mask for SW-MSA
        relative_position_bias = self.relative_position_bias()  # 1, num_heads, ws*ws, ws*ws
        if attention_mask is not None:
            # attention_mask: (num_windows, ws*ws, ws*ws)
            num_windows = attention_mask.shape[0]
            batch_size = input_shape[0] // num_windows
            seq_len = input_shape[1]
            # Expand to (batch * num_windows, 1, ws*ws, ws*ws) for broadcasting
            attention_mask = (
                attention_mask.unsqueeze(1)  # (num_windows, 1, ws*ws, ws*ws)
                .unsqueeze(0)  # (1, num_windows, 1, ws*ws, ws*ws)
                .expand(batch_size, -1, -1, -1, -1)  # (batch, num_windows, 1, ws*ws, ws*ws)
                .reshape(-1, 1, seq_len, seq_len)  # (batch * num_windows, 1, ws*ws, ws*ws)
            )
            combined_mask = relative_position_bias + attention_mask
        else:
            combined_mask = relative_position_bias

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(  # noqa: F821,F811
            self.config._attn_implementation, eager_attention_forward  # noqa: F821
        )

        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            combined_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)

        return attn_output, attn_weights


class _SwinRelativePositionBias(nn.Module):
    def forward(self):
        relative_position_bias = self.relative_position_bias_table[self.relative_position_index]
        relative_position_bias = relative_position_bias.view(self.window_area, self.window_area, -1)
        return relative_position_bias.permute(2, 0, 1).contiguous().unsqueeze(0)  # 1, num_heads, Wh*Ww, Wh*Ww


def graph_nodes(out: torch.Tensor, limit: int):
    """The autograd nodes behind `out`, breadth first from its grad_fn (the nearest first), at most `limit`."""
    todo, seen = [out.grad_fn], set()
    while todo and len(seen) < limit:
        node = todo.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        todo += [n for n, _ in node.next_functions]


def _kept_product(out: torch.Tensor):
    """The probabilities and values the attention product P V keeps for its backward: the first bmm met walking the
    graph back from the output projection's output, before any fused attention node."""
    for node in graph_nodes(out, 64):
        name = type(node).__name__
        if name == "BmmBackward0":
            return node._saved_self, node._saved_mat2
        if name.startswith("ScaledDotProduct"):
            break
    raise Refused("the attention is computed by a fused kernel that keeps no probabilities (flash / memory-efficient "
                  "scaled_dot_product_attention): the scores' gradient the relative-position table needs is not "
                  "available; use attn_implementation='eager'")


class SwinRelativePositionTableRule(Rule):
    """The relative-position table of an HF SwinAttention (Note [relative-position table])."""

    def param_paths(self, mod):
        return ("relative_position_bias.relative_position_bias_table",)

    def output(self, mod, out):
        return out[0] if isinstance(out, tuple) and isinstance(out[0], torch.Tensor) else None

    def keep_call(self, mod, x, args, kwargs, output):
        if mod.training and mod.attention_dropout > 0:
            raise Refused("the attention's dropout is active (training mode, p > 0): a random mask the rule cannot "
                          "replay")
        return kept_probabilities(self.output(mod, output), x.shape[0], mod.num_attention_heads, x.shape[1])

    def terms(self, mod, kept, g, attrs):
        rel = mod.relative_position_bias
        return {"relative_position_bias.relative_position_bias_table": table_term(
            kept, g, mod.o_proj.weight, mod.num_attention_heads, rel.relative_position_index,
            rel.relative_position_bias_table.shape[0])}


def kept_probabilities(out: torch.Tensor, windows: int, heads: int, n: int):
    """The [windows * heads, N, N] probabilities and [windows * heads, N, d] values the attention product of the
    call whose output projection gave `out` keeps for its backward, or Refused."""
    p, v = _kept_product(out)
    if p.shape != (windows * heads, n, n) or v.shape[:2] != (windows * heads, n):
        raise Refused(f"the attention product's operands {tuple(p.shape)} x {tuple(v.shape)} are not the "
                      f"[windows * heads, N, N] probabilities and values of {windows} windows of {n} tokens")
    return p.detach(), v.detach()


def table_term(kept, g: torch.Tensor, w_o: torch.Tensor, heads: int, index: torch.Tensor, rows: int) -> Index:
    """The table's gradient per window (Note [relative-position table]) from the output projection's output gradient
    g [windows, N, C], its weight, and the kept probabilities and values: an Index term over the N * N positions."""
    p, v = kept
    dt = compute_dtype(g)
    x_, n, _ = g.shape
    d_o = (g.to(dt) @ w_o.detach().to(dt)).reshape(x_, n, heads, -1).transpose(1, 2).reshape(x_ * heads, n, -1)
    p = p.to(dt)
    d_p = torch.bmm(d_o, v.to(dt).transpose(1, 2))
    d_s = p * (d_p - (d_p * p).sum(-1, keepdim=True))  # the scores' gradient, [windows * heads, N, N]
    idx = index.reshape(1, n * n).expand(x_, -1)
    return Index(idx, d_s.reshape(x_, heads, n * n).transpose(1, 2), rows)  # R: [windows, N * N, heads]


def _match(mod: nn.Module) -> bool:
    rel = getattr(mod, "relative_position_bias", None)
    return (isinstance(rel, nn.Module)
            and isinstance(rel._parameters.get("relative_position_bias_table"), nn.Parameter)
            and isinstance(getattr(mod, "o_proj", None), nn.Linear)
            and same_code(type(mod).forward, _SwinAttention.forward)
            and same_code(type(rel).forward, _SwinRelativePositionBias.forward))


register_pattern("HF Swin attention (the relative-position table)", _match, SwinRelativePositionTableRule())
