"""Where a Monitor's records come from: its hooks (hooks.py's C++-backed callables) put on the selected modules and
parameters, each with its hook id in the recorder (recorder.py), every one registered through
hookstats._owned_hooks (so that pickling or copying the model leaves them out)."""
from __future__ import annotations

from typing import Callable

import torch

from .._owned_hooks import register
from .._select import Site
from ..distributed import after_ddp_allreduce, grad_mode
from ..distributed import is_dtensor as _is_dtensor
from . import hooks as _hooks
from .recorder import Recorder


def attach_module_hooks(model: torch.nn.Module, rec: Recorder, kinds, wanted: Callable, handles: list,
                        unplaced: list) -> None:
    """The hooks of the module kinds (forward_pre, forward, backward_pre, backward) on every wanted module, their
    handles appended to `handles` as they are made (a failure halfway leaves them removable); unplaced[0] counts
    grad_output aliases that could not be put in place (hooks.replace_outputs)."""
    C, mid = rec.rec, rec.id
    for name, mod in model.named_modules():
        if not wanted(name, mod):
            continue
        if Site.FORWARD_PRE in kinds:
            handles.append(register(mod, "register_forward_pre_hook",
                                    _hooks.forward_pre_hook(C, mid, rec.hook(name, Site.FORWARD_PRE.value))))
        if Site.FORWARD in kinds or Site.BACKWARD_PRE in kinds:
            fwd = rec.hook(name, Site.FORWARD.value) if Site.FORWARD in kinds else -1
            grad = rec.hook(name, Site.BACKWARD_PRE.value) if Site.BACKWARD_PRE in kinds else -1
            hook, pre_hook = _hooks.forward_hook(C, mid, fwd, grad, unplaced, mod)
            if pre_hook is not None:
                handles.append(register(mod, "register_forward_pre_hook", pre_hook))
            handles.append(register(mod, "register_forward_hook", hook))
        if Site.BACKWARD in kinds:
            handles.append(register(mod, "register_full_backward_hook",
                                    _hooks.backward_hook(C, mid, rec.hook(name, Site.BACKWARD.value))))


def attach_grad_hooks(model: torch.nn.Module, rec: Recorder, wanted: Callable, group, optimizer,
                      record_grads: Callable[[], None], handles: list) -> list:
    """The grad kind: a hook id per wanted trainable parameter, recorded after each accumulation (a post-accumulate
    hook), or by `record_grads` (which must hold its Monitor weakly) at the optimizer's step (optimizer=), after
    DDP's allreduce, or never from here (optimizer="manual"). Returns [(hook id, parameter)]."""
    params = []
    ddp = grad_mode(model, group, optimizer)  # Note [grad records across ranks]
    for pname, p in model.named_parameters():
        if p.requires_grad and wanted(pname):
            hid = rec.hook(pname, Site.GRAD.value, replicated=ddp is not None and not _is_dtensor(p))
            params.append((hid, p))
            if optimizer is None and ddp != "end_of_backward":
                handles.append(p.register_post_accumulate_grad_hook(_hooks.grad_hook(rec.rec, rec.id, hid)))
    if optimizer is not None and optimizer != "manual":

        def step_pre_hook(opt, args, kwargs):
            record_grads()
            return None  # (args, kwargs) unchanged

        handles.append(optimizer.register_step_pre_hook(step_pre_hook))
    elif ddp == "end_of_backward":
        handles.append(after_ddp_allreduce(model, record_grads))
    return params
