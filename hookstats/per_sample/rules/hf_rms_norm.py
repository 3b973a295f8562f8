"""The RMSNorm each HF model defines for itself, matched by its code, not by class (Note [exact-type rules]):

  Llama pattern (LlamaRMSNorm, MistralRMSNorm, MixtralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, ...): the input is
      normalised in float32 and cast back, y = weight * xhat.to(input dtype).
  T5 pattern (T5LayerNorm, SwitchTransformersLayerNorm, ...): the variance in float32, y = weight * (x * rsqrt(var +
      eps)), cast to the weight's dtype when that is half precision.
  Gemma pattern (GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm, ...): y = (xhat * (1 + weight)) in float32, cast back.

A module matches when its class's forward has the same bytecode, names and constants as the pattern's (the HF
"Copied from" classes do); a norm with another forward matches none and is refused.
"""
from __future__ import annotations

import torch
from torch import nn

from ..registry import Rule, register_pattern, same_code
from ..terms import Dense, compute_dtype
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


def _matcher(ref):
    def match(mod: nn.Module) -> bool:
        w = mod._parameters.get("weight")
        return (isinstance(w, nn.Parameter) and w.dim() == 1 and set(k for k, p in mod._parameters.items()
                                                                    if p is not None) == {"weight"}
                and same_code(type(mod).forward, ref))
    return match


class _HFRMSNorm(Rule):
    rowwise = True
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


# Gemma pattern (GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm, ...): normalised in float32, multiplied by (1 + weight)
# in float32, cast back: grad weight_b = sum_t (g_bt in float32) * xhat_bt, the product and the cast as the module's
# backward does them; the sum over tokens is the only step not in float32 (so a float64 model agrees with a
# per-sample backward to float32 rounding, not to float64's).

def _gemma_norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _gemma_forward(self, x):
    output = self._norm(x.float())
    # Llama does x.to(float16) * w whilst Gemma is (x * w).to(float16)
    # See https://github.com/huggingface/transformers/pull/29402
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)


def _gemma_match(mod: nn.Module) -> bool:
    w = mod._parameters.get("weight")
    return (isinstance(w, nn.Parameter) and w.dim() == 1 and set(k for k, p in mod._parameters.items()
                                                                if p is not None) == {"weight"}
            and same_code(type(mod).forward, _gemma_forward) and same_code(getattr(type(mod), "_norm", None),
                                                                             _gemma_norm))


class GemmaRMSNormRule(Rule):
    rowwise = True
    params = ("weight",)

    def terms(self, mod, x, g, attrs):
        h = x.float()
        xhat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + mod.eps)
        d = (g.float() * xhat).to(compute_dtype(x))  # the float32 product of the module's backward
        return {"weight": Dense(d.reshape(x.shape[0], -1, mod.weight.shape[0]).sum(1))}


register_pattern("HF Gemma-style RMSNorm (1 + weight)", _gemma_match, GemmaRMSNormRule())
