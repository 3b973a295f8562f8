"""Per-sample clipping inside DistributedDataParallel (Note [clipping under DDP])."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .clip import apply_clip

# Note [clipping under DDP]: DDP's reducer copies each parameter's gradient into its bucket when autograd
# accumulates it (a hook on AccumulateGrad) and all-reduces the bucket then; at the end of the backward it writes
# the averaged buckets back into .grad. The clip runs at the end of the backward too, queued before DDP's own
# callback (at the model's output, before any parameter's gradient):
# - gradients the clip computes itself (Note [book-keeping]) are delivered through the parameters' AccumulateGrad
#   there, so the reducer sees the clipped gradient, once, and averages it;
# - a parameter whose gradient autograd computed (a bias, a norm weight, a first layer on data) was copied into its
#   bucket unclipped; the clip's correction sum_b (coef_b - 1) grad_b added to .grad there would be overwritten by
#   the averaged bucket. So in a backward that DDP reduces (its forward ran with require_backward_grad_sync) those
#   corrections are kept, and a callback queued from the clip's, which runs after DDP's, all-reduces them over
#   DDP's process group, divides by its size as DDP does, and adds them to .grad: the average over the ranks of
#   each rank's clipped sum. In a no_sync() backward the correction is added locally, as without DDP: the
#   accumulated .grad is reduced by the next syncing backward. A DDP with a communication hook (compression, a
#   custom average) cannot be mirrored and is refused; so is a correction set that differs between ranks.
# - a DDP that reads the autograd graph (find_unused_parameters=True, static_graph) would take a weight the layer ran
#   detached for unused and mark it ready at once, then again when the clip delivers its gradient (DDP's "marked
#   ready twice" error): under such a DDP nothing is deferred, and every correction is all-reduced as above.


def active_ddp(model: torch.nn.Module, max_norm: Optional[float]):
    """With max_norm, the DistributedDataParallel whose forward is running `model` (or `model` itself), when it will
    all-reduce the gradients of this forward's backward; None otherwise."""
    if max_norm is None:
        return None
    DDP = _ddp_class()
    if DDP is None:  # torch built without distributed
        return None
    ddp = model if isinstance(model, DDP) else DDP._get_active_ddp_module()
    if ddp is None or not torch.is_grad_enabled() or not ddp.require_backward_grad_sync:
        return None
    if getattr(ddp, "_comm_hooks", None) or getattr(ddp, "_use_python_reducer", False):
        raise RuntimeError("hookstats.PerSampleGradNorms(max_norm=...) inside DistributedDataParallel with a "
                           "communication hook (or the Python reducer): the clip's correction of the gradients "
                           "autograd computed cannot be averaged as the hook averages the rest (Note [clipping under "
                           "DDP]); remove the hook, or run the backward under ddp.no_sync() and all-reduce the "
                           "clipped .grad yourself")
    return ddp


_DDP: list = []


def _ddp_class():
    """torch's DistributedDataParallel, imported once (each forward asks), or None without torch.distributed."""
    if not _DDP:
        try:
            from torch.nn.parallel import DistributedDataParallel
        except ImportError:
            DistributedDataParallel = None
        _DDP.append(DistributedDataParallel)
    return _DDP[0]


def graph_ddp(ddp) -> bool:
    """Whether a DDP that reduces this backward finds its parameters from the autograd graph (Note [clipping under
    DDP]): book-keeping's detached weights would look unused to it."""
    return ddp is not None and bool(getattr(ddp, "find_unused_parameters", False)
                                    or getattr(ddp, "static_graph", False))


def add_after_ddp(ddp, deltas: Dict[int, torch.Tensor], order: List[int], params: Dict[int, torch.nn.Parameter],
                  names: Dict[int, str]) -> None:
    """Queues, on the running backward, the all-reduce of each rank's corrections (`deltas`: pid -> the correction
    of the gradient autograd computed) and their addition to .grad, after DDP has written its averaged buckets
    (Note [clipping under DDP]). `order`: every covered parameter, in one order on every rank."""
    pids = [pid for pid in order if pid in deltas]

    def reduce_and_add() -> None:
        import torch.distributed as dist

        group = ddp.process_group
        # the same corrections on every rank, or the flat buffers would not line up: [max, -min] of a signature
        sig = float(sum((i + 1) * deltas[pid].numel() for i, pid in enumerate(pids)) + 1e6 * len(pids))
        dev = deltas[pids[0]].device if pids else next(iter(params.values())).device
        check = torch.tensor([sig, -sig], dtype=torch.float64, device=dev)
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
        if float(check[0]) != sig or float(-check[1]) != sig:
            raise RuntimeError("hookstats.PerSampleGradNorms(max_norm=...) inside DistributedDataParallel: the ranks "
                               "corrected different parameters in this backward (Note [clipping under DDP]); every "
                               "rank must run the same layers on batches of the same layout")
        if not pids:
            return
        flat = torch.cat([deltas[pid].reshape(-1).to(torch.float64) for pid in pids])
        dist.all_reduce(flat, group=group)
        flat.div_(dist.get_world_size(group))
        at = 0
        with torch.no_grad():
            for pid in pids:
                p, n = params[pid], deltas[pid].numel()
                if p.grad is None:
                    raise RuntimeError(f"hookstats.PerSampleGradNorms(max_norm=...): {names[pid]} has no .grad "
                                       "after DistributedDataParallel's reduction")
                p.grad.add_(flat[at:at + n].view_as(p.grad).to(p.grad.dtype))
                at += n

    torch.autograd.Variable._execution_engine.queue_callback(reduce_and_add)


def clip_with(ddp, names: Dict[int, str]):
    """clip.apply_clip, or under a DDP that reduces this backward (Note [clipping under DDP]) the same with the
    corrections of autograd's gradients kept and queued for after DDP's reduction."""
    if ddp is None:
        return apply_clip

    def clip(entries: list, max_norm: float, eps: float, params: Dict[int, torch.nn.Parameter], groups=()):
        deltas: Dict[int, torch.Tensor] = {}
        coef, grads = apply_clip(entries, max_norm, eps, params, groups=groups, keep_corrections=deltas)
        add_after_ddp(ddp, deltas, list(names), params, names)
        return coef, grads
    return clip
