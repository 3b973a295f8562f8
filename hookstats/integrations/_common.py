"""What the framework callbacks share: finding the model under a framework's wrappers, the run log they write, the
summary scalars they hand to the framework's loggers, and the Monitor's step bookkeeping between optimizer steps.

Note [one Monitor step per optimizer step]
A callback numbers the Monitor's steps by the framework's optimizer steps: records made while the k-th optimizer
step is being computed (every micro-batch's forward and backward under gradient accumulation, then the grads, once)
carry step k (1-based: the framework's global step once that update is done, the step its own logs use). Between
two optimizer steps the Monitor is paused (Monitor.pause()): an evaluation pass run there records nothing. A resumed
run starts at the framework's restored global step + 1, so its steps continue the first run's.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import numpy as np
import torch

from .._fields import STAT_INDEX
from ..monitor import Monitor, MonitorConfig
from ..runlog import JSONLWriter, ParquetWriter

DEFAULT_KINDS = ("forward", "backward_pre", "grad")
PREFIX = "hookstats/"
_L2, _LINF, _NAN, _INF = (STAT_INDEX[f] for f in ("l2", "linf", "nan_count", "inf_count"))
_SET_BY_CALLBACK = ("process_group", "optimizer", "start_step")  # the framework decides these


def callback_config(monitor_kwargs: dict, **options) -> MonitorConfig:
    """A callback's Monitor options (its own keywords, then monitor_kwargs), checked when the callback is made, so
    that a misspelt option fails there and not at the start of training. keep_records defaults to False (the run
    log holds them); exporters given here are added beside the callback's run-log writer."""
    for k in _SET_BY_CALLBACK:
        if k in monitor_kwargs:
            raise TypeError(f"hookstats callback: {k}= is set by the callback from the training framework")
    cfg = MonitorConfig.from_options(**{**options, "keep_records": False, **monitor_kwargs})
    MonitorConfig.from_options(cfg, keep_records=True).checked()  # raises what Monitor(...) would
    return cfg


def callback_monitor(model: torch.nn.Module, config: MonitorConfig, writer, start_step: int) -> Monitor:
    """The callback's Monitor on the model under the framework's wrappers, writing the run log; the grad kind is
    recorded when the callback calls record_grads() (after the framework clipped them)."""
    grads = "grad" in config.kinds if not isinstance(config.kinds, str) else config.kinds == "grad"
    return Monitor(unwrap_model(model), config, exporters=[writer, *config.exporters], process_group=process_group(),
                   optimizer="manual" if grads else None, start_step=start_step)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DistributedDataParallel / DataParallel (`.module`), torch.compile (`._orig_mod`) and
    DeepSpeed's engine: the one whose modules and parameters the hooks go on (what accelerator.unwrap_model gives)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    for _ in range(8):
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            model = inner
            continue
        if isinstance(model, (DataParallel, DistributedDataParallel)) or type(model).__name__ == "DeepSpeedEngine":
            model = model.module
            continue
        break
    return model


def process_group():
    """"world" when torch.distributed runs more than one process (every rank's Monitor then merges its records into
    rank 0's log: Note [merging records across ranks]), else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return "world"
    return None


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _NotThisRank:
    """The exporter of a rank that does not write (the Monitor writes on export_rank only): satisfies
    keep_records=False and writes nothing."""

    def begin(self, info: dict) -> None:
        pass

    def write_block(self, block, scalars=()) -> None:
        pass

    def close(self) -> None:
        pass


def make_writer(run_dir: str, log_format: str = "auto"):
    """(exporter, log path) for RUN_DIR: log.parquet/ (ParquetWriter) where pyarrow is installed, else log.jsonl.
    log_format: "auto", "parquet" or "jsonl". Ranks other than 0 get an exporter that writes nothing."""
    if log_format not in ("auto", "parquet", "jsonl"):
        raise ValueError(f"hookstats: log_format must be 'auto', 'parquet' or 'jsonl', got {log_format!r}")
    if log_format == "auto":
        try:
            import pyarrow  # noqa: F401

            log_format = "parquet"
        except ImportError:
            log_format = "jsonl"
    path = os.path.join(run_dir, "log.parquet" if log_format == "parquet" else "log.jsonl")
    if rank() != 0:
        return _NotThisRank(), path
    if log_format == "parquet":
        return ParquetWriter(path), path
    return JSONLWriter(path), path


class Summary:
    """The scalars a callback adds to the framework's logs, from the blocks flushed since the last `scalars()`:
      hookstats/grad_norm           the l2 norm of every recorded parameter grad of the latest recorded step
                                    (sqrt of the sum of their squared l2 norms)
      hookstats/grad_norm_max       the largest of those per-parameter l2 norms
      hookstats/activation_absmax   the largest |x| of the recorded module outputs (kind forward) of that step
      hookstats/grad_output_absmax  the same of the recorded grad_outputs (kind backward_pre)
      hookstats/nonfinite           records holding a NaN or Inf since the last scalars() (every step flushed)
    A value is NaN when a tensor behind it held a NaN. Only the kinds recorded appear."""

    def __init__(self):
        self._step = -1
        self._parts: dict = {}
        self._nonfinite = 0
        self._new = False

    def add(self, block) -> None:
        n = len(block)
        if not n:
            return
        stats = block.stats
        kind = block.table.column("kind")[np.asarray(block.sites, dtype=np.int64)]
        self._nonfinite += int(((stats[:, _NAN] + stats[:, _INF]) > 0).sum())
        self._new = True
        steps = np.asarray(block.steps)
        last = int(steps.max())
        if last < self._step:
            return
        if last > self._step:
            self._step, self._parts = last, {}
        at = steps == last
        for k in ("grad", "forward", "backward_pre"):
            sel = at & (kind == k)
            if sel.any():
                col = _L2 if k == "grad" else _LINF
                self._parts.setdefault(k, []).append(stats[sel, col])

    def scalars(self) -> dict:
        """{name: float} (empty when nothing was flushed since the last call)."""
        if not self._new:
            return {}
        out: dict = {}
        p = {k: np.concatenate(v) for k, v in self._parts.items()}
        if "grad" in p:
            out[PREFIX + "grad_norm"] = float(np.linalg.norm(p["grad"]))
            out[PREFIX + "grad_norm_max"] = _nanmax(p["grad"])
        if "forward" in p:
            out[PREFIX + "activation_absmax"] = _nanmax(p["forward"])
        if "backward_pre" in p:
            out[PREFIX + "grad_output_absmax"] = _nanmax(p["backward_pre"])
        out[PREFIX + "nonfinite"] = float(self._nonfinite)
        self._nonfinite, self._new = 0, False
        return out


def _nanmax(v: np.ndarray) -> float:
    return math.nan if np.isnan(v).any() else float(v.max())


class StepKeeper:
    """A Monitor's steps kept on a framework's optimizer steps (Note [one Monitor step per optimizer step]), and its
    flushes: every `flush_every` optimizer steps (between two of them), and when the framework logs."""

    def __init__(self, monitor, flush_every: Optional[int]):
        self.monitor = monitor
        self.flush_every = flush_every
        self.summary = Summary()
        self._unflushed = 0
        monitor.pause()

    def begin(self, global_step: int) -> None:
        """Before the first micro-batch of the optimizer step that will make global step `global_step + 1`."""
        mon = self.monitor
        target = global_step + 1
        if mon.current_step >= target:
            mon.resume()
            return
        if self.flush_every is not None and self._unflushed >= self.flush_every:
            self.flush()
        while mon.current_step < target:
            mon.step()
            self._unflushed += 1

    def end(self) -> None:
        """After the optimizer step (and between micro-batches: the next begin() resumes)."""
        self.monitor.pause()

    def flush(self) -> None:
        self.summary.add(self.monitor.flush()._block)
        self._unflushed = 0

    def log_scalars(self) -> dict:
        """Flushes, and returns the summary scalars."""
        self.flush()
        return self.summary.scalars()
