"""Will a tensor fit a low-precision format? Fractions of values that would overflow, underflow (flush to zero)
or become subnormal in float16, bfloat16 and the two float8 formats, read off an exponent histogram."""
from __future__ import annotations

from typing import Dict, Iterable, NamedTuple, Optional

import torch

from ._ops import exp_layout


class Format(NamedTuple):
    emin: int  # exponent of the smallest normal
    emax: int  # exponent of the largest finite
    mantissa_bits: int
    max: float


FORMATS: Dict[str, Format] = {
    "float16": Format(-14, 15, 10, 65504.0),
    "bfloat16": Format(-126, 127, 7, 3.3895313892515355e38),
    "float8_e4m3fn": Format(-6, 8, 3, 448.0),
    "float8_e5m2": Format(-14, 15, 2, 57344.0),
}


def format_fit(counts: torch.Tensor, dtype: torch.dtype, formats: Optional[Iterable[str]] = None
               ) -> Dict[str, Dict[str, torch.Tensor]]:
    """For each format, the fractions of the values counted in `counts` (an exponent histogram of a tensor of
    `dtype`, from `hookstats.exp_histogram` or a `stats_into` buffer row) that would
    `overflow` (|x| beyond the format's range), `underflow` (round to zero), land `subnormal` (lose precision),
    or are `nonfinite` already (inf/NaN). Each fraction is a 0-d float64 tensor on `counts.device` (no host sync).

    Resolution is one binade (power of two): a value is counted by its exponent floor(log2|x|), so values in the
    top binade of a format whose largest finite is below the binade's end (e4m3fn: 448 < 512) count as fitting,
    and values in the binade just below the smallest subnormal count as underflow. The input's own subnormals
    (one bucket, no exponent) count as underflow when all lie below the format's smallest subnormal, as fitting
    when all are normal in the format, and as subnormal otherwise (float32 -> bfloat16, float16 -> e5m2: some of
    them may in fact flush to zero).
    """
    lay = exp_layout(dtype)
    if counts.dim() != 1 or counts.shape[0] != lay.length:
        raise ValueError(f"hookstats.format_fit needs an exponent histogram of {lay.length} counts for {dtype}, "
                         f"got shape {tuple(counts.shape)}")
    names = list(FORMATS) if formats is None else list(formats)
    for n in names:
        if n not in FORMATS:
            raise ValueError(f"hookstats.format_fit: unknown format {n!r}; known: {', '.join(FORMATS)}")
    c = counts.to(torch.float64)
    per_exp = c[lay.neg] + c[lay.pos]  # index i <-> exponent lay.emin + i
    exps = torch.arange(lay.emin, lay.emax + 1)
    subnormal_in = c[lay.neg_subnormal] + c[lay.pos_subnormal]
    nonfinite = c[lay.neg_inf] + c[lay.pos_inf] + c[lay.nan]
    total = c.sum().clamp_min(1.0)
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for name in names:
        f = FORMATS[name]
        min_sub = f.emin - f.mantissa_bits  # exponent of the smallest subnormal
        over = (exps > f.emax).to(c.device, torch.float64)
        under = (exps < min_sub).to(c.device, torch.float64)
        sub = ((exps >= min_sub) & (exps < f.emin)).to(c.device, torch.float64)
        # The input's own subnormals have exponents emin - mantissa_bits .. emin - 1: all below the
        # format's smallest subnormal (underflow), all normal in the format (fit), or else counted
        # as subnormal (some of them may flush to zero: the histogram cannot tell which).
        sub_lo, sub_hi = lay.emin - lay.mantissa_bits, lay.emin - 1
        if sub_hi < min_sub:
            sub_under, sub_sub = subnormal_in, 0.0
        elif sub_lo >= f.emin:
            sub_under, sub_sub = 0.0, 0.0
        else:
            sub_under, sub_sub = 0.0, subnormal_in
        out[name] = {
            "overflow": (per_exp * over).sum() / total,
            "underflow": ((per_exp * under).sum() + sub_under) / total,
            "subnormal": ((per_exp * sub).sum() + sub_sub) / total,
            "nonfinite": nonfinite / total,
        }
    return out
