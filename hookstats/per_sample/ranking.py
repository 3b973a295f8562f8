"""Which samples stand out: the one ranking of per-sample gradient norms behind `PerSampleGradNorms.top_samples` /
`first_nonfinite_sample` (one step) and the Monitor's (`per_sample=True`, every recorded step).

Note [ranking samples]
Samples are ranked by the norm of their whole gradient (PerSampleGradNorms.total()): NaN first, then +inf, then the
finite norms, largest first; samples with equal norms (NaNs among them) keep their (step, sample) order. The first
non-finite sample is the first, in (step, sample) order, whose total or any layer's norm is NaN or Inf; its
`layers` are those where its norm is non-finite, in model order (empty only when the total overflowed alone).
A step is read with one host copy.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch


class RankedSample(NamedTuple):
    step: Any  # the Monitor's step; None for a PerSampleGradNorms, which holds one step
    sample: int
    norm: float


class NonfiniteSample(NamedTuple):
    step: Any
    sample: int
    norm: float
    layers: List[str]


def top_samples(totals: Sequence[Tuple[Any, torch.Tensor]], k: int) -> List[RankedSample]:
    """The k highest-ranked samples (Note [ranking samples]) of (step, [samples] total norms) pairs, in one host
    copy."""
    if isinstance(k, bool) or int(k) != k or k < 0:
        raise ValueError(f"hookstats: top_samples needs an int k >= 0, got {k!r}")
    totals = [(s, t) for s, t in totals if t.numel()]
    if not totals or k == 0:
        return []
    v = torch.cat([t.detach().reshape(-1).to(torch.float64) for _, t in totals]).cpu()
    nan = torch.isnan(v)
    # Two stable sorts: largest first (NaN placed as 0 for now), then the NaNs moved to the front, each keeping the
    # (step, sample) order of its ties.
    order = torch.sort(torch.where(nan, torch.zeros_like(v), v), descending=True, stable=True).indices
    order = order[torch.sort((~nan[order]).to(torch.uint8), stable=True).indices][:int(k)]
    starts = list(itertools.accumulate((t.numel() for _, t in totals), initial=0))
    out = []
    for j in order.tolist():
        row = bisect.bisect_right(starts, j) - 1
        out.append(RankedSample(totals[row][0], j - starts[row], float(v[j])))
    return out


def first_nonfinite_sample(rows: Sequence[Tuple[Any, Sequence[str], torch.Tensor, torch.Tensor]]
                           ) -> Optional[NonfiniteSample]:
    """The first non-finite sample (Note [ranking samples]) of (step, layer names, [layers, samples] layer norms,
    [samples] total norms) rows, in step order: one host copy per step read, up to the one that has it."""
    for step, names, layers, total in rows:
        both = torch.cat([layers.detach().to(torch.float64).reshape(len(names), -1),
                          total.detach().to(torch.float64).reshape(1, -1)]).cpu()
        bad = ~torch.isfinite(both)
        hit = bad.any(0).nonzero()
        if hit.numel():
            i = int(hit[0, 0])
            return NonfiniteSample(step, i, float(both[-1, i]),
                                   [names[j] for j in bad[:-1, i].nonzero()[:, 0].tolist()])
    return None
