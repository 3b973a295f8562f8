"""A Monitor's exporters, run on one background thread (Note [export off the training thread]).

Note [export off the training thread]
A flush copies the device rows to the host (that copy stays on the training thread: it is what frees the device
rows) and hands the resulting Block and scalars to this thread through a bounded queue, then returns. The thread
calls each exporter in order: `write_block(block, scalars)` when it has one (the columnar entry point: hookstats'
JSONL, Parquet, TensorBoard and W&B writers), else `write(records, scalars)` (the dicts are built here, off
the training thread). Flushes are written in the order they were made, one at a time.

Back-pressure: when the exporters fall behind by `maxsize` flushes, the flush waits for a free place (it never
drops data); each such wait is counted (`waits`, `wait_seconds`; Monitor.export_waits). An exporter's error is
kept and raised at the next flush (before anything new is taken from the device, so no rows are lost) or at
drain() / detach(); the other exporters keep receiving the flushes. `drain()` waits until everything handed over
was written; Monitor.detach() drains, closes the exporters and stops the thread, and an atexit hook drains every
live thread at interpreter exit (errors then go to stderr: there is no caller left to raise to).
"""
from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
import traceback
import weakref
from typing import Sequence

_LIVE: "weakref.WeakSet[ExportThread]" = weakref.WeakSet()


class ExportError(RuntimeError):
    """An exporter failed on the export thread; raised at the next flush / drain / detach (the original error is
    its __cause__)."""


def records_of(block) -> list:
    """The block's rows as record dicts, not kept on the block (`Block.iter_records`)."""
    return list(block.iter_records())


def deliver(exporter, block, scalars) -> None:
    wb = getattr(exporter, "write_block", None)
    if wb is not None:
        wb(block, scalars)
    else:
        exporter.write(records_of(block), scalars)


def _lower_priority() -> None:
    """Linux: this thread (not the process) at a lower CPU priority, so that on a busy machine the training's
    threads (and PyTorch's intra-op workers, which spin while they wait) run first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))
    except (AttributeError, OSError, PermissionError):
        pass


class ExportThread:
    def __init__(self, exporters: Sequence, maxsize: int = 8):
        self.exporters = list(exporters)
        self.maxsize = maxsize
        self.waits = 0
        self.wait_seconds = 0.0
        self.written = 0  # flushes written by every exporter
        self._q: queue.Queue = queue.Queue(maxsize)
        self._errors: list = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hookstats-export", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _run(self) -> None:
        _lower_priority()
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                block, scalars = item
                for e in self.exporters:
                    try:
                        deliver(e, block, scalars)
                    except BaseException as ex:  # kept for the training thread: never lost, never kills the thread
                        with self._lock:
                            self._errors.append((e, ex))
                self.written += 1
            finally:
                self._q.task_done()

    def submit(self, block, scalars) -> None:
        """Hands a flush over; waits (counted) only when `maxsize` flushes are already waiting."""
        if self._closed:
            raise RuntimeError("hookstats: the Monitor's export thread is closed (detach() was called)")
        item = (block, scalars)
        try:
            self._q.put_nowait(item)
        except queue.Full:
            t0 = time.perf_counter()
            self._q.put(item)
            self.waits += 1
            self.wait_seconds += time.perf_counter() - t0

    def take_errors(self) -> list:
        """[(exporter, error, "write")] of the exporter errors since the last call, taken."""
        with self._lock:
            errs, self._errors = self._errors, []
        return [(e, ex, "write") for e, ex in errs]

    def raise_pending(self) -> None:
        """Raises the first exporter error since the last call (ExportError, the error as its cause)."""
        errs = self.take_errors()
        if errs:
            e, ex, _ = errs[0]
            more = f" ({len(errs) - 1} more exporter error(s) since)" if len(errs) > 1 else ""
            raise ExportError(f"hookstats.Monitor: exporter {type(e).__name__} failed on the export thread: "
                              f"{type(ex).__name__}: {ex}{more}") from ex

    def drain(self) -> None:
        """Waits until every flush handed over has been written (not raising)."""
        if self._thread.is_alive():
            self._q.join()

    def close(self) -> None:
        """Drains and stops the thread."""
        if self._closed:
            return
        self.drain()
        self._closed = True
        self._q.put(None)
        self._thread.join()
        _LIVE.discard(self)

    def stop_nowait(self) -> None:
        """Stops the thread after it wrote what it has, without waiting (a dropped Monitor's)."""
        if not self._closed:
            self._closed = True
            self._q.put_nowait(None)

    def _report_at_exit(self) -> None:
        self.drain()
        with self._lock:
            errs, self._errors = self._errors, []
        for e, ex in errs:
            print(f"hookstats.Monitor: exporter {type(e).__name__} failed on the export thread:", file=sys.stderr)
            traceback.print_exception(type(ex), ex, ex.__traceback__, file=sys.stderr)


@atexit.register
def _drain_all() -> None:  # daemon threads still run while atexit hooks do: what was handed over gets written
    for t in list(_LIVE):
        try:
            t._report_at_exit()
        except Exception:
            pass
