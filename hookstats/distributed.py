"""torch.distributed support: process groups, the grad kind under DDP, and the local part of a DTensor (merging
Monitor records across ranks: hookstats/monitor/merge.py, Note [merging records across ranks]).

Note [grad records across ranks]
DDP runs post-accumulate-grad hooks before its allreduce: the hook sees this rank's local gradient, not the one the
optimizer uses. So with a process group the "grad" kind records:
  - under DDP (the Monitor given the DistributedDataParallel module) without optimizer=: every parameter's .grad
    once per backward, after DDP's allreduce (a callback queued behind DDP's own at the end of the backward pass;
    none in no_sync() backwards), merged as replicated: the record of the averaged gradient, numel once;
  - with optimizer=: the grads at the optimizer's step, plain tensors merged as replicated (DDP's are the same on
    every rank), DTensors (FSDP2) by their local shards merged into the full gradient;
  - otherwise (hooks on a plain module, no optimizer=): each rank's gradient after its accumulation, merged as the
    concatenation of the ranks' local gradients (a module wrapped by DDP: before the allreduce).
"""
from __future__ import annotations

import sys
import warnings
from typing import Optional

import torch

from ._nested import flatten
from ._owned_hooks import register


def _dist():
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("hookstats: this torch build has no torch.distributed")
    return dist


def resolve_group(process_group):
    """The ProcessGroup for `process_group` ("world"/True: the default group), checked to be initialized."""
    dist = _dist()
    if not dist.is_initialized():
        raise RuntimeError("hookstats.Monitor(process_group=...) needs torch.distributed initialized first "
                           "(dist.init_process_group)")
    if process_group is True or process_group == "world":
        return dist.group.WORLD
    return process_group


def collective_device(group, buffer_device: Optional[torch.device]) -> torch.device:
    if buffer_device is not None:
        return buffer_device
    dist = _dist()
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def grad_mode(model, group, optimizer) -> Optional[str]:
    """How the grad kind records under a process group (Note [grad records across ranks]): "end_of_backward" (DDP,
    no optimizer=), "optimizer" (optimizer=: plain-tensor grads replicated), or None (as without a group)."""
    if group is None:
        return None
    if optimizer is not None:
        return "optimizer"
    from torch.nn.parallel import DistributedDataParallel

    return "end_of_backward" if isinstance(model, DistributedDataParallel) else None


class _Handles:
    def __init__(self, h):
        self.h = h

    def remove(self) -> None:
        self.h.remove()


def after_ddp_allreduce(ddp, record) -> _Handles:
    """Calls record() once per backward of `ddp` that syncs grads, after DDP's allreduce has written them: a forward
    hook puts a grad hook on the outputs, which queues a callback at the end of the backward pass; that callback
    queues record(), so that it runs after the callbacks queued during the backward pass (DDP's finalize_backward,
    which waits for the allreduce). The engine runs callbacks in the order queued, and those queued while
    running."""
    from torch.autograd import Variable
    from torch.autograd.graph import register_multi_grad_hook

    def queue_record():
        Variable._execution_engine.queue_callback(record)

    def on_grad(grads):
        Variable._execution_engine.queue_callback(queue_record)

    def fwd(module, args, output):
        if not torch.is_grad_enabled() or not getattr(module, "require_backward_grad_sync", True):
            return None
        # the output's tensors as DDP's reducer finds them (Note [nested hook arguments])
        ts = [t for t in flatten(output) if t.requires_grad]
        if ts:
            register_multi_grad_hook(ts, on_grad, mode="any")
        return None

    return _Handles(register(ddp, "register_forward_hook", fwd))


def _dtensor_type():
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t) -> bool:
    D = _dtensor_type()
    return D is not None and isinstance(t, D)


_warned_partial = False


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank contributes of a DTensor: its local shard, or an empty view where the DTensor is replicated
    along a mesh dimension and this rank is not the first there (so merged statistics count each element once).
    Plain tensors are returned as they are."""
    if not is_dtensor(t):
        return t
    local = t._local_tensor
    coord = t.device_mesh.get_coordinate()
    for dim, pl in enumerate(t.placements):
        if pl.is_replicate() and coord is not None and coord[dim] != 0:
            return local.reshape(-1)[:0]
        if pl.is_partial():
            global _warned_partial
            if not _warned_partial:
                _warned_partial = True
                warnings.warn("hookstats: a DTensor with a Partial placement is recorded by its local partial values; "
                              "merged statistics of it are not those of the reduced tensor", stacklevel=3)
    return local


def reduction_groups(t) -> tuple:
    """For a DTensor: its mesh, and the mesh dims whose placements shard it (where partial norms must be summed).
    Partial placements are refused: a norm of partial sums is not a partial norm."""
    dims = []
    for dim, pl in enumerate(t.placements):
        if pl.is_partial():
            raise ValueError("hookstats: cannot take the norm of a DTensor with a Partial placement (pending "
                             "reduction); call .redistribute() to Shard or Replicate it first")
        if pl.is_shard():
            dims.append(dim)
    return t.device_mesh, tuple(dims)
