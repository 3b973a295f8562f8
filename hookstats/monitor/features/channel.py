"""channel_stats={"inputs": dim, "outputs": dim}: per-channel statistics of the selected modules' inputs / outputs,
accumulated over every call by a hookstats.ChannelCalibrator per side."""
from __future__ import annotations

from typing import Dict

from ..._select import Site
from ...channel import FORWARD_SITES, ChannelCalibrator
from ..feature import FeatureContext, Shortcut, register_feature


class ChannelStatsFeature:
    name = "channel_stats"

    def __init__(self, sides: Dict[str, int]):
        if not isinstance(sides, dict) or not sides:
            raise TypeError("hookstats.Monitor: channel_stats must be a dict such as {'inputs': -1} (on: dim), got "
                            f"{sides!r}")
        self.sites: Dict[Site, int] = {}  # parsed here, at the public edge: a wrong key fails the Monitor's checks
        for on, dim in sides.items():
            self.sites[Site.parse(on, FORWARD_SITES, "hookstats.Monitor: a channel_stats key must be a forward site, "
                                  "got")] = dim
        self._calibrators: Dict[str, ChannelCalibrator] = {}

    def attach(self, ctx: FeatureContext) -> None:
        for site, dim in self.sites.items():
            cal = ChannelCalibrator(ctx.model, include=ctx.include, exclude=ctx.exclude, dim=dim, on=site)
            self._calibrators[cal.on] = cal

    def on_step(self, step: int, recorded: bool) -> None:
        pass  # accumulated over every call, steps or not (calibration)

    def results(self) -> dict:
        """{"inputs" / "outputs": {module: ChannelStats}}, one host copy per device."""
        return {on: cal.results() for on, cal in self._calibrators.items()}

    def detach(self) -> None:
        for cal in self._calibrators.values():
            cal.remove()


register_feature("channel_stats", lambda v: None if v is None else ChannelStatsFeature(v),
                 "channel_stats={'inputs': -1}", shortcuts=[
                     Shortcut("channel_results", ChannelStatsFeature.results, dict,
                              """{"inputs" / "outputs": {module: ChannelStats}}: the per-channel statistics accumulated
        since the Monitor was attached (Monitor(channel_stats={"inputs": -1})), one host copy per device; {} without
        channel_stats.""")])
