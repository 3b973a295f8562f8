"""hookstats.Monitor: statistics of every matching layer, every step, into device buffers, read back when you choose.

The data path, each stage built whole by its constructor here: hooks (attach.py: hooks.py's C++ callables of
csrc/monitor/) -> site rows of device buffers (recorder.py; Note [monitor sites] in csrc/monitor/recorder.h) ->
flush: one host copy per buffer, a columnar Block (block.py) -> with a process group, merged across ranks
(merging.py) -> kept and numbered (store.py) -> records(), summary(), first_nonfinite(), the export thread. The options are config.py's MonitorConfig; what a Monitor records
besides its sites comes from features (feature.py, Note [monitor features]), none of which this module knows.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .._ops import STATS_FIELDS
from .._select import Selection, Site
from .._version import __version__
from ..distributed import resolve_group
from . import lifecycle as _lifecycle
from .attach import attach_grad_hooks, attach_module_hooks
from .block import LazyRecords
from .config import MONITOR_KINDS, MonitorConfig
from .counters import Counters, counter_property
from .export_thread import ExportThread
from .feature import FeatureAccess, FeatureContext, build_features, claim, release
from .merge import MergeError
from .merging import MergeSession
from .recorder import Recorder, SeveralDevices
from .scalars import ScalarBuffer
from .store import Store
from .summary import format_summary, summary_from_columns

__all__ = ["MONITOR_KINDS", "Monitor"]


def _check_materialized(model: torch.nn.Module) -> None:
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise ValueError(
                    f"hookstats.Monitor: the model's {kind} {name!r} is on the meta device (no data: a model built "
                    "under torch.device('meta') or init_empty_weights()); materialize it first (model.to_empty("
                    "device=...), then initialise or load its weights), then attach the Monitor")


class Monitor(FeatureAccess):
    """Statistics of every matching layer, every step (or every `every` steps), into device buffers.

    `Monitor(model, **options)` or `Monitor(model, config, **options)`: the options are the fields of
    hookstats.MonitorConfig (grouped as selection, cadence, payload, output, distributed; each documented there and
    in docs/guide/monitor.md); `Monitor.config` is the checked copy.

    Each hook call is one C++ call: the stats kernel runs once per tensor into the tensor's row of a device buffer
    (Note [monitor sites]); nothing is read back until `flush()` / `records()`. Steps skipped by `every` launch
    nothing; `pause()` / `resume()` record nothing in between (an evaluation pass). Non-floating and meta tensors are
    skipped and counted (`skipped`); a model whose parameters are on the meta device is refused (materialize it
    first). A forward that activation checkpointing recomputes during the backward is recorded once, by its first
    run (hookstats._owned_hooks.in_backward()); pickling or copying the model leaves the hooks out (Note [hooks that
    stay with their owner]). The "grad" kind records each parameter's .grad after each accumulation, or, with
    `optimizer=`, once per step at the optimizer's step, or, with `optimizer="manual"`, when `record_grads()` is
    called (a framework's callback, after it clipped the grads: hookstats.integrations).

    Exporters receive each flush's new records on one background thread (Note [export off the training thread]): a
    flush hands its copied block over and returns, waiting only when `export_queue` flushes are still unwritten
    (export_waits); an exporter's error is raised at the next flush(), drain() or detach(). `log(tag, value)`
    records a scalar beside the statistics, without a host sync.

    Features (Note [monitor features]) add their own results: channel_stats= (`channel_results()`), per_sample=True
    (`top_samples(k)`, `first_nonfinite_sample()`, `sample_norms()`, `coverage()`), locations=True (each record
    names its largest |x| and first NaN/Inf element; `first_nonfinite()` then reads "step 90, module embed, kind
    forward, index 0, element (3, 17, 250)"), and `features=[...]` your own; `feature(name)` and `feature_results()`
    read any of them.

    With process_group= flush() merges every rank's records in one all_gather (Note [merging records across ranks];
    docs/distributed.md) and becomes a collective every rank calls at the same points (step() with flush_every,
    which only starts it, flush(), detach()); records()/summary()/first_nonfinite() then read what was flushed
    without starting one. A merged record names the ranks that wrote it (`ranks`), those whose tensor held a NaN/Inf
    (`nonfinite_ranks`) and, with locations, the element's rank (`location_rank`); what cannot be merged raises
    MergeError on every rank and is dropped (merge_failures). The grad kind under DDP records the optimizer's
    (averaged) grads once (Note [grad records across ranks]). Exporters write on `export_rank` only. DTensor tensors
    (FSDP2's sharded parameters and grads) are recorded by their local shard.
    """

    def __init__(self, model: torch.nn.Module, config: Optional[MonitorConfig] = None, **options):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"hookstats.Monitor needs a torch.nn.Module, got {type(model).__name__}")
        _check_materialized(model)
        self.config = cfg = MonitorConfig.from_options(config, **options).checked()
        self.every, self.flush_every, self.histogram_every = cfg.every, cfg.flush_every, cfg.histogram_every
        self.kinds, self.exporters, self.export_queue = cfg.kinds, cfg.exporters, cfg.export_queue
        self._features = build_features(cfg)
        buffer_options: dict = {}  # set by features (configure)
        for f in self._features:
            configure = getattr(f, "configure", None)
            if configure is not None:
                configure(buffer_options)
        # the data path: recorder (device rows) -> [merge session: every rank's rows] -> store (blocks) -> exporters
        self._rec = Recorder(cfg.histogram, cfg.slots, **buffer_options)
        self._merge: Optional[MergeSession] = None
        self.rank = 0
        self._exporting = True
        if cfg.process_group is not None:
            self._merge = MergeSession(resolve_group(cfg.process_group), self._rec)
            self.rank = dist.get_rank(self._merge.group)
            self._exporting = self.rank == cfg.export_rank
        self._store = Store(self._rec.empty_block, cfg.keep_records, merged=self._merge is not None)
        self._scalars = ScalarBuffer(keep=cfg.keep_records)
        self._step = cfg.start_step
        self._recorded_steps = -(-cfg.start_step // self.every)  # steps recorded so far (histogram_every counts these)
        self._step_flags = (False, False)
        self._handles: list = []
        self._model = model
        self._optimizer = cfg.optimizer
        self._export: Optional[ExportThread] = None

        self.selection = Selection(cfg.include, cfg.exclude)
        self._wanted = self.selection.matches
        self.modules = [name for name, _ in self.selection.modules(model)]
        self._attached: list = []  # features whose attach ran (each detached once, even if construction fails)
        try:
            self._attach(model)
            ctx = FeatureContext(model, self.selection, cfg.include, cfg.exclude, weakref.proxy(self))
            for f in self._features:
                claim(f)
                self._attached.append(f)  # detached again if its own attach fails halfway
                f.attach(ctx)
            self._begin_step()
            info = self.run_info()
            for e in self._active_exporters():
                begin = getattr(e, "begin", None)
                if begin is not None:
                    begin(info)
        except BaseException:  # no half-built Monitor left recording through its hooks
            self._detach_hooks()
            raise
        if self._active_exporters():
            self._export = ExportThread(self._active_exporters(), self.export_queue)
            _lifecycle.register(self, self._save_at_exit)  # Note [what survives a terminated run]

    # -- hooks ----------------------------------------------------------------------------------------------------
    def _attach(self, model: torch.nn.Module) -> None:
        self._unplaced = [0]  # grad_output aliases that could not be put in place (hooks.replace_outputs)
        attach_module_hooks(model, self._rec, self.kinds, self._wanted, self._handles, self._unplaced)
        self._params: list = []
        if Site.GRAD in self.kinds:
            me = weakref.ref(self)  # the optimizer or DDP must not keep a dropped Monitor (and its model) alive

            def record_grads() -> None:
                mon = me()
                if mon is not None:
                    mon.record_grads()

            self._params = attach_grad_hooks(model, self._rec, self._wanted, self._merge and self._merge.group,
                                             self._optimizer, record_grads, self._handles)

    def record_grads(self) -> None:
        """Records every monitored parameter's current .grad (kind "grad") under the current step: one C++ call,
        one kernel launch per gradient. Called at the optimizer's step when the Monitor was given `optimizer=`; with
        `optimizer="manual"` (a training framework's callback, after it clipped the grads) only when called. With a
        process group and `optimizer=`, plain-tensor grads are DDP's replicated ones: merged once, not as shards
        (Note [grad records across ranks]); DTensor grads are merged from their shards."""
        if Site.GRAD not in self.kinds:
            raise RuntimeError("hookstats.Monitor.record_grads needs the 'grad' kind (kinds=(..., 'grad'))")
        if self._model is None or not self._rec.active:
            return
        self._rec.record_params([(hid, p.grad) for hid, p in self._params if p.grad is not None])

    def _active_exporters(self) -> list:
        return self.exporters if self._exporting else []

    @property
    def histogram(self):
        """The Histogram recorded with each tensor, or None."""
        return self._rec.histogram

    def run_info(self) -> dict:
        """What exporters need to read the records: histogram spec, statistics fields, kinds, modules, versions."""
        h = self._rec.histogram
        hist = None if h is None else ({"kind": "exp"} if h.kind == "exp" else
                                       {"kind": "range", "bins": h.bins, "lo": h.lo, "hi": h.hi})
        info = {"hookstats": __version__, "torch": torch.__version__, "histogram": hist,
                "stats_fields": list(STATS_FIELDS), "kinds": list(self.kinds), "modules": list(self.modules),
                "every": self.every, "histogram_every": self.histogram_every, "start_step": self.config.start_step}
        if self._merge is not None:  # records merged across ranks: the ranks columns (runlog.schema)
            info["merged"] = True
        for f in self._features:
            extra = getattr(f, "run_info", None)
            if extra is not None:
                info.update(extra())
        return info

    # -- control --------------------------------------------------------------------------------------------------
    def _begin_step(self) -> None:
        active = self._model is not None and self._step % self.every == 0
        hist_on = self._recorded_steps % self.histogram_every == 0
        self._step_flags = (active, hist_on)
        self._rec.begin_step(self._step, active, hist_on)
        if active:
            self._recorded_steps += 1

    def pause(self) -> None:
        """Records nothing until resume() or the next step() (an evaluation pass between two training steps);
        log() still logs."""
        self._rec.begin_step(self._step, False, False)

    def resume(self) -> None:
        """Records the current step again after pause(), as it was recording before."""
        self._rec.begin_step(self._step, self._step_flags[0] and self._model is not None, self._step_flags[1])

    def step(self) -> None:
        """Ends a step: the next hooks record under step + 1 (and only every `every` steps). With flush_every=N,
        every N-th call flushes."""
        recorded = self._rec.active
        for f in self._features:
            f.on_step(self._step, recorded)
        self._step += 1
        self._begin_step()
        if self.flush_every is not None and self._step % self.flush_every == 0:
            if self._merge is not None:  # the merge's all_gather runs while the next steps do
                self._flush_block(async_merge=True)
                if self._export is not None:
                    self._export.raise_pending()
            else:
                self.flush()

    def log(self, tag: str, value) -> None:
        """Records a scalar under the current step: a one-element tensor (copied on its device, no host sync:
        `mon.log("loss", loss)`, `mon.log("grad_norm", clip_grad_norm_(...))`) or a number. Read back with
        `scalars()`; exporters write it as a scalar named tag. Logged even on steps skipped by `every`."""
        if not isinstance(tag, str) or not tag:
            raise TypeError(f"hookstats.Monitor.log needs a non-empty str tag, got {tag!r}")
        if self._model is None:
            raise RuntimeError("hookstats.Monitor.log after detach(): the monitor is closed")
        self._scalars.add(value, self._step, tag)

    @property
    def current_step(self) -> int:
        """The step the hooks record under now (start_step + the step() calls so far)."""
        return self._step

    @property
    def counters(self) -> Counters:
        """A snapshot of what this Monitor counts beside its records (hookstats.monitor.counters.Counters): tensors
        skipped, grad_output slots left unrecorded, graph replays dropped, flushes that could not be merged, export
        waits. Each is also a property of its own name."""
        m, e = self._merge, self._export
        return Counters(
            skipped=self._rec.skipped, unrecorded_grad_outputs=self._unplaced[0],
            dropped_replays=self._rec.dropped_replays,
            merge_failures=m.merge_failures if m else 0, dropped_records=m.dropped_records if m else 0,
            replica_mismatches=m.replica_mismatches if m else 0,
            export_waits=e.waits if e else 0, export_wait_seconds=e.wait_seconds if e else 0.0)

    skipped = counter_property("skipped")
    unrecorded_grad_outputs = counter_property("unrecorded_grad_outputs")
    dropped_replays = counter_property("dropped_replays")
    merge_failures = counter_property("merge_failures")
    dropped_records = counter_property("dropped_records")
    replica_mismatches = counter_property("replica_mismatches")
    export_waits = counter_property("export_waits")
    export_wait_seconds = counter_property("export_wait_seconds")

    def flush(self) -> list[dict]:
        """Copies the recorded rows to the host: one copy per buffer (non-blocking into pinned memory on CUDA), and
        hands the new block and scalars to the export thread (Note [export off the training thread]), waiting only
        when `export_queue` flushes are still unwritten. Then raises an exporter error from an earlier flush, if any
        (ExportError; this flush's rows were handed over before). Returns the new records (dicts, built when
        read)."""
        block = self._flush_block()
        if self._export is not None:
            self._export.raise_pending()
        return LazyRecords(block)

    def _flush_block(self, async_merge: bool = False):
        """The data path's flush: the recorder's rows as a Block, merged across ranks with a process group (with
        async_merge only started: it ends at the next flush or read), kept in the store, and everything the store
        got handed to the exporters with the scalars. Returns the new (merged) Block, or None."""
        try:
            if self._merge is None:
                return self._store.add(self._rec.take())
            return self._merge_block(async_merge)
        finally:  # a failed merge still hands over the scalars and the blocks merged before it
            self._hand_over(self._scalars.flush())

    def _merge_block(self, async_merge: bool):
        """Note [merging records across ranks]: this flush's gather, after the one a previous flush started."""
        try:
            block = self._rec.take(one_device=True)
        except SeveralDevices:  # this rank still takes part in the gather: every rank raises
            block = None
        err = out = None
        try:
            self._finish_merge(collective=True)  # the previous flush's gather, if it was started asynchronously
        except MergeError as e:
            err = e
        self._merge.start(block, async_merge)
        if not async_merge:
            try:
                out = self._finish_merge(collective=True)
            except MergeError as e:
                err = err or e
        if err is not None:
            raise err
        return out

    def _finish_merge(self, collective: bool):
        merged = self._merge.finish(collective)
        return self._store.add(merged) if merged is not None else None

    def _hand_over(self, scalars: list = ()) -> None:
        """Gives the export thread every flushed (merged) block not yet given, with the scalars flushed with it."""
        waiting = self._merge is not None and self._merge.pending
        for block, sc in self._store.take_ready(scalars, waiting):
            if self._export is not None and (len(block) or sc):
                self._export.submit(block, sc)

    def drain(self) -> None:
        """Waits until the exporters have written every flush handed to them, then raises an exporter error, if any.
        (Does not flush: call flush() first for the rows recorded since the last one.)"""
        if self._export is not None:
            self._export.drain()
            self._export.raise_pending()

    def table(self):
        """Every record flushed so far as a pyarrow.Table (hookstats.runlog.schema: step, seq, the site columns
        module / kind / index / dtype dictionary-encoded, one column per statistic, histogram_{L} fixed-size list
        columns), built from the flushed columns (no dict per record). Flushes first (without a process group).
        With keep_records=False only what is kept (nothing). Needs pyarrow."""
        self._read()
        return self._store.arrow_table(self.run_info())

    def to_pandas(self):
        """table() as a pandas.DataFrame (site columns as categoricals). Needs pandas."""
        try:
            import pandas  # noqa: F401
        except ImportError as e:
            raise ImportError("hookstats.Monitor.to_pandas needs pandas: pip install pandas") from e
        return self.table().to_pandas()

    def _read(self) -> None:
        if self._merge is None:
            if self._model is not None:
                self.flush()
        elif self._merge.pending:  # a merge started by step(): ends here unless it must be sent again
            try:
                self._finish_merge(collective=False)
            finally:
                self._hand_over()

    def scalars(self) -> list[dict]:
        """Every scalar logged with log() so far: dicts with seq, step, tag and value, in call order. Flushes first
        (without a process group). Scalars are this rank's: they are not merged across ranks."""
        self._read()
        return list(self._scalars.flushed)

    def records(self) -> list[dict]:
        """Every record so far, in the order the hooks ran (Note [grad_output by tensor hooks] says where a
        grad_output record's place differs from a full backward pre-hook's): dicts with
        seq, step, module, kind, index (the tensor's position in what the hook saw, None entries counted), dtype,
        stats (a dict of the 13 STATS_FIELDS) and histogram (a list of counts, or None). Flushes first (without a
        process group: with one, call flush() on every rank). Built from the flushed columns when called."""
        self._read()
        return self._store.records()

    def first_nonfinite(self) -> Optional[dict]:
        """The first record (by step and hook order) whose tensor held a NaN or Inf: NaN hunting without
        torch.autograd.detect_anomaly. None if there was none. With locations=True it names the element too
        (`first_nonfinite_index`; `str(record)` reads "step 90, module embed, kind forward, index 0, element
        (3, 17, 250)"). A feature that finds where NaN/Inf values began (nonfinite_ops=True: the first ATen op that
        made one, with its phase, autograd node and element) adds that as the record's "origin"; when no record
        held one (the op ran in the optimizer step, or in a module not monitored), that origin is returned
        itself."""
        self._read()
        rec = self._store.first_nonfinite()
        for f in self._features:
            find = getattr(f, "nonfinite_origin", None)
            origin = find() if find is not None else None
            if origin is not None:
                if rec is None:
                    return origin
                rec["origin"] = origin
                break
        return rec

    def summary_rows(self) -> list[dict]:
        """One row per (module, kind): hookstats.monitor.summary_rows() of the records, from their columns."""
        self._read()
        return summary_from_columns(*self._store.columns())

    def summary(self) -> str:
        """The per-layer table of summary_rows(), as text; then the backward_pre slots left unrecorded, if any, and
        each feature's summary (per_sample=True: the per-sample coverage)."""
        text = format_summary(self.summary_rows())
        if self._unplaced[0]:
            text += (f"\n{self._unplaced[0]} backward_pre slot(s) not recorded: an output container that could not be "
                     "rebuilt with the slot's own edge (Monitor.unrecorded_grad_outputs)")
        for f in self._features:
            extra = getattr(f, "summary", None)
            if extra is not None:
                text += "\n" + extra()
        return text

    def detach(self) -> None:
        """Removes every hook and drops the buffers and the reference to the model. Unflushed records are flushed
        first (and handed to the exporters); the export thread is drained and stopped, the exporters closed, and an
        exporter error raised (ExportError). Records already flushed stay readable."""
        exp, close_errors = self._export, []
        try:
            if self._model is not None:
                self._flush_block()
        finally:  # even when the flush fails (a rank mismatch), the queue drains, the hooks go and writers close
            if self._model is not None:  # each exporter closed whatever another raises; raised once, below
                end_info, end_errors = self._run_end_info()
                close_errors = end_errors + _lifecycle.close_exporters(exp, self._active_exporters(), end_info)
            _lifecycle.unregister(self)
            self._detach_hooks()
        _lifecycle.raise_detach_errors(exp, close_errors)

    def _save_at_exit(self, close: bool) -> None:
        """lifecycle's call (Note [what survives a terminated run]): at SIGTERM (everything recorded handed to the
        exporters and written) and at interpreter exit (close: detached too). With a process group nothing is
        flushed (a flush is a collective the other ranks may not reach): what was handed over is written."""
        if self._merge is None:
            if close:
                self.detach()
            else:
                self.flush()
                self.drain()
        elif close:
            errors = _lifecycle.close_exporters(self._export, self._active_exporters())
            self._detach_hooks()
            _lifecycle.raise_detach_errors(None, errors)
        elif self._export is not None:
            self._export.drain()

    def _run_end_info(self) -> tuple:
        """({name: value} of every feature's optional run_end_info(), [(feature, error)]): what the run learned by
        its end, which detach() hands to the exporters' end(info) before closing them."""
        info, errors = {}, []
        for f in self._features:
            end = getattr(f, "run_end_info", None)
            if end is not None:
                try:
                    info.update(end() or {})
                except Exception as ex:  # noqa: BLE001 -- raised once by detach(), after everything is closed
                    errors.append((f, ex))
        return info, errors

    def _detach_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        attached, self._attached = self._attached, []
        try:
            for f in attached:
                f.detach()
        finally:
            for f in attached:
                release(f)
        # A graph built before detach() still calls the hooks it captured (PyTorch snapshots a module's backward
        # hooks at forward time, and tensor hooks live in the graph): they must record nothing from now on.
        self._rec.release()
        self._scalars.release()
        self._model = None
        self._params = []

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def __del__(self):
        try:
            if self._export is not None:  # the thread writes what it has, then ends
                self._export.stop_nowait()
        except Exception:
            pass
        try:
            for h in self._handles:
                h.remove()
            self._rec.release()
        except Exception:
            pass
        for f in getattr(self, "_attached", ()):  # a dropped Monitor's features unhook too, and may serve again
            try:
                f.detach()
            except Exception:
                pass
            release(f)
