"""The per-layer summary table of a Monitor's records, computed from columns (numpy arrays), never per record."""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import numpy as np

from .._fields import STAT_INDEX as _F
from .._fields import STATS_FIELDS
from .block import mask_ranks


def summary_from_columns(module: Sequence[str], kind: Sequence[str], step: np.ndarray, stats: np.ndarray,
                         nonfinite_mask: Optional[np.ndarray] = None) -> list[dict]:
    """Per (module, kind), in the order first seen: number of records, last step's l2 (the tensors of that step
    combined), the largest linf, the smallest min and largest max (over records without NaN), and the NaN / Inf
    totals. `stats` is [n, 13] in STATS_FIELDS order, row i for (module[i], kind[i], step[i]). Records merged across
    ranks (nonfinite_mask: row i's bitmask of the ranks whose tensor held a NaN/Inf) add `nonfinite_ranks`."""
    n = len(step)
    if n == 0:
        return []
    keys: dict[tuple, int] = {}
    group = np.empty(n, dtype=np.int64)
    for i, k in enumerate(zip(module, kind)):
        group[i] = keys.setdefault(k, len(keys))
    return summary_from_groups(group, list(keys), step, stats, nonfinite_mask)


def summary_from_groups(group: np.ndarray, keys: Sequence[tuple], step: np.ndarray, stats: np.ndarray,
                        nonfinite_mask: Optional[np.ndarray] = None) -> list[dict]:
    """summary_from_columns() with the grouping done: row i belongs to keys[group[i]] = (module, kind), keys in the
    order first seen (a table's dictionary codes give this without a Python loop over the rows)."""
    if len(step) == 0:
        return []
    g = len(keys)
    keys = {k: j for j, k in enumerate(keys)}
    step = np.asarray(step, dtype=np.int64)
    count = np.bincount(group, minlength=g)
    nan = np.bincount(group, weights=stats[:, _F["nan_count"]], minlength=g)
    inf = np.bincount(group, weights=stats[:, _F["inf_count"]], minlength=g)

    def reduce(col: str, fn, init: float) -> np.ndarray:
        v = stats[:, _F[col]]
        ok = v == v
        out = np.full(g, init)
        fn.at(out, group[ok], v[ok])
        return out

    linf = reduce("linf", np.maximum, 0.0)
    mn = reduce("min", np.minimum, math.inf)
    mx = reduce("max", np.maximum, -math.inf)
    last = np.full(g, np.iinfo(np.int64).min)
    np.maximum.at(last, group, step)
    at_last = step == last[group]
    l2 = np.sqrt(np.bincount(group[at_last], weights=np.square(stats[at_last, _F["l2"]]), minlength=g))
    masks = None
    if nonfinite_mask is not None:
        masks = np.zeros(g, dtype=np.int64)
        np.bitwise_or.at(masks, group, np.asarray(nonfinite_mask, dtype=np.int64))
    rows = []
    for (mod, knd), j in keys.items():
        rows.append({"module": mod, "kind": knd, "records": int(count[j]), "last_step": int(last[j]),
                     "l2": float(l2[j]), "linf": float(linf[j]), "min": float(mn[j]), "max": float(mx[j]),
                     "nan": int(nan[j]), "inf": int(inf[j])})
        if masks is not None:
            rows[-1]["nonfinite_ranks"] = mask_ranks(int(masks[j]))
    return rows


def summary_rows(records: Iterable[dict]) -> list[dict]:
    """summary_from_columns() of records as dicts (a log read back, records())."""
    records = list(records)
    stats = np.array([[r["stats"][f] for f in STATS_FIELDS] for r in records], dtype=np.float64)
    stats = stats.reshape(-1, len(STATS_FIELDS))
    return summary_from_columns([r["module"] for r in records], [r["kind"] for r in records],
                                np.array([r["step"] for r in records], dtype=np.int64), stats)


SUMMARY_HEADER = ("module", "kind", "records", "last l2", "max |x|", "min", "max", "NaN", "Inf")


def summary_cells(rows: Sequence[dict]) -> list[list[str]]:
    """The cells of the summary table (SUMMARY_HEADER columns), as strings."""
    return [[r["module"] or "<model>", r["kind"], str(r["records"]), f"{r['l2']:.4g}", f"{r['linf']:.4g}",
             f"{r['min']:.4g}", f"{r['max']:.4g}", str(r["nan"]), str(r["inf"])] for r in rows]


def format_summary(rows: Sequence[dict]) -> str:
    """summary_rows() as an aligned text table (with a "NaN/Inf ranks" column for records merged across ranks)."""
    head = SUMMARY_HEADER
    body = summary_cells(rows)
    if rows and "nonfinite_ranks" in rows[0]:
        head = head + ("NaN/Inf ranks",)
        body = [b + [",".join(map(str, r["nonfinite_ranks"])) or "-"] for b, r in zip(body, rows)]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)
