"""Pure-PyTorch implementation of every hookstats op, computed in float64.

It is the test oracle, and the fallback when the compiled extension is missing. It is written for clarity,
not speed: each statistic is its own pass, as people write it by hand.
"""
from __future__ import annotations

import torch

from ._ops import STATS_FIELDS, Histogram, Stats, check_tensor, exp_layout, result_dtype


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
