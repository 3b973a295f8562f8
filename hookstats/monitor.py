"""record hooks and Monitor: statistics (and histograms) of what hooks see, one kernel call per tensor into a
preallocated device buffer, read back in one copy when you choose.

Note [monitor buffers]
Each record is one row of a [slots, 13] float64 stats buffer on the tensor's device (and, with a histogram, one row
of an int64 histogram buffer of that histogram's length for the tensor's dtype), written by one `stats_into` call.
Nothing is read back until `flush()`, which copies the used rows to the host in one copy per buffer. When a buffer
fills up before a flush it grows (doubles, by a device-to-device copy: no host sync, no record dropped); `flush()`
empties it. Metadata (step, module, kind, tensor index) lives in Python lists beside the buffer.
"""
from __future__ import annotations

import fnmatch
import itertools
import math
import weakref
from typing import Any, Iterable, Optional, Sequence

import torch

from ._ops import STATS_FIELDS, SUPPORTED_DTYPES, Histogram, as_histogram, check_device, uses_kernels
from .hooks import _flatten, _Forms, _is_float_tensor

_COUNT_FIELDS = ("numel", "nan_count", "inf_count", "zero_count")
_DTYPE_NAMES = {d: str(d).replace("torch.", "") for d in SUPPORTED_DTYPES}


class _Recorder:
    """The device buffers of Note [monitor buffers], and the host records they were flushed into."""

    def __init__(self, histogram=None, slots: int = 1024):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"hookstats: slots must be an int >= 1, got {slots!r}")
        self.histogram: Optional[Histogram] = as_histogram(histogram) if histogram is not None else None
        self.slots = slots
        self._stats: dict[torch.device, torch.Tensor] = {}
        self._used: dict[torch.device, int] = {}
        self._meta: dict[torch.device, list] = {}
        self._hists: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._hist_used: dict[tuple[torch.device, int], int] = {}
        self.flushed: list[dict] = []
        self.flushed_scalars: list[dict] = []
        self._scalars: dict[torch.device, torch.Tensor] = {}
        self._scalar_used: dict[torch.device, int] = {}
        self._scalar_meta: dict[torch.device, list] = {}
        self.keep = True
        self.group = None  # a ProcessGroup: flush merges rows across its ranks
        self.skipped = 0

    def _grow(self, old: Optional[torch.Tensor], used: int, make) -> torch.Tensor:
        rows = self.slots if old is None else 2 * old.shape[0]
        new = make(rows)
        if old is not None and used:
            new[:used].copy_(old[:used])
        return new

    def add(self, t: torch.Tensor, meta: tuple) -> None:
        """One record of t (statistics, and the histogram when configured) into the next row of its device's
        buffer. Non-floating tensors are skipped and counted."""
        if not _is_float_tensor(t):
            self.skipped += 1
            return
        if self.group is not None or type(t) is not torch.Tensor:
            from .distributed import local_part

            t = local_part(t)  # a DTensor: this rank's shard
        dev = t.device
        buf = self._stats.get(dev)
        n = self._used.get(dev, 0)
        if buf is None or n == buf.shape[0]:
            buf = self._grow(buf, n, lambda r: torch.full((r, len(STATS_FIELDS)), math.nan, dtype=torch.float64,
                                                          device=dev))
            self._stats[dev] = buf
            self._meta.setdefault(dev, [])
        x = t.detach() if t.requires_grad else t
        h = self.histogram
        if h is None:
            if uses_kernels(x):
                torch.ops.hookstats.stats_into.default(x, buf, n)
            else:
                from ._ops import stats_into

                stats_into(x, buf, n)
            self._meta[dev].append((meta, None, -1, t.dtype))
        else:
            key = (dev, h.length(t.dtype))
            hbuf = self._hists.get(key)
            hn = self._hist_used.get(key, 0)
            if hbuf is None or hn == hbuf.shape[0]:
                hbuf = self._grow(hbuf, hn, lambda r: torch.zeros((r, key[1]), dtype=torch.int64, device=dev))
                self._hists[key] = hbuf
            if uses_kernels(x):
                torch.ops.hookstats.stats_into.default(x, buf, n, hbuf, hn, h.mode, h.bins, h.lo, h.hi, True)
            else:
                from ._ops import stats_into

                stats_into(x, buf, n, hist=hbuf, hist_slot=hn, histogram=h, accumulate=True)
            self._hist_used[key] = hn + 1
            self._meta[dev].append((meta, key, hn, t.dtype))
        self._used[dev] = n + 1

    def flush(self) -> list[dict]:
        """Copies every used row to the host (one copy per buffer) into `flushed` (unless `keep` is False), empties
        the buffers, and returns the new records. With a process group, rows are merged across ranks first (Note
        [merging records across ranks]), and this is a collective."""
        new: list[dict] = []
        devices = [d for d in self._stats if self._used.get(d, 0)]
        if self.group is not None:
            from .distributed import collective_device

            if len(devices) > 1:
                raise RuntimeError("hookstats.Monitor(process_group=...) records tensors of one device per rank; this "
                                   f"rank recorded tensors on {sorted(map(str, devices))}")
            if not devices:
                devices = [collective_device(self.group, next(iter(self._stats), None))]
        for dev in devices:
            n = self._used.get(dev, 0)
            buf = self._stats.get(dev)
            metas = self._meta.get(dev, [])
            rows_t = buf[:n] if buf is not None else torch.empty((0, len(STATS_FIELDS)), dtype=torch.float64,
                                                                  device=dev)
            keys = sorted((k for k in self._hists if k[0] == dev and self._hist_used.get(k, 0)), key=lambda k: k[1])
            hists_t = [self._hists[k][: self._hist_used[k]] for k in keys]
            if self.group is not None:
                from .distributed import merge_rows, signature

                sig = signature([(m[1:], k[1] if k else 0, str(dt)) for m, k, _, dt in metas])
                rows_t, hists_t = merge_rows(self.group, rows_t, hists_t, sig)
            rows = _to_host(rows_t).tolist()
            hist_rows = {k: _to_host(h).tolist() for k, h in zip(keys, hists_t)}
            for k in keys:
                self._hists[k][: self._hist_used[k]].zero_()  # stats_into adds into histogram rows
                self._hist_used[k] = 0
            for row, (meta, key, hrow, dtype) in zip(rows, metas):
                rec = dict(meta)
                rec["dtype"] = _DTYPE_NAMES[dtype]
                stats = dict(zip(STATS_FIELDS, row))
                for k in _COUNT_FIELDS:
                    stats[k] = int(stats[k])
                rec["stats"] = stats
                rec["histogram"] = hist_rows[key][hrow] if key is not None else None
                new.append(rec)
            self._used[dev] = 0
            self._meta[dev] = []
        # Records of several devices interleave: order the new ones by hook-call order (older ones already are).
        new.sort(key=lambda r: r["seq"])
        if self.keep:
            self.flushed.extend(new)
        return new

    def add_scalar(self, value, meta: tuple) -> None:
        """Copies value (a one-element tensor, or a number) into the next slot of its device's scalar buffer: no
        host sync, and a later in-place change of value does not change what was logged."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"hookstats.Monitor.log needs a one-element tensor or a number, got shape "
                                 f"{tuple(value.shape)}")
            dev = value.device
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            dev = torch.device("cpu")
        else:
            raise TypeError(f"hookstats.Monitor.log needs a tensor or a number, got {type(value).__name__}")
        buf = self._scalars.get(dev)
        n = self._scalar_used.get(dev, 0)
        if buf is None or n == buf.shape[0]:
            buf = self._grow(buf, n, lambda r: torch.full((r,), math.nan, dtype=torch.float64, device=dev))
            self._scalars[dev] = buf
        if isinstance(value, torch.Tensor):
            buf[n].copy_(value.detach().reshape(()))
        else:
            buf[n] = float(value)
        self._scalar_meta.setdefault(dev, []).append(meta)
        self._scalar_used[dev] = n + 1

    def flush_scalars(self) -> list[dict]:
        new: list[dict] = []
        for dev, buf in self._scalars.items():
            n = self._scalar_used.get(dev, 0)
            if n:
                for meta, v in zip(self._scalar_meta[dev], _to_host(buf[:n]).tolist()):
                    rec = dict(meta)
                    rec["value"] = v
                    new.append(rec)
            self._scalar_used[dev] = 0
            self._scalar_meta[dev] = []
        new.sort(key=lambda r: r["seq"])
        if self.keep:
            self.flushed_scalars.extend(new)
        return new

    def release(self) -> None:
        self._scalars.clear()
        self._scalar_used.clear()
        self._scalar_meta.clear()
        self._stats.clear()
        self._hists.clear()
        self._used.clear()
        self._hist_used.clear()
        self._meta.clear()

    @property
    def pending(self) -> int:
        return sum(self._used.values()) + sum(self._scalar_used.values())


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.is_cuda:  # non-blocking into pinned memory, then one wait for this stream
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        return host
    return t.cpu() if t.device.type != "cpu" else t.clone()


def _first_nonfinite(records: Iterable[dict]) -> Optional[dict]:
    for r in records:
        s = r["stats"]
        if s["nan_count"] or s["inf_count"]:
            return r
    return None


# What a record hook's records are labelled with: the hook kind (a full backward hook records both sides).
_RECORD_LABELS = ("backward:grad_input", "backward:grad_output", "backward_pre", "forward_pre", "forward", "tensor",
                  "post_accumulate")


class record(_Forms):
    """A hook that records statistics (and a histogram) of what it sees into a device buffer, returns nothing and
    changes nothing. Register the object (full backward hook: grad_input and grad_output are both recorded) or one
    of its forms (see hookstats.hooks); read with `records()` (which flushes: one host copy)."""

    _name = "hookstats.record"

    def __init__(self, name: str = "", *, histogram=None, slots: int = 1024):
        self.name = name
        self._rec = _Recorder(histogram, slots)
        self._seq = 0
        self.step = 0
        self._id = next(_MONITOR_IDS)  # for _record_op: Note [monitor under torch.compile]
        _LIVE_MONITORS[self._id] = self

    def _add(self, kind: str, obj, module, which: str = "") -> None:
        label = kind + which
        if torch.compiler.is_compiling():  # no read of step/seq in traced code: Note [monitor under torch.compile]
            return _record_traced(self._id, _RECORD_LABELS.index(label), obj)
        tensors: list = []
        _flatten(obj, tensors, keep_none=True)
        self._add_tensors(label, tensors)
        return None

    def _add_tensors(self, label: str, tensors) -> None:
        for i, t in enumerate(tensors):
            if t is None:
                continue
            self._rec.add(t, (("seq", self._seq), ("step", self.step), ("module", self.name), ("kind", label),
                              ("index", i)))
            self._seq += 1

    def _record_compiled(self, hid: int, tensors) -> None:
        self._add_tensors(_RECORD_LABELS[hid], tensors)

    def _process(self, kind, obj, module, extra=None, param=None):
        if kind == "backward":
            self._add(kind, obj, module, ":grad_input")
            self._add(kind, extra, module, ":grad_output")
        else:
            self._add(kind, obj, module)
        return None

    def flush(self) -> None:
        self._rec.flush()

    def records(self) -> list[dict]:
        self._rec.flush()
        return list(self._rec.flushed)

    def first_nonfinite(self) -> Optional[dict]:
        return _first_nonfinite(self.records())

    @property
    def skipped(self) -> int:
        return self._rec.skipped


# Hook kinds a Monitor attaches, and the aliases it accepts.
MONITOR_KINDS = ("forward_pre", "forward", "backward_pre", "backward", "grad")
_KIND_ALIASES = {"inputs": "forward_pre", "outputs": "forward", "grad_output": "backward_pre",
                 "grad_input": "backward", "param_grad": "grad"}

# Note [monitor under torch.compile]
# A hook that dynamo traces (forward hooks inside a compiled module; module backward and "grad" hooks under compiled
# autograd) must not read the step, seq, `every` or buffer row counts: they change from call to call, so each would
# be a guard, and every step a recompile. Such a hook traces one _record_op call instead, with the tensors and two
# constant ids (the monitor's and the hook's). The op is registered as effectful (ordered), so compilers neither
# drop it (it returns nothing) nor reorder it; when the compiled graph runs, its Python body calls
# Monitor._record_compiled: the eager recording, with the step, seq and `every` of that moment. Records, their
# order and their step numbers are the eager ones, and no guard depends on them. Where the effect cannot be
# registered (older PyTorch), the op is called through torch.compiler.disable: a graph break per hook, same records.
# - The op is tagged cudagraph_unsafe: a CUDA graph replay would skip its Python body, and the record.
# - Hooks are never compiled as frames of their own (_inlined_only): one called from eager code records eagerly.
# - Dynamo does not guard on module hooks (torch._dynamo.config.skip_nnmodule_hook_guards): attach a Monitor before
#   compiling; code compiled before then never calls its hooks. After detach() the compiled code still calls the op,
#   which then records nothing.
# - Without compiled autograd, dynamo refuses module backward hooks (a graph break at each module that has them, the
#   hooks then run eagerly); "grad" hooks run eagerly in the autograd engine, after the compiled backward.
_MONITOR_IDS = itertools.count()
_LIVE_MONITORS: "weakref.WeakValueDictionary[int, Monitor]" = weakref.WeakValueDictionary()
_UNSAFE = {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") else {}


@torch.library.custom_op("hookstats::_monitor_record", mutates_args=(), **_UNSAFE)
def _record_op(xs: list[Optional[torch.Tensor]], monitor: int, hook: int) -> None:
    mon = _LIVE_MONITORS.get(monitor)
    if mon is not None:
        mon._record_compiled(hook, xs)


@_record_op.register_fake
def _record_op_fake(xs, monitor, hook) -> None:
    return None


def _register_ordered_effect() -> bool:
    try:
        from torch._library.effects import EffectType

        _record_op.register_effect(EffectType.ORDERED)
        return True
    except (ImportError, AttributeError):
        pass
    try:  # older PyTorch
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        _register_effectful_op(torch.ops.hookstats._monitor_record.default, _EffectType.ORDERED)
        return True
    except (ImportError, AttributeError):
        return False


if _register_ordered_effect():
    _record_op_traced = _record_op
else:
    _record_op_traced = torch.compiler.disable(_record_op)
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def _inlined_only(hook):
    """hook, which dynamo traces where a compiled frame calls it, but never compiles as a frame of its own: a hook
    called from eager code (a module run eagerly after a graph break) records eagerly, instead of being compiled
    once per hook (each has other constants) until dynamo's recompile limit."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        set_code_exec_strategy(hook.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except (ImportError, AttributeError):  # older PyTorch: the hook compiles, and records the same
        pass
    return hook


def _record_traced(mid: int, hid: int, obj) -> None:
    """The traced body of a Monitor hook: see Note [monitor under torch.compile]."""
    if _is_exporting():  # an exported program must not call back into this process's monitors
        return None
    tensors: list = []
    _flatten(obj, tensors, keep_none=True)
    _record_op_traced([None if t is None else t.detach() for t in tensors], mid, hid)
    return None


class Monitor:
    """Statistics of every matching layer, every step (or every `every` steps), into one device buffer.

    kinds (a name or a sequence of names): "forward" (module outputs), "forward_pre" (positional inputs), "backward_pre" (grad_output, alias
    "grad_output"), "backward" (grad_input, alias "grad_input"), "grad" (each parameter's .grad after accumulation).
    include / exclude: globs on qualified module names ("" is the model itself; "grad" uses parameter names).
    Each hook call is one `stats_into` kernel call per tensor; nothing is read back until `flush()` / `records()`.
    Steps skipped by `every` launch nothing. Non-floating tensors are skipped and counted (`skipped`).
    exporters: objects with write(records, scalars) (hookstats.export: JSONLWriter, TensorBoardWriter,
    WandbWriter) that receive each flush's new records; `flush_every=N` flushes at every N-th `step()` (one host copy
    per buffer then, none in between); `keep_records=False` keeps no host copy once exporters have them (long runs).
    `log(tag, value)` records a scalar (loss, total grad norm) beside the statistics, without a host sync.
    process_group (a ProcessGroup, or "world"): flush() merges every rank's records (Note [merging records across
    ranks] in hookstats.distributed) and becomes a collective that every rank calls at the same points (step() with
    flush_every, flush(), detach()); records()/summary()/first_nonfinite() then read what was flushed without
    flushing, so that calling them on one rank cannot hang the others. Exporters write on `export_rank` only.
    DTensor tensors (FSDP2's sharded parameters and grads) are recorded by their local shard.
    """

    def __init__(self, model: torch.nn.Module, include: Sequence[str] | str = "*", exclude: Sequence[str] | str = (),
                 kinds: Sequence[str] = ("forward", "backward_pre"), histogram=None, every: int = 1,
                 slots: int = 4096, exporters: Sequence[Any] = (), flush_every: Optional[int] = None,
                 keep_records: bool = True, process_group=None, export_rank: int = 0):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"hookstats.Monitor needs a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"hookstats.Monitor: every must be an int >= 1, got {every!r}")
        include = [include] if isinstance(include, str) else list(include)
        exclude = [exclude] if isinstance(exclude, str) else list(exclude)
        ks = []
        for k in ([kinds] if isinstance(kinds, str) else kinds):
            k = _KIND_ALIASES.get(k, k)
            if k not in MONITOR_KINDS:
                raise ValueError(f"hookstats.Monitor: unknown kind {k!r}; use any of {MONITOR_KINDS} "
                                 f"(or the aliases {sorted(_KIND_ALIASES)})")
            if k not in ks:
                ks.append(k)
        if flush_every is not None and (not isinstance(flush_every, int) or flush_every < 1):
            raise ValueError(f"hookstats.Monitor: flush_every must be None or an int >= 1, got {flush_every!r}")
        exporters = list(exporters)
        for e in exporters:
            if not callable(getattr(e, "write", None)):
                raise TypeError(f"hookstats.Monitor: an exporter needs a write(records, scalars) method; "
                                f"{type(e).__name__} has none")
        if not keep_records and not exporters:
            raise ValueError("hookstats.Monitor: keep_records=False without exporters would throw every record away")
        self.kinds = tuple(ks)
        self.every = every
        self.flush_every = flush_every
        self.exporters = exporters
        self._rec = _Recorder(histogram, slots)
        self._rec.keep = keep_records
        self.rank = 0
        self._exporting = True
        if process_group is not None:
            from .distributed import resolve_group

            import torch.distributed as dist

            self._rec.group = resolve_group(process_group)
            self.rank = dist.get_rank(self._rec.group)
            self._exporting = self.rank == export_rank
        self._step = 0
        self._seq = 0
        self._active = True
        self._handles: list = []
        self._model = model

        def wanted(name: str) -> bool:
            return any(fnmatch.fnmatchcase(name, p) for p in include) and \
                not any(fnmatch.fnmatchcase(name, p) for p in exclude)

        self.modules = [name for name, _ in model.named_modules() if wanted(name)]
        for name, mod in model.named_modules():
            if not wanted(name):
                continue
            for kind in self.kinds:
                if kind == "forward_pre":
                    self._handles.append(mod.register_forward_pre_hook(self._hook(name, kind, lambda m, a: a)))
                elif kind == "forward":
                    self._handles.append(mod.register_forward_hook(self._hook(name, kind, lambda m, a, o: o)))
                elif kind == "backward_pre":
                    self._handles.append(mod.register_full_backward_pre_hook(self._hook(name, kind, lambda m, g: g)))
                elif kind == "backward":
                    self._handles.append(mod.register_full_backward_hook(self._hook(name, kind, lambda m, gi, go: gi)))
        if "grad" in self.kinds:
            for pname, p in model.named_parameters():
                if p.requires_grad and wanted(pname):
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(pname)))
        info = self.run_info()
        try:
            for e in self._active_exporters():
                begin = getattr(e, "begin", None)
                if begin is not None:
                    begin(info)
        except BaseException:  # no half-built Monitor left recording through its hooks
            for h in self._handles:
                h.remove()
            self._handles = []
            raise

    def _active_exporters(self) -> list:
        return self.exporters if self._exporting else []

    @property
    def histogram(self):
        """The Histogram recorded with each tensor, or None."""
        return self._rec.histogram

    def run_info(self) -> dict:
        """What exporters need to read the records: histogram spec, statistics fields, kinds, modules, versions."""
        from . import __version__

        h = self._rec.histogram
        hist = None if h is None else ({"kind": "exp"} if h.kind == "exp" else
                                       {"kind": "range", "bins": h.bins, "lo": h.lo, "hi": h.hi})
        return {"hookstats": __version__, "torch": torch.__version__, "histogram": hist,
                "stats_fields": list(STATS_FIELDS), "kinds": list(self.kinds), "modules": list(self.modules),
                "every": self.every}

    # -- hooks ----------------------------------------------------------------------------------------------------
    def _hook(self, name: str, kind: str, pick):
        hid = self._hook_id(name, kind)
        mid = self._id

        def hook(*args):
            if torch.compiler.is_compiling():  # Note [monitor under torch.compile]
                return _record_traced(mid, hid, pick(*args))
            if not self._active:
                return None
            tensors: list = []
            _flatten(pick(*args), tensors, keep_none=True)
            self._record(name, kind, tensors)
            return None

        return _inlined_only(hook)

    def _grad_hook(self, pname: str):
        hid = self._hook_id(pname, "grad")
        mid = self._id

        def hook(param):
            if torch.compiler.is_compiling():
                return _record_traced(mid, hid, param.grad)
            if self._active and param.grad is not None:
                self._record(pname, "grad", [param.grad])

        return _inlined_only(hook)

    def _hook_id(self, name: str, kind: str) -> int:
        """A number for (name, kind) that a traced hook passes to _record_op in place of the strings."""
        if not hasattr(self, "_hook_names"):
            self._hook_names: list[tuple[str, str]] = []
            self._id = next(_MONITOR_IDS)
            _LIVE_MONITORS[self._id] = self
        self._hook_names.append((name, kind))
        return len(self._hook_names) - 1

    def _record(self, name: str, kind: str, tensors: Sequence[Optional[torch.Tensor]]) -> None:
        """One record per tensor (None entries keep their index), under the current step, in call order."""
        rec = self._rec
        for i, t in enumerate(tensors):
            if t is None:
                continue
            rec.add(t, (("seq", self._seq), ("step", self._step), ("module", name), ("kind", kind), ("index", i)))
            self._seq += 1

    def _record_compiled(self, hid: int, tensors: Sequence[Optional[torch.Tensor]]) -> None:
        """What _record_op runs when a compiled graph reaches a traced hook: the eager recording, with the step,
        seq and `every` of now."""
        if self._active:
            self._record(*self._hook_names[hid], tensors)

    # -- control --------------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Ends a step: the next hooks record under step + 1 (and only every `every` steps). With flush_every=N,
        every N-th call flushes."""
        self._step += 1
        self._active = self._model is not None and self._step % self.every == 0
        if self.flush_every is not None and self._step % self.flush_every == 0:
            self.flush()

    def log(self, tag: str, value) -> None:
        """Records a scalar under the current step: a one-element tensor (copied on its device, no host sync:
        `mon.log("loss", loss)`, `mon.log("grad_norm", clip_grad_norm_(...))`) or a number. Read back with
        `scalars()`; exporters write it as a scalar named tag. Logged even on steps skipped by `every`."""
        if not isinstance(tag, str) or not tag:
            raise TypeError(f"hookstats.Monitor.log needs a non-empty str tag, got {tag!r}")
        if self._model is None:
            raise RuntimeError("hookstats.Monitor.log after detach(): the monitor is closed")
        self._rec.add_scalar(value, (("seq", self._seq), ("step", self._step), ("tag", tag)))
        self._seq += 1

    @property
    def current_step(self) -> int:
        return self._step

    @property
    def skipped(self) -> int:
        """Non-floating tensors (token ids, masks) the hooks saw and did not record."""
        return self._rec.skipped

    def flush(self) -> list[dict]:
        """Copies the recorded rows to the host: one copy per buffer (non-blocking into pinned memory on CUDA), and
        hands the new records and scalars to every exporter. Returns the new records."""
        new = self._rec.flush()
        scalars = self._rec.flush_scalars()
        if new or scalars:
            for e in self._active_exporters():
                e.write(new, scalars)
        return new

    def _read(self) -> None:
        if self._rec.group is None and self._model is not None:
            self.flush()

    def scalars(self) -> list[dict]:
        """Every scalar logged with log() so far: dicts with step, tag and value, in call order. Flushes first
        (without a process group). Scalars are this rank's: they are not merged across ranks."""
        self._read()
        return list(self._rec.flushed_scalars)

    def records(self) -> list[dict]:
        """Every record so far, in hook-call order: dicts with step, module, kind, index (the tensor's position in
        what the hook saw, None entries counted), dtype, stats (a dict of the 13 STATS_FIELDS) and histogram (a list
        of counts, or None). Flushes first (without a process group: with one, call flush() on every rank)."""
        self._read()
        return list(self._rec.flushed)

    def first_nonfinite(self) -> Optional[dict]:
        """The first record (by step and hook order) whose tensor held a NaN or Inf: NaN hunting without
        torch.autograd.detect_anomaly. None if there was none."""
        return _first_nonfinite(self.records())

    def summary_rows(self) -> list[dict]:
        """summary_rows(self.records()): one row per (module, kind)."""
        return summary_rows(self.records())

    def summary(self) -> str:
        """The per-layer table of summary_rows(), as text."""
        return format_summary(self.summary_rows())

    def detach(self) -> None:
        """Removes every hook and drops the buffers and the reference to the model. Unflushed records are flushed
        first (and handed to the exporters, which are then closed); records already flushed stay readable."""
        try:
            if self._model is not None:
                self.flush()
        finally:  # even when the flush fails (a rank mismatch, an exporter error), the hooks go and writers close
            if self._model is not None:
                for e in self._active_exporters():
                    close = getattr(e, "close", None)
                    if close is not None:
                        close()
            self._detach_hooks()

    def _detach_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        # A graph built before detach() still calls the hooks it captured (PyTorch snapshots a module's backward
        # hooks at forward time): they must record nothing from now on.
        self._active = False
        self._rec.release()
        self._model = None

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def __del__(self):
        try:
            for h in self._handles:
                h.remove()
        except Exception:
            pass


def summary_rows(records: Iterable[dict]) -> list[dict]:
    """Per (module, kind): number of records, last step's l2 (the tensors of that step combined), the largest linf,
    the smallest min and largest max (over records without NaN), and the NaN / Inf totals, in the order modules
    were first seen."""
    rows: dict[tuple, dict] = {}
    for r in records:
        key = (r["module"], r["kind"])
        s = r["stats"]
        row = rows.get(key)
        if row is None:
            row = rows[key] = {"module": r["module"], "kind": r["kind"], "records": 0, "last_step": r["step"],
                               "l2": 0.0, "linf": 0.0, "min": math.inf, "max": -math.inf, "nan": 0, "inf": 0}
            row["_l2"] = {}
        row["records"] += 1
        row["nan"] += s["nan_count"]
        row["inf"] += s["inf_count"]
        if s["linf"] == s["linf"]:
            row["linf"] = max(row["linf"], s["linf"])
        if s["min"] == s["min"]:
            row["min"] = min(row["min"], s["min"])
        if s["max"] == s["max"]:
            row["max"] = max(row["max"], s["max"])
        step_l2 = row["_l2"]
        step_l2[r["step"]] = math.hypot(step_l2.get(r["step"], 0.0), s["l2"])
        row["last_step"] = max(row["last_step"], r["step"])
    out = []
    for row in rows.values():
        row["l2"] = row.pop("_l2")[row["last_step"]]
        out.append(row)
    return out


SUMMARY_HEADER = ("module", "kind", "records", "last l2", "max |x|", "min", "max", "NaN", "Inf")


def summary_cells(rows: Sequence[dict]) -> list[list[str]]:
    """The cells of the summary table (SUMMARY_HEADER columns), as strings."""
    return [[r["module"] or "<model>", r["kind"], str(r["records"]), f"{r['l2']:.4g}", f"{r['linf']:.4g}",
             f"{r['min']:.4g}", f"{r['max']:.4g}", str(r["nan"]), str(r["inf"])] for r in rows]


def format_summary(rows: Sequence[dict]) -> str:
    """summary_rows() as an aligned text table."""
    head = SUMMARY_HEADER
    body = summary_cells(rows)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)
