"""torch.compile glue of the Monitor's hooks: Note [monitor under torch.compile].

Note [monitor under torch.compile]
A hook that dynamo traces (forward hooks inside a compiled module; module backward and "grad" hooks under compiled
autograd) must not read the step, call counts, `every` or buffer sizes: they change from call to call, so each
would be a guard, and every step a recompile. Such a hook traces one _record_op call instead, with the tensors and
two constant ids (the recorder's and the hook's). The op is registered as effectful (ordered), so compilers neither
drop it (it returns nothing) nor reorder it; when the compiled graph runs, it hands the tensors to the C++
recorder (Note [monitor sites] in csrc/monitor/recorder.h): the eager recording, with the step, call numbers and `every` of that
moment. The op is C++ (csrc/monitor/traced.cpp): a compiled graph makes no call into Python where a hook was.
Records, their sites and their step numbers are the eager ones, and no guard depends on them. Where the
effect cannot be registered (older PyTorch), the op is called through torch.compiler.disable: a graph break per
hook, same records.
- The op is tagged cudagraph_unsafe: a CUDA graph replay would skip its body, and the record.
- Hooks are never compiled as frames of their own (inlined_only): one called from eager code records eagerly.
- Dynamo does not guard on module hooks (torch._dynamo.config.skip_nnmodule_hook_guards): attach a Monitor before
  compiling; code compiled before then never calls its hooks. After detach() the compiled code still calls the op,
  which then records nothing.
- Without compiled autograd, dynamo refuses module backward hooks (a graph break at each module that has them, the
  hooks then run eagerly); "grad" hooks run eagerly in the autograd engine, after the compiled backward.
"""
from __future__ import annotations

import itertools

import torch

from .._kernels import HAVE_EXTENSION, extension  # the op's fake kernel is there too
from .._nested import flatten

_IDS = itertools.count()


def register(buffers) -> int:
    """A constant id under which traced hooks reach the C++ recorder of `buffers` (held weakly by the registry)."""
    i = next(_IDS)
    extension().register_recorder(i, buffers.rec)
    return i


def _register_ordered_effect(op) -> bool:
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        _register_effectful_op(op, _EffectType.ORDERED)
        return True
    except (ImportError, AttributeError, TypeError):
        return False


if HAVE_EXTENSION:

    _record_op = torch.ops.hookstats._monitor_record.default
    _record_op_traced = _record_op if _register_ordered_effect(_record_op) else torch.compiler.disable(_record_op)
else:  # no compiled extension: Monitor and record refuse to start (recorder.py says why), nothing is traced
    _record_op = _record_op_traced = None
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)
# The eager check a hook makes on every call: dynamo folds it to True where it traces the hook; eagerly it is one
# call that returns False (torch.compiler.is_compiling costs twice as much).
is_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def inlined_only(hook):
    """hook, which dynamo traces where a compiled frame calls it, but never compiles as a frame of its own: a hook
    called from eager code (a module run eagerly after a graph break) records eagerly, instead of being compiled
    once per hook (each has other constants) until dynamo's recompile limit."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        set_code_exec_strategy(hook.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except (ImportError, AttributeError):  # older PyTorch: the hook compiles, and records the same
        pass
    return hook


def record_traced(mid: int, hid: int, obj) -> None:
    """The traced body of a Monitor hook: see Note [monitor under torch.compile]."""
    if _is_exporting():  # an exported program must not call back into this process's monitors
        return None
    tensors = flatten(obj, keep_none=True)
    _record_op_traced([None if t is None else t.detach() for t in tensors], mid, hid)
    return None


def record_traced_tensor(mid: int, hid: int, index: int, grad) -> None:
    """The traced body of a grad_output tensor hook (Note [grad_output by tensor hooks] in hooks.py)."""
    if grad is None or _is_exporting():
        return grad
    _record_op_traced([grad.detach()], mid, hid, index)
    return grad  # unchanged; compiled autograd takes a hook's None for a missing gradient
