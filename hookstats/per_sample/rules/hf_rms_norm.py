"""The RMSNorm each HF model defines for itself, matched by its code, not by class (Note [exact-type rules]):

  Llama pattern (LlamaRMSNorm, MistralRMSNorm, MixtralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, ...): the input is
      normalised in float32 and cast back, y = weight * xhat.to(input dtype).
  T5 pattern (T5LayerNorm, SwitchTransformersLayerNorm, ...): the variance in float32, y = weight * (x * rsqrt(var +
      eps)), cast to the weight's dtype when that is half precision.

A module matches when its class's forward has the same bytecode, names and constants as the pattern's (the HF
"Copied from" classes do); Gemma's (1 + weight) RMSNorm, for instance, does not.
"""
from __future__ import annotations

import torch
from torch import nn

from ..registry import Rule, register_pattern
from ..terms import compute_dtype
from .layer_norm import affine_terms


def _llama_forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _t5_forward(self, hidden_states):
    variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    if self.weight.dtype in [torch.float16, torch.bfloat16]:
        hidden_states = hidden_states.to(self.weight.dtype)
    return self.weight * hidden_states


def _same_code(fn, ref) -> bool:
    a, b = getattr(fn, "__code__", None), ref.__code__
    return a is not None and all(getattr(a, k) == getattr(b, k) for k in
                                 ("co_code", "co_names", "co_consts", "co_varnames", "co_argcount"))


def _matcher(ref):
    def match(mod: nn.Module) -> bool:
        w = mod._parameters.get("weight")
        return (isinstance(w, nn.Parameter) and w.dim() == 1 and set(k for k, p in mod._parameters.items()
                                                                    if p is not None) == {"weight"}
                and _same_code(type(mod).forward, ref))
    return match


class _HFRMSNorm(Rule):
    params = ("weight",)

    def terms(self, mod, x, g, attrs):
        xhat = self.normalized(mod, x).to(compute_dtype(x))
        return affine_terms(xhat, g.to(xhat.dtype), attrs, x.shape[0], mod.weight.shape[0])


class LlamaRMSNormRule(_HFRMSNorm):
    def normalized(self, mod, x):
        h = x.to(torch.float32)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon)).to(x.dtype)


class T5LayerNormRule(_HFRMSNorm):
    def normalized(self, mod, x):
        h = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + mod.variance_epsilon)
        return h.to(mod.weight.dtype) if mod.weight.dtype in (torch.float16, torch.bfloat16) else h


register_pattern("HF Llama-style RMSNorm", _matcher(_llama_forward), LlamaRMSNormRule())
register_pattern("HF T5-style RMSNorm", _matcher(_t5_forward), T5LayerNormRule())
