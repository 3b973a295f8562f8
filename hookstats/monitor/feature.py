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
Monitor.summary()), `nonfinite_origin() -> dict | None` (where NaN/Inf values began: Monitor.first_nonfinite() adds
it to its record as "origin") and `run_end_info() -> dict` (written as JSON, other values as their str; at detach()
the Monitor hands what every feature returns to each exporter's optional end(info) before closing it: the run log
keeps it as the header's "end").
The core knows no feature by name: the built-in ones (hookstats/monitor/features/: channel statistics, per-sample
gradient norms, element locations, non-finite ops) register a factory for their MonitorConfig option with
`register_feature`, and a user passes their own as `Monitor(features=[...])`. A feature's shortcuts on the Monitor
(`mon.top_samples(k)` reads the per_sample feature) come with its registration too (`Shortcut`): FeatureAccess, the
Monitor's base, holds only what every feature shares (`feature(name)`, `features`, `feature_results()`).
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, runtime_checkable

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


@dataclass(frozen=True)
class Shortcut:
    """A Monitor method that reads one registered feature: `mon.<name>(*args)` calls `method` (a function of the
    feature's class, whose signature it shows) on the feature the option attaches (named as the option), and
    without that feature returns `off()` (off=None: the RuntimeError naming the option that attaches it). `doc` is
    its docstring (default: the method's)."""

    name: str
    method: Callable
    off: Optional[Callable[[], Any]] = None
    doc: str = ""


# option name -> (factory(value) -> Feature or None when the option is off, the option's "on" example for errors)
_REGISTRY: Dict[str, tuple] = {}
_SHORTCUTS: Dict[str, str] = {}  # Monitor method name -> the option whose feature it reads


def register_feature(option: str, factory: Callable[[Any], Optional[Feature]], example: str,
                     shortcuts: Sequence[Shortcut] = ()) -> None:
    """Makes MonitorConfig option `option` build a feature: `factory(value)` returns the Feature (named `option`),
    or None when the value leaves it off. `example` is how to turn it on ("per_sample=True"), for the error of a
    missing feature; `shortcuts` become Monitor methods that read the feature (`Shortcut`)."""
    for sc in shortcuts:
        if sc.name.startswith("_") or (_SHORTCUTS.get(sc.name, option) != option or
                                       (sc.name not in _SHORTCUTS and _taken(sc.name))):
            raise ValueError(f"hookstats.monitor.register_feature: the shortcut {sc.name!r} of {option!r} would hide "
                             "another Monitor method; give it another name")
    _REGISTRY[option] = (factory, example)
    for sc in shortcuts:
        _SHORTCUTS[sc.name] = option
        setattr(FeatureAccess, sc.name, _shortcut(option, sc))


def registered() -> Dict[str, str]:
    """{option: example} of every registered feature option."""
    return {k: v[1] for k, v in _REGISTRY.items()}


def shortcuts() -> Dict[str, str]:
    """{Monitor method: the option whose feature it reads} of every registered shortcut."""
    return dict(_SHORTCUTS)


def _shortcut(option: str, sc: Shortcut):
    method = sc.method.__name__

    def shortcut(self, *args, **kwargs):
        f = self.feature(option) if sc.off is None else self.feature(option, None)
        return sc.off() if f is None else getattr(f, method)(*args, **kwargs)

    shortcut.__name__ = sc.name
    shortcut.__qualname__ = f"FeatureAccess.{sc.name}"
    shortcut.__doc__ = sc.doc or sc.method.__doc__
    shortcut.__signature__ = inspect.signature(sc.method)
    return shortcut


def _taken(name: str) -> bool:
    """Whether FeatureAccess or a class built on it (the Monitor) has an attribute `name` already."""
    todo, seen = [FeatureAccess], set()
    while todo:
        cls = todo.pop()
        if name in vars(cls):
            return True
        seen.add(cls)
        todo += [c for c in cls.__subclasses__() if c not in seen]
    return False


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
    """The Monitor's methods that read a feature (mixed into Monitor): `feature(name)`, `features`,
    `feature_results()`, and the shortcuts each registered feature contributes (`register_feature(...,
    shortcuts=...)`: `channel_results()`, `top_samples(k)`, ...)."""

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

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        hidden = sorted(set(vars(cls)) & set(_SHORTCUTS))
        if hidden:
            raise TypeError(f"{cls.__name__} defines {hidden}, which are shortcuts of registered features")
