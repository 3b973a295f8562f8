"""Typed wrappers over torch.ops.hookstats.*, and a fake kernel for each op (torch.compile)."""
from __future__ import annotations

import math
import warnings
from typing import NamedTuple, Optional

import torch

try:
    from . import _C  # noqa: F401  (loading the library registers torch.ops.hookstats)

    HAVE_EXTENSION = True
    _EXTENSION_ERROR: Optional[BaseException] = None
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    HAVE_EXTENSION = False
    _EXTENSION_ERROR = e
    warnings.warn(
        f"hookstats: the compiled extension hookstats._C could not be loaded ({e}); falling back to the "
        "pure-PyTorch reference implementation, which is correct but slow. Rebuild with "
        "`pip install --no-build-isolation -e .`.",
        RuntimeWarning,
        stacklevel=2,
    )

# Note [stats row layout] (csrc/core/stats_ops.h): the order of Stats' fields and of a stats_into row.
STATS_FIELDS = (
    "numel", "sum", "mean", "var", "std", "l1", "l2", "linf", "min", "max",
    "nan_count", "inf_count", "zero_count",
)
COUNT_FIELDS = ("numel", "nan_count", "inf_count", "zero_count")
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class Stats(NamedTuple):
    """Statistics of one tensor, each a 0-d tensor on the tensor's device (nothing is copied to the host).

    Float fields are float32 (float64 for float64 inputs); numel and the counts are int64 when returned by
    `hookstats.stats`, and of the buffer's dtype when read from a `stats_into` row.
    """

    numel: torch.Tensor
    sum: torch.Tensor
    mean: torch.Tensor
    var: torch.Tensor
    std: torch.Tensor
    l1: torch.Tensor
    l2: torch.Tensor
    linf: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    nan_count: torch.Tensor
    inf_count: torch.Tensor
    zero_count: torch.Tensor

    @classmethod
    def from_row(cls, row: torch.Tensor) -> "Stats":
        """Views of one row of a `stats_buffer` (no copy)."""
        if row.shape != (len(STATS_FIELDS),):
            raise ValueError(f"hookstats.Stats.from_row needs a row of {len(STATS_FIELDS)} values, got shape {tuple(row.shape)}")
        return cls(*row.unbind(0))

    def to_dict(self) -> dict:
        """Python numbers. This copies to the host (one sync per call): do it when you read results, not in a hook."""
        packed = torch.stack([t.to(torch.float64) for t in self]).tolist()
        return {k: (int(v) if k in COUNT_FIELDS and v == v else v) for k, v in zip(STATS_FIELDS, packed)}


class LocatedStats(Stats):
    """`Stats` with element locations (`hookstats.stats(x, locations=True)`; Note [element locations] in
    csrc/core/loc_ops.h). Besides the 13 statistics (it is a `Stats`, and unpacks as one):

    argmax_abs_index: flat index (into `x.flatten()`) of the first element of largest |x|: ties go to the smallest
        index, NaN is never a candidate, +-Inf counts as the largest; -1 when x has no non-NaN element.
    first_nonfinite_index: flat index of the first NaN or +-Inf, -1 when there is none.
    shape: x's shape, for `coordinates()`.

    Both indices are 0-d int64 tensors on x's device (no host sync)."""

    def __new__(cls, *fields, argmax_abs_index: torch.Tensor, first_nonfinite_index: torch.Tensor, shape=()):
        self = super().__new__(cls, *fields)
        self.argmax_abs_index = argmax_abs_index
        self.first_nonfinite_index = first_nonfinite_index
        self.shape = tuple(shape)
        return self

    def coordinates(self) -> dict:
        """{"argmax_abs": coordinates, "first_nonfinite": coordinates}: tuples of ints into x's shape (None where
        the index is -1). One host copy."""
        a, f = torch.stack([self.argmax_abs_index, self.first_nonfinite_index]).tolist()
        return {"argmax_abs": unravel(a, self.shape), "first_nonfinite": unravel(f, self.shape)}


def unravel(index, shape) -> Optional[tuple]:
    """The coordinates of flat index `index` (row-major, as `x.flatten()` indexes x) in a tensor of `shape`: a tuple
    of ints, () for a 0-d tensor, None for -1 (no such element). `index` may be an int or a 0-d tensor (read on the
    host). Raises ValueError when the index is outside the shape."""
    index = int(index.item()) if isinstance(index, torch.Tensor) else int(index)
    shape = tuple(int(d) for d in shape)
    if index == -1:
        return None
    numel = math.prod(shape)
    if not 0 <= index < numel:
        raise ValueError(f"hookstats.unravel: index {index} is outside a tensor of shape {shape} ({numel} elements)")
    out = []
    for d in reversed(shape):
        out.append(index % d)
        index //= d
    return tuple(reversed(out))


def unravel_many(flat, ndim, dims):
    """`unravel` of many records at once (records of different ndim): flat[i] in record i's shape, its ndim[i]
    sizes at dims[off[i]:off[i + 1]] (off: the running sum of ndim). Returns (coords, valid, off): coords laid out
    like dims (int64; zeros where flat[i] is -1), valid = flat >= 0."""
    import numpy as np

    flat = np.asarray(flat, dtype=np.int64)
    ndim = np.asarray(ndim, dtype=np.int64)
    dims = np.asarray(dims, dtype=np.int64)
    off = np.zeros(len(ndim) + 1, dtype=np.int64)
    np.cumsum(ndim, out=off[1:])
    valid = flat >= 0
    coords = np.zeros(len(dims), dtype=np.int64)
    rest = np.where(valid, flat, 0)
    for k in range(int(ndim.max()) if len(ndim) else 0):  # row-major: the last dim first
        has = valid & (ndim > k)  # (a record without a location may have a 0-size dim)
        pos = off[:-1][has] + ndim[has] - 1 - k
        d = dims[pos]
        coords[pos] = rest[has] % d
        rest[has] //= d
    return coords, valid, off


def result_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensor(x, op: str) -> None:
    """TypeError for anything hookstats' kernels do not take, before any dispatch."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hookstats.{op} needs a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"hookstats.{op} needs a dense (strided) tensor, got layout {x.layout}; call .to_dense() first")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"hookstats.{op} needs a floating tensor (float32, float64, float16 or bfloat16), got {x.dtype}"
        )


_CUDA_BUILT: Optional[bool] = None


def cuda_kernels_built() -> bool:
    """Whether this build of hookstats has its CUDA kernels."""
    global _CUDA_BUILT
    if _CUDA_BUILT is None:
        _CUDA_BUILT = HAVE_EXTENSION and torch._C._dispatch_has_kernel_for_dispatch_key("hookstats::stats", "CUDA")
    return _CUDA_BUILT


def check_device(x: torch.Tensor, op: str) -> None:
    if x.is_cuda:
        if not cuda_kernels_built():
            raise RuntimeError(
                f"hookstats.{op} got a CUDA tensor, but this build of hookstats has no CUDA kernels. Rebuild with a "
                "CUDA build of torch and a CUDA toolkit: `HOOKSTATS_CUDA=1 CUDA_HOME=/usr/local/cuda pip install "
                "--no-build-isolation -e .` (a build where no GPU is visible skips them unless HOOKSTATS_CUDA=1 or "
                "TORCH_CUDA_ARCH_LIST asks; docs/development.md)."
            )
    elif not (x.is_cpu or x.is_meta):
        raise RuntimeError(f"hookstats.{op} runs on CPU and CUDA tensors, got a tensor on {x.device}")


if HAVE_EXTENSION:

    @torch.library.register_fake("hookstats::stats")
    def _stats_fake(x):
        rt = result_dtype(x.dtype)
        return x.new_empty((9,), dtype=rt), x.new_empty((4,), dtype=torch.int64)

    @torch.library.register_fake("hookstats::stats_loc")
    def _stats_loc_fake(x, hist_mode=0, bins=0, lo=0.0, hi=0.0):
        values, counts = _stats_fake(x)
        n = _hist_length(x.dtype, hist_mode, bins) if hist_mode else 0
        return values, counts, x.new_empty((2,), dtype=torch.int64), x.new_empty((n,), dtype=torch.int64)

    @torch.library.register_fake("hookstats::stats_into")
    def _stats_into_fake(x, out, slot, hist=None, hist_slot=0, hist_mode=0, bins=0, lo=0.0, hi=0.0,
                         hist_accumulate=False, ring=None, loc=None, loc_slot=0):
        if loc is not None and loc.device != x.device:
            raise ValueError(f"hookstats.stats_into: the location buffer is on {loc.device} but the tensor is on "
                             f"{x.device}")
        if out.device != x.device or (hist is not None and hist.device != x.device):
            raise ValueError(
                f"hookstats.stats_into: the buffers must be on the tensor's device {x.device}, got {out.device}"
                + ("" if hist is None else f" and {hist.device}")
            )
        return None

    @torch.library.register_fake("hookstats::stats_hist")
    def _stats_hist_fake(x, hist_mode, bins, lo, hi):
        values, counts = _stats_fake(x)
        return values, counts, x.new_empty((_hist_length(x.dtype, hist_mode, bins),), dtype=torch.int64)


# Note [histogram layouts] (csrc/core/hist_ops.h), mirrored here.
if HAVE_EXTENSION:

    def _list_device(xs, op: str) -> torch.device:
        if len(xs) == 0:
            raise ValueError(f"hookstats.{op}: the op needs at least one tensor (the wrappers handle empty lists)")
        dev = xs[0].device
        for i, x in enumerate(xs):
            if x.device != dev:
                raise ValueError(f"hookstats.{op}: tensor {i} is on {x.device} but tensor 0 is on {dev}; "
                                 "group the tensors by device")
        return dev

    @torch.library.register_fake("hookstats::norms")
    def _norms_fake(xs, p):
        _list_device(xs, "norms")
        return (xs[0].new_empty((len(xs),), dtype=torch.float64), xs[0].new_empty((), dtype=torch.float64))

    @torch.library.register_fake("hookstats::scale_by_norm_")
    def _scale_by_norm_fake(xs, total, max_norm, eps, policy):
        if xs:
            _list_device(xs, "scale_by_norm_")
        return None

    @torch.library.register_fake("hookstats::clip_norm_")
    def _clip_norm_fake(x, p, max_norm, eps, policy, path=0):
        return x.new_empty((), dtype=torch.float64)

    @torch.library.register_fake("hookstats::clamp_count_")
    def _clamp_count_fake(xs, lo, hi):
        _list_device(xs, "clamp_count_")
        return xs[0].new_empty((), dtype=torch.int64)


def uses_kernels(x: torch.Tensor) -> bool:
    """Whether hookstats' compiled kernels serve tensors on x's device (else the pure-PyTorch reference does).

    CPU and meta (tracing) tensors always go to the ops; CUDA tensors too, and `check_device` says how to rebuild
    when this build lacks the CUDA kernels; other devices (mps, xla, ...) take the reference path."""
    return HAVE_EXTENSION and (x.is_cpu or x.is_cuda or x.is_meta)


def _explained(xs, op: str, call):
    """Runs an op on a list; when it fails, says which tensor was wrong in check_tensor's words (the op's own checks
    run in C++ and cost nothing in Python on the way in)."""
    try:
        return call()
    except (TypeError, NotImplementedError, RuntimeError, ValueError):
        for x in xs:
            check_tensor(x, op)
        raise


def _reference_checked(xs, op: str):
    from . import reference

    for x in xs:
        check_tensor(x, op)
    return reference


def norms_op(xs, p: float, op: str = "norms"):
    """(per-tensor norms, total) in float64 for a non-empty list of tensors on one device."""
    if uses_kernels(xs[0]):
        check_device(xs[0], op)
        return _explained(xs, op, lambda: torch.ops.hookstats.norms.default(xs, p))
    return _reference_checked(xs, op).norms(xs, p)


def scale_by_norm_op(xs, total: torch.Tensor, max_norm: float, eps: float, policy: int, op: str = "scale_by_norm_"):
    if uses_kernels(xs[0]):
        check_device(xs[0], op)
        _explained(xs, op, lambda: torch.ops.hookstats.scale_by_norm_.default(xs, total, max_norm, eps, policy))
    else:
        _reference_checked(xs, op).scale_by_norm_(xs, total, max_norm, eps, policy)
    bump_version(xs)


def clamp_count_op(xs, lo: float, hi: float, op: str = "clamp_count_") -> torch.Tensor:
    if uses_kernels(xs[0]):
        check_device(xs[0], op)
        count = _explained(xs, op, lambda: torch.ops.hookstats.clamp_count_.default(xs, lo, hi))
    else:
        count = _reference_checked(xs, op).clamp_count_(xs, lo, hi)
    bump_version(xs)
    return count


def clip_norm_op(x: torch.Tensor, p: float, max_norm: float, eps: float, policy: int, op: str = "clip_norm_",
                 path: int = 0) -> torch.Tensor:
    """Norm and scale of one tensor in one op call (on CUDA one launch when x fits on chip); returns the float64
    norm before clipping."""
    if uses_kernels(x):
        check_device(x, op)
        total = _explained([x], op, lambda: torch.ops.hookstats.clip_norm_.default(x, p, max_norm, eps, policy, path))
    else:
        _, total = _reference_checked([x], op).norms([x], p)
        _reference_checked([x], op).scale_by_norm_([x], total, max_norm, eps, policy)
    bump_version([x])
    return total


def bump_version(xs) -> None:
    """Our in-place ops write through data pointers, which autograd cannot see: bump the version counters, as
    PyTorch's own in-place ops do, so that a saved tensor modified later is detected. (Under torch.compile the
    traced graph already records the mutation from the op's schema.)"""
    if not torch.compiler.is_compiling():
        torch.autograd.graph.increment_version(xs)


_EXP_BITS = {torch.float32: (8, 23), torch.bfloat16: (8, 7), torch.float16: (5, 10), torch.float64: (11, 52)}
MAX_HIST_BINS = 8192
_MODE_RANGE, _MODE_EXP = 1, 2


def _hist_length(dtype: torch.dtype, mode: int, bins: int) -> int:
    if mode == _MODE_RANGE:
        return bins + 3
    if dtype not in _EXP_BITS:
        raise TypeError(f"hookstats: no exponent histogram for {dtype}; supported: float32, float64, float16, "
                        "bfloat16")
    e, _ = _EXP_BITS[dtype]
    return 2 * (2**e - 2) + 6


class ExpLayout(NamedTuple):
    """Where each count of an exponent histogram of `dtype` is (Note [histogram layouts])."""

    dtype: torch.dtype
    emin: int  # exponent of the smallest normal: floor(log2(finfo.tiny))
    emax: int  # exponent of the largest finite
    mantissa_bits: int
    neg: slice  # negative normals, index i <-> exponent emin + i
    pos: slice  # positive normals
    neg_subnormal: int
    pos_subnormal: int
    zero: int
    neg_inf: int
    pos_inf: int
    nan: int
    length: int


def exp_layout(dtype: torch.dtype) -> ExpLayout:
    if dtype not in _EXP_BITS:
        raise TypeError(f"hookstats.exp_layout: no exponent histogram for {dtype}; supported: float32, float64, "
                        "float16, bfloat16")
    e, m = _EXP_BITS[dtype]
    bias = 2 ** (e - 1) - 1
    n = 2**e - 2
    return ExpLayout(dtype, 1 - bias, bias, m, slice(0, n), slice(n, 2 * n), 2 * n, 2 * n + 1, 2 * n + 2,
                     2 * n + 3, 2 * n + 4, 2 * n + 5, 2 * n + 6)


class Histogram(NamedTuple):
    """Which histogram to compute in the same read as the statistics.

    `Histogram.range(bins, lo, hi)`: `bins` equal bins over [lo, hi] plus underflow (< lo, -inf included), overflow
    (> hi, +inf included) and NaN counts, `bins + 3` int64 counts that always sum to numel. In-range values are
    binned exactly as `torch.histc` bins float64 values: `floor((x - lo) * bins / (hi - lo))`, with `hi` in the
    last bin. `Histogram.exponent()`: counts of `floor(log2|x|)` per exponent of the input's dtype, by sign, plus
    subnormal, zero, inf and NaN counts (see `exp_layout`).
    """

    mode: int
    bins: int = 0
    lo: float = 0.0
    hi: float = 0.0

    @classmethod
    def range(cls, bins: int, lo: float, hi: float) -> "Histogram":
        if isinstance(bins, bool) or not isinstance(bins, int):
            raise TypeError(f"hookstats: histogram bins must be an int, got {type(bins).__name__}")
        if not 1 <= bins <= MAX_HIST_BINS:
            raise ValueError(f"hookstats: histogram needs 1 <= bins <= {MAX_HIST_BINS}, got bins={bins}")
        lo, hi = float(lo), float(hi)
        if not (math.isfinite(lo) and math.isfinite(hi) and math.isfinite(hi - lo)):
            raise ValueError(f"hookstats: histogram needs a finite range, got ({lo}, {hi})")
        if not lo < hi:
            raise ValueError(f"hookstats: histogram needs lo < hi, got range ({lo}, {hi})")
        if not math.isfinite((hi - lo) * bins):
            raise ValueError(f"hookstats: histogram: (hi - lo) * bins overflows float64 for range ({lo}, {hi}) and "
                             f"{bins} bins; use a narrower range")
        return cls(_MODE_RANGE, bins, lo, hi)

    @classmethod
    def exponent(cls) -> "Histogram":
        return cls(_MODE_EXP)

    @property
    def kind(self) -> str:
        return "range" if self.mode == _MODE_RANGE else "exp"

    def length(self, dtype: torch.dtype) -> int:
        """Number of counts for an input of `dtype`."""
        return _hist_length(dtype, self.mode, self.bins)

    def edges(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The bins + 1 bin edges of a range histogram; for an exponent histogram, the lower edge 2^e of each normal
        exponent of `dtype`."""
        if self.mode == _MODE_RANGE:
            return torch.linspace(self.lo, self.hi, self.bins + 1, dtype=torch.float64)
        lay = exp_layout(dtype)
        return torch.pow(2.0, torch.arange(lay.emin, lay.emax + 1, dtype=torch.float64))


def as_histogram(spec) -> Histogram:
    """A Histogram from what users pass: a Histogram, "exp", or (bins, (lo, hi))."""
    if isinstance(spec, Histogram):
        return spec
    if isinstance(spec, str):
        if spec in ("exp", "exponent"):
            return Histogram.exponent()
        raise ValueError(f"hookstats: unknown histogram {spec!r}; use 'exp' or (bins, (lo, hi))")
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], tuple) and len(spec[1]) == 2:
        return Histogram.range(spec[0], *spec[1])
    raise TypeError(
        f"hookstats: histogram must be hookstats.Histogram.range(bins, lo, hi), Histogram.exponent(), 'exp' or "
        f"(bins, (lo, hi)); got {spec!r}"
    )


def _stats_from_parts(values: torch.Tensor, counts: torch.Tensor) -> Stats:
    v = values.unbind(0)
    c = counts.unbind(0)
    return Stats(c[0], v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], c[1], c[2], c[3])


def _located(values: torch.Tensor, counts: torch.Tensor, loc: torch.Tensor, shape) -> LocatedStats:
    a, f = loc.unbind(0)
    return LocatedStats(*_stats_from_parts(values, counts), argmax_abs_index=a, first_nonfinite_index=f, shape=shape)


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
        if not HAVE_EXTENSION:
            from . import reference

            st, loc = reference.stats(x), reference.locations(x)
            out = LocatedStats(*st, argmax_abs_index=loc[0], first_nonfinite_index=loc[1], shape=x.shape)
            return out if h is None else (out, reference.histogram_of(x, h))
        check_device(x, "stats")
        values, counts, loc, hist = torch.ops.hookstats.stats_loc.default(
            x.detach(), h.mode if h else 0, h.bins if h else 0, h.lo if h else 0.0, h.hi if h else 0.0)
        out = _located(values, counts, loc, x.shape)
        return out if h is None else (out, hist)
    if histogram is not None:
        h = as_histogram(histogram)
        if not HAVE_EXTENSION:
            from . import reference

            return reference.stats(x), reference.histogram_of(x, h)
        check_device(x, "stats")
        values, counts, hist = torch.ops.hookstats.stats_hist.default(x.detach(), h.mode, h.bins, h.lo, h.hi)
        return _stats_from_parts(values, counts), hist
    if not HAVE_EXTENSION:
        from . import reference

        return reference.stats(x)
    check_device(x, "stats")
    values, counts = torch.ops.hookstats.stats.default(x.detach())
    return _stats_from_parts(values, counts)


def histogram(x: torch.Tensor, bins: int = 64, *, range) -> torch.Tensor:
    """Fixed-range histogram of `x`: int64 counts of length `bins + 3` (the bins, then underflow, overflow, NaN),
    computed on `x.device` with no host sync; nothing is dropped. See `Histogram` for the bin rule."""
    check_tensor(x, "histogram")
    if not (isinstance(range, (tuple, list)) and len(range) == 2):
        raise TypeError(f"hookstats.histogram needs range=(lo, hi), got {range!r}")
    return stats(x, Histogram.range(bins, range[0], range[1]))[1]


def exp_histogram(x: torch.Tensor) -> torch.Tensor:
    """Exponent histogram of `x` (no range, no min/max pass): see `Histogram.exponent` and `exp_layout`."""
    check_tensor(x, "exp_histogram")
    return stats(x, Histogram.exponent())[1]


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
    if not HAVE_EXTENSION:
        from . import reference

        if ring is not None:
            p, out, hist = reference.ring_rows(ring, out, hist, "stats_into")
            loc = None if loc is None else loc[p]
        reference.stats_into(x, out, slot)
        if hist is not None:
            reference.hist_into(x, h, hist, hist_slot, accumulate)
        if loc is not None:
            reference.locations_into(x, loc, loc_slot)
        return
    check_device(x, "stats_into")
    # The op checks the buffers (dtype: TypeError; shape, device, slot: ValueError), see csrc/core/checks.h.
    if hist is None and ring is None and loc is None:
        torch.ops.hookstats.stats_into.default(x.detach(), out, slot)
    else:
        torch.ops.hookstats.stats_into.default(x.detach(), out, slot, hist, 0 if hist_slot is None else hist_slot,
                                               mode, bins, lo, hi, bool(accumulate), ring, loc,
                                               0 if loc_slot is None else loc_slot)


if HAVE_EXTENSION:

    @torch.library.register_fake("hookstats::stats_multi_into")
    def _stats_multi_into_fake(xs, out, rows, hist=None, hist_rows=(), hist_mode=0, bins=0, lo=0.0, hi=0.0,
                               hist_accumulate=False, ring=None):
        if any(x.device != out.device for x in xs) or (hist is not None and hist.device != out.device):
            raise ValueError(f"hookstats.stats_multi_into: the tensors and buffers must be on one device, got "
                             f"{sorted({str(x.device) for x in xs} | {str(out.device)})}")
        return None


def stats_multi_into(xs, out: torch.Tensor, rows, hist: Optional[torch.Tensor] = None, hist_rows=None,
                     histogram=None, *, accumulate: bool = False, ring: Optional[torch.Tensor] = None) -> None:
    """`stats_into(xs[i], out, rows[i])` for every tensor of `xs` (one device), in one call: on the CPU the small
    tensors are spread over the threads (each reduced by one thread, big ones by all), on CUDA the flat tensors of
    a dtype go 24 at a time into one launch (Note [multi-tensor stats launches] in csrc/cuda/kernels/stats_launch.h). With `hist` and `histogram`, each histogram is written into (with
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
    if not HAVE_EXTENSION or not uses_kernels(xs[0]):
        for i, x in enumerate(xs):
            stats_into(x, out, rows[i], hist, None if hist is None else hist_rows[i], histogram,
                       accumulate=accumulate, ring=ring)
        return
    check_device(xs[0], "stats_multi_into")
    xs = [x.detach() for x in xs]
    if hist is None and ring is None:
        torch.ops.hookstats.stats_multi_into.default(xs, out, rows)
    elif hist is None:
        torch.ops.hookstats.stats_multi_into.default(xs, out, rows, ring=ring)
    else:
        torch.ops.hookstats.stats_multi_into.default(xs, out, rows, hist, hist_rows, h.mode, h.bins, h.lo, h.hi,
                                                     bool(accumulate), ring)
