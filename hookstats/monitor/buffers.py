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

from .._kernels import extension
from .._ops import STATS_FIELDS, Histogram, as_histogram
from ..distributed import collective_device, local_part
from .compile import register
from .block import Block, HistRows, LazyRecords, Record, gather_rows, unravel_rows  # noqa: F401 (re-exported)
from .merge import INITIAL_CAPACITY, Gather, MergeError, MergedSites, capacity_for, combine, hist_rows, pack
from .merge import signature as merge_signature
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


class _SeveralDevices(RuntimeError):
    pass


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
        self.ready: list[Block] = []  # flushed (merged) blocks not yet handed to exporters
        self._held_scalars: list = []
        self.hook_modes: list[int] = []  # per hook: 0 merged over ranks, 1 replicated (DDP grads: one rank's)
        self.merged_table = MergedSites(self.table.hook_names)
        self._pending: Optional[Gather] = None
        self._pending_n = 0
        self._capacity = INITIAL_CAPACITY
        self._sig: Optional[tuple] = None
        self._coll_dev: Optional[torch.device] = None
        self.merge_failures = 0  # flushes whose records could not be merged (dropped)
        self.dropped_records = 0  # this rank's records in those flushes
        self.replica_mismatches = 0
        self._warned_replicas = False
        self.id = register(self)  # what traced hooks pass to the record op (Note [monitor under torch.compile])

    # -- recording --------------------------------------------------------------------------------------------------
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
    def flush(self, async_merge: bool = False) -> Optional[Block]:
        """One host copy per buffer, the device rows reset, and the copied rows as a Block (kept in `blocks` unless
        keep is False). With a process group this is a collective: the rows are merged across ranks (Note [merging
        records across ranks] in hookstats.distributed) in one all_gather, and the merged Block is returned; with
        async_merge the gather is only started (None is returned) and ends at the next flush or read. Blocks that
        became ready (merged) wait in `ready` for the Monitor's exporters."""
        try:
            block = self._local_block()
        except _SeveralDevices:  # (with a group only) this rank still takes part in the gather: every rank raises
            block = None
        if self.group is None:
            self._keep(block)
            self.ready.append(block)
            return block
        err = None
        try:
            self.finish(collective=True)  # the previous flush's gather, if it was started asynchronously
        except MergeError as e:
            err = e
        self._start_merge(block, async_merge)
        out = None
        if not async_merge:
            try:
                out = self.finish(collective=True)
            except MergeError as e:
                err = err or e
        if err is not None:
            raise err
        return out

    def _local_block(self) -> Block:
        taken = self.rec.take()
        stats_blocks, hist_blocks, steps, hist_on, order_slots, order_sites = taken[:6]
        self.table.sync(self.rec)
        if self.group is not None and len(stats_blocks) > 1:
            self.rec.reset()
            raise _SeveralDevices("hookstats.Monitor(process_group=...) records tensors of one device per rank; this "
                               f"rank recorded tensors on {self.rec.devices()}")
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
                          RuntimeWarning, stacklevel=4)
        return block

    def _keep(self, block: Block) -> None:
        block.seq0 = self._seq
        self._seq += len(block)
        if self.keep and len(block):
            self.blocks.append(block)

    def take_ready(self, scalars: list = ()) -> list:
        """(block, scalars) pairs for the exporters: every block flushed since the last call, the scalars with the
        last one; scalars flushed while a merge is still running wait for its block."""
        self._held_scalars += list(scalars)
        ready, self.ready = self.ready, []
        if not ready:
            if self._pending is not None or not self._held_scalars:
                return []
            ready = [self.empty_block()]
        out = [(b, []) for b in ready]
        out[-1] = (ready[-1], self._held_scalars)
        self._held_scalars = []
        return out

    def empty_block(self) -> Block:
        e = np.empty(0, dtype=np.int64)
        return Block(self.table, e, e, np.empty((0, _NF)), e, e, [], self._seq)

    # -- merging across ranks (Note [merging records across ranks] in monitor/merge.py) --------------------------
    def _signature(self) -> float:
        """What every rank's Monitor must share (hooks, their merge modes, histogram and locations settings)."""
        n = len(self.table.hook_names)
        if self._sig is None or self._sig[0] != n:
            h = self.histogram
            spec = None if h is None else (h.kind, h.bins, h.lo, h.hi)
            self._sig = (n, merge_signature([self.table.hook_names, self.hook_modes, spec, self.locations]))
        return self._sig[1]

    def _start_merge(self, block: Optional[Block], async_merge: bool) -> None:
        if self._coll_dev is None:
            self._coll_dev = collective_device(self.group, None)
        dev = self._coll_dev
        if block is None:  # Note [merging records across ranks]: signature -1 makes every rank refuse this flush
            payload, n, sig = np.empty(0), 0, -1.0
        else:
            payload, n, sig = pack(block, self.locations), len(block), self._signature()
        self._pending = Gather(self.group, dev, payload, n, sig, self.locations, self._capacity, async_op=async_merge)
        self._pending_n = n

    def finish(self, collective: bool) -> Optional[Block]:
        """Ends the pending gather, if any, and keeps its merged Block. Off a collective point (a read on one rank)
        a gather whose payloads outgrew the capacity stays pending: sending it again is a collective."""
        g = self._pending
        if g is None:
            return None
        need = g.overflow()
        if need:
            if not collective:
                return None
            g.resend(capacity_for(need))
        self._pending = None
        chunks = g.chunks()
        longest = max(len(p) for _, p in chunks)
        if longest > self._capacity or 4 * longest < self._capacity:  # every rank computes the same
            self._capacity = capacity_for(longest)
        try:
            m = combine(chunks, g.sig, np.asarray(self.hook_modes + [0], dtype=np.int64), self.table.hook_names)
        except MergeError:
            self.merge_failures += 1
            self.dropped_records += self._pending_n
            raise
        if m.replica_mismatches:
            self.replica_mismatches += m.replica_mismatches
            if not self._warned_replicas:
                self._warned_replicas = True
                warnings.warn(f"hookstats.Monitor: {m.replica_mismatches} records of replicated gradients differ "
                              "between ranks (Monitor.replica_mismatches counts them); the merged record is the "
                              "lowest rank's. Replicated grads (DDP's, after its allreduce) should be identical.",
                              RuntimeWarning, stacklevel=3)
        block = self._merged_block(m)
        self._keep(block)
        self.ready.append(block)
        return block

    def _merged_block(self, m) -> Block:
        t = self.merged_table
        sites = t.ids(m.hook, m.index, m.call, m.dtype)
        n = len(sites)
        hgroup = np.full(n, -1, dtype=np.int64)
        hrow = np.zeros(n, dtype=np.int64)
        hists = []
        for g, (L, (gsel, acc)) in enumerate(sorted(m.hists.items())):
            hgroup[gsel] = g
            hrow[gsel] = np.arange(len(gsel))
            hists.append(hist_rows(acc))
        block = Block(t, m.steps, sites, m.stats, hgroup, hrow, hists, self._seq, m.loc, m.shape_ndim, m.shape_dims)
        block.ranks, block.nonfinite_mask, block.location_rank = m.ranks, m.nonfinite_mask, m.location_rank
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
        """(module, kind, step, stats, nonfinite mask or None) over every kept block, for the summary."""
        if not self.blocks:
            return [], [], np.empty(0, dtype=np.int64), np.empty((0, _NF)), None
        module = np.concatenate([b.column("module") for b in self.blocks])
        kind = np.concatenate([b.column("kind") for b in self.blocks])
        steps = np.concatenate([b.steps for b in self.blocks])
        stats = np.concatenate([b.stats for b in self.blocks])
        mask = None
        if self.group is not None:  # merged blocks: the ranks with a NaN/Inf
            mask = np.concatenate([b.nonfinite_mask if b.nonfinite_mask is not None else
                                   np.zeros(len(b), dtype=np.int64) for b in self.blocks])
        return module, kind, steps, stats, mask

    def release(self) -> None:
        self.rec.close()
        self.scalars.release()
