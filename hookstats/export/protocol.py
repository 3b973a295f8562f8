"""What an exporter is: the `Exporter` protocol every hookstats writer implements, and the smaller `RecordWriter`
form a user's own exporter may take instead.

A Monitor hands each flush to its exporters on its export thread (Note [export off the training thread] in
hookstats/monitor/export_thread.py): `begin(run_info)` once when the Monitor attaches, `write_block(block, scalars)`
per flush, and at detach, on the training thread after the last flush was written, the optional `end(info)` (what
the run learned by its end: the features' run_end_info(), e.g. nonfinite_ops=True's first non-finite op) then
`close()`. A `Block` is the flush's columns (hookstats.monitor.block.Block: `len(block)`,
`block.stats` [rows, 13], `block.column("module")`, `block.iter_records()` for record dicts); `scalars` are dicts
with seq, step, tag and value.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from ..monitor.block import Block


@runtime_checkable
class Exporter(Protocol):
    """The columnar exporter: JSONLWriter, ParquetWriter, TensorBoardWriter and WandbWriter implement it."""

    def begin(self, info: dict) -> None:
        """The run's header (Monitor.run_info(): histogram spec, statistics fields, kinds, modules, versions)."""

    def write_block(self, block: "Block", scalars: Sequence[dict] = ()) -> None:
        """One flush: its records as columns, and the scalars logged since the last flush."""

    def close(self) -> None:
        """The Monitor detached: write what is buffered and release files."""

    # Optional: `end(info: dict) -> None`, called by detach() before close() when a feature reported something at
    # the run's end (JSONLWriter writes a "run_end" line, ParquetWriter the header's "end"; both read back as
    # read_run(path).info["end"]). Not part of the runtime check, so exporters without it stay Exporters.


@runtime_checkable
class RecordWriter(Protocol):
    """The smallest exporter a user can write: `write(records, scalars)` with record dicts (Monitor.records()'s
    form). `begin` and `close`, when present, are called as for an Exporter."""

    def write(self, records: Sequence[dict], scalars: Sequence[dict] = ()) -> None:
        """One flush's records and scalars."""


def is_exporter(obj) -> bool:
    """Whether a Monitor can hand flushes to obj: an Exporter, or anything with write_block or write."""
    return callable(getattr(obj, "write_block", None)) or callable(getattr(obj, "write", None))
