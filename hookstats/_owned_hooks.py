"""Module hooks that hookstats puts on a user's model, and that stay with the object that put them there.

Note [hooks that stay with their owner]
A Monitor (or a ChannelCalibrator, PerSampleGradNorms, a DDP helper) puts hooks into the hook dicts of the user's
modules. Those dicts are part of each module's __dict__, so `torch.save(model)`, `pickle`, `copy.deepcopy(model)` (an
EMA or teacher copy) and `copy.copy` would carry them along: pickling fails on the hooks (local closures) after
torch.save has already truncated the file, and a deep copy records into the original's recorder under the same
module names (functions are copied by reference), and keeps those hooks after detach().

So every hook hookstats registers goes through `register()`, which notes the hook's handle id on its module and puts
a `__getstate__` into that module's instance __dict__ (pickle, deepcopy and copy all look __getstate__ up on the
instance). It returns the state of the module's class (nn.Module's: a copy of __dict__; a LightningModule's own)
with hookstats' entries taken out of every hook dict, and itself too. A copy or a loaded model therefore carries no
hookstats hook at all, and its pickle names nothing of hookstats: it loads where hookstats is not installed. The
original is untouched and keeps recording. Removing the last owned hook of a module (detach()) takes the
__getstate__ away again. Nothing here runs on the hook path: it costs only at registration and at a save or copy.
(A DataParallel replica shares its original's __dict__ copy, and so this object: it is never pickled.)
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

__all__ = ["OwnedHandle", "in_backward", "register"]

# Every dict of nn.Module that holds hooks keyed by RemovableHandle.id (the *_with_kwargs / always_called dicts are
# the extra dicts of the same ids).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")


class _StateWithoutOwnedHooks:
    """The instance-level __getstate__ of a module that carries hookstats hooks (Note [hooks that stay with their
    owner])."""

    __slots__ = ("module", "ids", "previous")

    def __init__(self, module: torch.nn.Module, previous):
        self.module = weakref.ref(module)
        self.ids: set = set()
        self.previous = previous  # an instance-level __getstate__ that was there before, if any

    def __call__(self):
        m = self.module()
        if m is None:  # unreachable: pickling holds the module
            raise RuntimeError("hookstats: the module of this __getstate__ is gone")
        state = self.previous() if self.previous is not None else type(m).__getstate__(m)
        if not isinstance(state, dict):
            return state
        state = dict(state)
        if state.get("__getstate__") is self:
            if self.previous is None:
                del state["__getstate__"]
            else:
                state["__getstate__"] = self.previous
        for name in _HOOK_DICTS:
            hooks = state.get(name)
            if isinstance(hooks, dict) and not self.ids.isdisjoint(hooks):
                state[name] = OrderedDict((k, v) for k, v in hooks.items() if k not in self.ids)
        return state


class OwnedHandle:
    """A RemovableHandle of a hook hookstats put on a module: remove() removes the hook, and the module's
    __getstate__ once it carries no hookstats hook any more."""

    __slots__ = ("handle", "state")

    def __init__(self, handle, state: _StateWithoutOwnedHooks):
        self.handle = handle
        self.state = state

    @property
    def id(self) -> int:
        return self.handle.id

    def remove(self) -> None:
        self.handle.remove()
        st = self.state
        st.ids.discard(self.handle.id)
        if st.ids:
            return
        m = st.module()
        if m is not None and m.__dict__.get("__getstate__") is st:
            if st.previous is None:
                del m.__dict__["__getstate__"]
            else:
                m.__dict__["__getstate__"] = st.previous


def register(module: torch.nn.Module, how: str, hook, **kwargs) -> OwnedHandle:
    """`getattr(module, how)(hook, **kwargs)` (how: "register_forward_hook", "register_forward_pre_hook",
    "register_full_backward_hook", ...), as a hook that pickling and copying the module leave out."""
    handle = getattr(module, how)(hook, **kwargs)
    st = module.__dict__.get("__getstate__")
    if not isinstance(st, _StateWithoutOwnedHooks) or st.module() is not module:
        # a replica's copy of its original's (DataParallel) is not this module's: it is replaced, not chained
        st = _StateWithoutOwnedHooks(module, None if isinstance(st, _StateWithoutOwnedHooks) else st)
        module.__dict__["__getstate__"] = st
    st.ids.add(handle.id)
    return OwnedHandle(handle, st)


def in_backward() -> bool:
    """Whether the autograd engine is running this call: a backward hook or node, or a forward hook of a forward that
    activation checkpointing recomputes during the backward (torch.utils.checkpoint with either use_reentrant, HF's
    gradient_checkpointing_enable(), a reversible block). For a forward hook that is a call the first forward already
    saw, and seeing it again would count it twice. (The Monitor's C++ hooks ask the engine the same:
    csrc/monitor/monitor_py.cpp, recomputing().)"""
    return _graph_task_id() != -1


_graph_task_id = torch._C._current_graph_task_id
