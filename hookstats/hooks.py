"""Drop-in hook functions: clip or record what a PyTorch hook sees, on the device, with no host sync.

Every hook object has one form per hook kind, because PyTorch calls each kind with different arguments and gives
its return value a different meaning:

  form                  register with                                   receives                  returns
  obj (obj.backward)    module.register_full_backward_hook(obj)         (module, grad_input,      new grad_input
                                                                          grad_output)
  obj.backward_pre      module.register_full_backward_pre_hook(...)     (module, grad_output)     new grad_output
  obj.forward_pre       module.register_forward_pre_hook(...)           (module, args)            new args
  obj.forward           module.register_forward_hook(...)               (module, args, output)    new output
  obj.tensor            tensor.register_hook(...)                       grad                      new grad
  obj.post_accumulate   param.register_post_accumulate_grad_hook(...)   param                     None (in place)

Clipping hooks return new tensors (a hook must not modify its arguments in place), except the post-accumulate form,
which clips `param.grad` in place, as PyTorch allows there. `record` hooks return nothing and change nothing.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._checks import POLICY_CODE, check_bounds, check_eps, check_max_norm, check_norm_type, check_policy
from ._forms import HookForms
from ._nested import flatten, rebuild
from ._ops import SUPPORTED_DTYPES, clamp_count_op, clip_norm_op, norms_op
from ._select import Site
from .clip import CLIP_EPS, get_total_norm
from .reference import clip_coef


def _is_float_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in SUPPORTED_DTYPES and t.layout == torch.strided


class fused_clip(HookForms):
    """Clips what a hook sees by norm: every tensor scaled by min(1, max_norm / (norm + eps)), the norm taken jointly
    over the hook's tensors (one norm kernel call for all of them), or per tensor with per_tensor=True.

    `module.register_full_backward_hook(hookstats.fused_clip(1.0))` clips grad_input (the gradients w.r.t. the
    module's inputs) and returns the new tuple, None entries kept. See the module docstring for the other forms.
    In the forward forms the coefficient is a constant for autograd (like `clip_grad_norm_`, which runs under
    no_grad): the backward pass scales the gradient by the same factor. `last_norm` holds the last norm seen
    (a device tensor; per_tensor: the last tensor's).
    """

    _name = "hookstats.fused_clip"

    def __init__(self, max_norm: float, norm_type: float = 2.0, *, per_tensor: bool = False, eps: float = CLIP_EPS,
                 nonfinite: str = "propagate"):
        self.max_norm = check_max_norm(max_norm, "fused_clip")
        self.norm_type = check_norm_type(norm_type, "fused_clip")
        self.per_tensor = bool(per_tensor)
        self.eps = check_eps(eps, "fused_clip")
        self.nonfinite = check_policy(nonfinite, "fused_clip")
        self.last_norm: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        return (f"hookstats.fused_clip(max_norm={self.max_norm}, norm_type={self.norm_type}, "
                f"per_tensor={self.per_tensor}, nonfinite={self.nonfinite!r})")

    def _coef(self, total: torch.Tensor) -> torch.Tensor:
        return clip_coef(total, self.max_norm, self.eps, self.nonfinite == "zero")

    def _check_finite(self, total: torch.Tensor) -> None:
        if self.nonfinite == "error" and not bool(torch.isfinite(total)):
            raise RuntimeError(f"hookstats.fused_clip: the norm of order {self.norm_type} of what the hook sees is "
                               f"non-finite ({float(total)}), so it cannot be clipped")

    def _scaled(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """New tensors: each group (all tensors, or each tensor) scaled by its clipping coefficient."""
        groups = [[t] for t in tensors] if self.per_tensor else [tensors]
        out: list[torch.Tensor] = []
        for group in groups:
            with torch.no_grad():
                by_dev = group[0].device
                same = all(t.device == by_dev for t in group)
                if same:
                    _, total = norms_op([t.detach() for t in group], self.norm_type, "fused_clip")
                else:
                    total = get_total_norm(group, self.norm_type).to(torch.float64)
                self._check_finite(total)
                self.last_norm = total
                coef = self._coef(total)
            for t in group:
                c = coef.to(device=t.device, dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
                y = t * c
                if self.nonfinite == "zero":
                    y = torch.where(c != 0, y, torch.zeros((), dtype=y.dtype, device=y.device))
                out.append(y.to(t.dtype))
        return out

    def _process(self, site, obj, extra=None):
        if site is Site.GRAD:  # in place on param.grad: the one place PyTorch allows it
            if not _is_float_tensor(obj):
                return None
            if self.nonfinite == "error":
                _, total = norms_op([obj], self.norm_type, "fused_clip")
                self._check_finite(total)
            total = clip_norm_op(obj, self.norm_type, self.max_norm, self.eps, POLICY_CODE[self.nonfinite],
                                 "fused_clip")
            self.last_norm = total
            return None
        tensors = flatten(obj)
        floats = [t for t in tensors if _is_float_tensor(t)]
        if not floats:
            return None  # nothing to clip: PyTorch keeps what it had
        new = iter(self._scaled(floats))
        replaced = iter([next(new) if _is_float_tensor(t) else t for t in tensors])
        return rebuild(obj, replaced)


class clip_value(HookForms):
    """Clamps what a hook sees to [-v, v] (clip_value(v)) or [lo, hi] (clip_value(lo, hi)); new tensors, except the
    post-accumulate form, which clamps `param.grad` in place. `last_count` holds the number of values clipped by
    the last call (an int64 device tensor)."""

    _name = "hookstats.clip_value"

    def __init__(self, lo: float, hi: Optional[float] = None):
        self.lo, self.hi = check_bounds(lo, hi, "clip_value")
        self.last_count: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        return f"hookstats.clip_value({self.lo}, {self.hi})"

    def _process(self, site, obj, extra=None):
        if site is Site.GRAD:
            if _is_float_tensor(obj):
                self.last_count = clamp_count_op([obj], self.lo, self.hi, "clip_value")
            return None
        tensors = flatten(obj)
        if not any(_is_float_tensor(t) for t in tensors):
            return None
        floats = [t for t in tensors if _is_float_tensor(t)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in floats):
            # Autograd must see the clamp (its gradient masks the clipped values): PyTorch ops, and the count apart.
            with torch.no_grad():
                self.last_count = torch.stack([((t < self.lo) | (t > self.hi)).sum() for t in floats]).sum()
            out = iter([t.clamp(self.lo, self.hi) for t in floats])
        else:
            # New tensors (a hook must not modify its arguments): one copy, then one clamp-and-count kernel call.
            clones = [t.clone() for t in floats]
            self.last_count = clamp_count_op(clones, self.lo, self.hi, "clip_value")
            out = iter(clones)
        return rebuild(obj, iter([next(out) if _is_float_tensor(t) else t for t in tensors]))
