"""The per-site forms of a hook object (hookstats.fused_clip, clip_value, record): one method per place a PyTorch hook
can sit, each taking that hook kind's arguments and handing what it sees to `_process(site, obj, extra)` under the
site's `hookstats.Site` (the table of forms is hookstats/hooks.py's docstring)."""
from __future__ import annotations

import torch

from ._owned_hooks import in_backward
from ._select import Site


def check_full_backward(module, form_owner: str) -> None:
    """A hook registered with the legacy register_backward_hook gets the last autograd node's inputs (weight and
    bias grads included), not the module's input grads: refuse it, with the call to use instead."""
    if getattr(module, "_is_full_backward_hook", None) is False:
        raise RuntimeError(
            f"{form_owner} was registered with module.register_backward_hook, whose grad_input holds the gradients of "
            "the last autograd node's inputs (for nn.Linear: input, weight and bias), not the module's inputs. "
            f"Use module.register_full_backward_hook({form_owner})."
        )


class HookForms:
    """The per-site forms of a hook object; subclasses implement _process(site, obj, extra=None) -> new obj or None:
    site is a hookstats.Site (Site.GRAD: the post-accumulate form, obj is param.grad; Site.TENSOR: a tensor hook's
    grad), extra a full backward hook's grad_output beside its grad_input (Site.BACKWARD), else None."""

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
        check_full_backward(module, self._name)
        return self._process(Site.BACKWARD, grad_input, extra=grad_output)

    def backward_pre(self, module, grad_output):
        return self._process(Site.BACKWARD_PRE, grad_output)

    def forward_pre(self, module, args):
        return self._process(Site.FORWARD_PRE, args)

    def forward(self, module, args, output):
        return self._process(Site.FORWARD, output)

    def tensor(self, grad):
        if grad is None:
            # An output of a multi-output op (chunk, unbind) that the loss does not use: PyTorch calls its hooks
            # with None. Returning None keeps it None; raising would abort the backward pass.
            return None
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"{self._name}.tensor is a Tensor.register_hook hook (grad) -> grad; got "
                            f"{type(grad).__name__}. For modules use the object itself or its module forms")
        return self._process(Site.TENSOR, grad)

    def post_accumulate(self, param):
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"{self._name}.post_accumulate is a Tensor.register_post_accumulate_grad_hook hook "
                            f"(param) -> None; got {type(param).__name__}")
        if param.grad is not None:
            self._process(Site.GRAD, param.grad)
        return None

    def _process(self, site: Site, obj, extra=None):  # pragma: no cover - abstract
        raise NotImplementedError
