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
import math
from typing import Any, Iterable, Optional, Sequence

import torch

from ._ops import STATS_FIELDS, SUPPORTED_DTYPES, Histogram, as_histogram, check_device, uses_kernels
from .hooks import _flatten, _Forms, _is_float_tensor

_COUNT_FIELDS = ("numel", "nan_count", "inf_count", "zero_count")


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
            self._meta[dev].append((meta, None, -1))
        else:
            key = (dev, h.length(t.dtype))
            hbuf = self._hists.get(key)
            hn = self._hist_used.get(key, 0)
            if hbuf is None or hn == hbuf.shape[0]:
                hbuf = self._grow(hbuf, hn, lambda r: torch.zeros((r, key[1]), dtype=torch.int64, device=dev))
                self._hists[key] = hbuf
            if uses_kernels(x):
                torch.ops.hookstats.stats_into.default(x, buf, n, hbuf, hn, h.mode, h.bins, h.lo, h.hi)
            else:
                from ._ops import stats_into

                stats_into(x, buf, n, hist=hbuf, hist_slot=hn, histogram=h)
            self._hist_used[key] = hn + 1
            self._meta[dev].append((meta, key, hn))
        self._used[dev] = n + 1

    def flush(self) -> None:
        """Copies every used row to the host (one copy per buffer) into `flushed`, and empties the buffers."""
        new: list[dict] = []
        for dev, buf in self._stats.items():
            n = self._used.get(dev, 0)
            if n == 0:
                continue
            rows = _to_host(buf[:n]).tolist()
            hist_rows = {}
            for key, hbuf in self._hists.items():
                if key[0] == dev and self._hist_used.get(key, 0):
                    hist_rows[key] = _to_host(hbuf[: self._hist_used[key]]).tolist()
                    hbuf[: self._hist_used[key]].zero_()  # stats_into adds into histogram rows
                    self._hist_used[key] = 0
            for row, (meta, key, hrow) in zip(rows, self._meta[dev]):
                rec = dict(meta)
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
        self.flushed.extend(new)

    def release(self) -> None:
        self._stats.clear()
        self._hists.clear()
        self._used.clear()
        self._hist_used.clear()
        self._meta.clear()

    @property
    def pending(self) -> int:
        return sum(self._used.values())


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

    def _add(self, kind: str, obj, module, which: str = "") -> None:
        tensors: list = []
        _flatten(obj, tensors, keep_none=True)
        for i, t in enumerate(tensors):
            if t is None:
                continue
            self._rec.add(t, (("seq", self._seq), ("step", self.step), ("module", self.name),
                              ("kind", kind + which), ("index", i)))
            self._seq += 1

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


class Monitor:
    """Statistics of every matching layer, every step (or every `every` steps), into one device buffer.

    kinds (a name or a sequence of names): "forward" (module outputs), "forward_pre" (positional inputs), "backward_pre" (grad_output, alias
    "grad_output"), "backward" (grad_input, alias "grad_input"), "grad" (each parameter's .grad after accumulation).
    include / exclude: globs on qualified module names ("" is the model itself; "grad" uses parameter names).
    Each hook call is one `stats_into` kernel call per tensor; nothing is read back until `flush()` / `records()`.
    Steps skipped by `every` launch nothing. Non-floating tensors are skipped and counted (`skipped`).
    """

    def __init__(self, model: torch.nn.Module, include: Sequence[str] | str = "*", exclude: Sequence[str] | str = (),
                 kinds: Sequence[str] = ("forward", "backward_pre"), histogram=None, every: int = 1,
                 slots: int = 4096):
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
        self.kinds = tuple(ks)
        self.every = every
        self._rec = _Recorder(histogram, slots)
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

    # -- hooks ----------------------------------------------------------------------------------------------------
    def _hook(self, name: str, kind: str, pick):
        rec = self._rec

        def hook(*args):
            if not self._active:
                return None
            tensors: list = []
            _flatten(pick(*args), tensors, keep_none=True)
            for i, t in enumerate(tensors):
                if t is None:
                    continue
                rec.add(t, (("seq", self._seq), ("step", self._step), ("module", name), ("kind", kind), ("index", i)))
                self._seq += 1
            return None

        return hook

    def _grad_hook(self, pname: str):
        rec = self._rec

        def hook(param):
            if self._active and param.grad is not None:
                rec.add(param.grad, (("seq", self._seq), ("step", self._step), ("module", pname), ("kind", "grad"),
                                     ("index", 0)))
                self._seq += 1

        return hook

    # -- control --------------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Ends a step: the next hooks record under step + 1 (and only every `every` steps)."""
        self._step += 1
        self._active = self._model is not None and self._step % self.every == 0

    @property
    def current_step(self) -> int:
        return self._step

    @property
    def skipped(self) -> int:
        """Non-floating tensors (token ids, masks) the hooks saw and did not record."""
        return self._rec.skipped

    def flush(self) -> None:
        """Copies the recorded rows to the host: one copy per buffer (non-blocking into pinned memory on CUDA)."""
        self._rec.flush()

    def records(self) -> list[dict]:
        """Every record so far, in hook-call order: dicts with step, module, kind, index (the tensor's position in
        what the hook saw, None entries counted), stats (a dict of the 13 STATS_FIELDS) and histogram (a list of
        counts, or None). Flushes first."""
        self._rec.flush()
        return list(self._rec.flushed)

    def first_nonfinite(self) -> Optional[dict]:
        """The first record (by step and hook order) whose tensor held a NaN or Inf: NaN hunting without
        torch.autograd.detect_anomaly. None if there was none."""
        return _first_nonfinite(self.records())

    def summary_rows(self) -> list[dict]:
        """Per (module, kind): number of records, last step's l2, the largest linf, the smallest min and largest
        max (over records without NaN), and the NaN / Inf totals, in the order modules were first seen."""
        rows: dict[tuple, dict] = {}
        for r in self.records():
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

    def summary(self) -> str:
        """The per-layer table of summary_rows(), as text."""
        rows = self.summary_rows()
        head = ["module", "kind", "records", "last l2", "max |x|", "min", "max", "NaN", "Inf"]
        body = [[r["module"] or "<model>", r["kind"], str(r["records"]), f"{r['l2']:.4g}", f"{r['linf']:.4g}",
                 f"{r['min']:.4g}", f"{r['max']:.4g}", str(r["nan"]), str(r["inf"])] for r in rows]
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
        return "\n".join(lines)

    def detach(self) -> None:
        """Removes every hook and drops the buffers and the reference to the model. Records already flushed stay
        readable; unflushed ones are flushed first."""
        if self._handles:
            self._rec.flush()
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
