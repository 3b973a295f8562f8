"""The Monitor's hooks: thin Python functions around the C++ hook callables of hookstats._C (csrc/monitor/).

Each hook is a Python function that dynamo can trace (Note [monitor under torch.compile] in compile.py) and that,
eagerly, makes one call into C++, which flattens what the hook sees, skips non-floating tensors and launches the
stats kernel into each tensor's site row (Note [monitor sites] in csrc/monitor/recorder.h). The closures hold the
C++ recorder only, never the Monitor or the model: PyTorch keeps tensor hooks in C++, where Python's collector
cannot see a cycle, so a hook that reached the Monitor would keep the model alive forever.

Note [grad_output by tensor hooks]
"backward_pre" (grad_output) is not recorded with register_full_backward_pre_hook, whose BackwardHookFunction wraps
every module's inputs and outputs in autograd nodes (that alone doubles the step of a 1,000-module MLP). The forward
hook registers a C++ tensor hook on each output that requires grad; the autograd engine runs it, without Python or
the GIL, with the gradient of the loss w.r.t. that output. Where this equals the full backward pre-hook, and where
not:
- The values are the same: both see the gradient w.r.t. the module's output tensor (its total gradient, summed over
  every consumer). An output modified in place after the module (`y = m(x); y.mul_(2)`): a tensor hook registered
  before the in-place op keeps the gradient w.r.t. the value the module returned, as the full pre-hook does.
- Outputs that need no grad: no record, and none from the pre-hook either (it never fires then). An output that
  the loss does not use: no record (PyTorch passes None; the pre-hook records nothing for None either).
- A container whose output is its last child's output (nn.Sequential): the same tensor gets both modules' hooks, so
  both record it, with the same values. Tensor hooks run in registration order, so the child's record comes first;
  PyTorch's pre-hooks run the container's first (records come in the order the hooks ran).
- A module called several times in a step, gradient accumulation (several backward calls per step) and
  retain_graph (backward twice over one graph): one record per backward call, each its own site (the call number
  counts hook runs per step), as the pre-hook is called once per backward call.
- Registration happens in the forward: a graph built before the Monitor was attached has no hooks (the pre-hook
  needs the forward too). Under torch.compile the tensor hooks are traced with compiled autograd; without it the
  forward hook's registration is a graph break, as module backward hooks are.
"backward" (grad_input) keeps register_full_backward_hook, with the C++ callable as its body: a tensor hook on a
module's input would see the input's total gradient, which differs from grad_input whenever another module also
reads that input (every residual connection), so only PyTorch's wrapping gives grad_input.
"""
from __future__ import annotations

import functools

import torch

from .compile import inlined_only, is_compiling, record_traced, record_traced_tensor


def forward_hook(rec, mid: int, fwd: int, grad: int):
    """A forward hook recording the output (hook id fwd >= 0) and registering grad_output hooks (grad >= 0)."""
    from .. import _C

    call = _C.forward_hook(rec, fwd, grad)
    call_no_grad = _C.forward_hook(rec, fwd, -1) if grad >= 0 else call

    def hook(module, args, output):
        if is_compiling():
            if fwd >= 0:
                record_traced(mid, fwd, output)
            if grad >= 0:
                _traced_grad_hooks(mid, grad, output)
            return None
        if grad >= 0 and _compiled_autograd_on():
            # An eager forward whose backward compiled autograd will trace: it cannot run C++ tensor hooks, so the
            # grad_output hooks are Python ones it can trace (they record through the ordered op).
            call_no_grad(module, args, output)
            _traced_grad_hooks(mid, grad, output)
            return None
        call(module, args, output)
        return None

    return inlined_only(hook)


_CA = None


def _compiled_autograd_on() -> bool:
    global _CA
    if _CA is None:
        import sys

        _CA = sys.modules.get("torch._dynamo.compiled_autograd", False)
        if _CA is False:  # never imported: compiled autograd cannot be on
            _CA = None
            return False
    return bool(getattr(_CA, "compiled_autograd_enabled", False))


def _traced_grad_hooks(mid: int, hid: int, output) -> None:
    from ..hooks import _flatten

    tensors: list = []
    _flatten(output, tensors, keep_none=True)
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(functools.partial(record_traced_tensor, mid, hid, i))


def forward_pre_hook(rec, mid: int, hid: int):
    from .. import _C

    call = _C.forward_pre_hook(rec, hid)

    def hook(module, args):
        if is_compiling():
            return record_traced(mid, hid, args)
        call(module, args)
        return None

    return inlined_only(hook)


def backward_hook(rec, mid: int, hid: int):
    """register_full_backward_hook: records grad_input (Note [grad_output by tensor hooks] says why not a tensor
    hook)."""
    from .. import _C

    call = _C.backward_hook(rec, hid)

    def hook(module, grad_input, grad_output):
        if is_compiling():
            return record_traced(mid, hid, grad_input)
        call(module, grad_input, grad_output)
        return None

    return inlined_only(hook)


def grad_hook(rec, mid: int, hid: int):
    """A post-accumulate-grad hook: records param.grad after each accumulation."""
    record = rec.record

    def hook(param):
        if is_compiling():
            return record_traced(mid, hid, param.grad)
        g = param.grad
        if g is not None and rec.active:
            record(hid, g)
        return None

    return inlined_only(hook)
