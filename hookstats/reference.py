"""Pure-PyTorch implementation of every hookstats op, computed in float64.

It is the test oracle, and the fallback when the compiled extension is missing. It is written for clarity,
not speed: each statistic is its own pass, as people write it by hand.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ._types import (CHANNEL_FIELDS, STATS_FIELDS, ChannelStats, Histogram, Stats, check_tensor, exp_layout,
                     result_dtype)


def _pow2_scale(xd: torch.Tensor) -> torch.Tensor:
    """A power of two near the largest finite magnitude (1 when there is none): dividing by it keeps
    squares of float64 values in range, so l2/std of values near 1e300 come out right."""
    finite = xd[torch.isfinite(xd)]
    if finite.numel() == 0:
        return torch.ones((), dtype=torch.float64, device=xd.device)
    amax = finite.abs().amax()
    if amax == 0:
        return torch.ones((), dtype=torch.float64, device=xd.device)
    _, exponent = torch.frexp(amax)
    return torch.ldexp(torch.ones((), dtype=torch.float64, device=xd.device), exponent)


def stats(x: torch.Tensor) -> Stats:
    """The statistics of `x`, as `hookstats.stats` documents them."""
    check_tensor(x, "reference.stats")
    rt = result_dtype(x.dtype)
    xd = x.detach().to(torch.float64).reshape(-1)
    n = xd.numel()
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=xd.device)
    zero = torch.zeros((), dtype=torch.float64, device=xd.device)
    has_nan = bool(torch.isnan(xd).any())
    has_inf = bool(torch.isinf(xd).any())
    scale = _pow2_scale(xd)
    total = xd.sum()
    if n == 0:
        mean = var = std = mn = mx = nan
        linf = zero
    else:
        mean = xd.mean()
        mn, mx = xd.amin(), xd.amax()
        linf = torch.linalg.vector_norm(xd, float("inf"))
        if n < 2 or has_nan or has_inf:
            var = std = nan
        else:
            std = (xd / scale).std(correction=1) * scale
            var = (xd / scale).var(correction=1) * scale * scale
    l1 = torch.linalg.vector_norm(xd, 1)
    if has_nan:
        l2 = nan
    elif has_inf:
        l2 = torch.tensor(float("inf"), dtype=torch.float64, device=xd.device)
    else:
        l2 = torch.linalg.vector_norm(xd / scale, 2) * scale
    counts = [
        torch.tensor(n, dtype=torch.int64, device=xd.device),
        torch.isnan(xd).sum(),
        torch.isinf(xd).sum(),
        (xd == 0).sum(),
    ]
    values = [t.to(rt) for t in (total, mean, var, std, l1, l2, linf, mn, mx)]
    return Stats(counts[0], *values, counts[1], counts[2], counts[3])


def stats_into(x: torch.Tensor, out: torch.Tensor, slot: int) -> None:
    """Row `slot` of `out` gets `stats(x)` in STATS_FIELDS order."""
    if out.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"hookstats.stats_into needs a float32 or float64 buffer, got {out.dtype}")
    if out.dim() != 2 or out.shape[1] != len(STATS_FIELDS):
        raise ValueError(f"hookstats.stats_into needs a buffer of shape [slots, {len(STATS_FIELDS)}], got {tuple(out.shape)}")
    if out.device != x.device:
        raise ValueError(f"hookstats.stats_into: the buffer is on {out.device} but the tensor is on {x.device}")
    if not (0 <= slot < out.shape[0]):
        raise ValueError(f"hookstats.stats_into: slot {slot} is out of range for a buffer of {out.shape[0]} slots")
    s = stats(x)
    out[slot] = torch.stack([getattr(s, f).to(out.dtype) for f in STATS_FIELDS])


def ring_rows(ring: torch.Tensor, out: torch.Tensor, hist: Optional[torch.Tensor], op: str):
    """Note [ring rows]: the ring slot p mod out.shape[0] and the [rows, ...] views of out and hist it selects."""
    if ring.dtype != torch.int64 or ring.numel() < 1:
        raise TypeError(f"hookstats.{op}: ring must be an int64 tensor of at least one element")
    if out.dim() != 3:
        raise ValueError(f"hookstats.{op}: with ring, the buffer is [ring slots, rows, {len(STATS_FIELDS)}], got "
                         f"{tuple(out.shape)}")
    if hist is not None and (hist.dim() != 3 or hist.shape[0] != out.shape[0]):
        raise ValueError(f"hookstats.{op}: with ring, the histogram buffer is [{out.shape[0]} ring slots, rows, "
                         f"length], got {tuple(hist.shape)}")
    p = int(ring.reshape(-1)[0]) % out.shape[0]
    return p, out[p], None if hist is None else hist[p]


def locations(x: torch.Tensor) -> torch.Tensor:
    """(argmax_abs, first_nonfinite) flat indices of x as int64 [2] (Note [element locations] in
    csrc/core/loc_ops.h): the smallest index of the largest |x| over the non-NaN elements (+-Inf is the largest;
    -1 when every element is NaN or x is empty), and the smallest index of a NaN or +-Inf (-1 when none). Plain
    torch.argmax would return a NaN's index; NaN is taken out first here."""
    check_tensor(x, "reference.locations")
    xd = x.detach().to(torch.float64).reshape(-1)
    out = torch.full((2,), -1, dtype=torch.int64, device=xd.device)
    if xd.numel() == 0:
        return out
    a = xd.abs()
    notnan = ~torch.isnan(xd)
    if bool(notnan.any()):
        a = torch.where(notnan, a, torch.full_like(a, -1.0))
        amax = a.max()
        out[0] = torch.nonzero(a == amax)[0, 0]  # the first of the ties (argmax does not promise which)
    bad = torch.isfinite(xd).logical_not().nonzero()
    if bad.numel():
        out[1] = bad[0, 0]
    return out


def locations_into(x: torch.Tensor, loc: torch.Tensor, slot: int) -> None:
    """Row `slot` of `loc` ([slots, 2] int64) gets `locations(x)`, as `hookstats.stats_into(..., loc=...)` does."""
    if loc.dtype != torch.int64:
        raise TypeError(f"hookstats.stats_into needs an int64 location buffer, got {loc.dtype}")
    if loc.dim() != 2 or loc.shape[1] != 2:
        raise ValueError(f"hookstats.stats_into needs a location buffer of shape [slots, 2], got {tuple(loc.shape)}")
    if not (0 <= slot < loc.shape[0]):
        raise ValueError(f"hookstats.stats_into: location slot {slot} is out of range for a buffer of "
                         f"{loc.shape[0]} slots")
    loc[slot] = locations(x).to(loc.device)


def hist_into(x: torch.Tensor, h: Histogram, hist: torch.Tensor, hist_slot: int, accumulate: bool = False) -> None:
    """Row `hist_slot` of `hist` gets histogram_of(x, h) (written, or added to it with `accumulate`), as
    `hookstats.stats_into(..., hist=...)` does (Note [histogram rows] in csrc/core/bindings.h)."""
    counts = histogram_of(x, h).to(hist.device)
    if accumulate:
        hist[hist_slot] += counts
    else:
        hist[hist_slot] = counts


def histogram_of(x: torch.Tensor, h: Histogram) -> torch.Tensor:
    """The histogram `hookstats.stats(x, histogram=h)` returns, in plain PyTorch (Note [histogram layouts])."""
    xd = x.detach().reshape(-1).to(torch.float64)
    if h.kind == "range":
        inside = xd[(xd >= h.lo) & (xd <= h.hi)]
        bins = torch.histc(inside, bins=h.bins, min=h.lo, max=h.hi).to(torch.int64)
        extra = torch.stack([(xd < h.lo).sum(), (xd > h.hi).sum(), torch.isnan(xd).sum()])
        return torch.cat([bins, extra])
    lay = exp_layout(x.dtype)
    tiny = torch.finfo(x.dtype).tiny
    a = xd.abs()
    neg = torch.signbit(xd)
    normal = torch.isfinite(xd) & (a >= tiny)
    _, e = torch.frexp(xd[normal])  # x = m * 2^e with 0.5 <= |m| < 1: floor(log2|x|) = e - 1
    slot = (e.to(torch.int64) - 1 - lay.emin) + torch.where(neg[normal], 0, lay.pos.start)
    counts = torch.bincount(slot, minlength=lay.length)[: lay.length].clone()
    sub = torch.isfinite(xd) & (a > 0) & (a < tiny)
    counts[lay.neg_subnormal] = (sub & neg).sum()
    counts[lay.pos_subnormal] = (sub & ~neg).sum()
    counts[lay.zero] = (xd == 0).sum()
    counts[lay.neg_inf] = (xd == float("-inf")).sum()
    counts[lay.pos_inf] = (xd == float("inf")).sum()
    counts[lay.nan] = torch.isnan(xd).sum()
    return counts


# ---------------------------------------------------------------------------------------------------------------
# Norms and clipping (hookstats/clip.py). float64 throughout; the coefficient rule is PyTorch's.


def _norm64(xd: torch.Tensor, p: float) -> torch.Tensor:
    """The p-norm of float64 values without overflow or underflow: the values are divided by a power of two near
    their largest finite magnitude first. Empty -> 0 (also for p = inf, where PyTorch raises)."""
    if xd.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=xd.device)
    if p == float("inf"):
        return torch.linalg.vector_norm(xd, p)
    scale = _pow2_scale(xd)
    return torch.linalg.vector_norm(xd / scale, p) * scale


def norms(tensors, p: float):
    """(per-tensor norms [n], total norm of the concatenation), float64, as `torch.ops.hookstats.norms`."""
    tensors = list(tensors)
    dev = tensors[0].device if tensors else torch.device("cpu")
    per = [_norm64(t.detach().to(torch.float64).reshape(-1), p) for t in tensors]
    per_t = torch.stack(per) if per else torch.zeros((0,), dtype=torch.float64, device=dev)
    return per_t, _norm64(per_t, p)


def clip_coef(total: torch.Tensor, max_norm: float, eps: float, zero_nonfinite: bool) -> torch.Tensor:
    """min(1, max_norm / (total + eps)) in float64, NaN kept; 0 for a non-finite total under the zero policy."""
    total = total.to(torch.float64)
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    if zero_nonfinite:
        coef = torch.where(torch.isfinite(total), coef, torch.zeros_like(coef))
    return coef


def scale_by_norm_(tensors, total: torch.Tensor, max_norm: float, eps: float, policy: int) -> None:
    """Scales each tensor in place as `torch.ops.hookstats.scale_by_norm_` (policy 1: zeros for a non-finite total)."""
    zero = policy == 1 and not bool(torch.isfinite(total).all())
    coef = clip_coef(total, max_norm, eps, policy == 1)
    for t in tensors:
        if zero:
            t.zero_()
        else:
            t.copy_((t.to(torch.float64) * coef.to(t.device)).to(t.dtype))


def clamp_count_(tensors, lo: float, hi: float) -> torch.Tensor:
    """Clamps each tensor in place to [lo, hi] (rounded to its dtype); returns the number of changed elements."""
    count = torch.zeros((), dtype=torch.int64, device=tensors[0].device if tensors else "cpu")
    for t in tensors:
        lo_t = torch.tensor(lo, dtype=t.dtype).item()
        hi_t = torch.tensor(hi, dtype=t.dtype).item()
        count += ((t < lo_t) | (t > hi_t)).sum().to(count.device)
        t.clamp_(lo_t, hi_t)
    return count


def clip_norm_(x: torch.Tensor, max_norm: float, norm_type: float = 2.0, eps: float = 1e-6,
               nonfinite: str = "propagate") -> torch.Tensor:
    """What `hookstats.clip_norm_` does, in float64: returns the norm before clipping (x's result dtype)."""
    _, total = norms([x], float(norm_type))
    if nonfinite == "error" and not bool(torch.isfinite(total)):
        raise RuntimeError("hookstats.reference.clip_norm_: the norm is non-finite")
    scale_by_norm_([x], total, max_norm, eps, 1 if nonfinite == "zero" else 0)
    return total.to(result_dtype(x.dtype))


def clip_value_(x: torch.Tensor, lo: float, hi=None) -> torch.Tensor:
    """What `hookstats.clip_value_` does: clamps in place, returns the count of clipped elements."""
    if hi is None:
        lo, hi = -lo, lo
    return clamp_count_([x], lo, hi)


# ---------------------------------------------------------------------------------------------------------------
# Per-channel statistics (hookstats/channel.py, Note [channel stats] in csrc/core/channel_ops.h). float64.


def channel_stats(x: torch.Tensor, dim: int = -1):
    """`hookstats.channel_stats(x, dim)` in plain PyTorch: statistics over the finite values of each index of `dim`,
    NaN/Inf counted in `nonfinite`; float32 values (float64 for float64 x), int64 counts."""
    check_tensor(x, "reference.channel_stats")
    rt = result_dtype(x.dtype)
    c = x.shape[dim]
    rows = math.prod(s for i, s in enumerate(x.shape) if i != dim % x.dim())
    xd = x.detach().to(torch.float64).movedim(dim, -1).reshape(rows, c)
    fin = torch.isfinite(xd)
    a = torch.where(fin, xd.abs(), torch.zeros_like(xd))
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=xd.device)
    if xd.shape[0] == 0:  # the identities: nothing seen
        absmax = torch.zeros(c, dtype=torch.float64, device=xd.device)
        mn, mx = absmax + inf, absmax - inf
    else:
        absmax = a.amax(0)
        mn = torch.where(fin, xd, inf).amin(0)
        mx = torch.where(fin, xd, -inf).amax(0)
    values = [t.to(rt) for t in (absmax, a.sum(0), (a * a).sum(0), mn, mx)]
    nonfinite = (~fin).sum(0)
    count = torch.full((c,), xd.shape[0], dtype=torch.int64, device=xd.device)
    return ChannelStats(*values, nonfinite, count)


def channel_stats_into(x: torch.Tensor, buf: torch.Tensor, dim: int = -1) -> None:
    """Combines `channel_stats(x, dim)` into a [7, C] buffer as `hookstats.channel_stats_into` does."""
    if buf.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"hookstats.channel_stats_into needs a float32 or float64 buffer, got {buf.dtype}")
    c = x.shape[dim]
    if buf.dim() != 2 or tuple(buf.shape) != (len(CHANNEL_FIELDS), c):
        raise ValueError(f"hookstats.channel_stats_into needs a buffer of shape [{len(CHANNEL_FIELDS)}, {c}], got "
                         f"{tuple(buf.shape)}")
    if buf.device != x.device:
        raise ValueError(f"hookstats.channel_stats_into: the buffer is on {buf.device} but the tensor is on {x.device}")
    s = channel_stats(x.to(torch.float64) if x.dtype != torch.float64 else x, dim)
    old = buf.to(torch.float64)
    new = torch.stack([
        torch.maximum(old[0], s.absmax), old[1] + s.sum_abs, old[2] + s.sum_sq, torch.minimum(old[3], s.min),
        torch.maximum(old[4], s.max), old[5] + s.nonfinite.to(torch.float64), old[6] + s.count.to(torch.float64),
    ])
    buf.copy_(new.to(buf.dtype))
