"""The kept end of a Monitor's data path: the Blocks its flushes yielded (recorder.py's, or merging.py's merged ones),
numbered, kept for reading (records, first_nonfinite, the summary's columns, the Arrow table), and queued for the
exporters until the Monitor hands them over (Note [export off the training thread])."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .._ops import STATS_FIELDS
from ..runlog import schema
from .block import Block, Record

_NF = len(STATS_FIELDS)


class Store:
    """Blocks in flush order. keep: keep them for reading (keep_records; the exporters get them either way);
    empty_block: makes an empty Block (for scalars flushed with no records); merged: the blocks are merged across
    ranks (they name the ranks with a NaN/Inf)."""

    def __init__(self, empty_block: Callable[[], Block], keep: bool = True, merged: bool = False):
        self.keep = keep
        self.merged = merged
        self.blocks: list[Block] = []
        self._empty_block = empty_block
        self._seq = 0  # the seq of the next record
        self._ready: list[Block] = []  # added, not yet handed to the exporters
        self._held_scalars: list = []
        self._tables: list = []  # arrow_table()'s cache: the Arrow table of each kept block

    def add(self, block: Block) -> Block:
        """Numbers block's records on from the last one, keeps it (with keep) and queues it for the exporters."""
        block.seq0 = self._seq
        self._seq += len(block)
        if self.keep and len(block):
            self.blocks.append(block)
        self._ready.append(block)
        return block

    def take_ready(self, scalars: list = (), waiting: bool = False) -> list:
        """(block, scalars) pairs for the exporters: every block added since the last call, the scalars with the last
        one. waiting: a merge is still running: scalars flushed meanwhile wait for its block."""
        self._held_scalars += list(scalars)
        ready, self._ready = self._ready, []
        if not ready:
            if waiting or not self._held_scalars:
                return []
            empty = self._empty_block()
            empty.seq0 = self._seq
            ready = [empty]
        out = [(b, []) for b in ready]
        out[-1] = (ready[-1], self._held_scalars)
        self._held_scalars = []
        return out

    def drop_ready(self) -> None:
        """Forgets the blocks queued for exporters (a record hook has none)."""
        self._ready.clear()

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
        if self.merged:  # merged blocks: the ranks with a NaN/Inf
            mask = np.concatenate([b.nonfinite_mask if b.nonfinite_mask is not None else
                                   np.zeros(len(b), dtype=np.int64) for b in self.blocks])
        return module, kind, steps, stats, mask

    def arrow_table(self, run_info: dict):
        """Every kept block as one pyarrow.Table (runlog.schema), each block's table built once."""
        for b in self.blocks[len(self._tables):]:
            self._tables.append(schema.block_table(b))
        return schema.with_run_info(schema.concat(self._tables[:len(self.blocks)]), run_info)
