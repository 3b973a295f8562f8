"""Which modules and parameters a hookstats tool attaches to, and the names of the places a hook can sit.

`Selection` is the one include/exclude rule of the Monitor, `ChannelCalibrator` and `PerSampleGradNorms`: glob
patterns (fnmatch, case-sensitive) matched against a module's qualified name ("" is the model itself,
"layers.0.attn") and its class name ("Linear", "*Norm*"); parameters are matched by their qualified name only.
`Site` names where a hook sits, with the aliases each tool accepted before (`ChannelCalibrator(on="inputs")` is
`Site.FORWARD_PRE`, the Monitor's "grad_output" is `Site.BACKWARD_PRE`).
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
    """Where a hook sits. The value is the Monitor's kind name; `Site.lookup` also takes the aliases (SITE_ALIASES)."""

    FORWARD_PRE = "forward_pre"    # the module's positional inputs (register_forward_pre_hook)
    FORWARD = "forward"            # its output (register_forward_hook)
    BACKWARD_PRE = "backward_pre"  # grad_output (the full backward pre-hook's argument)
    BACKWARD = "backward"          # grad_input (register_full_backward_hook)
    GRAD = "grad"                  # each parameter's .grad (register_post_accumulate_grad_hook)

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


SITE_ALIASES = {"inputs": "forward_pre", "outputs": "forward", "grad_output": "backward_pre", "grad_input": "backward",
            "param_grad": "grad"}
