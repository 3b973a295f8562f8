"""locations=True: every record also names the coordinates of its tensor's first largest |x| and first NaN/Inf,
found by the same kernel call (Note [element locations]); the buffers get a coordinates row per record."""
from __future__ import annotations

from ..feature import FeatureContext, register_feature


class LocationsFeature:
    name = "locations"

    def __init__(self):
        self._monitor = None

    def configure(self, options: dict) -> None:
        options["locations"] = True

    def attach(self, ctx: FeatureContext) -> None:
        self._monitor = ctx.monitor

    def on_step(self, step: int, recorded: bool) -> None:
        pass  # the coordinates travel in the Monitor's own rows

    def results(self) -> list:
        """Every record so far whose tensor held a NaN or Inf, with its element (`first_nonfinite_index`)."""
        if self._monitor is None:
            return []
        return [r for r in self._monitor.records() if r.get("first_nonfinite_index") is not None]

    def run_info(self) -> dict:
        return {"locations": True}

    def detach(self) -> None:
        pass  # records stay readable after detach; the weak proxy dies with the Monitor


register_feature("locations", lambda v: LocationsFeature() if v else None, "locations=True")
