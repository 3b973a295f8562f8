"""Walking and rebuilding what a hook sees: a tensor, or tensors nested in tuples, lists, dicts and dataclasses.

Note [nested hook arguments]
A hook's argument (a module's args, its output, grad_input / grad_output) is walked depth first, in order:
  - a tensor is one position;
  - None is a position with no tensor when the walk keeps None (a record's index is then the position in what the
    hook saw: a grad_input of (None, g) records g at index 1), and nothing otherwise;
  - a tuple (namedtuples and structseqs such as torch.return_types.max included) or a list: its items;
  - a dict (OrderedDict, Hugging Face's ModelOutput and any other subclass): its values(), in its own order;
  - a dataclass instance: its fields, in declaration order;
  - anything else (ints, strings, other objects, a Mapping that is no dict): no position.
This is what DDP's own walk of a module's output finds (torch.nn.parallel.distributed._find_tensors), so the
tensors hookstats watches under DDP are the ones DDP's reducer does. The Monitor's C++ hook path walks the same way
for speed (`flatten` in csrc/monitor/monitor_py.cpp, keeping None); this module is its specification, and
tests/test_nested.py checks that both agree on the same arguments.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Iterator, List, Optional

import torch


def is_dataclass_instance(obj) -> bool:
    """Whether obj is an instance of a dataclass (not the class itself)."""
    return hasattr(type(obj), "__dataclass_fields__")


def flatten(obj, keep_none: bool = False) -> List[Optional[torch.Tensor]]:
    """The tensors of a hook argument, in the order of Note [nested hook arguments]; with keep_none, None entries
    stay as placeholders, so that a tensor's list index is its position in what the hook saw. (Plain recursion, no
    generator: dynamo traces it inside compiled hooks.)"""
    out: list = []
    _collect(obj, out, keep_none)
    return out


def _collect(obj, out: list, keep_none: bool) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif obj is None:
        if keep_none:
            out.append(None)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _collect(o, out, keep_none)
    elif isinstance(obj, dict):
        for o in obj.values():
            _collect(o, out, keep_none)
    elif is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name), out, keep_none)


def first_floating(obj) -> Optional[torch.Tensor]:
    """The first floating-point tensor of a hook argument (Note [nested hook arguments]), or None."""
    for t in flatten(obj):
        if t.is_floating_point():
            return t
    return None


def rebuild(obj, new: Iterator):
    """A copy of obj with each tensor (in flatten's order, None not counted) replaced by the next item of `new`: the
    same structure and container types (namedtuples, structseqs, dict subclasses, a copy of a dataclass instance,
    frozen ones too), everything that is no tensor kept as it is. A dict subclass whose values() disagree with its
    keys() in order is refused (TypeError): its tensors could not go back where they were found."""
    if isinstance(obj, torch.Tensor):
        return next(new)
    if isinstance(obj, tuple):
        items = [rebuild(o, new) for o in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        if type(obj) is not tuple:  # structseq such as torch.return_types.max
            return type(obj)(items)
        return tuple(items)
    if isinstance(obj, list):
        return [rebuild(o, new) for o in obj]
    if isinstance(obj, dict):  # walked by values(): each goes back under its key, which must be in the same order
        keys, vals = list(obj.keys()), list(obj.values())
        if len(keys) != len(vals) or any(obj[k] is not v for k, v in zip(keys, vals)):
            raise TypeError(f"hookstats: a {type(obj).__name__} whose values() are not in the order of its keys() "
                            "cannot be rebuilt with new tensors")
        return type(obj)((k, rebuild(v, new)) for k, v in zip(keys, vals))
    if is_dataclass_instance(obj):  # a copy with the new fields (frozen ones too: the copy is ours)
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, rebuild(getattr(obj, f.name), new))
        return out
    return obj
