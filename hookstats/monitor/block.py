"""What a flush yields (recorder.py makes it; merging.py a merged one): a `Block` of numpy columns, one flush's records in the order they were
written, its histogram rows as `HistRows` (the nonzero columns), and the record dicts built from it on demand
(`Record`, `LazyRecords`)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from .._fields import LOCATION_COLUMNS, STAT_INDEX, stats_dict, unravel_many
from .sites import SiteTable

_NAN, _INF = STAT_INDEX["nan_count"], STAT_INDEX["inf_count"]


class HistRows(np.lib.mixins.NDArrayOperatorsMixin):
    """The histogram rows of a flushed block, [n, length] int64 counts, stored as the columns that hold a nonzero
    count somewhere in the block (int32 when every count fits): an exponent histogram has 514 slots for float32 and
    a layer's values span a few dozen binades, so a Monitor keeps, and page-faults in, a fraction of the dense rows
    (1,000 modules over 10 steps: ~5 MB a flush instead of 82 MB). Read-only; it indexes (ints, slices, index
    arrays, tuples of them), converts (np.asarray), computes (operators, ufuncs) and answers array attributes and
    methods as the dense [n, length] int64 array would, which it builds for the call."""

    __slots__ = ("data", "cols", "length")
    dtype = np.dtype(np.int64)
    ndim = 2

    def __init__(self, data: np.ndarray, cols: np.ndarray, length: int):
        self.data, self.cols, self.length = data, cols, length

    @property
    def shape(self) -> tuple:
        return (len(self.data), self.length)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, idx) -> np.ndarray:
        if isinstance(idx, tuple):  # rows first, then the rest on the dense rows
            if not idx or idx[0] is Ellipsis or idx[0] is None:
                return self[:][idx]
            return self[idx[0]][(Ellipsis,) + idx[1:]]
        d = self.data[idx]
        out = np.zeros(d.shape[:-1] + (self.length,), dtype=np.int64)
        out[..., self.cols] = d
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if copy is False:
            raise ValueError("HistRows holds only its nonzero columns: np.asarray(copy=False) cannot be a view")
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        args = [x[:] if isinstance(x, HistRows) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(x[:] if isinstance(x, HistRows) else x for x in kwargs["out"])
        return getattr(ufunc, method)(*args, **kwargs)

    def __getattr__(self, name: str):
        """Any other array attribute or method (sum, T, max, ...) of the dense rows."""
        if name.startswith("__") or name in HistRows.__slots__:
            raise AttributeError(name)
        return getattr(self[:], name)


_SCAN_ROWS = 1024  # rows per pass of the nonzero-column scan (a 4 MB temporary at most for 514 int64 columns)


def gather_rows(block: np.ndarray, slot: np.ndarray, row: np.ndarray) -> HistRows:
    """block[slot[i], row[i]] for every i (block: [slots, rows, length], usually a view of the first rows of a larger
    buffer), as HistRows (new memory: the block's nonzero columns only). The pairs go in pieces of _SCAN_ROWS: a piece
    of consecutive rows of one slot (every step's sites written in the same order: the usual case) is read in place,
    others are gathered."""
    length = block.shape[-1]
    n = len(slot)
    if n == 0:
        return HistRows(np.empty((0, 0), dtype=np.int32), np.empty(0, dtype=np.int64), length)

    def part(c: int) -> np.ndarray:
        s, r = slot[c:c + _SCAN_ROWS], row[c:c + _SCAN_ROWS]
        r0, m = int(r[0]), len(r)
        if s[0] == s[-1] and int(r[-1]) - r0 == m - 1 and (m == 1 or (bool(np.all(s == s[0])) and
                                                                     bool(np.all(np.diff(r) == 1)))):
            return block[int(s[0]), r0:r0 + m]
        return block[s, r]

    seen = np.zeros(length, dtype=np.int64)  # the OR of the rows: nonzero where a count is, and >= every count
    for c in range(0, n, _SCAN_ROWS):
        seen |= np.bitwise_or.reduce(part(c), axis=0)
    cols = np.flatnonzero(seen)
    data = np.empty((n, len(cols)), dtype=np.int32 if int(seen.max()) < 2**31 else np.int64)
    for c in range(0, n, _SCAN_ROWS):
        data[c:c + _SCAN_ROWS] = part(c)[:, cols]
    return HistRows(data, cols, length)


def mask_ranks(mask: int) -> list:
    """The ranks set in a nonfinite_mask (bit r: rank r, for ranks 0-62)."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class Record(dict):
    """A record dict that prints where it is: `step 90, module embed, kind forward, index 0, element (3, 17, 250)`
    (the element: the first NaN/Inf when the tensor held one, else the first largest |x|; only with locations).
    Merged across ranks it names the ranks whose tensors held a NaN/Inf, and the rank of the element:
    `..., index 0, NaN/Inf on ranks [1], element (3, 17, 250) on rank 1`."""

    def __str__(self) -> str:
        out = f"step {self['step']}, module {self['module'] or '<model>'}, kind {self['kind']}, index {self['index']}"
        if self.get("nonfinite_ranks"):
            out += f", NaN/Inf on ranks {self['nonfinite_ranks']}"
        where = self.get("first_nonfinite_index")
        if where is None:
            where = self.get("argmax_abs_index")
        if where is not None:
            out += f", element {tuple(where)}"
            if self.get("location_rank") is not None:
                out += f" on rank {self['location_rank']}"
        if self.get("origin") is not None:  # Monitor(nonfinite_ops=True): the op it began at
            out += f"; began at {self['origin']}"
        return out


def unravel_rows(flat: np.ndarray, ndim: np.ndarray, dims: np.ndarray) -> list:
    """Coordinates (tuples, None for -1) of flat indices flat[i] in record i's shape (ndim[i] sizes in dims)."""
    coords, valid, off = unravel_many(flat, ndim, dims)
    c, o = coords.tolist(), off.tolist()
    return [tuple(c[o[i]:o[i + 1]]) if v else None for i, v in enumerate(valid.tolist())]


class Block:
    """The records of one flush, as columns. Row i: steps[i], sites[i] (ids into the site table), stats[i] (the 13
    STATS_FIELDS, float64), and its histogram counts hists[hist_group[i]][hist_row[i]] where hist_group[i] >= 0
    (hists[g]: HistRows, which index like [rows, length] int64 arrays).
    `seq0` is the seq of row 0 (records are numbered on in flush order). With locations (Monitor(locations=True)):
    loc[i] = (argmax_abs, first_nonfinite) flat indices (-1: none) and the record's shape, shape_ndim[i] sizes
    starting at shape_dims[shape_off[i]]; otherwise loc is None."""

    def __init__(self, table: SiteTable, steps: np.ndarray, sites: np.ndarray, stats: np.ndarray,
                 hist_group: np.ndarray, hist_row: np.ndarray, hists: list, seq0: int,
                 loc: Optional[np.ndarray] = None, shape_ndim: Optional[np.ndarray] = None,
                 shape_dims: Optional[np.ndarray] = None):
        self.table = table
        self.steps, self.sites, self.stats = steps, sites, stats
        self.hist_group, self.hist_row, self.hists = hist_group, hist_row, hists
        self.seq0 = seq0
        self.loc, self.shape_ndim, self.shape_dims = loc, shape_ndim, shape_dims
        if loc is not None:
            self.shape_off = np.zeros(len(shape_ndim) + 1, dtype=np.int64)
            np.cumsum(shape_ndim, out=self.shape_off[1:])
        self._records: Optional[list] = None
        self._coords: Optional[tuple] = None
        # Merged across ranks (Note [merging records across ranks]): ranks that wrote each record, a bitmask of the
        # ranks whose tensor held a NaN/Inf (ranks 0-62), and with locations the rank whose element is named.
        self.ranks: Optional[np.ndarray] = None
        self.nonfinite_mask: Optional[np.ndarray] = None
        self.location_rank: Optional[np.ndarray] = None

    def shape(self, i: int) -> tuple:
        """Record i's tensor shape (with locations)."""
        return tuple(self.shape_dims[self.shape_off[i]:self.shape_off[i + 1]].tolist())

    def coordinates(self) -> tuple:
        """(argmax_abs, first_nonfinite) coordinate lists over the rows (tuples, None for -1), with locations."""
        if self._coords is None:
            self._coords = tuple(unravel_rows(self.loc[:, j], self.shape_ndim, self.shape_dims) for j in (0, 1))
        return self._coords

    def __len__(self) -> int:
        return len(self.steps)

    def column(self, name: str):
        """A site column (module, kind, index, dtype, call) for every row."""
        return self.table.column(name)[self.sites]

    def nonfinite_rows(self) -> np.ndarray:
        return np.flatnonzero((self.stats[:, _NAN] > 0) | (self.stats[:, _INF] > 0))

    def record(self, i: int, stats_row: Optional[list] = None) -> dict:
        t = self.table
        s = int(self.sites[i])
        module, kind = t.hook_names[t.hook[s]]
        row = self.stats[i].tolist() if stats_row is None else stats_row
        g = int(self.hist_group[i])
        r = {"seq": self.seq0 + i, "step": int(self.steps[i]), "module": module, "kind": kind,
             "index": int(t.index[s]), "dtype": t.dtypes[s], "stats": stats_dict(row),
             "histogram": self.hists[g][int(self.hist_row[i])].tolist() if g >= 0 else None}
        if self.loc is not None:  # the shape, then a coordinate column per column of loc (LOCATION_COLUMNS)
            r.update(zip(LOCATION_COLUMNS, (self.shape(i),) + tuple(c[i] for c in self.coordinates())))
        if self.ranks is not None:
            r["ranks"] = int(self.ranks[i])
            r["nonfinite_ranks"] = mask_ranks(int(self.nonfinite_mask[i]))
            if self.location_rank is not None:
                r["location_rank"] = int(self.location_rank[i])
        return r  # its keys in the order of _fields.RECORD_KEYS (tests/test_fields.py)

    def records(self) -> list[dict]:
        """The rows as record dicts (built once, on first call)."""
        if self._records is None:
            rows = self.stats.tolist()
            self._records = [self.record(i, rows[i]) for i in range(len(rows))]
        return self._records

    def iter_records(self):
        """The rows as record dicts, one at a time, not kept on the block (an exporter's view: a kept block would
        otherwise hold every dict for the whole run). The dicts are records()'s when those were built already."""
        if self._records is not None:
            yield from self._records
            return
        rows = self.stats.tolist()
        for i in range(len(rows)):
            yield self.record(i, rows[i])


class LazyRecords(Sequence):
    """The records of one Block as a sequence of dicts, built on first access: what flush() returns, so that a
    training loop that ignores it pays for no dict. Compares equal to the list of the same dicts."""

    def __init__(self, block: Block):
        self._block = block

    def __len__(self) -> int:
        return len(self._block)

    def __getitem__(self, i):
        return self._block.records()[i]

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, tuple, Sequence)) else NotImplemented

    def __repr__(self) -> str:
        return repr(self._block.records())
