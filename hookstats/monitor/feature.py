"""The Monitor's features: what a Monitor records besides its per-site statistics, behind one small protocol.

Note [monitor features]
A feature is an object with a `name` and these methods, called by the Monitor core at fixed points (configure
is optional; so are run_info() and summary(), below):
  configure(options) before the device buffers are made: it may set buffer options (locations adds element
                     coordinates to every row); optional;
  attach(ctx)        after the Monitor's own hooks are registered (so its hooks run after them, as before);
  on_step(step, recorded)  at Monitor.step(), before the step number moves on (`recorded`: the step was recorded,
                     i.e. not skipped by `every` and not paused);
  results()          what it measured (Monitor.feature_results() gathers them by name);
  detach()           removes its hooks; called once, by Monitor.detach(), or when construction fails after its
                     attach began (so it must undo a partial attach).
and, optionally, `run_info() -> dict` (added to the run header exporters get), `summary() -> str` (appended to
Monitor.summary()) and `nonfinite_origin() -> dict | None` (where NaN/Inf values began: Monitor.first_nonfinite()
adds it to its record as "origin") and `run_end_info() -> dict` (written as JSON, other values as their str; at detach() the Monitor hands what
every feature returns to each exporter's optional end(info) before closing it: the run log keeps it as the
header's "end").
The core knows no feature by name: the built-in ones (hookstats/monitor/features/: channel statistics, per-sample
gradient norms, element locations) register a factory for their MonitorConfig option with `register_feature`, and a
user passes their own as `Monitor(features=[...])`.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, runtime_checkable

import torch

from .._select import Selection


@dataclass(frozen=True)
class FeatureContext:
    """What a feature gets at attach: the model, the Monitor's selection (and its globs, for features that build a
    selection of their own kind), and the Monitor (a weak proxy: a feature must not keep it alive)."""

    model: torch.nn.Module
    selection: Selection
    include: list
    exclude: list
    monitor: Any


@runtime_checkable
class Feature(Protocol):
    """What a Monitor feature implements (Note [monitor features]); configure, run_info and summary are optional."""

    name: str

    def attach(self, ctx: FeatureContext) -> None:
        """Registers the feature's hooks, once, after the Monitor's own."""

    def on_step(self, step: int, recorded: bool) -> None:
        """At Monitor.step(), before the step number moves on; recorded: this step was recorded."""

    def results(self) -> Any:
        """What the feature measured (Monitor.feature_results())."""

    def detach(self) -> None:
        """Removes its hooks (also after a partial attach)."""


# option name -> (factory(value) -> Feature or None when the option is off, the option's "on" example for errors)
_REGISTRY: Dict[str, tuple] = {}


def register_feature(option: str, factory: Callable[[Any], Optional[Feature]], example: str) -> None:
    """Makes MonitorConfig option `option` build a feature: `factory(value)` returns the Feature, or None when the
    value leaves it off. `example` is how to turn it on ("per_sample=True"), for the error of a missing feature."""
    _REGISTRY[option] = (factory, example)


def registered() -> Dict[str, str]:
    """{option: example} of every registered feature option."""
    return {k: v[1] for k, v in _REGISTRY.items()}


def build_features(config) -> List[Feature]:
    """The features a checked MonitorConfig asks for: the registered options' (in registration order), then
    config.features. Each must implement the protocol and have a name no other has."""
    out = []
    for option, (factory, _) in _REGISTRY.items():
        f = factory(getattr(config, option))
        if f is not None:
            out.append(f)
    out += list(config.features)
    names = set()
    for f in out:
        if not isinstance(f, Feature):
            raise TypeError(f"hookstats.Monitor: a feature needs a name and attach, on_step, results and detach "
                            f"methods (hookstats.monitor.Feature); {type(f).__name__} lacks some")
        if f.name in names:
            raise ValueError(f"hookstats.Monitor: two features are named {f.name!r}")
        names.add(f.name)
    return out


_IN_USE: "weakref.WeakSet" = weakref.WeakSet()  # features attached to a live Monitor


def claim(feature: Feature) -> None:
    """Marks a feature attached; a feature already attached to another Monitor (one config's `features` given to two
    Monitors at once) is refused: its state would mix both. Detached, it may be attached again."""
    try:
        if feature in _IN_USE:
            raise ValueError(f"hookstats.Monitor: the feature {feature.name!r} is attached to another Monitor; give "
                             "each Monitor its own instance (or detach the other first)")
        _IN_USE.add(feature)
    except TypeError:  # not weak-referenceable (__slots__ without __weakref__): not tracked
        pass


def release(feature: Feature) -> None:
    try:
        _IN_USE.discard(feature)
    except TypeError:
        pass


class FeatureAccess:
    """The Monitor's methods that read a feature (mixed into Monitor): `feature(name)`, `feature_results()`, and
    the shortcuts of the built-in features."""

    _features: list

    @property
    def features(self) -> Dict[str, Feature]:
        """{name: feature} of the attached features."""
        return {f.name: f for f in self._features}

    def feature(self, name: str, default: Any = ...) -> Any:
        """The attached feature called `name`; without a default, a RuntimeError saying which option attaches it."""
        for f in self._features:
            if f.name == name:
                return f
        if default is not ...:
            return default
        how = registered().get(name)
        raise RuntimeError(f"hookstats.Monitor has no {name!r} feature" +
                           (f": construct it with Monitor(..., {how})" if how else
                            f" (attached: {[f.name for f in self._features]})"))

    def feature_results(self) -> Dict[str, Any]:
        """{name: results()} of every attached feature."""
        return {f.name: f.results() for f in self._features}

    def channel_results(self) -> dict:
        """{"inputs" / "outputs": {module: ChannelStats}}: the per-channel statistics accumulated since the Monitor
        was attached (Monitor(channel_stats={"inputs": -1})), one host copy per device; {} without channel_stats."""
        f = self.feature("channel_stats", None)
        return {} if f is None else f.results()

    def coverage(self):
        """Which trainable parameters the per-sample norms cover and why the others are not
        (hookstats.per_sample.Coverage; per_sample=True)."""
        return self.feature("per_sample").coverage()

    def sample_norms(self) -> list:
        """(step, layer names, [layers, samples] float64 host tensor) of every recorded step with per_sample=True:
        each sample's gradient norm per layer (hookstats.PerSampleGradNorms), one host copy per step when read;
        [] without per_sample."""
        f = self.feature("per_sample", None)
        return [] if f is None else f.results()

    def top_samples(self, k: int = 1) -> list:
        """The k (step, sample) pairs with the largest total gradient norm over the recorded steps (per_sample=True),
        largest first, non-finite first: dicts with step, sample, norm; [] without per_sample."""
        f = self.feature("per_sample", None)
        return [] if f is None else f.top_samples(k)

    def first_nonfinite_sample(self) -> Optional[dict]:
        """The first (step, sample) whose gradient norm is NaN or Inf, with the layers where it is: {"step",
        "sample", "norm", "layers"}, or None (also without per_sample)."""
        f = self.feature("per_sample", None)
        return None if f is None else f.first_nonfinite_sample()
