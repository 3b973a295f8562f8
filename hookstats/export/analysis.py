"""The data behind the plots and the report, from records (a Monitor's, a log's, or an Arrow table): numpy only.

Non-finite events, the layer order, the layers x steps norm matrix, which layers to draw, histogram panels. The
drawing (matplotlib) is in plots.py; the report that puts both together is report.py.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from .._types import exp_layout
from ..runlog.columns import Columns, first_seen
# Kinds in the order they are looked for when a plot wants gradients, and in which they are listed otherwise.
GRAD_KINDS = ("grad", "backward_pre", "backward")
KIND_ORDER = ("forward_pre", "forward", "backward_pre", "backward", "grad")
_KIND_TITLES = {"forward_pre": "module inputs (forward_pre)", "forward": "module outputs (forward)",
                "backward_pre": "grad_output (backward_pre)", "backward": "grad_input (backward)",
                "grad": "parameter .grad (grad)"}
_BACKWARD = frozenset(GRAD_KINDS)


# -- data --------------------------------------------------------------------------------------------------------
class NonfiniteEvent(NamedTuple):
    step: int
    module: str
    kind: str
    nan_count: int
    inf_count: int


def nonfinite_events(records) -> list:
    """Every (step, module, kind) whose tensors held a NaN or Inf, as NonfiniteEvent(step, module, kind, nan_count,
    inf_count) tuples (counts summed over that step's tensors of the module and kind), first occurrence first: by
    step, then in the order the hooks ran (seq). records: dicts, a records table (read_log, Monitor.table()) or
    Columns."""
    c = Columns.of(records)
    if not c.n:
        return []
    nan, inf = c.stat("nan_count"), c.stat("inf_count")
    rows = np.flatnonzero((nan > 0) | (inf > 0))
    if not len(rows):
        return []
    nk = max(1, len(c.kind_names))
    nm = max(1, len(c.module_names))
    key = (c.step[rows] * nm + c.module[rows]) * nk + c.kind[rows]
    u, inv = np.unique(key, return_inverse=True)
    g = len(u)
    nan_s = np.bincount(inv, weights=nan[rows], minlength=g)
    inf_s = np.bincount(inv, weights=inf[rows], minlength=g)
    # first occurrence of each event: the smallest (step, seq, position)
    order = np.lexsort((rows, c.seq[rows], c.step[rows]))
    rank = np.empty(len(rows), dtype=np.int64)
    rank[order] = np.arange(len(rows))
    first_rank = np.full(g, len(rows), dtype=np.int64)
    np.minimum.at(first_rank, inv, rank)
    ev_order = np.argsort(first_rank, kind="stable")
    first = rows[order[first_rank[ev_order]]]
    out = []
    for j, r in zip(ev_order, first):
        out.append(NonfiniteEvent(int(c.step[r]), c.module_names[c.module[r]], c.kind_names[c.kind[r]],
                                  int(nan_s[j]), int(inf_s[j])))
    return out


def kinds_present(records) -> list:
    """The hook kinds found in records, in KIND_ORDER (unknown kinds last, as first seen)."""
    c = Columns.of(records)
    seen = [c.kind_names[k] for k in first_seen(c.kind)]
    return [k for k in KIND_ORDER if k in seen] + [k for k in seen if k not in KIND_ORDER]


def gradient_kind(records) -> Optional[str]:
    """The kind a gradient plot uses: "grad" (parameter grads) if recorded, else "backward_pre" (grad_output), else
    "backward" (grad_input); None when there are none of them."""
    present = set(kinds_present(records))
    return next((k for k in GRAD_KINDS if k in present), None)


def _owner(name: str, modules: dict) -> str:
    """The module a parameter name belongs to: the longest module name that prefixes it ("" when none)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        m = ".".join(parts[:i])
        if m in modules:
            return m
    return ""


def layer_order(records, kind: str, order: Optional[Sequence[str]] = None) -> list:
    """The names (modules, or parameters for "grad") that have records of `kind`, in model order (see the module
    docstring)."""
    c = Columns.of(records)
    sel = c.kind_mask(kind)
    first_codes = first_seen(c.module[sel])
    names = [c.module_names[m] for m in first_codes]
    first = {n: i for i, n in enumerate(names)}
    backward = kind in _BACKWARD
    if order is None:
        fwd_mask = c.kind_mask("forward_pre") | c.kind_mask("forward")
        fwd_names = [c.module_names[m] for m in first_seen(c.module[fwd_mask])]
        if not fwd_names:  # backward hooks run in reverse model order
            return names[::-1] if backward else names
        ranks = {m: i for i, m in enumerate(fwd_names)}
    else:
        ranks = {m: i for i, m in enumerate(order)}
    n = len(first)

    def key(name):
        m = name if name in ranks else (_owner(name, ranks) if kind == "grad" else None)
        rank = ranks.get(m, len(ranks)) if m is not None else len(ranks)
        tie = n - first[name] if backward else first[name]
        return (rank, m != name, tie)

    return sorted(names, key=key)


def _matrix(records, kind: str, order: Optional[Sequence[str]] = None, field: str = "l2"):
    """(layers, steps, values, recorded, bad): a step's tensors of one module combined (sqrt of the sum of squares
    for l2, else the max; for "grad", a parameter's last record of the step: its accumulated gradient)."""
    c = Columns.of(records)
    layers = layer_order(c, kind, order)
    sel = np.flatnonzero(c.kind_mask(kind))
    code_row = np.full(max(1, len(c.module_names)), -1, dtype=np.int64)
    for i, m in enumerate(layers):
        code_row[c.module_names.index(m)] = i
    st = c.step[sel]
    steps_arr = np.unique(st)
    steps = [int(x) for x in steps_arr]
    nl, ns = len(layers), len(steps)
    values = np.full((nl, ns), np.nan)
    recorded = np.zeros((nl, ns), dtype=bool)
    bad = np.zeros((nl, ns), dtype=bool)
    if not len(sel):
        return layers, steps, values, recorded, bad
    li = code_row[c.module[sel]]
    sj = np.searchsorted(steps_arr, st)
    cell = li * ns + sj
    v = c.stat(field)[sel]
    rowbad = (c.stat("nan_count")[sel] > 0) | (c.stat("inf_count")[sel] > 0)
    flat_v = values.reshape(-1)
    if kind == "grad":  # the last record of the step (file order)
        last = np.full(nl * ns, -1, dtype=np.int64)
        np.maximum.at(last, cell, np.arange(len(sel)))
        have = last >= 0
        flat_v[have] = v[last[have]]
        badc = np.zeros(nl * ns, dtype=bool)
        badc[have] = rowbad[last[have]]
    else:
        if field == "l2":  # sqrt(sum l2^2), scaled by the cell's largest so that no finite norm squares to inf
            top = np.zeros(nl * ns)
            with np.errstate(invalid="ignore"):
                np.fmax.at(top, cell, np.abs(v))
            scale = np.where((top > 0) & np.isfinite(top), top, 1.0)
            with np.errstate(over="ignore", invalid="ignore"):
                sq = np.bincount(cell, weights=np.square(v / scale[cell]), minlength=nl * ns)
            agg = np.sqrt(sq) * scale
        else:
            agg = np.full(nl * ns, -np.inf)
            np.maximum.at(agg, cell, v)
        have = np.bincount(cell, minlength=nl * ns) > 0
        flat_v[have] = agg[have]
        badc = np.bincount(cell, weights=rowbad, minlength=nl * ns) > 0
    recorded.reshape(-1)[:] = have
    with np.errstate(invalid="ignore"):
        bad.reshape(-1)[:] = badc | (have & ~np.isfinite(flat_v))
    return layers, steps, values, recorded, bad


def norm_matrix(records, kind: str, order: Optional[Sequence[str]] = None):
    """(layers, steps, values): the l2 norm of each layer's `kind` tensors at each step, values[i, j] for layers[i]
    at steps[j] (a float64 numpy array; NaN where nothing was recorded, NaN/Inf where the tensor held them). The
    tensors of one module and step are combined as sqrt(sum l2^2); for "grad", a parameter's last record of a step
    (the accumulated gradient). This is what grad_flow and norm_heatmap draw."""
    layers, steps, values, _, _ = _matrix(records, kind, order)
    return layers, steps, values


def pick_layers(values: np.ndarray, bad: np.ndarray, k: int) -> tuple:
    """At most k row indices of a layers x steps norm matrix, for plots of many layers: the layers that went
    non-finite (first-bad step first), then, in turn, the largest norms and the largest changes (|log10 of the last
    finite norm / the first|), sorted back into model order. Returns (indices, reason text)."""
    n = values.shape[0]
    if n <= k:
        return list(range(n)), ""
    good = np.where(~bad & np.isfinite(values) & (values > 0), values, np.nan)
    with np.errstate(all="ignore"):
        peak = np.where(np.isnan(good).all(axis=1), -np.inf, np.nanmax(np.where(np.isnan(good), -np.inf, good), 1))
        idx = np.arange(good.shape[1])
        has = ~np.isnan(good)
        first_j = np.where(has.any(1), np.argmax(has, axis=1), 0)
        last_j = np.where(has.any(1), good.shape[1] - 1 - np.argmax(has[:, ::-1], axis=1), 0)
        rows = np.arange(n)
        change = np.abs(np.log10(good[rows, last_j]) - np.log10(good[rows, first_j]))
        change = np.where(np.isfinite(change), change, -np.inf)
    del idx
    chosen: dict = {}
    bad_rows = np.flatnonzero(bad.any(axis=1))
    if len(bad_rows):
        first_bad = np.argmax(bad[bad_rows], axis=1)
        for i in bad_rows[np.argsort(first_bad, kind="stable")][: max(1, k // 2)]:
            chosen.setdefault(int(i), "non-finite")
    by_peak = list(np.argsort(-peak, kind="stable"))
    by_change = list(np.argsort(-change, kind="stable"))
    while len(chosen) < k and (by_peak or by_change):
        for lst, why in ((by_peak, "largest norm"), (by_change, "largest change")):
            while lst and len(chosen) < k:
                i = int(lst.pop(0))
                if i not in chosen:
                    chosen[i] = why
                    break
    counts: dict = {}
    for why in chosen.values():
        counts[why] = counts.get(why, 0) + 1
    reason = ", ".join(f"{v} {w}" for w, v in counts.items())
    return sorted(chosen), f"{len(chosen)} of {n} layers shown ({reason})"


# -- drawing helpers ---------------------------------------------------------------------------------------------


def _np_dtype_layout(dtype: Optional[str]):
    dt = getattr(torch, dtype or "float32", None)
    try:
        return exp_layout(dt)
    except TypeError:
        return None


def _hist_spec(records, info: Optional[dict]) -> Optional[dict]:
    spec = (info or {}).get("histogram")
    if spec:
        return spec
    c = Columns.of(records)
    for L in c.hist_lengths():  # no header: an exponent histogram has its dtype's layout length
        for rows, _ in c.hist_chunks(L):
            lay = _np_dtype_layout(c.dtype_names[c.dtype[rows[0]]] if c.dtype_names else None)
            if lay is not None and L == lay.length:
                return {"kind": "exp"}
            return {"kind": "range", "bins": L - 3, "lo": None, "hi": None}
    return None


def _hist_groups(c: Columns, spec: dict) -> dict:
    """{(module, kind): (nonfinite, spread)} of the tensors with histograms, from their histograms summed over the
    run (chunk by chunk: never all histograms at once), without building a record."""
    nm, nk = max(1, len(c.module_names)), max(1, len(c.kind_names))
    ng = nm * nk
    seen = np.zeros(ng, dtype=bool)
    lo = np.full(ng, np.iinfo(np.int64).max)
    hi = np.full(ng, np.iinfo(np.int64).min)
    bad = np.zeros(ng, dtype=bool)
    for L in c.hist_lengths():
        for rows, h in c.hist_chunks(L):
            g = c.module[rows] * nk + c.kind[rows]
            seen[g] = True
            if spec["kind"] == "exp":
                for d in np.unique(c.dtype[rows]):
                    sel = c.dtype[rows] == d
                    lay = _np_dtype_layout(c.dtype_names[d])
                    if lay is None or L != lay.length:
                        continue
                    hs, gs = h[sel], g[sel]
                    per = hs[:, lay.neg] + hs[:, lay.pos]
                    occ = per > 0
                    anyo = occ.any(1)
                    first = np.argmax(occ, 1)
                    last = per.shape[1] - 1 - np.argmax(occ[:, ::-1], 1)
                    np.minimum.at(lo, gs[anyo], first[anyo])
                    np.maximum.at(hi, gs[anyo], last[anyo])
                    nf = (hs[:, lay.nan] + hs[:, lay.neg_inf] + hs[:, lay.pos_inf]) > 0
                    bad[gs[nf]] = True
            else:
                bins = L - 3
                occ = h[:, :bins] > 0
                anyo = occ.any(1)
                first = np.argmax(occ, 1)
                last = bins - 1 - np.argmax(occ[:, ::-1], 1)
                np.minimum.at(lo, g[anyo], first[anyo])
                np.maximum.at(hi, g[anyo], last[anyo])
                bad[g[h[:, bins + 2] > 0]] = True
    out = {}
    for gi in np.flatnonzero(seen):
        spread = int(hi[gi] - lo[gi]) if hi[gi] >= lo[gi] else 0
        out[(c.module_names[gi // nk], c.kind_names[gi % nk])] = (bool(bad[gi]), spread)
    return out


class _Panel(NamedTuple):
    module: str
    kind: str
    steps: list
    counts: np.ndarray  # [rows, steps], rows bottom to top
    rows: list  # row labels (None for an unlabelled row)
    row_kind: str  # "exp" or "range"
    first_exp_row: int  # rows below it are special (exp: 0 / subnormal)
    exps: list  # the exponent of each exponent row
    nbins: int  # range histograms: the number of in-range bins (rows 1..nbins)
    nonfinite: bool
    spread: int


def _exp_panel(module, kind, recs) -> _Panel:
    by_step: dict = {}
    e_lo, e_hi = None, None
    for r in recs:
        lay = _np_dtype_layout(r.get("dtype"))
        h = np.asarray(r["histogram"], dtype=np.int64)
        if lay is None or len(h) != lay.length:
            continue
        per = h[lay.neg] + h[lay.pos]
        d = by_step.setdefault(r["step"], {"exp": {}, "zero": 0, "sub": 0, "inf": 0, "nan": 0})
        for i in np.flatnonzero(per):
            e = lay.emin + int(i)
            d["exp"][e] = d["exp"].get(e, 0) + int(per[i])
            e_lo = e if e_lo is None else min(e_lo, e)
            e_hi = e if e_hi is None else max(e_hi, e)
        d["zero"] += int(h[lay.zero])
        d["sub"] += int(h[lay.neg_subnormal] + h[lay.pos_subnormal])
        d["inf"] += int(h[lay.neg_inf] + h[lay.pos_inf])
        d["nan"] += int(h[lay.nan])
    steps = sorted(by_step)
    if e_lo is None:
        e_lo = e_hi = 0
    spread = e_hi - e_lo
    exps = list(range(e_lo - 1, e_hi + 2))
    has_inf = any(by_step[s]["inf"] for s in steps)
    has_nan = any(by_step[s]["nan"] for s in steps)
    rows = ["0", "subnormal"] + [None] * len(exps) + (["\u00b1Inf"] if has_inf else []) + (["NaN"] if has_nan else [])
    counts = np.zeros((len(rows), len(steps)), dtype=np.int64)
    for j, s in enumerate(steps):
        d = by_step[s]
        counts[0, j] = d["zero"]
        counts[1, j] = d["sub"]
        for e, c in d["exp"].items():
            counts[2 + e - exps[0], j] = c
        r = 2 + len(exps)
        if has_inf:
            counts[r, j] = d["inf"]
            r += 1
        if has_nan:
            counts[r, j] = d["nan"]
    return _Panel(module, kind, steps, counts, rows, "exp", 2, exps, 0, has_inf or has_nan, spread)


def _range_panel(module, kind, recs, spec) -> _Panel:
    bins = int(spec["bins"])
    lo, hi = spec.get("lo"), spec.get("hi")
    by_step: dict = {}
    for r in recs:
        h = np.asarray(r["histogram"], dtype=np.int64)
        if len(h) != bins + 3:
            continue
        cur = by_step.get(r["step"])
        by_step[r["step"]] = h if cur is None else cur + h
    steps = sorted(by_step)
    if lo is not None and hi is not None:
        w = (float(hi) - float(lo)) / bins
        centers = [f"{float(lo) + (i + 0.5) * w:.3g}" for i in range(bins)]
        under, over = f"< {float(lo):.3g}", f"> {float(hi):.3g}"
    else:
        centers = [f"bin {i}" for i in range(bins)]
        under, over = "under", "over"
    counts = np.zeros((bins + 3, len(steps)), dtype=np.int64)
    for j, s in enumerate(steps):
        h = by_step[s]
        counts[0, j] = h[bins]
        counts[1:bins + 1, j] = h[:bins]
        counts[bins + 1, j] = h[bins + 1]
        counts[bins + 2, j] = h[bins + 2]
    has_nan = bool(counts[bins + 2].any())
    rows = [under] + centers + [over] + (["NaN"] if has_nan else [])
    if not has_nan:
        counts = counts[:-1]
    occupied = np.flatnonzero(counts[1:bins + 1].any(axis=1))
    spread = int(occupied[-1] - occupied[0]) if occupied.size else 0
    return _Panel(module, kind, steps, counts, rows, "range", 1, [], bins, has_nan, spread)
