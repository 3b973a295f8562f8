"""Norms and in-place clipping with no host sync: single tensors, and drop-ins for `torch.nn.utils`' clipping.

Every norm is computed in one kernel call per device (all tensors of a device at once, whatever their dtypes and
layouts), overflow-safe (csrc/core/norm_ops.h, Note [norm partials]), and combined on the device; the clipping
coefficient is read on the device by the scaling kernel, so nothing waits for the GPU unless you ask for an error
on non-finite norms.
"""
from __future__ import annotations

import functools
import math
import types
import warnings
from typing import Iterable, NamedTuple, Optional, Union

import torch

from ._ops import (
    SUPPORTED_DTYPES,
    check_tensor,
    clamp_count_op,
    clip_norm_op,
    norms_op,
    result_dtype,
    scale_by_norm_op,
)
from ._checks import (
    POLICY_CODE,
    check_bounds,
    check_eps,
    check_max_norm,
    check_norm_type,
    check_policy,
    check_writable,
)
from .distributed import _dtensor_type, is_dtensor, reduction_groups

TensorOrTensors = Union[torch.Tensor, Iterable[torch.Tensor]]

# PyTorch's epsilon in clip_grads_with_norm_: grad * min(1, max_norm / (total_norm + 1e-6)).
CLIP_EPS = 1e-6


class Norms(NamedTuple):
    """Norms of a list of tensors: `per_tensor` [n] and `total` (the norm of their concatenation), float64."""

    per_tensor: torch.Tensor
    total: torch.Tensor


def _nonfinite_error(norm_type: float, switch: str = "set `error_if_nonfinite=False`") -> RuntimeError:
    # PyTorch's message (torch.nn.utils.get_total_norm), so code that matches on it keeps working; `switch` names
    # what turns the error off in the call that raised it.
    return RuntimeError(
        f"The total norm of order {norm_type} for gradients from "
        "`parameters` is non-finite, so it cannot be clipped. To disable "
        f"this error and scale the gradients by the non-finite norm anyway, {switch}"
    )


def _group(tensors: list[torch.Tensor], op: str) -> tuple[dict[torch.device, list[torch.Tensor]], torch.dtype]:
    """The tensors grouped by device (one kernel call per device takes every dtype) and their promoted dtype (the
    dtype PyTorch's total norm has). The grouping runs in C++, as in torch.nn.utils: ~0.07 us a tensor."""
    try:
        grouped = torch._C._group_tensors_by_device_and_dtype([tensors], False)
    except Exception:
        for t in tensors:  # say which argument was wrong, as check_tensor words it
            check_tensor(t, op)
        raise
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    dtypes = []
    for (dev, dtype), (lists, _) in grouped.items():
        if dtype not in SUPPORTED_DTYPES:
            check_tensor(lists[0][0], op)
        by_device.setdefault(dev, []).extend(lists[0])
        dtypes.append(dtype)
    return by_device, functools.reduce(torch.promote_types, dtypes)


def _check_foreach(foreach: Optional[bool], device: torch.device) -> None:
    if foreach and device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")


def _combine(totals: list[torch.Tensor], p: float) -> torch.Tensor:
    """The p-norm of several devices' float64 totals, on the first device, scaled so it cannot overflow."""
    if len(totals) == 1:
        return totals[0]
    dev = totals[0].device
    t = torch.stack([x.to(dev) for x in totals])
    m = t.amax()
    if p == math.inf:
        return m
    safe = torch.where(m > 0, m, torch.ones_like(m))
    r = (t / safe).pow(p).sum().pow(1.0 / p) * safe
    return torch.where(torch.isinf(m), m, r)


def _total64(by_device: dict[torch.device, list[torch.Tensor]], first_device: torch.device, p: float,
             foreach: Optional[bool], op: str) -> torch.Tensor:
    """The total norm in float64 on first_device: one norms kernel call per device, combined on the device."""
    totals = []
    for dev, group in by_device.items():
        _check_foreach(foreach, dev)
        totals.append(norms_op(group, p, op)[1])
    if len(totals) > 1:  # the first device's total first, as PyTorch stacks the norms on the first device
        totals.sort(key=lambda t: t.device != first_device)
    return _combine(totals, p)


def _split_dtensors(ts: list) -> tuple[list, list]:
    """(plain tensors, DTensors). No DTensor can exist before torch.distributed.tensor is imported: then free."""
    D = _dtensor_type()
    if D is None:
        return ts, []
    plain, dts = [], []
    for t in ts:
        (dts if isinstance(t, D) else plain).append(t)
    return plain, dts


def _dtensor_groups(dts: list) -> dict:
    """DTensors grouped by (mesh, the mesh dims that shard them): the local parts of one group are reduced over the
    same process groups. Replicated dims need no reduction: every rank there holds the same values."""
    groups: dict = {}
    for d in dts:
        mesh, dims = reduction_groups(d)
        groups.setdefault((id(mesh), dims), (mesh, dims, []))[2].append(d._local_tensor)
    return groups


def _all_reduce_dims(t: torch.Tensor, mesh, dims: tuple, op_name: str) -> None:
    import torch.distributed as dist

    op = getattr(dist.ReduceOp, op_name)
    for dim in dims:
        dist.all_reduce(t, op=op, group=mesh.get_group(mesh_dim=dim))


def _dtensor_total64(dts: list, p: float, foreach: Optional[bool], op: str) -> list[torch.Tensor]:
    """The global p-norm of each group of DTensors (float64, on the local device, the same on every rank): local
    partial norms from one kernel call per device, raised to p and summed over the sharding mesh dims (MAX for inf) by
    one all_reduce per dim: no host sync. Float64 partials: p-th powers overflow only past norms of ~1e154 (p=2)."""
    out = []
    for mesh, dims, locals_ in _dtensor_groups(dts).values():
        by_device, _ = _group(locals_, op)
        dev = locals_[0].device
        t = _total64(by_device, dev, p, foreach, op)
        if not dims:
            out.append(t)
            continue
        if p == math.inf:
            t = t.clone()
            _all_reduce_dims(t, mesh, dims, "MAX")
        else:
            t = t.pow(p)
            _all_reduce_dims(t, mesh, dims, "SUM")
            t = t.pow(1.0 / p)
        out.append(t)
    return out


def _global_total64(grads: list, p: float, foreach: Optional[bool], op: str) -> tuple[torch.Tensor, torch.dtype, dict]:
    """(total norm in float64, its PyTorch dtype, the tensors to scale by device) for plain tensors and DTensors
    alike; the total is on the first tensor's (local) device."""
    plain, dts = _split_dtensors(grads)
    totals, dtypes, by_device = [], [], {}
    if plain:
        bd, dt = _group(plain, op)
        totals.append(_total64(bd, plain[0].device, p, foreach, op))
        dtypes.append(dt)
        by_device = bd
    if dts:
        totals += _dtensor_total64(dts, p, foreach, op)
        bd, dt = _group([d._local_tensor for d in dts], op)
        dtypes.append(dt)
        for dev, g in bd.items():
            by_device.setdefault(dev, []).extend(g)
    first = grads[0]._local_tensor.device if dts and grads[0] is dts[0] else grads[0].device
    totals.sort(key=lambda t: t.device != first)
    return _combine(totals, p), functools.reduce(torch.promote_types, dtypes), by_device


def norm(x: torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    """The `norm_type`-norm of `x` (1, 2, inf or any p > 0) as a 0-d tensor on x's device: float32, float64 for
    float64 x. It cannot overflow or underflow while the true norm fits the result (PyTorch's float32 norm of 1000
    values of 1e30 is inf; this is 3.16e31). NaN anywhere gives NaN, else Inf gives inf; an empty x gives 0."""
    check_tensor(x, "norm")
    p = check_norm_type(norm_type, "norm")
    return norms_op([x.detach()], p, "norm")[1].to(result_dtype(x.dtype))


def norms(tensors: TensorOrTensors, norm_type: float = 2.0) -> Norms:
    """Per-tensor norms and the total norm of tensors on one device (any float dtypes and layouts), in one kernel
    call, as float64 tensors on that device."""
    ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    p = check_norm_type(norm_type, "norms")
    if not ts:
        return Norms(torch.zeros((0,), dtype=torch.float64), torch.zeros((), dtype=torch.float64))
    devices = {t.device for t in ts}
    if len(devices) > 1:
        raise ValueError(f"hookstats.norms needs tensors on one device, got {sorted(map(str, devices))}; "
                         "use hookstats.get_total_norm for tensors on several devices")
    with torch.no_grad():
        per, total = norms_op(ts, p, "norms")
    return Norms(per, total)


def clip_norm_(x: torch.Tensor, max_norm: float, norm_type: float = 2.0, eps: float = CLIP_EPS, *,
               nonfinite: str = "propagate") -> torch.Tensor:
    """Scales `x` in place by min(1, max_norm / (norm + eps)) (PyTorch's rule) and returns the norm before
    clipping (0-d, on x's device, float32; float64 for float64 x). Nothing is copied to the host.

    nonfinite: "propagate" (PyTorch's behaviour: an inf norm zeroes finite values and turns infs into NaN, a NaN
    norm makes x NaN), "zero" (x becomes all zeros when its norm is NaN or inf, decided on the device), or "error"
    (RuntimeError before x is touched; this one waits for the norm)."""
    check_tensor(x, "clip_norm_")
    p = check_norm_type(norm_type, "clip_norm_")
    m = check_max_norm(max_norm, "clip_norm_")
    policy = check_policy(nonfinite, "clip_norm_")
    eps = check_eps(eps, "clip_norm_")
    check_writable(x, "clip_norm_")
    xd = x.detach()
    if policy == "error":  # the one policy that must see the norm before scaling
        _, total = norms_op([xd], p, "clip_norm_")
        if not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"hookstats.clip_norm_: the norm of order {p} of the tensor is non-finite ({total.item()}), so it "
                "cannot be clipped; pass nonfinite='propagate' to scale by it anyway, or 'zero' to zero the tensor"
            )
        scale_by_norm_op([xd], total, m, float(eps), POLICY_CODE[policy], "clip_norm_")
    else:
        total = clip_norm_op(xd, p, m, float(eps), POLICY_CODE[policy])
    return total.to(result_dtype(x.dtype))


def clip_value_(x: torch.Tensor, lo: float, hi: Optional[float] = None) -> torch.Tensor:
    """Clamps `x` in place to [-lo, lo] (hi omitted) or [lo, hi], like `x.clamp_` (bounds rounded to x's dtype,
    NaN kept), and returns how many elements changed, as a 0-d int64 tensor on x's device (no host sync)."""
    check_tensor(x, "clip_value_")
    lo_f, hi_f = check_bounds(lo, hi, "clip_value_")
    check_writable(x, "clip_value_")
    return clamp_count_op([x.detach()], lo_f, hi_f, "clip_value_")


def _as_list(parameters: TensorOrTensors) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    is_generator = isinstance(parameters, types.GeneratorType)
    params = list(parameters)
    if is_generator and not params:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    return params


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [g for p in params if (g := p.grad) is not None]  # one .grad read a parameter: 0.10 -> 0.05 us


@torch.no_grad()
def get_total_norm(tensors: TensorOrTensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: Optional[bool] = None) -> torch.Tensor:
    """Drop-in for `torch.nn.utils.get_total_norm`: the norm of all `tensors` viewed as one vector.

    Same result dtype (the tensors' promoted dtype) and device (the first tensor's) as PyTorch; computed in float64
    by one kernel call per device, so it does not overflow midway (PyTorch's float32 total of values near 1e30 is
    inf). An empty list gives tensor(0.). error_if_nonfinite raises PyTorch's error (and waits for the result)."""
    ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    p = check_norm_type(norm_type, "get_total_norm")
    if not ts:
        return torch.tensor(0.0)
    total64, dtype, _ = _global_total64(ts, p, foreach, "get_total_norm")
    out = total64.to(dtype)
    if error_if_nonfinite and not bool(torch.isfinite(out)):
        raise _nonfinite_error(p)
    return out


def _total_on(total64: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """The 0-d float64 total on `dev`, without waiting for any device. A CPU total headed for an accelerator is read
    on the host (a CPU read, no device sync) and written on `dev` by a fill kernel: `total64.to(dev)` would be a
    pageable host-to-device copy, which waits for the stream. Between accelerators it is a device-to-device copy; only
    a device total headed for CPU tensors must wait (the CPU kernel reads it at once)."""
    if total64.device == dev:
        return total64
    if dev.type == "cpu":
        return total64.to(dev)
    if total64.device.type == "cpu":
        return torch.full((), float(total64), dtype=torch.float64, device=dev)
    return total64.to(dev, non_blocking=True)


def _scale_all(by_device: dict[torch.device, list[torch.Tensor]], total64: torch.Tensor, max_norm: float,
               policy: str, foreach: Optional[bool]) -> None:
    for dev, group in by_device.items():
        _check_foreach(foreach, dev)
        scale_by_norm_op(group, _total_on(total64, dev), max_norm, CLIP_EPS, POLICY_CODE[policy], "clip_grad_norm_")


@torch.no_grad()
def clip_grads_with_norm_(parameters: TensorOrTensors, max_norm: float, total_norm: torch.Tensor,
                          foreach: Optional[bool] = None, *, nonfinite: str = "propagate") -> None:
    """Drop-in for `torch.nn.utils.clip_grads_with_norm_`: scales every `p.grad` in place by
    min(1, max_norm / (total_norm + 1e-6)); `None` grads are skipped. The coefficient is computed on the device.
    total_norm may be a tensor on any device or a number; a CPU total (or a number) for GPU grads is written on the
    GPU without waiting for it (PyTorch's `.to(device)` of it waits for the stream).
    nonfinite="zero" zeroes the grads when total_norm is NaN or inf; "error" raises PyTorch's error instead."""
    params = _as_list(parameters)
    m = check_max_norm(max_norm, "clip_grads_with_norm_")
    policy = check_policy(nonfinite, "clip_grads_with_norm_")
    grads = _grads(params)
    if not grads:
        return
    plain, dts = _split_dtensors(grads)
    by_device, _ = _group(plain + [d._local_tensor for d in dts], "clip_grads_with_norm_")
    if not isinstance(total_norm, torch.Tensor):
        total_norm = torch.tensor(float(total_norm), dtype=torch.float64)
    if is_dtensor(total_norm):  # PyTorch's total of DTensor grads is a DTensor: its full value
        total_norm = total_norm.full_tensor()
    total64 = total_norm.detach().to(torch.float64)
    if policy == "error" and not bool(torch.isfinite(total64)):
        raise RuntimeError(f"hookstats.clip_grads_with_norm_: total_norm is non-finite ({float(total64)}), so the "
                           "gradients cannot be clipped. To scale them by it anyway, pass nonfinite=\"propagate\" "
                           "(PyTorch's behaviour); to zero them, nonfinite=\"zero\"")
    _scale_all(by_device, total64, m, policy, foreach)


@torch.no_grad()
def clip_grad_norm_(parameters: TensorOrTensors, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None, *,
                    nonfinite: str = "propagate") -> torch.Tensor:
    """Drop-in for `torch.nn.utils.clip_grad_norm_`: same arguments, same return value (the total norm of the
    grads before clipping, in PyTorch's dtype, on the first grad's device), grads scaled in place by
    min(1, max_norm / (total + 1e-6)).

    One norm kernel call and one scale kernel call per device, whatever the number and dtypes of the parameters;
    the total is combined and the coefficient computed on the device, in float64 (PyTorch: in the grads' dtype),
    so no host sync happens unless error_if_nonfinite=True (same as nonfinite="error"), which raises PyTorch's
    error. nonfinite="zero" zeroes every grad when the total norm is NaN or inf (skip the step's update)."""
    params = _as_list(parameters)
    p = check_norm_type(norm_type, "clip_grad_norm_")
    m = check_max_norm(max_norm, "clip_grad_norm_")
    policy = "error" if error_if_nonfinite else check_policy(nonfinite, "clip_grad_norm_")
    grads = _grads(params)
    if not grads:
        return torch.tensor(0.0)
    total64, dtype, by_device = _global_total64(grads, p, foreach, "clip_grad_norm_")
    out = total64.to(dtype)
    if policy == "error" and not bool(torch.isfinite(out)):
        raise _nonfinite_error(p) if error_if_nonfinite else _nonfinite_error(p, "pass nonfinite=\"propagate\"")
    _scale_all(by_device, total64, m, policy, foreach)
    return out


@torch.no_grad()
def clip_grad_value_(parameters: TensorOrTensors, clip_value: float, foreach: Optional[bool] = None) -> torch.Tensor:
    """Like `torch.nn.utils.clip_grad_value_`: clamps every `p.grad` in place to [-clip_value, clip_value].

    Returns the number of clipped elements as a 0-d int64 tensor on the first grad's device (PyTorch returns None),
    from one kernel call per device and no host sync."""
    params = _as_list(parameters)
    cv = float(clip_value)
    if not cv >= 0:
        raise ValueError(f"hookstats.clip_grad_value_ needs clip_value >= 0, got {clip_value!r}")
    grads = _grads(params)
    if not grads:
        return torch.tensor(0)
    plain, dts = _split_dtensors(grads)
    counts = []
    if plain:
        by_device, _ = _group(plain, "clip_grad_value_")
        for dev, group in sorted(by_device.items(), key=lambda kv: kv[0] != plain[0].device):
            _check_foreach(foreach, dev)
            counts.append(clamp_count_op(group, -cv, cv, "clip_grad_value_"))
    for mesh, dims, locals_ in _dtensor_groups(dts).values():  # local counts, summed over the sharding dims
        by_device, _ = _group(locals_, "clip_grad_value_")
        for dev, group in by_device.items():
            _check_foreach(foreach, dev)
            c = clamp_count_op(group, -cv, cv, "clip_grad_value_")
            _all_reduce_dims(c, mesh, dims, "SUM")
            counts.append(c)
    first = counts[0]
    for c in counts[1:]:
        first = first + c.to(first.device)
    return first

