"""`HookstatsCallback`: a Hugging Face `transformers.TrainerCallback` that runs a hookstats Monitor on the model the
Trainer trains.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[HookstatsCallback()])

What it does at each Trainer event (Note [one Monitor step per optimizer step] in hookstats.integrations._common):
  on_train_begin        attaches a Monitor to the model (under DDP / accelerate / torch.compile wrappers), numbering
                        steps from the Trainer's restored global step + 1 (a resumed run continues), paused
  on_step_begin         records from the first micro-batch of an optimizer step on (gradient accumulation: one step)
  on_pre_optimizer_step records the parameter grads (kind "grad"): after the Trainer's max_grad_norm clipping (and
                        AMP unscaling), right before optimizer.step(): the grads the optimizer uses
  on_step_end           pauses (evaluation and checkpointing between steps record nothing)
  on_log                adds the Trainer's numeric logs (loss, learning_rate, grad_norm, ...) to the run log as
                        scalars, flushes, and adds a few summary scalars (hookstats.integrations._common.Summary) to
                        the Trainer's `logs`, so that every report_to backend (TensorBoard, W&B, ...) gets them
                        (and state.log_history)
  on_train_end          detaches: the rest is flushed and the log closed
The log is written under args.output_dir/hookstats (log.parquet/ where pyarrow is installed, else log.jsonl): read it
with hookstats.runlog.read_log, pandas, DuckDB or Polars, or `python -m hookstats report OUTPUT_DIR/hookstats`.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Optional, Sequence

from transformers import TrainerCallback

from ..monitor import Monitor
from ._common import DEFAULT_KINDS, PREFIX, StepKeeper, callback_config, callback_monitor, make_writer


class HookstatsCallback(TrainerCallback):
    """Statistics of every matching layer at every optimizer step of a Hugging Face Trainer (see the module
    docstring for when each is recorded).

    include / exclude / kinds / histogram / every / histogram_every: as hookstats.Monitor (kinds default to module
    outputs, grad_outputs and parameter grads). log_dir: the run directory (default args.output_dir/hookstats);
    log_format: "auto" (Parquet where pyarrow is installed, else JSONL), "parquet" or "jsonl". flush_every: copy the
    records to the host and hand them to the writer every that many optimizer steps (and at each Trainer log); logs:
    add the summary scalars to the Trainer's logs. monitor_kwargs: any other hookstats.MonitorConfig option, checked
    here (a misspelt one fails when the callback is made; exporters given there write beside the run log);
    `callback.config` is the MonitorConfig. The Monitor is `callback.monitor` from on_train_begin on;
    `callback.log_path` is the log."""

    def __init__(self, include: Sequence[str] | str = "*", exclude: Sequence[str] | str = (),
                 kinds: Sequence[str] = DEFAULT_KINDS, histogram=None, every: int = 1, histogram_every: int = 1,
                 log_dir: Optional[str] = None, log_format: str = "auto", flush_every: Optional[int] = 50,
                 logs: bool = True, **monitor_kwargs: Any):
        self.config = callback_config(monitor_kwargs, include=include, exclude=exclude, kinds=tuple(kinds),
                                      histogram=histogram, every=every, histogram_every=histogram_every)
        self.log_dir, self.log_format, self.flush_every, self.logs = log_dir, log_format, flush_every, logs
        self.monitor: Optional[Monitor] = None
        self.log_path: Optional[str] = None
        self._keeper: Optional[StepKeeper] = None
        self._warned = False

    def _first(self) -> None:
        """Moves this callback to the front of the Trainer's callback list: the report_to callbacks (added before
        the user's) write `logs` in their on_log, so the summary scalars must be in `logs` before theirs runs. The
        list is found in the calling CallbackHandler.call_event's frame; moving an item to the front while that loop
        iterates neither skips nor repeats any callback."""
        f = sys._getframe(1)
        for _ in range(4):
            if f is None:
                break
            cbs = getattr(f.f_locals.get("self"), "callbacks", None)
            if isinstance(cbs, list) and any(c is self for c in cbs):
                if cbs[0] is not self:
                    cbs.remove(self)
                    cbs.insert(0, self)
                return
            f = f.f_back
        if self.logs and not self._warned:
            self._warned = True
            warnings.warn("hookstats HookstatsCallback: the Trainer's callback list was not found, so the callback "
                          "could not go first; report_to callbacks listed before it write their logs without the "
                          "hookstats/ scalars (the run log has everything)", stacklevel=2)

    def on_init_end(self, args, state, control, **kwargs):
        self._first()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._first()
        if self.monitor is not None:  # a second train() with the same callback
            self._detach()
        if model is None:
            raise RuntimeError("hookstats HookstatsCallback: the Trainer passed no model to on_train_begin")
        run_dir = self.log_dir or os.path.join(args.output_dir, "hookstats")
        writer, self.log_path = make_writer(run_dir, self.log_format)
        self.monitor = callback_monitor(model, self.config, writer, state.global_step + 1)
        self._keeper = StepKeeper(self.monitor, self.flush_every)

    def on_step_begin(self, args, state, control, **kwargs):
        if self._keeper is not None:
            self._keeper.begin(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._keeper is not None and "grad" in self.monitor.kinds:
            self.monitor.record_grads()

    def on_step_end(self, args, state, control, **kwargs):
        if self._keeper is not None:
            self._keeper.end()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._keeper is None:
            return
        for k, v in (logs or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith(PREFIX):
                self.monitor.log(k, float(v))
        scalars = self._keeper.log_scalars()
        if self.logs and logs is not None and scalars:
            hist = state.log_history[-1] if state.log_history else None
            if hist is not None and hist.get("step") == state.global_step and all(k in hist for k in logs):
                hist.update(scalars)  # the Trainer copied `logs` there before on_log: trainer_state.json has them too
            logs.update(scalars)

    def on_train_end(self, args, state, control, **kwargs):
        self._detach()

    def _detach(self) -> None:
        mon, self._keeper = self.monitor, None
        if mon is not None:
            mon.detach()


__all__ = ["HookstatsCallback"]
