"""The recording end of a Monitor's data path (or a record hook's): the C++ recorder, its site table, and the rows it
wrote taken out as one columnar Block (block.py).

Rows live in the C++ recorder (hookstats._C.Recorder, Note [monitor sites] in csrc/monitor/recorder.h): per device
a [slots, sites, 13] float64 block, per (device, histogram length) a [slots, sites, length] int64 block, NaN / zero
until written. `Recorder.take()` copies each used CUDA block to the host in one copy (non-blocking into pinned
memory, one wait; CPU blocks are read in place), gathers the written rows into one `Block` (block.py): numpy columns
(step, site, the 13 statistics, histogram rows as their nonzero columns), in the order the rows were written
(hook-call order), and then resets the device rows. Nothing is built per record until `Block.records()` is asked
for (`Monitor.records()`, exporters). With locations (Monitor(locations=True)) each device also has a
[slots, sites, 2] int64 block of flat indices (first largest |x|, first NaN/Inf; -1: none), and the recorder keeps
every record's shape: the Block gets a `loc` column and the shapes, and records their coordinates.

Where the Block goes next: store.py keeps it (and numbers its records); with a process group, merging.py merges it
with every rank's first.
"""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import torch

from .._kernels import extension
from .._ops import STATS_FIELDS, Histogram, as_histogram
from ..distributed import local_part
from .block import Block, gather_rows
from .compile import register
from .sites import SiteTable

_NF = len(STATS_FIELDS)


# Note [flush across streams]
# Rows are written by kernels on whatever stream was current where the record was made: a side stream
# (`with torch.cuda.stream(s)`), autograd's stream for a backward op (the forward op's), the stream a captured graph
# is replayed on. A copy ordered only after the current stream could read a row before its kernel ran, and the
# recorder's NaN reset could run before it and be overwritten. The recorder cannot know every such stream (a graph
# replay runs none of its code), so a flush, which blocks anyway, waits for the whole device: Recorder::take
# (csrc/monitor/recorder.cpp) before it reads the rings' counts and hands out the blocks, to_host before each copy
# (the logged scalars too), and Recorder::reset waits for its fills before it returns, so that a record made after
# the flush, on any stream, is enqueued after them. The cost: the flush also waits for work queued on other streams
# (a data loader's copies, collectives) that would otherwise overlap with it, and one more wait for the fills
# (microseconds). tests/test_cuda_streams.py records on side streams and flushes without wait_stream.
def to_host(t: torch.Tensor) -> torch.Tensor:
    if t.is_cuda:  # after the whole device (Note [flush across streams]); non-blocking into pinned memory, one wait
        torch.cuda.synchronize(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        return host
    return t.cpu() if t.device.type != "cpu" else t.clone()


def host_view(t: torch.Tensor) -> np.ndarray:
    """A flush's block as numpy: CPU tensors in place (read before the recorder's reset), others copied."""
    return t.numpy() if t.device.type == "cpu" else to_host(t).numpy()


def _extension():
    _C = extension()
    _C.set_local_part(local_part)  # DTensors (FSDP2, TP) are recorded by their local shard
    return _C


class SeveralDevices(RuntimeError):
    """A flush with a process group found rows of more than one device (a rank records one)."""





class Recorder:
    """A C++ recorder and its site table (Note [monitor sites]): hook ids, the rows their calls write, and `take()`,
    which hands those rows out as a Block and resets them.

    histogram: a Histogram spec (or None); slots: step slots a buffer holds before it grows; rows: sites per device
    a buffer holds before it grows; locations: element locations and shapes beside each row."""

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
        self.hook_modes: list[int] = []  # per hook: 0 merged over ranks, 1 replicated (DDP grads: one rank's)
        self.id = register(self)  # what traced hooks pass to the record op (Note [monitor under torch.compile])

    def hook(self, name: str, kind: str, replicated: bool = False) -> int:
        """A new hook id, for records labelled (name, kind); replicated: its tensors are the same on every rank
        (merged as one rank's, not as shards)."""
        hid = self.rec.add_hook()
        self.table.add_hook(hid, name, kind)
        self.hook_modes.append(1 if replicated else 0)
        return hid

    def record(self, hid: int, obj) -> None:
        """Records the tensors of obj (a tensor, or tuples/lists/dicts of them) as one call of hook hid."""
        self.rec.record(hid, obj)

    def record_params(self, pairs) -> None:
        """Records each (hook id, tensor) of pairs as one call of its hook (the grad kind's: one C++ call)."""
        self.rec.record_params(pairs)

    def begin_step(self, step: int, active: bool, hist_on: bool) -> None:
        """Records from now on carry `step`; active: they are recorded; hist_on: with their histograms."""
        self.rec.begin_step(step, active, hist_on)

    @property
    def active(self) -> bool:
        """Whether the current step records (Recorder::begin_step)."""
        return self.rec.active

    @property
    def skipped(self) -> int:
        return self.rec.skipped

    @property
    def dropped_replays(self) -> int:
        return self.rec.dropped_replays

    @property
    def pending(self) -> int:
        """Step slots written since the last take()."""
        return self.rec.pending_slots

    def take(self, one_device: bool = False) -> Block:
        """The rows written since the last take(), in the order they were written, as a Block (its seq0 is set by
        the store that keeps it); the device rows are reset. one_device: refuse (SeveralDevices, rows dropped) rows
        of more than one device (a rank of a merge records one)."""
        taken = self.rec.take()
        stats_blocks, hist_blocks, steps, hist_on, order_slots, order_sites = taken[:6]
        self.table.sync(self.rec)
        if one_device and len(stats_blocks) > 1:
            self.rec.reset()
            raise SeveralDevices("hookstats.Monitor(process_group=...) records tensors of one device per rank; this "
                                 f"rank recorded tensors on {self.rec.devices()}")
        # CPU blocks are read in place: the gathers below copy the rows out before reset() (a copy of the whole
        # block first would double the flush's memory traffic: 80 MB a flush for exponent histograms of 1,000
        # modules over 10 steps)
        host_stats = [host_view(b) for b in stats_blocks]
        host_hists = [(dev, host_view(b)) for dev, _, b in hist_blocks]
        host_locs = [host_view(b) for b in taken[6]] if self.locations else None
        slot, site = order_slots.astype(np.int64), order_sites.astype(np.int64)
        block = self._columns(host_stats, host_hists, np.asarray(steps, dtype=np.int64),
                              np.asarray(hist_on, dtype=bool), slot, site)
        if host_locs is not None:  # Note [monitor sites]: location rows beside the stats rows, shapes per record
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
                          RuntimeWarning, stacklevel=4)
        return block

    def _device_rows(self, blocks: list, slot: np.ndarray, site: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[i] = the row (slot[i], site[i]) of its device's block (blocks[d]: [slots, rows, k]), for every i."""
        dev, row = self.table.dev[site], self.table.row[site]
        if len(blocks) == 1 and blocks[0].dtype == out.dtype and not dev.any():
            # every row on one device (device 0): the gather is the result, with no second copy of the rows (on a
            # large model megabytes a flush, which the C allocator maps afresh and faults in each time)
            return blocks[0][slot, row]
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
        return Block(t, steps[slot] if n else np.empty(0, dtype=np.int64), site, stat, hgroup, hrow, out_hists, 0)

    def empty_block(self) -> Block:
        e = np.empty(0, dtype=np.int64)
        return Block(self.table, e, e, np.empty((0, _NF)), e, e, [], 0)

    def release(self) -> None:
        """Closes the C++ recorder: hooks of a graph built before still call it, and record nothing."""
        self.rec.close()
