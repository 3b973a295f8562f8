"""The Monitor's hooks: thin Python functions around the C++ hook callables of hookstats._C (csrc/monitor/).

Each hook is a Python function that dynamo can trace (Note [monitor under torch.compile] in compile.py) and that,
eagerly, makes one call into C++, which flattens what the hook sees, skips non-floating tensors and launches the
stats kernel into each tensor's site row (Note [monitor sites] in csrc/monitor/recorder.h). The closures hold the
C++ recorder only, never the Monitor or the model: PyTorch keeps tensor hooks in C++, where Python's collector
cannot see a cycle, so a hook that reached the Monitor would keep the model alive forever.

Note [grad_output by tensor hooks]
"backward_pre" (grad_output) is not recorded with register_full_backward_pre_hook, whose BackwardHookFunction wraps
every module's inputs and outputs in autograd nodes (that alone doubles the step of a 1,000-module MLP). It records
what that hook receives: per output slot of the call, the gradient that flows through that slot (not the tensor's
total gradient). The forward hook puts a C++ tensor hook on an output where the autograd sequence numbers prove
that the two are the same, and returns an alias with a recording node of its own in place of any other output
(Note [grad_output per output slot] in csrc/monitor/slots.cpp; a forward pre-hook notes the call's start, except
on modules whose outputs are known: module_outputs). When a record equals PyTorch's grad_output (tests/test_grad_output_slots.py and
tests/test_real_models.py against the pre-hook on twins; docs/guide/hooks-semantics.md has the table):
- Equal, to rounding, for every Tensor or tuple output: a computed output; an output that is an input (nn.Identity,
  Dropout in eval or p=0); the same tensor in several slots; an output the module also consumed (router logits,
  T5's position_bias, attention weights); a leaf output (a Parameter, an input reused across steps: one record a
  step, and no hook is ever put on the leaf); a view. "To rounding": PyTorch's node, like an alias, collects its
  slot's gradients before they join the tensor's other contributions, so a twin with pre-hooks can sum in another
  order.
- No record, as the pre-hook gives none: outputs that need no grad; an output the loss does not use (None).
- An output modified in place after the module (ReLU(inplace=True), `x += shortcut`): PyTorch's hook raises; the
  record is the gradient w.r.t. the value the module returned (a tensor hook stays on the node it was registered
  on; an alias is a detach() sharing the version counter, whose node stays on the path of the in-place op).
- Where PyTorch gives nothing, the same definition: a dict / ModelOutput output (the pre-hook never fires), tensors
  nested in a tuple element (PyTorch wraps top-level tensors only). So an HF model called with labels= records its
  loss (and any output used outside the model), not its logits, which only the model's own loss consumed.
- Index: the flat position, None counted, other objects not; PyTorch's grad_output counts every tuple element.
- Not proven by sequence numbers: a computed output that the module also keeps elsewhere (an attribute) and that is
  used through that reference after the call; its record then includes that use (PyTorch's would not).
- A tuple subclass that cannot be rebuilt with an alias in it (type(t)(items) fails), or a tensor that refuses
  detach(): no record for those slots, counted in Monitor.unrecorded_grad_outputs and summary().
- A container whose output is its last child's (nn.Sequential): both record it, with the same values; the child's
  record first (PyTorch's pre-hooks run the container's first), or the container's where the child's output needed
  an alias (the container's tensor hook then runs before the alias's node). When one output of a call needs an
  alias, all get one: a call's records then come in one order for every Monitor on the model.
- A module called several times in a step, gradient accumulation and retain_graph: one record per backward call,
  each its own site (the call number counts hook runs per step), as the pre-hook is called once per backward call.
- Gradients: a tensor hook reads, an alias's node passes the gradient on unchanged; no bit changed on the tested
  models (tests/test_real_models.py). An alias can change rounding only for a tensor whose gradient has three or
  more contributions, some through the alias and some not (they are then summed in another grouping).
- Registration happens in the forward: a graph built before the Monitor was attached has no hooks (the pre-hook
  needs the forward too). Traced hooks (torch.compile, and an eager forward whose backward compiled autograd
  traces) cannot read sequence numbers: every output that requires grad gets a view_as alias with a traced hook.
  Its records equal eager ones (tests/test_real_models.py) except that an output modified in place after the
  module loses its record (the in-place op rebases the view), and AOTAutograd can record a zero gradient for a
  returned slot that nothing uses.
"backward" (grad_input) keeps register_full_backward_hook, with the C++ callable as its body: a tensor hook on a
module's input would see the input's total gradient, which differs from grad_input whenever another module also
reads that input (every residual connection), so only PyTorch's wrapping gives grad_input.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .._kernels import extension
from .._nested import flatten, is_dataclass_instance
from .compile import inlined_only, is_compiling, record_traced, record_traced_tensor


# What a module's call returns, by the forward function its class runs, for grad_output hooks without a forward
# pre-hook (Note [grad_output per output slot] in csrc/monitor/slots.cpp): COMPUTED, every tensor it returns is
# computed by the call, so an output's node (when it has one) was made by the call; COMPUTED_OR_INPUT, those or its
# positional input as it came (nn.Identity; Dropout in eval or with p=0, when not in place: in place, training with
# p > 0, it returns its input with a node the call made, which only the call's start tells apart). Any other module
# (containers, a class that overrides forward, a subclass of these included) gets a forward pre-hook that takes the
# call's start.
COMPUTED, COMPUTED_OR_INPUT = 1, 2
_COMPUTED = frozenset(getattr(torch.nn, name).forward for name in (
    "Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "LayerNorm", "GroupNorm", "RMSNorm", "LocalResponseNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
    "Embedding", "EmbeddingBag", "ReLU", "ReLU6", "GELU", "SiLU", "Mish", "Tanh", "Sigmoid", "Softmax",
    "LogSoftmax", "LeakyReLU", "ELU", "SELU", "CELU", "GLU", "Hardtanh", "Hardswish", "Hardsigmoid", "Softplus",
    "PReLU") if hasattr(torch.nn, name))
_DROPOUTS = frozenset(getattr(torch.nn, name).forward for name in (
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout") if hasattr(torch.nn, name))


def module_outputs(module) -> int:
    """COMPUTED, COMPUTED_OR_INPUT or 0 (unknown: the call's start is needed) for what `module` returns."""
    fwd = getattr(type(module), "forward", None)
    if fwd in _COMPUTED:
        return COMPUTED
    if fwd is torch.nn.Identity.forward or (fwd in _DROPOUTS and not getattr(module, "inplace", True)):
        return COMPUTED_OR_INPUT
    return 0


def forward_hook(rec, mid: int, fwd: int, grad: int, unplaced: list | None = None, module=None):
    """(forward hook, forward pre-hook or None): the forward hook records the output (hook id fwd >= 0) and hooks
    grad_output (grad >= 0: per output slot, Note [grad_output per output slot] in csrc/monitor/slots.cpp),
    putting an alias in place of an output where that is needed; the pre-hook (registered with it when grad >= 0,
    unless what `module` returns is known: module_outputs) takes the call's start. An alias that
    cannot be put in place (a tuple subclass that cannot be rebuilt) records nothing, and is counted in
    unplaced[0]."""
    _C = extension()
    unplaced = [0] if unplaced is None else unplaced

    call, start = _C.forward_hook(rec, fwd, grad, 0 if module is None else module_outputs(module))

    def hook(module, args, output):
        if is_compiling():
            if fwd >= 0:
                record_traced(mid, fwd, output)
            if grad >= 0:
                return _traced_grad_hooks(mid, grad, output, unplaced)
            return None
        aliases = call(module, args, output)
        if aliases is None or isinstance(aliases, torch.Tensor):  # nothing to replace, or the one output's alias
            return aliases
        if aliases is ...:
            # An eager forward whose backward compiled autograd will trace: it cannot run C++ hooks or nodes, so the
            # grad_output hooks are Python ones it can trace (they record through the ordered op).
            return _traced_grad_hooks(mid, grad, output, unplaced)
        made = {i: a for i, a in aliases if a is not None}
        unplaced[0] += len(aliases) - len(made)
        return replace_outputs(output, made, unplaced)

    if start is None:
        return inlined_only(hook), None

    def pre_hook(module, args):
        if not is_compiling():
            start(module, args)
        return None

    return inlined_only(hook), inlined_only(pre_hook)


def _traced_grad_hooks(mid: int, hid: int, output, unplaced: list | None = None):
    """The traced (and compiled-autograd) form of the grad_output hooks: every output that requires grad gets a
    view_as alias of its own, as its slot's edge (Note [grad_output per output slot]: the sequence numbers that
    prove a tensor hook exact are not there to read while tracing); returns the output with the aliases in place."""
    tensors = flatten(output, keep_none=True)
    aliases = {}
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            a = t.view_as(t)
            a.register_hook(functools.partial(record_traced_tensor, mid, hid, i))
            aliases[i] = a
    return replace_outputs(output, aliases, unplaced) if aliases else None


def replace_outputs(obj, aliases: dict, unplaced: list | None = None):
    """obj with the tensor at each flat index of `aliases` (hookstats._nested.flatten's, None counted) replaced by
    its alias. Tuples are rebuilt (as torch.nn.modules' BackwardHook does: type(obj)(*items) for a namedtuple),
    lists, dicts (OrderedDict, ModelOutput) and dataclass instances changed in place, so that a ModelOutput's
    attributes follow. A tuple
    that cannot be rebuilt keeps its tensors, and the aliases not placed are counted in unplaced[0]."""
    pos = [0]

    def walk(o):
        if isinstance(o, torch.Tensor):
            i = pos[0]
            pos[0] += 1
            return aliases.get(i, o)
        if o is None:
            pos[0] += 1
            return o
        if isinstance(o, tuple):
            first = pos[0]
            items = [walk(v) for v in o]
            if type(o) is tuple:
                return tuple(items)
            try:
                return type(o)(*items) if hasattr(o, "_fields") else type(o)(items)
            except Exception:  # its aliases get no gradient, so record nothing: counted, never a wrong number
                if unplaced is not None:
                    unplaced[0] += sum(first <= i < pos[0] for i in aliases)
                return o
        if isinstance(o, list):
            for k, v in enumerate(o):
                n = walk(v)
                if n is not v:
                    o[k] = n
            return o
        if isinstance(o, dict):  # walked by values() (Note [nested hook arguments]); each alias back under its key
            first, keys, vals = pos[0], list(o.keys()), list(o.values())
            new = [walk(v) for v in vals]
            if len(keys) != len(vals) or any(o[k] is not v for k, v in zip(keys, vals)):
                # values() not in the order of keys(): an alias could not go back where its tensor was found
                if unplaced is not None:
                    unplaced[0] += sum(first <= i < pos[0] for i in aliases)
                return o
            items = dict(zip(keys, new))
            if is_compiling():  # dynamo does not carry a ModelOutput's __setitem__ into the traced output
                return type(o)(**items) if type(o) is not dict else items
            for k, n in items.items():
                if n is not o[k]:
                    o[k] = n
            return o
        if is_dataclass_instance(o):  # in place, as a ModelOutput (the module made it; a frozen one too)
            for f in dataclasses.fields(o):
                v = getattr(o, f.name)
                n = walk(v)
                if n is not v:
                    object.__setattr__(o, f.name, n)
            return o
        return o

    return walk(obj)


def forward_pre_hook(rec, mid: int, hid: int):
    _C = extension()
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
    _C = extension()
    call = _C.backward_hook(rec, hid)

    def hook(module, grad_input, grad_output):
        if is_compiling():
            return record_traced(mid, hid, grad_input)
        call(module, grad_input, grad_output)
        return None

    return inlined_only(hook)


def grad_hook(rec, mid: int, hid: int):
    """A post-accumulate-grad hook: records param.grad after each accumulation."""
    call = extension().grad_hook(rec, hid)

    def hook(param):
        if is_compiling():
            return record_traced(mid, hid, param.grad)
        call(param)
        return None

    return inlined_only(hook)
