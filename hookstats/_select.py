"""Which modules and parameters a hookstats tool attaches to, and the names of the places a hook can sit.

`Selection` is the one include/exclude rule of the Monitor, `ChannelCalibrator` and `PerSampleGradNorms`: glob
patterns (fnmatch, case-sensitive) matched against a module's qualified name ("" is the model itself,
"layers.0.attn") and its class name ("Linear", "*Norm*"); parameters are matched by their qualified name only.
`Site` names where a hook sits: the one vocabulary of hook sites inside the library. Strings are accepted at the
public edge only (`Monitor(kinds=...)`, `ChannelCalibrator(on=...)`, `channel_stats={...}`), parsed there once by
`Site.parse`, which also takes the aliases each tool accepted before (`on="inputs"` is `Site.FORWARD_PRE`, the
Monitor's "grad_output" is `Site.BACKWARD_PRE`). A Site is a str whose value is the `kind` written to the logs, so
every log keeps the values it held; `Site.record_labels` are the kinds `hookstats.record` writes.
"""
from __future__ import annotations

import enum
import fnmatch
from typing import Iterator, Optional, Sequence, Tuple, Union

import torch

Globs = Union[str, Sequence[str]]


def globs(patterns: Globs) -> Tuple[str, ...]:
    """A tuple of patterns from one pattern or a sequence of them."""
    if isinstance(patterns, str):
        return (patterns,)
    out = tuple(patterns)
    for p in out:
        if not isinstance(p, str):
            raise TypeError(f"hookstats: include/exclude patterns must be strings, got {p!r}")
    return out


class Selection:
    """include / exclude globs over qualified names and class names (see the module docstring)."""

    __slots__ = ("include", "exclude")

    def __init__(self, include: Globs = "*", exclude: Globs = ()):
        self.include, self.exclude = globs(include), globs(exclude)

    def matches(self, name: str, mod: Optional[torch.nn.Module] = None) -> bool:
        """Whether `name` (and, for a module, its class name) matches an include glob and no exclude glob."""
        keys = (name,) if mod is None else (name, type(mod).__name__)
        return any(fnmatch.fnmatchcase(k, p) for p in self.include for k in keys) and \
            not any(fnmatch.fnmatchcase(k, p) for p in self.exclude for k in keys)

    def modules(self, model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
        """(qualified name, module) of every selected module of `model`, in `named_modules()` order."""
        for name, mod in model.named_modules():
            if self.matches(name, mod):
                yield name, mod

    def parameters(self, model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Parameter]]:
        """(qualified name, parameter) of every selected parameter of `model` that requires grad."""
        for name, p in model.named_parameters():
            if p.requires_grad and self.matches(name):
                yield name, p

    def __repr__(self) -> str:
        return f"Selection(include={self.include!r}, exclude={self.exclude!r})"


class Site(str, enum.Enum):
    """Where a hook sits. The value is the `kind` a Monitor's records carry; `Site.parse` reads a site name or an alias
    (SITE_ALIASES) at the public edge."""

    FORWARD_PRE = "forward_pre"    # the module's positional inputs (register_forward_pre_hook)
    FORWARD = "forward"            # its output (register_forward_hook)
    BACKWARD_PRE = "backward_pre"  # grad_output (the full backward pre-hook's argument)
    BACKWARD = "backward"          # grad_input (register_full_backward_hook)
    GRAD = "grad"                  # each parameter's .grad (register_post_accumulate_grad_hook)
    TENSOR = "tensor"              # a tensor's gradient (Tensor.register_hook): hook objects only, no Monitor kind

    # str() and format() give the value, as enum.StrEnum's do (Python 3.11+): "kind forward", never "Site.FORWARD"
    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def lookup(cls, name) -> Optional["Site"]:
        """The site `name` (a Site, a site name or an alias) stands for, None if it stands for none."""
        if isinstance(name, Site):
            return name
        if not isinstance(name, str):
            return None
        try:
            return cls(SITE_ALIASES.get(name, name))
        except ValueError:
            return None

    @classmethod
    def parse(cls, name, accepted: Sequence["Site"], what: str) -> "Site":
        """The site `name` stands for (a Site, its value or an alias), which must be one of `accepted`: the public
        edge's one parse. Otherwise a ValueError (a TypeError for a name that is no str) reading "{what} {name!r}: use
        one of ..." with the accepted names and their aliases."""
        site = cls.lookup(name)
        if site is not None and site in accepted:
            return site
        aliases = ", ".join(f"{a!r} for {v!r}" for a, v in SITE_ALIASES.items() if cls(v) in accepted)
        msg = (f"{what} {name!r}: use one of {', '.join(repr(s.value) for s in accepted)}"
               + (f" (or an alias: {aliases})" if aliases else ""))
        raise (ValueError if isinstance(name, str) else TypeError)(msg)

    @property
    def record_labels(self) -> Tuple[str, ...]:
        """The kinds `hookstats.record` labels this site's records with (what its logs hold): the value, except a
        full backward hook's two sides ("backward:grad_input", "backward:grad_output") and the post-accumulate form
        ("post_accumulate")."""
        return _RECORD_LABELS.get(self, (self.value,))


SITE_ALIASES = {"inputs": "forward_pre", "outputs": "forward", "grad_output": "backward_pre", "grad_input": "backward",
                "param_grad": "grad"}

# The sites a Monitor attaches (its kinds): every site but a tensor's, which only a hook object sits on.
MONITOR_SITES = (Site.FORWARD_PRE, Site.FORWARD, Site.BACKWARD_PRE, Site.BACKWARD, Site.GRAD)

_RECORD_LABELS = {Site.BACKWARD: ("backward:grad_input", "backward:grad_output"), Site.GRAD: ("post_accumulate",)}
