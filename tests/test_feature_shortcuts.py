"""Note [monitor features]: each feature brings its Monitor shortcuts through register_feature; none may hide a
Monitor method or another feature's shortcut."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import hookstats
from hookstats.monitor import Shortcut, register_feature
from hookstats.monitor.feature import FeatureAccess, registered, shortcuts
from hookstats.monitor.features import ChannelStatsFeature, PerSampleFeature


def test_builtin_shortcuts_come_from_the_registry():
    assert shortcuts() == {"channel_results": "channel_stats", "coverage": "per_sample",
                           "sample_norms": "per_sample", "top_samples": "per_sample",
                           "first_nonfinite_sample": "per_sample"}
    assert set(shortcuts().values()) <= set(registered())
    sig = inspect.signature(hookstats.Monitor.top_samples)
    assert list(sig.parameters) == ["self", "k"] and sig.parameters["k"].default == 1
    assert "[ranking samples]" in hookstats.Monitor.top_samples.__doc__


def test_a_shortcut_reads_its_feature_or_its_off_value():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    mon = hookstats.Monitor(model, kinds="forward", per_sample=True, channel_stats={"inputs": -1})
    model(torch.randn(5, 3)).sum().backward()
    mon.step()
    assert mon.top_samples(2) == mon.feature("per_sample").top_samples(2) and len(mon.top_samples(2)) == 2
    assert set(mon.channel_results()["inputs"]) == {"", "0", "1", "2"}  # every module (include="*")
    mon.detach()
    plain = hookstats.Monitor(model)
    assert plain.top_samples(3) == [] and plain.channel_results() == {} and plain.first_nonfinite_sample() is None
    with pytest.raises(RuntimeError, match=r"construct it with Monitor\(\.\.\., per_sample=True\)"):
        plain.coverage()
    plain.detach()


@pytest.mark.parametrize("name", ["flush", "records", "feature", "top_samples", "_private"])
def test_a_shortcut_may_not_hide_a_monitor_method(name):
    before = (registered(), shortcuts())
    with pytest.raises(ValueError, match=f"shortcut {name!r} of 'channel_stats' would hide"):
        register_feature("channel_stats", lambda v: None, "channel_stats={'inputs': -1}",
                         shortcuts=[Shortcut(name, ChannelStatsFeature.results, dict)])
    assert (registered(), shortcuts()) == before  # nothing registered halfway


def test_a_monitor_subclass_may_not_hide_a_shortcut():
    with pytest.raises(TypeError, match=r"defines \['top_samples'\], which are shortcuts"):
        class Mine(hookstats.Monitor):  # noqa: F841
            def top_samples(self, k=1):
                return []
    assert "top_samples" in vars(FeatureAccess) and PerSampleFeature.top_samples.__name__ == "top_samples"
