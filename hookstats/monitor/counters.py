"""What a Monitor counts beside its records: what it saw and did not record, and what it could not merge or export
in time. `Monitor.counters` is a snapshot; each field is also a Monitor property of the same name."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


def _counter(doc: str, default=0):
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class Counters:
    """A snapshot of a Monitor's counters (`Monitor.counters`); each field is documented as the Monitor property
    of the same name."""

    skipped: int = _counter(
        "Non-floating tensors (token ids, masks) and meta tensors (a shape-inference forward) the hooks saw and did "
        "not record.")
    unrecorded_grad_outputs: int = _counter(
        "backward_pre slots left unrecorded because their output could not carry an edge of its own (a tuple "
        "subclass the forward hook could not rebuild with the slot's alias in place; Note [grad_output by tensor "
        "hooks] in hookstats/monitor/hooks.py): counted here and in summary(), never recorded with a wrong value.")
    dropped_replays: int = _counter(
        "Replays of a captured CUDA graph whose rows were overwritten before a flush read them (a captured step "
        "keeps its last `slots` replays; Note [monitor graph replays] in csrc/monitor/recorder.h).")
    merge_failures: int = _counter(
        "Flushes whose records could not be merged across ranks (Note [merging records across ranks]): each raised "
        "MergeError on every rank, and its records were dropped (`dropped_records` counts this rank's).")
    dropped_records: int = _counter("This rank's records in the flushes counted by merge_failures.")
    replica_mismatches: int = _counter("Merged records of replicated grads (DDP's) that were not the same on every "
                                       "rank.")
    export_waits: int = _counter("How many flushes waited for the export queue (the exporters were `export_queue` "
                                 "flushes behind).")
    export_wait_seconds: float = _counter("The training thread's total time in those waits.", 0.0)


def counter_property(name: str) -> property:
    """A read-only Monitor property: its counter `name` (documented as that field is)."""
    doc = next(f.metadata["doc"] for f in fields(Counters) if f.name == name)

    def get(self):
        return getattr(self.counters, name)

    get.__name__, get.__doc__ = name, doc
    return property(get, doc=doc)
