"""The built-in Monitor features (Note [monitor features] in hookstats/monitor/feature.py): each module implements
the Feature protocol for one MonitorConfig option and registers it; importing this package registers all three."""
from . import channel, locations, per_sample  # noqa: F401  (each registers its option)
from .channel import ChannelStatsFeature
from .locations import LocationsFeature
from .per_sample import PerSampleFeature

__all__ = ["ChannelStatsFeature", "LocationsFeature", "PerSampleFeature"]
