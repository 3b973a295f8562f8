"""nonfinite_ops=True: beside the Monitor's module-level records, the first ATen op whose floating output held a NaN
or an Inf (hookstats.detect_nonfinite: op, phase, module, autograd node, element), on the steps the Monitor
records, numbered as the Monitor numbers them. Read with `mon.feature("nonfinite_ops").first()` (one host read);
the run log gets, every recorded step, the scalar `nonfinite_ops/found` (0, or the op's order once one was found:
a device copy, no sync) and the Monitor's summary the op's line."""
from __future__ import annotations

from typing import Optional

import torch

from ...anomaly import _FOUND, NonfiniteGuard, NonfiniteOp
from ...distributed import resolve_group
from ..feature import FeatureContext, register_feature

_PHASE_ORDER = {"forward": 0, "backward": 1, "optimizer": 2}


class NonfiniteOpsFeature:
    name = "nonfinite_ops"

    def __init__(self):
        self._guard: Optional[NonfiniteGuard] = None
        self._monitor = None
        self._rank = 0
        self._group = None
        self._final: Optional[NonfiniteOp] = None
        self._read = False

    def attach(self, ctx: FeatureContext) -> None:
        self._monitor = ctx.monitor
        self._rank = ctx.monitor.rank
        pg = ctx.monitor.config.process_group
        self._group = resolve_group(pg) if pg is not None else None
        self._guard = NonfiniteGuard(ctx.model, every=ctx.monitor.every, start_step=ctx.monitor.current_step)
        self._guard.start()

    def on_step(self, step: int, recorded: bool) -> None:
        g = self._guard
        if g is None:
            return
        if recorded:
            for s in torch.ops.hookstats._nf_states():
                self._monitor.log("nonfinite_ops/found" + ("" if s.is_cpu else f"/{s.device}"), s[_FOUND:_FOUND + 1])
        g.step()

    def first(self, across_ranks: bool = False) -> Optional[NonfiniteOp]:
        """The first non-finite op output so far (None when all were finite), with the Monitor's rank (`rank`): one
        host read of each device's state. across_ranks=True (with the Monitor's process_group; a collective: every
        rank calls it) gathers every rank's and returns the earliest (by step, then phase, then rank), so that
        every rank learns which rank went bad first."""
        if self._guard is None:
            ev = self._final if self._read else None
        else:
            ev = self._guard.first()
            if ev is not None:
                ev["rank"] = self._rank
        if not across_ranks or self._group is None:
            return ev
        import torch.distributed as dist

        gathered: list = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(gathered, None if ev is None else dict(ev), group=self._group)
        found = [NonfiniteOp(e) for e in gathered if e is not None]
        return min(found, key=lambda e: (e["step"], _PHASE_ORDER.get(e["phase"], 3), e["rank"])) if found else None

    def results(self) -> Optional[NonfiniteOp]:
        return self.first()

    def run_end_info(self) -> dict:
        """{"nonfinite_op": the first non-finite op output, or None}: what the run log keeps at its end
        (read_run(path).info["end"]["nonfinite_op"]; its dtype and device as strings)."""
        ev = self.first()
        return {"nonfinite_op": None if ev is None else dict(ev)}

    def nonfinite_origin(self) -> Optional[NonfiniteOp]:
        """What Monitor.first_nonfinite() adds as its record's "origin" (this rank's op; a process group's earliest
        needs first(across_ranks=True), a collective)."""
        return self.first()

    def run_info(self) -> dict:
        return {"nonfinite_ops": True}

    def summary(self) -> str:
        ev = self.first()
        return "first non-finite op output: " + ("none" if ev is None else str(ev))

    def detach(self) -> None:
        g, self._guard = self._guard, None
        if g is not None:
            g.stop()
            self._final = g.first()
            if self._final is not None:
                self._final["rank"] = self._rank
            self._read = True


register_feature("nonfinite_ops", lambda v: NonfiniteOpsFeature() if v else None, "nonfinite_ops=True")
