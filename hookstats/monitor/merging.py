"""A Monitor's merge session (only with a process group): every flush's Block gathered from every rank and combined
into one merged Block, the same on every rank (Note [merging records across ranks] in merge.py, which holds the
payload, the gather and the combine; this module holds what lasts from one flush to the next: the gather in flight,
the agreed capacity, the merged site table and the counts of what could not be merged)."""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np

from ..distributed import collective_device
from .block import Block
from .merge import INITIAL_CAPACITY, Gather, MergeError, MergedSites, capacity_for, combine, hist_rows, pack
from .merge import signature as merge_signature
from .recorder import Recorder


class MergeSession:
    """Merges the Blocks of `recorder` across the ranks of `group`: start(block) begins a flush's all_gather (every
    rank calls it at the same points), finish() ends it and returns the merged Block."""

    def __init__(self, group, recorder: Recorder):
        self.group = group
        self.recorder = recorder
        self.merged_table = MergedSites(recorder.table.hook_names)
        self.merge_failures = 0  # flushes whose records could not be merged (dropped)
        self.dropped_records = 0  # this rank's records in those flushes
        self.replica_mismatches = 0
        self._warned_replicas = False
        self._pending: Optional[Gather] = None
        self._pending_n = 0
        self._capacity = INITIAL_CAPACITY
        self._sig: Optional[tuple] = None
        self._device = None  # the collectives' device, found at the first flush (the current CUDA device then)

    @property
    def pending(self) -> bool:
        """Whether a gather was started and not finished."""
        return self._pending is not None

    def _signature(self) -> float:
        """What every rank's Monitor must share (hooks, their merge modes, histogram and locations settings)."""
        r = self.recorder
        n = len(r.table.hook_names)
        if self._sig is None or self._sig[0] != n:
            h = r.histogram
            spec = None if h is None else (h.kind, h.bins, h.lo, h.hi)
            self._sig = (n, merge_signature([r.table.hook_names, r.hook_modes, spec, r.locations]))
        return self._sig[1]

    def start(self, block: Optional[Block], async_op: bool) -> None:
        """Starts the gather of this rank's block (None: this rank cannot take part, and every rank refuses the
        flush); async_op: returns before it ends."""
        if self._device is None:
            self._device = collective_device(self.group, None)
        if block is None:  # Note [merging records across ranks]: signature -1 makes every rank refuse this flush
            payload, n, sig = np.empty(0), 0, -1.0
        else:
            payload, n, sig = pack(block, self.recorder.locations), len(block), self._signature()
        self._pending = Gather(self.group, self._device, payload, n, sig, self.recorder.locations, self._capacity,
                               async_op=async_op)
        self._pending_n = n

    def finish(self, collective: bool) -> Optional[Block]:
        """Ends the pending gather, if any, and returns its merged Block (MergeError: the ranks' records could not be
        merged; counted and dropped). Off a collective point (a read on one rank) a gather whose payloads outgrew
        the capacity stays pending: sending it again is a collective."""
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
        r = self.recorder
        try:
            m = combine(chunks, g.sig, np.asarray(r.hook_modes + [0], dtype=np.int64), r.table.hook_names)
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
        return self._merged_block(m)

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
        block = Block(t, m.steps, sites, m.stats, hgroup, hrow, hists, 0, m.loc, m.shape_ndim, m.shape_dims)
        block.ranks, block.nonfinite_mask, block.location_rank = m.ranks, m.nonfinite_mask, m.location_rank
        return block
