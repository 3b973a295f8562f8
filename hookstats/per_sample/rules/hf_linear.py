"""Linear subclasses whose forward is the plain linear map written out, matched by their code, not by class (Note
[exact-type rules]): HF FalconLinear's `input @ weight.T (+ bias)`. The Linear rule holds: grad W_b =
sum_t g_bt x_bt^T, grad b_b = sum_t g_bt."""
from __future__ import annotations

import torch
from torch import nn

from ..registry import register_pattern, same_code
from .linear import LinearRule


def _falcon_forward(self, input: torch.Tensor) -> torch.Tensor:
    hidden_states = input @ self.weight.T
    if self.bias is None:
        return hidden_states
    return hidden_states + self.bias


def _matches(mod: nn.Module) -> bool:
    w = mod._parameters.get("weight")
    b = mod._parameters.get("bias")
    return (isinstance(mod, nn.Linear) and isinstance(w, nn.Parameter) and w.dim() == 2
            and (b is None or b.dim() == 1) and same_code(type(mod).forward, _falcon_forward))


register_pattern("HF FalconLinear-style Linear (input @ weight.T + bias)", _matches, LinearRule())
