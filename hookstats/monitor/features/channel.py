"""channel_stats={"inputs": dim, "outputs": dim}: per-channel statistics of the selected modules' inputs / outputs,
accumulated over every call by a hookstats.ChannelCalibrator per side."""
from __future__ import annotations

from typing import Dict

from ...channel import ChannelCalibrator
from ..feature import FeatureContext, register_feature

_SIDES = {"forward_pre": "inputs", "forward": "outputs", "inputs": "inputs", "outputs": "outputs"}


class ChannelStatsFeature:
    name = "channel_stats"

    def __init__(self, sides: Dict[str, int]):
        if not isinstance(sides, dict) or not sides:
            raise TypeError("hookstats.Monitor: channel_stats must be a dict such as {'inputs': -1} (on: dim), got "
                            f"{sides!r}")
        self.sides = {_SIDES.get(on, on): dim for on, dim in sides.items()}
        self._calibrators: Dict[str, ChannelCalibrator] = {}

    def attach(self, ctx: FeatureContext) -> None:
        for on, dim in self.sides.items():
            self._calibrators[on] = ChannelCalibrator(ctx.model, include=ctx.include, exclude=ctx.exclude, dim=dim,
                                                      on=on)

    def on_step(self, step: int, recorded: bool) -> None:
        pass  # accumulated over every call, steps or not (calibration)

    def results(self) -> dict:
        """{"inputs" / "outputs": {module: ChannelStats}}, one host copy per device."""
        return {on: cal.results() for on, cal in self._calibrators.items()}

    def detach(self) -> None:
        for cal in self._calibrators.values():
            cal.remove()


register_feature("channel_stats", lambda v: None if v is None else ChannelStatsFeature(v),
                 "channel_stats={'inputs': -1}")
