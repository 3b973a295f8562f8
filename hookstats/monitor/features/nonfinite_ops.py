"""nonfinite_ops=True: beside the Monitor's module-level records, the first ATen op whose floating output held a NaN
or an Inf (hookstats.detect_nonfinite: op, phase, module, autograd node, element), on the steps the Monitor
records, numbered as the Monitor numbers them. Read with `mon.feature("nonfinite_ops").first()` (one host read);
the run log gets, every recorded step, the scalar `nonfinite_ops/found` (0, or the op's order once one was found:
a device copy, no sync) and the Monitor's summary the op's line."""
from __future__ import annotations

from typing import Optional

import torch

from ...anomaly import _FOUND, NonfiniteGuard, NonfiniteOp
from ..feature import FeatureContext, register_feature


class NonfiniteOpsFeature:
    name = "nonfinite_ops"

    def __init__(self):
        self._guard: Optional[NonfiniteGuard] = None
        self._monitor = None
        self._rank = 0
        self._final: Optional[NonfiniteOp] = None
        self._read = False

    def attach(self, ctx: FeatureContext) -> None:
        self._monitor = ctx.monitor
        self._rank = ctx.monitor.rank
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

    def first(self) -> Optional[NonfiniteOp]:
        """The first non-finite op output so far (None when all were finite), with the Monitor's rank (`rank`): one
        host read of each device's state."""
        if self._guard is None:
            return self._final if self._read else None
        ev = self._guard.first()
        if ev is not None:
            ev["rank"] = self._rank
        return ev

    def results(self) -> Optional[NonfiniteOp]:
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
