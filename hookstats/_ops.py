"""The public op wrappers: `stats`, `histogram`, `stats_into`, ... and the list ops the clipping code calls.

Each checks its arguments, asks `_kernels.use_kernels` once (Note [kernels or reference] in _kernels.py) and calls
the compiled op or `hookstats.reference`. The result types live in `_types` (re-exported here for old imports).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._kernels import (  # noqa: F401  (re-exported: hookstats.HAVE_EXTENSION, cuda_kernels_built)
    _EXTENSION_ERROR,
    HAVE_EXTENSION,
    check_device,
    cuda_kernels_built,
    explained,
    reference_checked,
    result_of,
    use_kernels,
)
from ._types import (  # noqa: F401  (re-exported: the names other modules imported from here before _types)
    CHANNEL_FIELDS,
    COUNT_FIELDS,
    MAX_HIST_BINS,
    STATS_FIELDS,
    SUPPORTED_DTYPES,
    ChannelStats,
    ExpLayout,
    Histogram,
    LocatedStats,
    Stats,
    as_histogram,
    check_tensor,
    exp_layout,
    hist_length,
    result_dtype,
    unravel,
    unravel_many,
)


def norms_op(xs, p: float, op: str = "norms"):
    """(per-tensor norms, total) in float64 for a non-empty list of tensors on one device."""
    if use_kernels(xs[0], op):
        return explained(xs, op, lambda: torch.ops.hookstats.norms.default(xs, p))
    return reference_checked(xs, op).norms(xs, p)


def scale_by_norm_op(xs, total: torch.Tensor, max_norm: float, eps: float, policy: int, op: str = "scale_by_norm_"):
    if use_kernels(xs[0], op):
        explained(xs, op, lambda: torch.ops.hookstats.scale_by_norm_.default(xs, total, max_norm, eps, policy))
    else:
        reference_checked(xs, op).scale_by_norm_(xs, total, max_norm, eps, policy)
    bump_version(xs)


def clamp_count_op(xs, lo: float, hi: float, op: str = "clamp_count_") -> torch.Tensor:
    if use_kernels(xs[0], op):
        count = explained(xs, op, lambda: torch.ops.hookstats.clamp_count_.default(xs, lo, hi))
    else:
        count = reference_checked(xs, op).clamp_count_(xs, lo, hi)
    bump_version(xs)
    return count


def clip_norm_op(x: torch.Tensor, p: float, max_norm: float, eps: float, policy: int, op: str = "clip_norm_",
                 path: int = 0) -> torch.Tensor:
    """Norm and scale of one tensor in one op call (on CUDA one launch when x fits on chip); returns the float64
    norm before clipping."""
    if use_kernels(x, op):
        total = explained([x], op, lambda: torch.ops.hookstats.clip_norm_.default(x, p, max_norm, eps, policy, path))
    else:
        _, total = reference_checked([x], op).norms([x], p)
        reference_checked([x], op).scale_by_norm_([x], total, max_norm, eps, policy)
    bump_version([x])
    return total


def bump_version(xs) -> None:
    """Our in-place ops write through data pointers, which autograd cannot see: bump the version counters, as
    PyTorch's own in-place ops do, so that a saved tensor modified later is detected. (Under torch.compile the
    traced graph already records the mutation from the op's schema.)"""
    if not torch.compiler.is_compiling():
        torch.autograd.graph.increment_version(xs)


def _located(values: torch.Tensor, counts: torch.Tensor, loc: torch.Tensor, shape) -> LocatedStats:
    a, f = loc.unbind(0)
    return LocatedStats(*result_of(Stats, values, counts), argmax_abs_index=a, first_nonfinite_index=f, shape=shape)


def stats(x: torch.Tensor, histogram=None, *, locations: bool = False):
    """All statistics of `x` in one fused read, as a `Stats` of 0-d tensors on `x.device`. No host sync.

    With `histogram` (a `Histogram`, `"exp"` or `(bins, (lo, hi))`), returns `(Stats, counts)` where `counts` is
    the int64 histogram computed in the same read.

    With `locations=True` the `Stats` is a `LocatedStats`: it also carries `argmax_abs_index` (flat index of the
    first largest |x|, NaN ignored) and `first_nonfinite_index` (of the first NaN/Inf), 0-d int64, -1 where there
    is none, found in the same read; `hookstats.unravel(i, x.shape)` or `.coordinates()` turn them into
    coordinates. Without it the kernels are exactly the ones without locations (they cost nothing).

    Semantics match PyTorch's (`sum`, `mean`, `var(correction=1)`, `std`, `linalg.vector_norm` for l1/l2/linf,
    `amin`/`amax`, `isnan/isinf/== 0` counts) with these deliberate differences: results are float32 for
    float16/bfloat16/float32 inputs (float64 for float64), so fp16 sums do not overflow; l2 and std never
    overflow or underflow when the true value fits the result dtype; an empty tensor gives numel 0, sum/l1/l2/
    linf 0 and NaN for mean/var/std/min/max instead of raising.
    """
    check_tensor(x, "stats")
    if locations:
        h = as_histogram(histogram) if histogram is not None else None
        if not use_kernels(x, "stats"):
            reference = reference_checked((x,), "stats")
            st, loc = reference.stats(x), reference.locations(x)
            out = LocatedStats(*st, argmax_abs_index=loc[0], first_nonfinite_index=loc[1], shape=x.shape)
            return out if h is None else (out, reference.histogram_of(x, h))
        values, counts, loc, hist = torch.ops.hookstats.stats_loc.default(
            x.detach(), h.mode if h else 0, h.bins if h else 0, h.lo if h else 0.0, h.hi if h else 0.0)
        out = _located(values, counts, loc, x.shape)
        return out if h is None else (out, hist)
    if histogram is not None:
        h = as_histogram(histogram)
        if not use_kernels(x, "stats"):
            reference = reference_checked((x,), "stats")
            return reference.stats(x), reference.histogram_of(x, h)
        values, counts, hist = torch.ops.hookstats.stats_hist.default(x.detach(), h.mode, h.bins, h.lo, h.hi)
        return result_of(Stats, values, counts), hist
    if not use_kernels(x, "stats"):
        return reference_checked((x,), "stats").stats(x)
    values, counts = torch.ops.hookstats.stats.default(x.detach())
    return result_of(Stats, values, counts)


def histogram(x: torch.Tensor, bins: int = 64, *, range) -> torch.Tensor:
    """Fixed-range histogram of `x`: int64 counts of length `bins + 3` (the bins, then underflow, overflow, NaN),
    computed on `x.device` with no host sync; nothing is dropped. See `Histogram` for the bin rule."""
    check_tensor(x, "histogram")
    if not (isinstance(range, (tuple, list)) and len(range) == 2):
        raise TypeError(f"hookstats.histogram needs range=(lo, hi), got {range!r}")
    return _counts_only(x, Histogram.range(bins, range[0], range[1]))


def exp_histogram(x: torch.Tensor) -> torch.Tensor:
    """Exponent histogram of `x` (no range, no min/max pass): see `Histogram.exponent` and `exp_layout`."""
    check_tensor(x, "exp_histogram")
    return _counts_only(x, Histogram.exponent())


def _counts_only(x: torch.Tensor, h: Histogram) -> torch.Tensor:
    """`stats(x, histogram=h)[1]` without building the `Stats` it drops (13 views: ~10 µs a call); x is checked."""
    if not use_kernels(x, "stats"):
        return reference_checked((x,), "stats").histogram_of(x, h)
    return torch.ops.hookstats.stats_hist.default(x.detach(), h.mode, h.bins, h.lo, h.hi)[2]


def histogram_buffer(slots: int, histogram, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Zeroed int64 buffer of `slots` rows for `stats_into(..., hist=...)` histograms of inputs of `dtype`."""
    h = as_histogram(histogram)
    if not isinstance(slots, int) or slots < 1:
        raise ValueError(f"hookstats.histogram_buffer needs slots >= 1, got {slots!r}")
    return torch.zeros((slots, h.length(dtype)), dtype=torch.int64, device=device)


def stats_buffer(slots: int, device=None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A buffer for `stats_into`: `slots` rows of the 13 `STATS_FIELDS`, NaN until written.

    float64 keeps counts exact up to 2^53; float32 halves the size and keeps counts exact up to 2^24.
    """
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"hookstats.stats_buffer dtype must be torch.float32 or torch.float64, got {dtype}")
    if not isinstance(slots, int) or slots < 1:
        raise ValueError(f"hookstats.stats_buffer needs slots >= 1, got {slots!r}")
    return torch.full((slots, len(STATS_FIELDS)), float("nan"), dtype=dtype, device=device)


def location_buffer(slots: int, device=None) -> torch.Tensor:
    """A buffer for `stats_into(..., loc=...)`: `slots` rows of (argmax_abs, first_nonfinite) flat indices, int64,
    -1 until written (Note [element locations])."""
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise ValueError(f"hookstats.location_buffer needs slots >= 1, got {slots!r}")
    return torch.full((slots, 2), -1, dtype=torch.int64, device=device)


def stats_into(x: torch.Tensor, out: torch.Tensor, slot: int, hist: Optional[torch.Tensor] = None,
               hist_slot: Optional[int] = None, histogram=None, *, accumulate: bool = False,
               ring: Optional[torch.Tensor] = None, loc: Optional[torch.Tensor] = None,
               loc_slot: Optional[int] = None) -> None:
    """Writes the statistics of `x` into row `slot` of `out` (see `stats_buffer`), on the device, no host sync.

    With `hist` (an int64 buffer from `histogram_buffer`) and `histogram`, the histogram of `x` from the same read
    is *written* to row `hist_slot` (default: `slot`) of `hist`, replacing what the row held, as the stats row is:
    a CUDA graph that replays the call leaves the same rows after every replay. With `accumulate=True` the counts
    are *added* to the row instead, so histograms sum over calls and steps (zero the row yourself to restart).
    Many hooks can fill one preallocated buffer; read it back once with `out.cpu()`.
    With `loc` (an int64 [slots, 2] buffer from `location_buffer`), row `loc_slot` (default: `slot`) gets the flat
    indices of x's first largest |x| and first NaN/Inf (-1 where none; see `hookstats.stats(x, locations=True)`),
    found in the same read.

    With `ring` (an int64 tensor on x's device whose first element p is read when the kernel runs, not when it is
    launched), `out` is a [ring slots, rows, 13] buffer (and `hist` [ring slots, rows, length]) and the call writes
    row `slot` of ring slot p mod ring slots: a call captured in a CUDA graph then writes a new row at each replay
    if p is advanced on the device between replays (how hookstats.Monitor records captured steps; Note [ring rows]
    in csrc/core/stats_ops.h).
    """
    check_tensor(x, "stats_into")
    if loc is not None:
        if not isinstance(loc, torch.Tensor):
            raise TypeError(f"hookstats.stats_into: loc must be a tensor (hookstats.location_buffer), got "
                            f"{type(loc).__name__}")
        loc_slot = slot if loc_slot is None else int(loc_slot)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"hookstats.stats_into needs a buffer tensor, got {type(out).__name__}")
    mode = bins = 0
    lo = hi = 0.0
    if hist is not None:
        if histogram is None:
            raise ValueError("hookstats.stats_into: hist= needs histogram= (hookstats.Histogram.range(...) or 'exp')")
        h = as_histogram(histogram)
        mode, bins, lo, hi = h.mode, h.bins, h.lo, h.hi
        hist_slot = slot if hist_slot is None else hist_slot
    if ring is not None and not isinstance(ring, torch.Tensor):
        raise TypeError(f"hookstats.stats_into: ring must be an int64 tensor, got {type(ring).__name__}")
    if not use_kernels(x, "stats_into"):
        reference = reference_checked((x,), "stats_into")
        if ring is not None:
            p, out, hist = reference.ring_rows(ring, out, hist, "stats_into")
            loc = None if loc is None else loc[p]
        reference.stats_into(x, out, slot)
        if hist is not None:
            reference.hist_into(x, h, hist, hist_slot, accumulate)
        if loc is not None:
            reference.locations_into(x, loc, loc_slot)
        return
    # The op checks the buffers (dtype: TypeError; shape, device, slot: ValueError), see csrc/core/checks.h.
    if hist is None and ring is None and loc is None:
        torch.ops.hookstats.stats_into.default(x.detach(), out, slot)
    else:
        torch.ops.hookstats.stats_into.default(x.detach(), out, slot, hist, 0 if hist_slot is None else hist_slot,
                                               mode, bins, lo, hi, bool(accumulate), ring, loc,
                                               0 if loc_slot is None else loc_slot)


def stats_multi_into(xs, out: torch.Tensor, rows, hist: Optional[torch.Tensor] = None, hist_rows=None,
                     histogram=None, *, accumulate: bool = False, ring: Optional[torch.Tensor] = None) -> None:
    """`stats_into(xs[i], out, rows[i])` for every tensor of `xs` (one device), in one call: on the CPU the small
    tensors are spread over the threads (each reduced by one thread, big ones by all), on CUDA the flat tensors of
    a dtype go 24 at a time into one launch (Note [multi-tensor stats launches] in
    csrc/cuda/kernels/stats_launch.h). With `hist` and `histogram`, each histogram is written into (with
    accumulate=True: added to) row `hist_rows[i]` (default: `rows`) of `hist`; exponent histograms need tensors of
    one dtype group (one length). `ring` as in `stats_into`.
    Every row equals what `stats_into` writes."""
    xs = list(xs)
    for x in xs:
        check_tensor(x, "stats_multi_into")
    rows = [int(r) for r in rows]
    if not xs:
        return
    if hist is not None:
        if histogram is None:
            raise ValueError("hookstats.stats_multi_into: hist= needs histogram= (Histogram.range(...) or 'exp')")
        h = as_histogram(histogram)
        hist_rows = rows if hist_rows is None else [int(r) for r in hist_rows]
    if not use_kernels(xs[0], "stats_multi_into"):
        for i, x in enumerate(xs):
            stats_into(x, out, rows[i], hist, None if hist is None else hist_rows[i], histogram,
                       accumulate=accumulate, ring=ring)
        return
    xs = [x.detach() for x in xs]
    if hist is None and ring is None:
        torch.ops.hookstats.stats_multi_into.default(xs, out, rows)
    elif hist is None:
        torch.ops.hookstats.stats_multi_into.default(xs, out, rows, ring=ring)
    else:
        torch.ops.hookstats.stats_multi_into.default(xs, out, rows, hist, hist_rows, h.mode, h.bins, h.lo, h.hi,
                                                     bool(accumulate), ring)
