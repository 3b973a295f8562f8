"""hookstats.Monitor: statistics of every matching layer, every step, into device buffers, read back when you choose.

The data path: hooks (hooks.py, C++ callables of csrc/monitor/) -> site rows of device buffers (buffers.py; Note
[monitor sites] in csrc/monitor/recorder.h) -> flush: one host copy per buffer, a columnar Block (block.py) ->
records(), summary(), first_nonfinite(), exporters. The options are config.py's MonitorConfig; what a Monitor records
besides its sites comes from features (feature.py, Note [monitor features]), none of which this module knows.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .._ops import STATS_FIELDS
from .._owned_hooks import register
from .._select import Selection
from .._version import __version__
from ..distributed import after_ddp_allreduce, grad_mode, resolve_group
from ..distributed import is_dtensor as _is_dtensor
from ..runlog import schema as _table
from . import hooks as _hooks
from . import lifecycle as _lifecycle
from .block import LazyRecords
from .buffers import Buffers
from .config import MONITOR_KINDS, MonitorConfig
from .export_thread import ExportThread
from .feature import FeatureAccess, FeatureContext, build_features, claim, release
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
        self._buf = Buffers(cfg.histogram, cfg.slots, **buffer_options)
        self._buf.keep = cfg.keep_records
        self.rank = 0
        self._exporting = True
        if cfg.process_group is not None:
            self._buf.group = resolve_group(cfg.process_group)
            self.rank = dist.get_rank(self._buf.group)
            self._exporting = self.rank == cfg.export_rank
        self._step = cfg.start_step
        self._recorded_steps = -(-cfg.start_step // self.every)  # steps recorded so far (histogram_every counts these)
        self._step_flags = (False, False)
        self._handles: list = []
        self._model = model
        self._optimizer = cfg.optimizer
        self._export: Optional[ExportThread] = None
        self._tables: list = []  # table() cache: the Arrow table of each kept block

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
            _lifecycle.register(self)  # SIGTERM and interpreter exit (Note [what survives a terminated run])

    # -- hooks ----------------------------------------------------------------------------------------------------
    def _attach(self, model: torch.nn.Module) -> None:
        b, rec, mid, kinds = self._buf, self._buf.rec, self._buf.id, self.kinds
        self._unplaced = [0]  # grad_output aliases that could not be put in place (hooks.replace_outputs)
        for name, mod in model.named_modules():
            if not self._wanted(name, mod):
                continue
            if "forward_pre" in kinds:
                self._handles.append(register(mod, "register_forward_pre_hook",
                                              _hooks.forward_pre_hook(rec, mid, b.hook(name, "forward_pre"))))
            if "forward" in kinds or "backward_pre" in kinds:
                fwd = b.hook(name, "forward") if "forward" in kinds else -1
                grad = b.hook(name, "backward_pre") if "backward_pre" in kinds else -1
                hook, pre_hook = _hooks.forward_hook(rec, mid, fwd, grad, self._unplaced, mod)
                if pre_hook is not None:
                    self._handles.append(register(mod, "register_forward_pre_hook", pre_hook))
                self._handles.append(register(mod, "register_forward_hook", hook))
            if "backward" in kinds:
                self._handles.append(register(mod, "register_full_backward_hook",
                                              _hooks.backward_hook(rec, mid, b.hook(name, "backward"))))
        self._params: list = []
        if "grad" in kinds:
            ddp = grad_mode(model, b.group, self._optimizer)  # Note [grad records across ranks]
            for pname, p in model.named_parameters():
                if p.requires_grad and self._wanted(pname):
                    hid = b.hook(pname, "grad", replicated=ddp is not None and not _is_dtensor(p))
                    self._params.append((hid, p))
                    if self._optimizer is None and ddp != "end_of_backward":
                        self._handles.append(p.register_post_accumulate_grad_hook(_hooks.grad_hook(rec, mid, hid)))
            if self._optimizer is not None and self._optimizer != "manual":
                self._handles.append(self._optimizer.register_step_pre_hook(self._optimizer_hook()))
            elif ddp == "end_of_backward":
                self._handles.append(after_ddp_allreduce(model, self._weak_record_grads()))

    def _weak_record_grads(self):
        me = weakref.ref(self)  # DDP must not keep a dropped Monitor (and its buffers) alive
        return lambda: me() is not None and me().record_grads()

    def _optimizer_hook(self):
        me = weakref.ref(self)  # the optimizer must not keep a dropped Monitor (and its model) alive

        def hook(optimizer, args, kwargs):
            mon = me()
            if mon is not None:
                mon.record_grads()
            return None

        return hook

    def record_grads(self) -> None:
        """Records every monitored parameter's current .grad (kind "grad") under the current step: one C++ call,
        one kernel launch per gradient. Called at the optimizer's step when the Monitor was given `optimizer=`; with
        `optimizer="manual"` (a training framework's callback, after it clipped the grads) only when called. With a
        process group and `optimizer=`, plain-tensor grads are DDP's replicated ones: merged once, not as shards
        (Note [grad records across ranks]); DTensor grads are merged from their shards."""
        if "grad" not in self.kinds:
            raise RuntimeError("hookstats.Monitor.record_grads needs the 'grad' kind (kinds=(..., 'grad'))")
        if self._model is None or not self._buf.rec.active:
            return
        self._buf.rec.record_params([(hid, p.grad) for hid, p in self._params if p.grad is not None])

    def _active_exporters(self) -> list:
        return self.exporters if self._exporting else []

    @property
    def histogram(self):
        """The Histogram recorded with each tensor, or None."""
        return self._buf.histogram

    def run_info(self) -> dict:
        """What exporters need to read the records: histogram spec, statistics fields, kinds, modules, versions."""
        h = self._buf.histogram
        hist = None if h is None else ({"kind": "exp"} if h.kind == "exp" else
                                       {"kind": "range", "bins": h.bins, "lo": h.lo, "hi": h.hi})
        info = {"hookstats": __version__, "torch": torch.__version__, "histogram": hist,
                "stats_fields": list(STATS_FIELDS), "kinds": list(self.kinds), "modules": list(self.modules),
                "every": self.every, "histogram_every": self.histogram_every, "start_step": self.config.start_step}
        if self._buf.group is not None:  # records merged across ranks: the ranks columns (runlog.schema)
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
        self._buf.rec.begin_step(self._step, active, hist_on)
        if active:
            self._recorded_steps += 1

    def pause(self) -> None:
        """Records nothing until resume() or the next step() (an evaluation pass between two training steps);
        log() still logs."""
        self._buf.rec.begin_step(self._step, False, False)

    def resume(self) -> None:
        """Records the current step again after pause(), as it was recording before."""
        self._buf.rec.begin_step(self._step, self._step_flags[0] and self._model is not None, self._step_flags[1])

    def step(self) -> None:
        """Ends a step: the next hooks record under step + 1 (and only every `every` steps). With flush_every=N,
        every N-th call flushes."""
        recorded = self._buf.rec.active
        for f in self._features:
            f.on_step(self._step, recorded)
        self._step += 1
        self._begin_step()
        if self.flush_every is not None and self._step % self.flush_every == 0:
            if self._buf.group is not None:  # the merge's all_gather runs while the next steps do
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
        self._buf.scalars.add(value, self._step, tag)

    @property
    def current_step(self) -> int:
        """The step the hooks record under now (start_step + the step() calls so far)."""
        return self._step

    @property
    def skipped(self) -> int:
        """Non-floating tensors (token ids, masks) and meta tensors (a shape-inference forward) the hooks saw and did not
        record."""
        return self._buf.skipped

    @property
    def unrecorded_grad_outputs(self) -> int:
        """backward_pre slots left unrecorded because their output could not carry an edge of its own (a tuple
        subclass the forward hook could not rebuild with the slot's alias in place; Note [grad_output by tensor
        hooks] in hookstats/monitor/hooks.py): counted here and in summary(), never recorded with a wrong value."""
        return self._unplaced[0]

    @property
    def dropped_replays(self) -> int:
        """Replays of a captured CUDA graph whose rows were overwritten before a flush read them (a captured step
        keeps its last `slots` replays; Note [monitor graph replays] in csrc/monitor/recorder.h)."""
        return self._buf.dropped_replays

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
        try:
            block = self._buf.flush(async_merge)
        finally:  # a failed merge still hands over the scalars and the blocks merged before it
            self._hand_over(self._buf.scalars.flush(self._buf.keep))
        return block

    def _hand_over(self, scalars: list = ()) -> None:
        """Gives the export thread every flushed (merged) block not yet given, with the scalars flushed with it."""
        for block, sc in self._buf.take_ready(scalars):
            if self._export is not None and (len(block) or sc):
                self._export.submit(block, sc)

    @property
    def merge_failures(self) -> int:
        """Flushes whose records could not be merged across ranks (Note [merging records across ranks]): each
        raised MergeError on every rank, and its records were dropped (`dropped_records` counts this rank's)."""
        return self._buf.merge_failures

    @property
    def dropped_records(self) -> int:
        """This rank's records in the flushes counted by merge_failures."""
        return self._buf.dropped_records

    @property
    def replica_mismatches(self) -> int:
        """Merged records of replicated grads (DDP's) that were not the same on every rank."""
        return self._buf.replica_mismatches

    def drain(self) -> None:
        """Waits until the exporters have written every flush handed to them, then raises an exporter error, if any.
        (Does not flush: call flush() first for the rows recorded since the last one.)"""
        if self._export is not None:
            self._export.drain()
            self._export.raise_pending()

    @property
    def export_waits(self) -> int:
        """How many flushes waited for the export queue (the exporters were `export_queue` flushes behind)."""
        return self._export.waits if self._export is not None else 0

    @property
    def export_wait_seconds(self) -> float:
        """The training thread's total time in those waits."""
        return self._export.wait_seconds if self._export is not None else 0.0

    def table(self):
        """Every record flushed so far as a pyarrow.Table (hookstats.runlog.schema: step, seq, the site columns
        module / kind / index / dtype dictionary-encoded, one column per statistic, histogram_{L} fixed-size list
        columns), built from the flushed columns (no dict per record). Flushes first (without a process group).
        With keep_records=False only what is kept (nothing). Needs pyarrow."""
        self._read()
        blocks = self._buf.blocks
        for b in blocks[len(self._tables):]:
            self._tables.append(_table.block_table(b))
        return _table.with_run_info(_table.concat(self._tables[:len(blocks)]), self.run_info())

    def to_pandas(self):
        """table() as a pandas.DataFrame (site columns as categoricals). Needs pandas."""
        try:
            import pandas  # noqa: F401
        except ImportError as e:
            raise ImportError("hookstats.Monitor.to_pandas needs pandas: pip install pandas") from e
        return self.table().to_pandas()

    def _read(self) -> None:
        if self._buf.group is None:
            if self._model is not None:
                self.flush()
        elif self._buf._pending is not None:  # a merge started by step(): ends here unless it must be sent again
            try:
                self._buf.finish(collective=False)
            finally:
                self._hand_over()

    def scalars(self) -> list[dict]:
        """Every scalar logged with log() so far: dicts with seq, step, tag and value, in call order. Flushes first
        (without a process group). Scalars are this rank's: they are not merged across ranks."""
        self._read()
        return list(self._buf.scalars.flushed)

    def records(self) -> list[dict]:
        """Every record so far, in the order the hooks ran (Note [grad_output by tensor hooks] says where a
        grad_output record's place differs from a full backward pre-hook's): dicts with
        seq, step, module, kind, index (the tensor's position in what the hook saw, None entries counted), dtype,
        stats (a dict of the 13 STATS_FIELDS) and histogram (a list of counts, or None). Flushes first (without a
        process group: with one, call flush() on every rank). Built from the flushed columns when called."""
        self._read()
        return self._buf.records()

    def first_nonfinite(self) -> Optional[dict]:
        """The first record (by step and hook order) whose tensor held a NaN or Inf: NaN hunting without
        torch.autograd.detect_anomaly. None if there was none. With locations=True it names the element too
        (`first_nonfinite_index`; `str(record)` reads "step 90, module embed, kind forward, index 0, element
        (3, 17, 250)"). A feature that finds where NaN/Inf values began (nonfinite_ops=True: the first ATen op that
        made one, with its phase, autograd node and element) adds that as the record's "origin"; when no record
        held one (the op ran in the optimizer step, or in a module not monitored), that origin is returned
        itself."""
        self._read()
        rec = self._buf.first_nonfinite()
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
        return summary_from_columns(*self._buf.columns())

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
        self._buf.release()
        self._model = None
        self._params = []

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def __del__(self):
        try:
            exp = self._export
            if exp is not None and not exp._closed:  # the thread writes what it has, then ends
                exp._closed = True
                exp._q.put_nowait(None)
        except Exception:
            pass
        try:
            for h in self._handles:
                h.remove()
            self._buf.release()
        except Exception:
            pass
        for f in getattr(self, "_attached", ()):  # a dropped Monitor's features unhook too, and may serve again
            try:
                f.detach()
            except Exception:
                pass
            release(f)
