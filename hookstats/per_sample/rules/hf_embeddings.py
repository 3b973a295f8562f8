"""The Embedding subclasses of HF models, matched by their code, not by class (Note [exact-type rules]):

  scaled word embeddings (GemmaTextScaledWordEmbedding and its Gemma2/3 copies: output * embed_scale in the weight's
      dtype; BartScaledWordEmbedding and its copies: output * embed_scale): the Embedding rule on the output
      gradient times the scale, as the product's backward computes it;
  learned positional embeddings with an offset (OPTLearnedPositionalEmbedding: positions from the attention mask's
      cumulative sum; BartLearnedPositionalEmbedding: arange over the input's length): the positions the forward
      computes, recomputed by the same code from the same arguments, plus the offset, through the Embedding rule;
  WhisperPositionalEmbedding: weight[position_ids], the Embedding rule on the ids.

Each class's forward must have the code of the reference below, and `super().forward`, where it calls it, must be
nn.Embedding's.
"""
from __future__ import annotations

import torch
from torch import nn

from ..registry import register_pattern, super_forward_is, same_code
from .embedding import EmbeddingRule


# The references are defined in class bodies: zero-argument super() compiles to a __class__ cell only there.

class _GemmaScaled(nn.Embedding):
    def forward(self, input_ids: torch.Tensor):
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


class _BartScaled(nn.Embedding):
    def forward(self, input_ids: torch.Tensor):
        return super().forward(input_ids) * self.embed_scale


class _OPTPositions(nn.Embedding):
    def forward(
        self,
        attention_mask: torch.LongTensor,
        cache_length: int = 0,
        position_ids: torch.LongTensor | None = None,
    ):
        """`input_ids_shape` is expected to be [bsz x seqlen]."""

        if position_ids is None:
            position_ids = torch.cumsum(attention_mask, dim=1)
            position_ids = (position_ids * attention_mask - 1).long()
            # cut positions if `cache_length` is > 0
            position_ids = position_ids[:, cache_length:]

        return super().forward(position_ids + self.offset)


class _BartPositions(nn.Embedding):
    def forward(self, input_ids: torch.Tensor, cache_length: int = 0, position_ids: torch.Tensor | None = None):
        """`input_ids' shape is expected to be [bsz x seqlen]."""

        if position_ids is None:
            bsz, seq_len = input_ids.shape[:2]
            position_ids = torch.arange(
                cache_length, cache_length + seq_len, dtype=torch.long, device=self.weight.device
            ).expand(bsz, -1)
        else:
            position_ids = position_ids.unsqueeze(0)

        return super().forward(position_ids + self.offset)


class _WhisperPositions(nn.Embedding):
    def forward(self, input_ids, cache_length=0, position_ids=None):
        if position_ids is None:
            return self.weight[cache_length : cache_length + input_ids.shape[1]]
        else:
            return self.weight[position_ids]


_gemma_scaled, _bart_scaled = _GemmaScaled.forward, _BartScaled.forward
_opt_positions, _bart_positions = _OPTPositions.forward, _BartPositions.forward


def _embedding_like(mod: nn.Module, ref, via_super: bool = True) -> bool:
    return (isinstance(mod, nn.Embedding) and same_code(type(mod).forward, ref)
            and (not via_super or super_forward_is(type(mod), nn.Embedding)))


class ScaledEmbeddingRule(EmbeddingRule):
    """y = embedding(ids) * scale: the Embedding rule on g * scale."""

    defer = ()  # autograd's gradient and the clip's correction (Note [book-keeping])

    def keep(self, mod, x, args=(), kwargs=None):
        s = mod.embed_scale
        return x, (s.detach().to(mod.weight.dtype) if isinstance(s, torch.Tensor) and _gemma(mod) else s)

    def terms(self, mod, kept, g, attrs):
        idx, scale = kept
        return super().terms(mod, idx, g * scale, attrs)


def _gemma(mod) -> bool:
    return same_code(type(mod).forward, _gemma_scaled)


class PositionsRule(EmbeddingRule):
    """The positions the module's forward computes (the same code on the same arguments) plus its offset: they are
    the rows checked against the batch, so positions of batch 1 (BART's decoder, given position_ids) have their output
    expanded to the batch (Note [broadcast layers])."""

    defer = ()  # autograd's gradient and the clip's correction (Note [book-keeping])

    def input(self, mod, args, kwargs):
        kwargs = dict(kwargs or {})
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        first, rest = args[0], list(args[1:])
        cache_length = rest.pop(0) if rest else kwargs.pop("cache_length", 0)
        position_ids = rest.pop(0) if rest else kwargs.pop("position_ids", None)
        with torch.no_grad():
            if same_code(type(mod).forward, _opt_positions):
                if position_ids is None:
                    position_ids = torch.cumsum(first, dim=1)
                    position_ids = (position_ids * first - 1).long()
                    position_ids = position_ids[:, cache_length:]
            elif position_ids is None:
                bsz, seq_len = first.shape[:2]
                position_ids = torch.arange(cache_length, cache_length + seq_len, dtype=torch.long,
                                            device=mod.weight.device).expand(bsz, -1)
            else:
                position_ids = position_ids.unsqueeze(0)
            return position_ids + mod.offset


class WhisperPositionsRule(EmbeddingRule):
    """weight[position_ids] (Whisper's decoder passes [B, T] ids); without position_ids the forward returns the
    [T, d] rows with no batch dim, broadcast over the batch after the layer: refused (Note [broadcast layers])."""

    defer = ()  # autograd's gradient and the clip's correction (Note [book-keeping])

    def expands(self, mod, x):
        return False

    def input(self, mod, args, kwargs):
        kwargs = dict(kwargs or {})
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        rest = list(args[1:])
        cache_length = rest.pop(0) if rest else kwargs.pop("cache_length", 0)
        position_ids = rest.pop(0) if rest else kwargs.pop("position_ids", None)
        if position_ids is None:
            return torch.arange(cache_length, cache_length + args[0].shape[1], device=mod.weight.device)[None]
        return position_ids


register_pattern("HF Whisper positional embedding (weight[position_ids])",
                 lambda m: _embedding_like(m, _WhisperPositions.forward, via_super=False), WhisperPositionsRule())
register_pattern("HF scaled word embedding (Gemma: * embed_scale in the weight's dtype)",
                 lambda m: _embedding_like(m, _gemma_scaled), ScaledEmbeddingRule())
register_pattern("HF scaled word embedding (BART: * embed_scale)",
                 lambda m: _embedding_like(m, _bart_scaled), ScaledEmbeddingRule())
register_pattern("HF learned positional embedding with an offset (OPT, from the attention mask)",
                 lambda m: _embedding_like(m, _opt_positions), PositionsRule())
register_pattern("HF learned positional embedding with an offset (BART, arange)",
                 lambda m: _embedding_like(m, _bart_positions), PositionsRule())
