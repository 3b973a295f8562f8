"""The device buffers of a Monitor (or record hook) and their flush into the columnar blocks of block.py.

Rows live in the C++ recorder (hookstats._C.Recorder, Note [monitor sites] in csrc/monitor/recorder.h): per device
a [slots, sites, 13] float64 block, per (device, histogram length) a [slots, sites, length] int64 block, NaN / zero
until written. `Buffers.flush()` copies each used CUDA block to the host in one copy (non-blocking into pinned memory,
one wait; CPU blocks are read in place), gathers the written rows into one `Block` (block.py): numpy columns (step,
site, the 13 statistics, histogram rows as their nonzero columns), in the order the rows were written (hook-call
order), and then resets the device rows. Nothing is built per record until `Block.records()` is asked for
(`Monitor.records()`, exporters). With locations (Monitor(locations=True)) each device also has a
[slots, sites, 2] int64 block of flat indices (first largest |x|, first NaN/Inf; -1: none), and the recorder keeps
every record's shape: the Block gets a `loc` column and the shapes, and records their coordinates.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import numpy as np
import torch

from .._ops import STATS_FIELDS, Histogram, as_histogram
from .block import Block, HistRows, LazyRecords, Record, gather_rows, unravel_rows  # noqa: F401 (re-exported)
from .sites import SiteTable

_NF = len(STATS_FIELDS)


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
