"""`HookstatsCallback`: a Lightning `Callback` (lightning.pytorch; hookstats.integrations.pytorch_lightning has the
same for the `pytorch_lightning` package) that runs a hookstats Monitor on the LightningModule being fitted.

    trainer = L.Trainer(..., callbacks=[HookstatsCallback()])

What it does at each hook (Note [one Monitor step per optimizer step] in hookstats.integrations._common):
  on_fit_start              attaches a Monitor to the LightningModule, paused (the sanity check and every
                            validation record nothing)
  on_train_batch_start      records from the first micro-batch of an optimizer step on (accumulate_grad_batches:
                            one step), numbered trainer.global_step + 1
  on_before_optimizer_step  records the parameter grads (kind "grad"): unscaled, before gradient_clip_val clips
                            them (where Lightning gives them to callbacks; what its grad_norm utility reports)
  on_train_batch_end        pauses; every log_every_n_steps optimizer steps, flushes and logs the summary scalars
                            (hookstats.integrations._common.Summary) through every trainer.logger (TensorBoardLogger,
                            CSVLogger, WandbLogger, ...) at step trainer.global_step, and copies the trainer's
                            callback_metrics (loss, ...) into the run log as scalars
  on_train_end              flushes and logs the rest
  on_fit_end / on_exception detaches: the log is closed
state_dict() (saved in every checkpoint) holds the last step and the log path: a fit resumed from a checkpoint
(ckpt_path=...) continues the step numbers, in the same log. The log goes to trainer.log_dir/hookstats
(log.parquet/ where pyarrow is installed, else log.jsonl) unless log_dir is given.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name only
    from pytorch_lightning import Callback

from ..monitor import Monitor
from ._common import DEFAULT_KINDS, StepKeeper, callback_config, callback_monitor, make_writer


class HookstatsCallbackMixin:
    """The callback's body, for lightning.pytorch.Callback and pytorch_lightning.Callback alike.

    include / exclude / kinds / histogram / every / histogram_every: as hookstats.Monitor (kinds default to module
    outputs, grad_outputs and parameter grads). log_dir: the run directory (default trainer.log_dir/hookstats);
    log_format: "auto" (Parquet where pyarrow is installed, else JSONL), "parquet" or "jsonl". flush_every: copy the
    records to the host and hand them to the writer every that many optimizer steps (and at each log); log_every:
    log the summary scalars every that many optimizer steps (default: the trainer's log_every_n_steps; 0: never).
    monitor_kwargs: any other hookstats.MonitorConfig option, checked here (a misspelt one fails when the callback
    is made; exporters given there write beside the run log); `callback.config` is the MonitorConfig. The Monitor is
    `callback.monitor` from on_fit_start on; `callback.log_path` is the log."""

    def __init__(self, include: Sequence[str] | str = "*", exclude: Sequence[str] | str = (),
                 kinds: Sequence[str] = DEFAULT_KINDS, histogram=None, every: int = 1, histogram_every: int = 1,
                 log_dir: Optional[str] = None, log_format: str = "auto", flush_every: Optional[int] = 50,
                 log_every: Optional[int] = None, **monitor_kwargs: Any):
        super().__init__()
        self.config = callback_config(monitor_kwargs, include=include, exclude=exclude, kinds=tuple(kinds),
                                      histogram=histogram, every=every, histogram_every=histogram_every)
        self.log_dir, self.log_format, self.flush_every, self.log_every = log_dir, log_format, flush_every, log_every
        self.monitor: Optional[Monitor] = None
        self.log_path: Optional[str] = None
        self._keeper: Optional[StepKeeper] = None
        self._resumed: Optional[dict] = None
        self._logged = -1

    @property
    def state_key(self) -> str:
        return "HookstatsCallback"

    def state_dict(self) -> dict:
        step = self.monitor.current_step if self.monitor is not None else (self._resumed or {}).get("step", 0)
        return {"step": int(step), "log_path": self.log_path}

    def load_state_dict(self, state_dict: dict) -> None:
        self._resumed = dict(state_dict)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            self._detach()
        resumed = self._resumed or {}
        run_dir = self.log_dir or (os.path.dirname(resumed["log_path"]) if resumed.get("log_path") else
                                   os.path.join(trainer.log_dir or trainer.default_root_dir, "hookstats"))
        writer, self.log_path = make_writer(run_dir, self.log_format)
        start = max(int(resumed.get("step", 0)), trainer.global_step) + 1
        self.monitor = callback_monitor(pl_module, self.config, writer, start)
        self._keeper = StepKeeper(self.monitor, self.flush_every)
        self._logged = start - 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._keeper is not None:
            self._keeper.begin(trainer.global_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._keeper is not None and "grad" in self.monitor.kinds:
            self.monitor.record_grads()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._keeper is None:
            return
        self._keeper.end()
        every = trainer.log_every_n_steps if self.log_every is None else self.log_every
        step = trainer.global_step
        if every and step > self._logged and step % every == 0:
            self._log(trainer)

    def _log(self, trainer) -> None:
        step = trainer.global_step
        for k, v in trainer.callback_metrics.items():
            if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point():
                self.monitor.log(k, v.detach().reshape(1))
        scalars = self._keeper.log_scalars()  # a collective with a process group: every rank gets here
        self._logged = step
        if scalars and trainer.is_global_zero:
            for lg in trainer.loggers:
                lg.log_metrics(scalars, step=step)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._keeper is not None and trainer.global_step > self._logged:
            self._log(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._detach()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._detach()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._detach()

    def _detach(self) -> None:
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.monitor.detach()


class HookstatsCallback(HookstatsCallbackMixin, Callback):
    __doc__ = HookstatsCallbackMixin.__doc__


__all__ = ["HookstatsCallback", "HookstatsCallbackMixin"]
