"""The device buffers of a Monitor (or record hook), their flush, and the columnar blocks a flush yields.

Rows live in the C++ recorder (hookstats._C.Recorder, Note [monitor sites] in csrc/monitor/recorder.h): per device
a [slots, sites, 13] float64 block, per (device, histogram length) a [slots, sites, length] int64 block, NaN / zero
until written. `Buffers.flush()` copies each used block to the host in one copy (non-blocking into pinned memory on
CUDA, one wait), resets the device rows, and turns the copies into one `Block`: numpy columns (step, site, the 13
statistics, histogram rows), in the order the rows were written (hook-call order). Nothing is built per record until `Block.records()` is
asked for (`Monitor.records()`, exporters). With locations (Monitor(locations=True)) each device also has a
[slots, sites, 2] int64 block of flat indices (first largest |x|, first NaN/Inf; -1: none), and the recorder keeps
every record's shape: the Block gets a `loc` column and the shapes, and records their coordinates.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from .._ops import COUNT_FIELDS, STATS_FIELDS, Histogram, as_histogram, unravel_many
from .sites import SiteTable

_NF = len(STATS_FIELDS)
_COUNT_IDX = [STATS_FIELDS.index(f) for f in COUNT_FIELDS]
_NUMEL, _NAN, _INF = STATS_FIELDS.index("numel"), STATS_FIELDS.index("nan_count"), STATS_FIELDS.index("inf_count")


def to_host(t: torch.Tensor) -> torch.Tensor:
    if t.is_cuda:  # non-blocking into pinned memory, then one wait for this stream
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        return host
    return t.cpu() if t.device.type != "cpu" else t.clone()


def host_view(t: torch.Tensor) -> np.ndarray:
    """A flush's block as numpy: CPU tensors in place (read before the recorder's reset), others copied."""
    return t.numpy() if t.device.type == "cpu" else to_host(t).numpy()


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


def _extension():
    from .. import _ops

    if not _ops.HAVE_EXTENSION:
        raise RuntimeError(f"hookstats.Monitor and hookstats.record need the compiled extension hookstats._C, which "
                           f"could not be loaded ({_ops._EXTENSION_ERROR}). Rebuild with "
                           "`pip install --no-build-isolation -e .`")
    from .. import _C
    from ..distributed import local_part

    _C.set_local_part(local_part)  # DTensors (FSDP2, TP) are recorded by their local shard
    return _C


class Record(dict):
    """A record dict that prints where it is: `step 90, module embed, kind forward, index 0, element (3, 17, 250)`
    (the element: the first NaN/Inf when the tensor held one, else the first largest |x|; only with locations)."""

    def __str__(self) -> str:
        out = f"step {self['step']}, module {self['module'] or '<model>'}, kind {self['kind']}, index {self['index']}"
        where = self.get("first_nonfinite_index")
        if where is None:
            where = self.get("argmax_abs_index")
        if where is not None:
            out += f", element {tuple(where)}"
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
        st = dict(zip(STATS_FIELDS, row))
        for k in COUNT_FIELDS:
            st[k] = int(st[k])
        g = int(self.hist_group[i])
        r = {"seq": self.seq0 + i, "step": int(self.steps[i]), "module": module, "kind": kind,
             "index": int(t.index[s]), "dtype": t.dtypes[s], "stats": st,
             "histogram": self.hists[g][int(self.hist_row[i])].tolist() if g >= 0 else None}
        if self.loc is not None:
            a, f = self.coordinates()
            r["shape"] = self.shape(i)
            r["argmax_abs_index"] = a[i]
            r["first_nonfinite_index"] = f[i]
        return r

    def records(self) -> list[dict]:
        """The rows as record dicts (built once, on first call)."""
        if self._records is None:
            rows = self.stats.tolist()
            self._records = [self.record(i, rows[i]) for i in range(len(rows))]
        return self._records


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


class ScalarBuffer:
    """Scalars logged with Monitor.log(): one float64 slot each, on the value's device, copied there (no sync)."""

    def __init__(self, slots: int):
        self.slots = slots
        self._bufs: dict[torch.device, torch.Tensor] = {}
        self._used: dict[torch.device, int] = {}
        self._meta: dict[torch.device, list] = {}
        self.flushed: list[dict] = []
        self._seq = 0

    def add(self, value, step: int, tag: str) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"hookstats.Monitor.log needs a one-element tensor or a number, got shape "
                                 f"{tuple(value.shape)}")
            dev = value.device
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            dev = torch.device("cpu")
        else:
            raise TypeError(f"hookstats.Monitor.log needs a tensor or a number, got {type(value).__name__}")
        buf = self._bufs.get(dev)
        n = self._used.get(dev, 0)
        if buf is None or n == buf.shape[0]:
            new = torch.full((self.slots if buf is None else 2 * buf.shape[0],), math.nan, dtype=torch.float64,
                             device=dev)
            if buf is not None:
                new[:n].copy_(buf[:n])
            self._bufs[dev] = buf = new
        if isinstance(value, torch.Tensor):
            buf[n].copy_(value.detach().reshape(()))
        else:
            buf[n] = float(value)
        self._meta.setdefault(dev, []).append((self._seq, step, tag))
        self._seq += 1
        self._used[dev] = n + 1

    def flush(self, keep: bool) -> list[dict]:
        new: list[dict] = []
        for dev, buf in self._bufs.items():
            n = self._used.get(dev, 0)
            if n:
                for (seq, step, tag), v in zip(self._meta[dev], to_host(buf[:n]).tolist()):
                    new.append({"seq": seq, "step": step, "tag": tag, "value": v})
            self._used[dev] = 0
            self._meta[dev] = []
        new.sort(key=lambda r: r["seq"])
        if keep:
            self.flushed.extend(new)
        return new

    @property
    def pending(self) -> int:
        return sum(self._used.values())

    def release(self) -> None:
        self._bufs.clear()
        self._used.clear()
        self._meta.clear()


class Buffers:
    """A C++ recorder, its site table, the flushed blocks and the logged scalars (Note [monitor sites]).

    histogram: a Histogram spec (or None); slots: step slots a buffer holds before it grows; rows: sites per device
    a buffer holds before it grows."""

    def __init__(self, histogram=None, slots: int = 16, rows: int = 64, locations: bool = False):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"hookstats: slots must be an int >= 1, got {slots!r}")
        C = _extension()
        self.histogram: Optional[Histogram] = as_histogram(histogram) if histogram is not None else None
        h = self.histogram
        self.locations = bool(locations)
        self.rec = C.Recorder(slots, h.mode if h else 0, h.bins if h else 0, h.lo if h else 0.0, h.hi if h else 0.0,
                              rows, self.locations)
        self.table = SiteTable()
        self.blocks: list[Block] = []
        self.scalars = ScalarBuffer(64)
        self.keep = True
        self.group = None  # a ProcessGroup: flush merges rows across its ranks
        self._seq = 0
        from .compile import register

        self.id = register(self)  # what traced hooks pass to the record op (Note [monitor under torch.compile])

    # -- recording --------------------------------------------------------------------------------------------------
    def hook(self, name: str, kind: str) -> int:
        """A new hook id, for records labelled (name, kind)."""
        hid = self.rec.add_hook()
        self.table.add_hook(hid, name, kind)
        return hid

    def record(self, hid: int, obj) -> None:
        """Records the tensors of obj (a tensor, or tuples/lists/dicts of them) as one call of hook hid."""
        self.rec.record(hid, obj)

    def record_tensors(self, hid: int, xs) -> None:
        """The compiled path's recording (Note [monitor under torch.compile]): xs is a list of tensors or None."""
        self.rec.record_tensors(hid, xs)

    def record_grad(self, hid: int, index: int, grad) -> None:
        """A grad_output tensor hook's recording of output `index` (the compiled path's)."""
        self.rec.record_grad(hid, index, grad)

    @property
    def skipped(self) -> int:
        return self.rec.skipped

    @property
    def dropped_replays(self) -> int:
        return self.rec.dropped_replays

    @property
    def pending(self) -> int:
        return self.rec.pending_slots + self.scalars.pending

    # -- flush ------------------------------------------------------------------------------------------------------
    def flush(self) -> Block:
        """One host copy per buffer, the device rows reset, and the copied rows as a Block (kept in `blocks` unless
        keep is False). With a process group the rows are merged across ranks first (Note [merging records across
        ranks] in hookstats.distributed), and this is a collective."""
        taken = self.rec.take()
        stats_blocks, hist_blocks, steps, hist_on, order_slots, order_sites = taken[:6]
        self.table.sync(self.rec)
        if self.group is not None:
            stats_blocks, hist_blocks = self._merge(stats_blocks, hist_blocks, steps)
        # CPU blocks are read in place: the gathers below copy the rows out before reset() (a copy of the whole
        # block first would double the flush's memory traffic: 80 MB a flush for exponent histograms of 1,000
        # modules over 10 steps)
        host_stats = [host_view(b) for b in stats_blocks]
        host_hists = [(dev, host_view(b)) for dev, _, b in hist_blocks]
        host_locs = [host_view(b) for b in taken[6]] if self.locations else None
        block = self._columns(host_stats, host_hists, np.asarray(steps, dtype=np.int64),
                              np.asarray(hist_on, dtype=bool), order_slots.astype(np.int64),
                              order_sites.astype(np.int64))
        if host_locs is not None:  # Note [monitor sites]: location rows beside the stats rows, shapes per record
            slot, site = order_slots.astype(np.int64), order_sites.astype(np.int64)
            loc = self._device_rows(host_locs, slot, site, np.full((len(site), 2), -1, dtype=np.int64))
            block.loc, block.shape_ndim, block.shape_dims = loc, taken[7].astype(np.int64), taken[8]
            block.shape_off = np.zeros(len(site) + 1, dtype=np.int64)
            np.cumsum(block.shape_ndim, out=block.shape_off[1:])
        del host_stats, host_hists, host_locs  # views of the device rows (CPU) that reset() clears
        dropped = self.rec.dropped_replays
        self.rec.reset()
        dropped = self.rec.dropped_replays - dropped
        if dropped:
            warnings.warn(f"hookstats.Monitor: {dropped} replays of a captured CUDA graph were overwritten before "
                          f"this flush: a captured step keeps the rows of its last `slots` replays. Flush at least "
                          f"every `slots` replays (flush_every=), or give the Monitor more slots (slots=).",
                          RuntimeWarning, stacklevel=3)
        self._seq += len(block)
        if self.keep and len(block):
            self.blocks.append(block)
        return block

    def _device_rows(self, blocks: list, slot: np.ndarray, site: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[i] = the row (slot[i], site[i]) of its device's block (blocks[d]: [slots, rows, k]), for every i."""
        dev, row = self.table.dev[site], self.table.row[site]
        for d, b in enumerate(blocks):
            sel = np.flatnonzero(dev == d)
            if len(sel):
                out[sel] = b[slot[sel], row[sel]]
        return out

    def _columns(self, stats: list, hists: list, steps: np.ndarray, hist_on: np.ndarray, slot: np.ndarray,
                 site: np.ndarray) -> Block:
        """The written rows (slot[i], site[i]), in the order they were written, as a Block."""
        t = self.table
        n = len(site)
        stat = self._device_rows(stats, slot, site, np.empty((n, _NF)))
        hgroup = np.full(n, -1, dtype=np.int64)
        hrow = np.zeros(n, dtype=np.int64)
        out_hists = []
        if hists:
            g_of = t.hgroup[site]
            on = hist_on[slot] & (g_of >= 0)
            for g, (_, hb) in enumerate(hists):
                sel = np.flatnonzero(on & (g_of == g))
                out_hists.append(gather_rows(hb, slot[sel], t.hrow[site[sel]]))
                hgroup[sel] = g
                hrow[sel] = np.arange(len(sel))
        return Block(t, steps[slot] if n else np.empty(0, dtype=np.int64), site, stat, hgroup, hrow, out_hists,
                     self._seq)

    def _merge(self, stats_blocks: list, hist_blocks: list, steps: list):
        from ..distributed import collective_device, merge_rows, signature

        if len(stats_blocks) > 1:
            raise RuntimeError("hookstats.Monitor(process_group=...) records tensors of one device per rank; this "
                               f"rank recorded tensors on {self.rec.devices()}")
        if stats_blocks:
            dev_block = stats_blocks[0]
            rows = dev_block.reshape(-1, _NF)
            shape = dev_block.shape
        else:
            dev = collective_device(self.group, None)
            rows = torch.empty((0, _NF), dtype=torch.float64, device=dev)
            shape = (0, 0, _NF)
        sig = signature([self.table.signature(), tuple(steps), tuple((len_, tuple(b.shape)) for _, len_, b in
                                                                      hist_blocks)])
        merged, mh = merge_rows(self.group, rows, [b.reshape(-1, b.shape[-1]) for _, _, b in hist_blocks], sig)
        new_stats = [merged.view(shape)] if stats_blocks else []
        new_hists = [(d, n, m.view(b.shape)) for (d, n, b), m in zip(hist_blocks, mh)]
        return new_stats, new_hists

    # -- reading ----------------------------------------------------------------------------------------------------
    def records(self) -> list[dict]:
        out: list[dict] = []
        for b in self.blocks:
            out.extend(b.records())
        return out

    def first_nonfinite(self) -> Optional[dict]:
        for b in self.blocks:
            rows = b.nonfinite_rows()
            if len(rows):
                return Record(b.record(int(rows[0])))
        return None

    def columns(self):
        """(module, kind, step, stats) over every kept block, for the summary."""
        if not self.blocks:
            return [], [], np.empty(0, dtype=np.int64), np.empty((0, _NF))
        module = np.concatenate([b.column("module") for b in self.blocks])
        kind = np.concatenate([b.column("kind") for b in self.blocks])
        steps = np.concatenate([b.steps for b in self.blocks])
        stats = np.concatenate([b.stats for b in self.blocks])
        return module, kind, steps, stats

    def release(self) -> None:
        self.rec.close()
        self.scalars.release()
