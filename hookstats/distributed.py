"""torch.distributed support: merging Monitor records across ranks, and the local part of a DTensor.

Note [merging records across ranks]
With `Monitor(..., process_group=pg)`, `flush()` is a collective: every rank of pg must call it at the same point,
having recorded the same tensors (same modules, kinds and order: true of DDP and FSDP2, where every rank runs the
same model). The rows of the device buffer are merged before they are copied to the host, so that every record
holds the statistics of the concatenation of what each rank's hook saw: the whole global batch for activations and
grad_outputs, the whole gradient for FSDP2's sharded parameter grads. Three all_reduces per flush, whatever the
number of records:
  1. MAX over a 4-value header [rows, -rows, signature, -signature]: every rank checks that all recorded the same
     number of tensors with the same (module, kind, index, dtype) sequence; a mismatch raises instead of merging
     unrelated rows (or hanging in a collective of mismatched sizes).
  2. MAX over [max, -min, linf] per row (rows with no value or a NaN contribute -inf, -inf, 0).
  3. SUM over the additive columns [numel, sum, l1, (l2 / L)^2, NaN, Inf, zero count, ((n - 1) std^2 + n (mean -
     c)^2) / L^2] per row and every histogram count (float64: exact up to 2^53). L is the merged linf, so squares
     neither overflow nor underflow (values near 1e300 keep a finite std, as in one process), and c the merged
     mid-range: the variance is combined around a point inside the data, not around 0 as E[x^2] - mean^2 would be,
     so |mean| >> std costs little (relative error ~ eps (range / std)^2 at worst, from each rank's rounded mean).
Then, on the device: mean = sum / numel, std = L sqrt((sum of the M2 terms - numel ((mean - c) / L)^2) / (numel -
1)), var = std^2, l2 = L sqrt(sum), and NaN where the single-process statistics give NaN (any NaN: min, max, linf, l2,
var; Inf: var). All ranks end up with the same merged rows; exporters write on one rank (export_rank).
"""
from __future__ import annotations

import math
import sys
import warnings
import zlib
from typing import Optional, Sequence

import torch

from ._ops import STATS_FIELDS

_F = {name: i for i, name in enumerate(STATS_FIELDS)}


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


def signature(metas: Sequence[tuple]) -> float:
    """A float64-exact checksum of the (module, kind, index, dtype) sequence (the same on every rank, unlike hash())."""
    crc = 0
    for m in metas:
        crc = zlib.crc32(repr(m).encode(), crc)
    return float(crc)


def merge_rows(group, stats: torch.Tensor, hists: Sequence[torch.Tensor], sig: float) -> tuple:
    """The merged stats rows [n, 13] (float64) and histogram rows (int64), Note [merging records across ranks].
    `stats` and each of `hists` are this rank's rows; returns new tensors on the same device."""
    dist = _dist()
    dev = stats.device
    n = stats.shape[0]
    head = torch.tensor([n, -n, sig, -sig], dtype=torch.float64, device=dev)
    dist.all_reduce(head, op=dist.ReduceOp.MAX, group=group)
    h = head.tolist()  # flush copies to the host anyway; this one waits for the check
    if h[0] != n or -h[1] != n or h[2] != sig or -h[3] != sig:
        raise RuntimeError(
            "hookstats.Monitor: ranks recorded different tensors since the last flush (this rank: "
            f"{n} records; across ranks: {int(-h[1])} to {int(h[0])}, or the same count of different "
            "modules/kinds/dtypes). Every rank must attach the same Monitor to the same model, run the same steps "
            "and call flush() at the same points."
        )
    if n == 0:
        return stats, list(hists)
    F = _F
    cnt = stats[:, F["numel"]]
    nan = stats[:, F["nan_count"]]
    no_value = (cnt == 0) | (nan > 0)
    ninf = torch.full_like(cnt, -math.inf)
    mx = torch.stack([
        torch.where(no_value, ninf, stats[:, F["max"]]),
        torch.where(no_value, ninf, -stats[:, F["min"]]),
        torch.where(no_value, torch.zeros_like(cnt), stats[:, F["linf"]]),
    ], 1)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    gmax, gmin, glinf = mx[:, 0], -mx[:, 1], mx[:, 2]
    # Scale for l2 and shift for the variance, agreed by every rank.
    L = torch.where(torch.isfinite(glinf) & (glinf > 0), glinf, torch.ones_like(glinf))
    c = torch.where(torch.isfinite(gmax) & torch.isfinite(gmin), 0.5 * gmax + 0.5 * gmin, torch.zeros_like(gmax))
    mean = stats[:, F["mean"]]
    # Everything squared is first divided by L: values near 1e300 or 1e-300 neither overflow nor underflow.
    sd = stats[:, F["std"]] / L
    m2 = torch.where(cnt >= 2, sd * sd * (cnt - 1), torch.zeros_like(sd))
    dm = torch.where(cnt >= 1, (mean - c) / L, torch.zeros_like(mean))
    l2s = stats[:, F["l2"]] / L
    add = torch.stack([cnt, stats[:, F["sum"]], stats[:, F["l1"]], l2s * l2s, nan, stats[:, F["inf_count"]],
                       stats[:, F["zero_count"]], m2 + cnt * dm * dm], 1)
    parts = [add.reshape(-1)] + [hb.to(torch.float64).reshape(-1) for hb in hists]
    packed = torch.cat(parts)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    add = packed[: add.numel()].view(n, 8)
    N, S, L1, L2s, NAN, INF, ZERO, M2c = add.unbind(1)
    out = torch.empty_like(stats)
    gmean = torch.where(N > 0, S / N.clamp_min(1), torch.full_like(S, math.nan))
    d = (gmean - c) / L
    std = L * ((M2c - N * d * d).clamp_min(0) / (N - 1).clamp_min(1)).sqrt()
    bad_var = (N < 2) | (NAN > 0) | (INF > 0)
    std = torch.where(bad_var, torch.full_like(std, math.nan), std)
    var = std * std
    l2 = L * L2s.sqrt()
    l2 = torch.where(INF > 0, torch.full_like(l2, math.inf), l2)
    has_nan = NAN > 0
    nanv = torch.full_like(l2, math.nan)
    empty = N == 0
    out[:, F["numel"]] = N
    out[:, F["sum"]] = S
    out[:, F["mean"]] = gmean
    out[:, F["var"]] = var
    out[:, F["std"]] = std
    out[:, F["l1"]] = L1
    out[:, F["l2"]] = torch.where(has_nan, nanv, l2)
    out[:, F["linf"]] = torch.where(has_nan, nanv, glinf)
    out[:, F["min"]] = torch.where(has_nan | empty, nanv, gmin)
    out[:, F["max"]] = torch.where(has_nan | empty, nanv, gmax)
    out[:, F["nan_count"]] = NAN
    out[:, F["inf_count"]] = INF
    out[:, F["zero_count"]] = ZERO
    merged_h = []
    off = add.numel()
    for hb in hists:
        k = hb.numel()
        merged_h.append(packed[off: off + k].view(hb.shape).round().to(hb.dtype))
        off += k
    return out, merged_h


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
