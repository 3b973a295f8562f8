"""The op layer's result types and input checks (the leaf of the package: it imports only torch and the torch-free
field specification `_fields`).

`_kernels` loads the compiled library and chooses between it and `reference`; `_ops` and `channel` are the thin
public wrappers; `reference` is the pure-PyTorch oracle. All of them take their types from here.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ._fields import COUNT_FIELDS, DTYPES, STAT_PARTS, STATS_FIELDS, exp_hist_length, parts_of, range_hist_length
from ._fields import unravel_many  # noqa: F401  (re-exported: the op layer's name for it)



_BY_NAME = {d.name: getattr(torch, d.name) for d in DTYPES}
SUPPORTED_DTYPES = tuple(_BY_NAME.values())


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a record's "dtype" name ("float32", ...); KeyError for one the kernels do not take."""
    return _BY_NAME[name]

# Note [record fields] (_fields.py): the statistics, in the order of Note [stats row layout] (csrc/core/stats_ops.h).
_StatsRow = NamedTuple("Stats", [(name, torch.Tensor) for name in STATS_FIELDS])


class Stats(_StatsRow):
    """Statistics of one tensor, each a 0-d tensor on the tensor's device (nothing is copied to the host).

    Float fields are float32 (float64 for float64 inputs); numel and the counts are int64 when returned by
    `hookstats.stats`, and of the buffer's dtype when read from a `stats_into` row.
    """

    __slots__ = ()
    _PARTS = STAT_PARTS  # where each field is in the stats ops' (values, counts): from_parts

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

    def __reduce__(self):  # pickle and copy: the indices and shape are keyword arguments of __new__
        return _located, (tuple(self), self.argmax_abs_index, self.first_nonfinite_index, self.shape)

    def coordinates(self) -> dict:
        """{"argmax_abs": coordinates, "first_nonfinite": coordinates}: tuples of ints into x's shape (None where
        the index is -1). One host copy."""
        a, f = torch.stack([self.argmax_abs_index, self.first_nonfinite_index]).tolist()
        return {"argmax_abs": unravel(a, self.shape), "first_nonfinite": unravel(f, self.shape)}


def _located(fields, argmax_abs_index, first_nonfinite_index, shape) -> LocatedStats:
    return LocatedStats(*fields, argmax_abs_index=argmax_abs_index, first_nonfinite_index=first_nonfinite_index,
                        shape=shape)


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


def result_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensor(x, op: str) -> None:
    """TypeError for anything hookstats' kernels do not take, before any dispatch."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hookstats.{op} needs a torch.Tensor, got {type(x).__name__}")
    if x.is_nested:
        raise TypeError(f"hookstats.{op} does not take a nested tensor: call it on each component "
                        f"([hookstats.{op}(t, ...) for t in x.unbind()]) or, for a jagged one, on x.values()")
    if x.layout != torch.strided:
        raise TypeError(f"hookstats.{op} needs a dense (strided) tensor, got layout {x.layout}; call .to_dense() first")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"hookstats.{op} needs a floating tensor (float32, float64, float16 or bfloat16), got {x.dtype}"
        )


_EXP_BITS = {_BY_NAME[d.name]: (d.exponent_bits, d.mantissa_bits) for d in DTYPES}
MAX_HIST_BINS = 8192
_MODE_RANGE, _MODE_EXP = 1, 2


def hist_length(dtype: torch.dtype, mode: int, bins: int) -> int:
    if mode == _MODE_RANGE:
        return range_hist_length(bins)
    if dtype not in _EXP_BITS:
        raise TypeError(f"hookstats: no exponent histogram for {dtype}; supported: float32, float64, float16, "
                        "bfloat16")
    return exp_hist_length(str(dtype).removeprefix("torch."))


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
    """Where each exponent of `dtype` lands in an exponent histogram ("exp"): the slots of zero, subnormals, each
    normal binade, Inf and NaN (hookstats.ExpLayout)."""
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
        """"range" (fixed bins over [lo, hi]) or "exp" (one slot per binade)."""
        return "range" if self.mode == _MODE_RANGE else "exp"

    def length(self, dtype: torch.dtype) -> int:
        """Number of counts for an input of `dtype`."""
        return hist_length(dtype, self.mode, self.bins)

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


# Note [channel stats] (csrc/core/channel_ops.h): the rows of a channel_stats_into buffer.
CHANNEL_FIELDS = ("absmax", "sum_abs", "sum_sq", "min", "max", "nonfinite", "count")
CHANNEL_COUNT_FIELDS = ("nonfinite", "count")  # int64 in channel_stats' (values, counts)


class ChannelStats(NamedTuple):
    """Per-channel statistics, each a `[C]` tensor on the input's device (no host copy).

    absmax, sum_abs, sum_sq, min and max are over the *finite* values of each channel; NaN and +-inf are skipped and
    counted in `nonfinite`; `count` is the number of values per channel. A channel without finite values has absmax
    and sums 0, min +inf and max -inf. From `channel_stats`: float32 values (float64 for float64 inputs) and int64
    counts; read from a buffer (`from_buffer`): everything in the buffer's dtype.
    """

    absmax: torch.Tensor
    sum_abs: torch.Tensor
    sum_sq: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    nonfinite: torch.Tensor
    count: torch.Tensor

    _PARTS = parts_of(CHANNEL_FIELDS, CHANNEL_COUNT_FIELDS)

    @classmethod
    def from_buffer(cls, buf: torch.Tensor) -> "ChannelStats":
        """Views of the rows of a `channel_stats_buffer` (no copy)."""
        if buf.dim() != 2 or buf.shape[0] != len(CHANNEL_FIELDS):
            raise ValueError(f"hookstats.ChannelStats.from_buffer needs a [{len(CHANNEL_FIELDS)}, C] buffer, got "
                             f"shape {tuple(buf.shape)}")
        return cls(*buf.unbind(0))

    def finite_count(self) -> torch.Tensor:
        """Per channel: how many finite values were seen."""
        return self.count - self.nonfinite

    def mean_abs(self) -> torch.Tensor:
        """sum_abs / the number of finite values (NaN for a channel without any), in float64 if the sums are."""
        return self.sum_abs / self.finite_count().to(self.sum_abs.dtype)

    def rms(self) -> torch.Tensor:
        """sqrt(sum_sq / the number of finite values)."""
        return torch.sqrt(self.sum_sq / self.finite_count().to(self.sum_sq.dtype))

    def to_dict(self) -> dict:
        """Python lists, one host copy (do it when you read results, not in a hook)."""
        packed = torch.stack([t.to(torch.float64) for t in self]).cpu()
        return {f: packed[i].tolist() for i, f in enumerate(CHANNEL_FIELDS)}


def from_parts(cls, values: torch.Tensor, counts: torch.Tensor):
    """A `Stats` or `ChannelStats` from its op's (values, counts) outputs (views, no copy): each field where the
    type's _PARTS puts it (Note [record fields]; Note [channel stats]).

    One `unbind` per output (a view costs ~0.4 µs) and the tuple built from a precomputed order: what a traced call
    and a tensor subclass take; `_kernels.result_of` makes the views in one extension call otherwise (Note [field
    views] in csrc/monitor/py_tensors.cpp)."""
    parts = (values.unbind(0), counts.unbind(0))
    return cls._make([parts[c >> 16][c & 0xFFFF] for c in part_codes(cls)])


def part_codes(cls) -> tuple:
    """cls._PARTS as codes part << 16 | index, part 0 for the op's values and 1 for its counts (from_parts, and
    hookstats._C._fields)."""
    codes = _PART_CODES.get(cls)
    if codes is None:
        codes = _PART_CODES[cls] = tuple((0 if p == "values" else 1) << 16 | j for p, j in cls._PARTS)
    return codes


_PART_CODES: dict = {}  # cls -> part_codes(cls)
