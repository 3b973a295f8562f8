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

import copy
import dataclasses
from typing import Optional

import torch

from ._ops import SUPPORTED_DTYPES, clamp_count_op, clip_norm_op, norms_op
from ._owned_hooks import in_backward
from .clip import CLIP_EPS, _bounds, _eps, _max_norm, _norm_type, _policy, _POLICY_CODE, get_total_norm
from .reference import clip_coef

def _is_float_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in SUPPORTED_DTYPES and t.layout == torch.strided


def _check_full_backward(module, form_owner: str) -> None:
    """A hook registered with the legacy register_backward_hook gets the last autograd node's inputs (weight and
    bias grads included), not the module's input grads: refuse it, with the call to use instead."""
    if getattr(module, "_is_full_backward_hook", None) is False:
        raise RuntimeError(
            f"{form_owner} was registered with module.register_backward_hook, whose grad_input holds the gradients of "
            "the last autograd node's inputs (for nn.Linear: input, weight and bias), not the module's inputs. "
            f"Use module.register_full_backward_hook({form_owner})."
        )


def _flatten(obj, out: list, keep_none: bool = False) -> None:
    """The tensors of a hook argument (a tensor, or tuples/lists/dicts/dataclasses of them), depth first, in order. With
    keep_none, None entries stay as placeholders, so a record's index is the position in what the hook saw (a
    grad_input of (None, g) records g at index 1)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif obj is None:
        if keep_none:
            out.append(None)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _flatten(o, out, keep_none)
    elif isinstance(obj, dict):
        for o in obj.values():
            _flatten(o, out, keep_none)
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            _flatten(getattr(obj, f.name), out, keep_none)


def _is_dataclass_instance(obj) -> bool:
    return hasattr(type(obj), "__dataclass_fields__")


def _rebuild(obj, it):
    """obj with each tensor replaced by the next item of it (same structure and container types)."""
    if isinstance(obj, torch.Tensor):
        return next(it)
    if isinstance(obj, tuple):
        items = [_rebuild(o, it) for o in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        if type(obj) is not tuple:  # structseq such as torch.return_types.max
            return type(obj)(items)
        return tuple(items)
    if isinstance(obj, list):
        return [_rebuild(o, it) for o in obj]
    if isinstance(obj, dict):
        return type(obj)((k, _rebuild(v, it)) for k, v in obj.items())
    if _is_dataclass_instance(obj):  # a copy with the new fields (frozen ones too: the copy is ours)
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, _rebuild(getattr(obj, f.name), it))
        return new
    return obj


class _Forms:
    """The per-kind forms of a hook object; subclasses implement _process(kind, obj, extra=None) -> new obj or None
    (extra: a full backward hook's grad_output beside its grad_input)."""

    _name = "hook"

    def __call__(self, *args):
        if len(args) != 3:
            raise TypeError(
                f"{self._name}(...) called with {len(args)} argument(s): the object itself is a full backward hook "
                "(module, grad_input, grad_output); for other hook kinds use its forms "
                ".tensor, .post_accumulate, .forward_pre, .forward or .backward_pre"
            )
        if not in_backward() and not isinstance(args[2], tuple):
            # A full backward hook always gets a tuple grad_output, inside the autograd engine; (module, args,
            # tensor) outside it is a forward hook's call.
            raise TypeError(
                f"{self._name} was called outside the backward pass with (module, args, output): it looks registered "
                "with module.register_forward_hook; the object itself is a full backward hook, use its .forward form "
                "for forward hooks"
            )
        return self.backward(*args)

    def backward(self, module, grad_input, grad_output):
        _check_full_backward(module, self._name)
        return self._process("backward", grad_input, extra=grad_output)

    def backward_pre(self, module, grad_output):
        return self._process("backward_pre", grad_output)

    def forward_pre(self, module, args):
        return self._process("forward_pre", args)

    def forward(self, module, args, output):
        return self._process("forward", output)

    def tensor(self, grad):
        if grad is None:
            # An output of a multi-output op (chunk, unbind) that the loss does not use: PyTorch calls its hooks
            # with None. Returning None keeps it None; raising would abort the backward pass.
            return None
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"{self._name}.tensor is a Tensor.register_hook hook (grad) -> grad; got "
                            f"{type(grad).__name__}. For modules use the object itself or its module forms")
        return self._process("tensor", grad)

    def post_accumulate(self, param):
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"{self._name}.post_accumulate is a Tensor.register_post_accumulate_grad_hook hook "
                            f"(param) -> None; got {type(param).__name__}")
        if param.grad is not None:
            self._process("post_accumulate", param.grad)
        return None

    def _process(self, kind, obj, extra=None):  # pragma: no cover - abstract
        raise NotImplementedError


class fused_clip(_Forms):
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
        self.max_norm = _max_norm(max_norm, "fused_clip")
        self.norm_type = _norm_type(norm_type, "fused_clip")
        self.per_tensor = bool(per_tensor)
        self.eps = _eps(eps, "fused_clip")
        self.nonfinite = _policy(nonfinite, "fused_clip")
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

    def _process(self, kind, obj, extra=None):
        if kind == "post_accumulate":  # in place on param.grad: the one place PyTorch allows it
            if not _is_float_tensor(obj):
                return None
            if self.nonfinite == "error":
                _, total = norms_op([obj], self.norm_type, "fused_clip")
                self._check_finite(total)
            total = clip_norm_op(obj, self.norm_type, self.max_norm, self.eps, _POLICY_CODE[self.nonfinite],
                                 "fused_clip")
            self.last_norm = total
            return None
        tensors: list[torch.Tensor] = []
        _flatten(obj, tensors)
        floats = [t for t in tensors if _is_float_tensor(t)]
        if not floats:
            return None  # nothing to clip: PyTorch keeps what it had
        new = iter(self._scaled(floats))
        replaced = iter([next(new) if _is_float_tensor(t) else t for t in tensors])
        return _rebuild(obj, replaced)


class clip_value(_Forms):
    """Clamps what a hook sees to [-v, v] (clip_value(v)) or [lo, hi] (clip_value(lo, hi)); new tensors, except the
    post-accumulate form, which clamps `param.grad` in place. `last_count` holds the number of values clipped by
    the last call (an int64 device tensor)."""

    _name = "hookstats.clip_value"

    def __init__(self, lo: float, hi: Optional[float] = None):
        self.lo, self.hi = _bounds(lo, hi, "clip_value")
        self.last_count: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        return f"hookstats.clip_value({self.lo}, {self.hi})"

    def _process(self, kind, obj, extra=None):
        if kind == "post_accumulate":
            if _is_float_tensor(obj):
                self.last_count = clamp_count_op([obj], self.lo, self.hi, "clip_value")
            return None
        tensors: list[torch.Tensor] = []
        _flatten(obj, tensors)
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
        return _rebuild(obj, iter([next(out) if _is_float_tensor(t) else t for t in tensors]))
