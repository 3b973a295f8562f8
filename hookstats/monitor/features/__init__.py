"""The built-in Monitor features (Note [monitor features] in hookstats/monitor/feature.py): each module implements
the Feature protocol for one MonitorConfig option and registers it; importing this package registers all four."""
from . import channel, locations, nonfinite_ops, per_sample  # noqa: F401  (each registers its option)
from .channel import ChannelStatsFeature
from .locations import LocationsFeature
from .nonfinite_ops import NonfiniteOpsFeature
from .per_sample import PerSampleFeature

__all__ = ["ChannelStatsFeature", "LocationsFeature", "NonfiniteOpsFeature", "PerSampleFeature"]
