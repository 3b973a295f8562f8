"""What the TensorBoard and W&B exporters share: tag names, and a record's histogram as buckets."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Iterator, NamedTuple, Optional, Sequence


from .._types import dtype_of, exp_layout

# Statistics written as scalars by default: the ones people chart (norms, range, moments, non-finite counts).
DEFAULT_STATS = ("l2", "linf", "mean", "std", "min", "max", "nan_count", "inf_count", "zero_count")



def tensor_name(r: dict) -> str:
    """module (or "model" for the root), with [i] for a hook's i-th tensor when it is not the first."""
    name = r["module"] or "model"
    return f"{name}[{r['index']}]" if r.get("index") else name


def scalar_tag(r: dict, stat: str) -> str:
    """`{kind}.{stat}/{module}`: TensorBoard groups tags by their first component, so each chart group holds one
    statistic of one hook kind for every layer (all layers' gradient l2 norms side by side)."""
    return f"{r['kind']}.{stat}/{tensor_name(r)}"


def hist_tag(r: dict, info: Optional[dict]) -> str:
    axis = "log2abs" if (info or {}).get("histogram", {}) and info["histogram"]["kind"] == "exp" else "hist"
    return f"{r['kind']}.{axis}/{tensor_name(r)}"


def scalar_items(records: Iterable[dict], stats: Sequence[str]) -> Iterator[tuple[int, str, float]]:
    for r in records:
        s = r["stats"]
        for k in stats:
            yield r["step"], scalar_tag(r, k), float(s[k])


def by_step(records: list, scalars: Sequence[dict], stats: Sequence[str], histograms: bool,
            info: Optional[dict]) -> list[tuple[int, list]]:
    """What a flush writes, step by step in increasing order: (step, [(tag, float or Buckets), ...]) with the
    records' statistics, their histograms (when `histograms`), then the logged scalars."""
    per_step: dict[int, list] = defaultdict(list)
    for step, tag, value in scalar_items(records, stats):
        per_step[step].append((tag, value))
    if histograms:
        for r in records:
            b = buckets(r, info)
            if b is not None:
                per_step[r["step"]].append((hist_tag(r, info), b))
    for s in scalars:
        per_step[s["step"]].append((s["tag"], float(s["value"])))
    return sorted(per_step.items())


class Buckets(NamedTuple):
    """A histogram as TensorBoard's HistogramProto wants it: each bucket's upper limit and count; the first bucket
    starts at `min`. NaN (and, on the exponent axis, zeros and infinities) are not in any bucket."""

    min: float
    max: float
    num: int
    sum: float
    sum_squares: float
    limits: list
    counts: list


def _moments(pairs: list) -> tuple:
    num = sum(c for _, c in pairs)
    s = sum(c * x for x, c in pairs)
    ss = sum(c * x * x for x, c in pairs)
    return num, s, ss


def buckets(r: dict, info: Optional[dict]) -> Optional[Buckets]:
    """The record's histogram as buckets, or None (no histogram, or nothing to bin).

    Range histograms are on the value axis: underflow becomes a bucket ending at lo (starting at the tensor's min),
    overflow one ending at the tensor's max; min/max/sum/sum of squares are the tensor's exact statistics (NaN
    excluded when finite). Exponent histograms are on the axis log2|x|: one bucket [e, e+1) per exponent e of the
    dtype (both signs together), the dtype's subnormals as one bucket below its smallest normal exponent; min/max and
    moments are those of the bucket midpoints.
    """
    h = r.get("histogram")
    spec = (info or {}).get("histogram")
    if h is None or spec is None:
        return None
    st = r["stats"]
    if spec["kind"] == "range":
        bins, lo, hi = spec["bins"], float(spec["lo"]), float(spec["hi"])
        width = (hi - lo) / bins
        under, over = h[bins], h[bins + 1]
        limits, counts = [], []
        mn, mx = st["min"], st["max"]
        if under:
            limits.append(lo)
            counts.append(under)
        for i in range(bins):
            limits.append(lo + (i + 1) * width)
            counts.append(h[i])
        if over:
            limits.append(mx if math.isfinite(mx) and mx > hi else hi + width)  # +inf or NaN max: one bin wide
            counts.append(over)
        num = sum(counts)
        if num == 0:
            return None
        lo_edge = (mn if math.isfinite(mn) else lo - width) if under else lo
        hi_edge = limits[-1]
        # Exact moments when the tensor held no NaN/Inf (stats cover every value); else bucket midpoints.
        if st["nan_count"] == 0 and st["inf_count"] == 0:
            s, ss = st["sum"], st["l2"] ** 2
        else:
            prev = lo_edge
            pairs = []
            for lim, c in zip(limits, counts):
                pairs.append(((prev + lim) / 2, c))
                prev = lim
            _, s, ss = _moments(pairs)
        return Buckets(lo_edge, hi_edge, num, s, ss, limits, counts)
    lay = exp_layout(dtype_of(r["dtype"]))
    per_exp = [a + b for a, b in zip(h[lay.neg], h[lay.pos])]
    sub = h[lay.neg_subnormal] + h[lay.pos_subnormal]
    pairs = []  # (lower edge on the log2 axis, width, count)
    if sub:
        pairs.append((lay.emin - lay.mantissa_bits, lay.mantissa_bits, sub))
    pairs += [(lay.emin + i, 1, c) for i, c in enumerate(per_exp) if c]
    if not pairs:
        return None
    first, last = pairs[0][0], pairs[-1][0] + pairs[-1][1]
    # Contiguous buckets from the first occupied exponent to the last (empty ones included, so TensorBoard draws the
    # gaps), then the moments of the midpoints.
    limits, counts = [], []
    if sub:
        limits.append(lay.emin)
        counts.append(sub)
    start = max(first, lay.emin)
    for e in range(start, last):
        limits.append(e + 1)
        counts.append(per_exp[e - lay.emin])
    num, s, ss = _moments([(lo + w / 2, c) for lo, w, c in pairs])
    return Buckets(float(first), float(last), num, s, ss, [float(x) for x in limits], counts)


def bucket_edges(b: Buckets) -> list:
    """The len(counts) + 1 edges of the buckets (numpy.histogram style)."""
    return [b.min, *b.limits]
