"""Which rule computes a layer's per-sample gradient: rules registered by exact type, by qualified class name (for
other libraries' classes, without importing them) or by a pattern, and the layers refused with a reason.

Note [exact-type rules]: a rule is chosen by the module's exact type, never by isinstance: timm's StdConv2d is an
nn.Conv2d that standardises its weight, LayerNorm2d an nn.LayerNorm over dim 1; a rule written for the base class
would give a plausible, wrong number. A subclass that does not override `forward` computes what its base computes
and gets the base's rule; one with its own `forward` gets a rule only by proof: a pattern (register_pattern) whose
match compares the class's forward with a reference copy in the rule's file by its code (same_code: bytecode, names,
constants, arguments, nested code), as for FalconLinear, the HF RMSNorms and embeddings, peft's LoRA Embedding. Any
other is refused, named in a warning and left out of the total.
"""
from __future__ import annotations

import fnmatch
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .terms import Term


class Rule:
    """How one layer type's per-sample gradient is computed from what its forward keeps and its output's gradient.

    A rule is stateless; subclass it and register an instance with `register_rule`:

    - `params`: the parameter attributes the rule covers (those the module holds as nn.Parameter and that require
      grad are computed); `param_paths(mod)` returns them for a given module (default `params`), and may name a
      child's parameter by a dotted path ("lora_embedding_A.default": a parameter the module applies itself but a
      ParameterDict holds).
    - `batch_dim_applies`: True when the inputs are [B, T..., features] (Linear, Embedding, norms over the last
      dims), so that `PerSampleGradNorms(batch_dim=1)` moves dim 1 to the front; False for [B, C, ...] (conv).
    - `rowwise`: True when output row r (dim 0) is computed from input row r alone (Linear, norms over the last
      dims, embeddings): a batch-major flattened input then makes a batch-major flattened output (Note [flattened
      batches] in batch.py).
    - `defer`: the parameter attributes whose gradient the clip may compute instead of autograd (Note
      [book-keeping] in bookkeeping.py): attributes the module's forward applies as an ordinary tensor argument (read
      from mod._parameters at the call), whose gradient its terms give in full (Linear and conv weights, conv biases,
      an Embedding's table); `deferrable(mod)` returns them for a given module (default `defer`).
    - `hook_site(mod)`: the module whose call the rule reads (default: `mod` itself): a child, for parameters the
      module applies in its own forward before calling that child (timm ViT's class token and position table, read at
      its pos_drop); input(), output() and keep() then see that child's arguments and output, with `mod` the holder.
    - `input(mod, args, kwargs)`: the tensor whose batch dim is checked and that keep() receives (default: the
      first argument).
    - `check(mod)`: a reason to refuse this module (an option the rule does not cover), or None.
    - `is_batched(mod, x)`: whether the input has a batch dim (False: one sample, the input gets a leading 1).
    - `expands(mod, x)`: whether a call fed a batch of 1 gets its output expanded to the batch (default False:
      refused; Note [broadcast layers]).
    - `keep(mod, x, args, kwargs)`: what the forward keeps for the backward, from the first input with its batch
      dim first (default: the detached input itself, a tensor autograd keeps anyway); may raise
      hookstats.per_sample.Refused(reason) for a call it cannot split per sample; `keep_call(mod, x, args, kwargs,
      output)` is what the forward hook calls (default: keep()), for a rule that reads the call's output graph.
    - `output(mod, out)`: the output tensor whose gradient the rule needs (default: the output, when a tensor).
    - `terms(mod, kept, grad, attrs)`: {attribute: Term} (hookstats.per_sample.terms: Outer, Index, Dense) for the
      attributes in `attrs`, from the kept value and the output's gradient (batch dim first), in float64 for float64
      models and float32 otherwise. The squared norm, the clip delta and the cross terms of tied weights all follow
      from the terms.
    """

    params: Tuple[str, ...] = ("weight", "bias")
    batch_dim_applies: bool = True
    rowwise: bool = False
    defer: Tuple[str, ...] = ()

    def input(self, mod: nn.Module, args: tuple, kwargs: Optional[dict]):
        """The tensor whose dim 0 (dim batch_dim) is the batch and that keep() receives: the first argument."""
        return args[0] if args else None

    def param_paths(self, mod: nn.Module) -> Sequence[str]:
        return self.params

    def hook_site(self, mod: nn.Module) -> nn.Module:
        return mod

    def deferrable(self, mod: nn.Module) -> Sequence[str]:
        return self.defer

    def check(self, mod: nn.Module) -> Optional[str]:
        return None

    def is_batched(self, mod: nn.Module, x: torch.Tensor) -> bool:
        return x.dim() > 1

    def expands(self, mod: nn.Module, x: torch.Tensor) -> bool:
        """Whether a call fed a batch of 1 (x, batch dim first) has its output expanded to the model's batch
        (Note [broadcast layers]); otherwise it is refused."""
        return False

    def keep(self, mod: nn.Module, x: torch.Tensor, args: tuple = (), kwargs: Optional[dict] = None):
        return x

    def keep_call(self, mod: nn.Module, x: torch.Tensor, args: tuple, kwargs: Optional[dict], output):
        """What the forward keeps, from the call's output too (the autograd graph the call built: what its backward
        keeps); by default keep()."""
        return self.keep(mod, x, args, kwargs)

    def output(self, mod: nn.Module, out):
        return out if isinstance(out, torch.Tensor) else None

    def terms(self, mod: nn.Module, kept, grad: torch.Tensor, attrs: Sequence[str]) -> Dict[str, Term]:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return type(self).__name__


_BY_TYPE: Dict[type, Rule] = {}
_BY_NAME: Dict[str, Rule] = {}  # "module.QualName" of a class from another library
_PATTERNS: List[Tuple[str, Callable[[nn.Module], bool], Rule]] = []
_REFUSALS: List[Tuple[str, Callable[[str, nn.Module], bool], str]] = []


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_rule(targets: Union[type, str, Sequence[Union[type, str]]], rule: Optional[Rule] = None):
    """Registers `rule` (a Rule instance) for the exact types in `targets`: classes, or "module.QualName" strings
    for classes of libraries that need not be imported. Usable as a class decorator (the class is instantiated):

        @hookstats.per_sample.register_rule(MyScale)
        class MyScaleRule(hookstats.per_sample.Rule):
            params = ("scale",)
            def terms(self, mod, x, g, attrs):
                return {"scale": Dense((g * x).reshape(g.shape[0], -1, x.shape[-1]).sum(1))}

    A later registration for the same type replaces the earlier one."""
    def add(r):
        inst = r() if isinstance(r, type) else r
        if not isinstance(inst, Rule):
            raise TypeError(f"hookstats.per_sample.register_rule needs a Rule, got {type(inst).__name__}")
        for t in (targets if isinstance(targets, (list, tuple)) else [targets]):
            if isinstance(t, str):
                _BY_NAME[t] = inst
            elif isinstance(t, type) and issubclass(t, nn.Module):
                _BY_TYPE[t] = inst
            else:
                raise TypeError(f"hookstats.per_sample.register_rule: {t!r} is neither an nn.Module class nor a "
                                "'module.QualName' string")
        return r
    return add if rule is None else add(rule)


def register_pattern(name: str, match: Callable[[nn.Module], bool], rule: Rule) -> None:
    """Registers `rule` for every module `match(module)` accepts (tried after the exact types): for families of
    classes that compute the same thing, such as each HF model's own copy of LlamaRMSNorm."""
    _PATTERNS.append((name, match, rule))


def register_refusal(match: Union[str, Callable[[str, nn.Module], bool]], reason: str) -> None:
    """Refuses the modules `match` accepts, with `reason`: a glob on qualified module names, or a predicate
    (name, module) -> bool. Their parameters are reported as not covered and left out of the total."""
    pred = match if callable(match) else (lambda name, mod, g=match: fnmatch.fnmatchcase(name, g))
    _REFUSALS.append((str(match), pred, reason))


def same_code(fn, ref) -> bool:
    """Whether the function `fn` has the bytecode, names, constants and arguments of `ref`: the same computation,
    read from its code (the HF "Copied from" classes are such copies)."""
    a, b = getattr(fn, "__code__", None), getattr(ref, "__code__", None)
    return a is not None and b is not None and _same_code_object(a, b)


def _same_code_object(a, b) -> bool:
    if not all(getattr(a, k) == getattr(b, k) for k in (
            "co_code", "co_names", "co_varnames", "co_argcount", "co_kwonlyargcount", "co_freevars")):
        return False
    if len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts):  # nested code (a comprehension) by its code, not its file and line
        if hasattr(x, "co_code") and hasattr(y, "co_code"):
            if not _same_code_object(x, y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def methods_match(cls: type, **refs) -> bool:
    """Whether each method of `cls` named in `refs` (the one its MRO resolves) has the code of the given reference
    function (same_code): a proof, from the class's code, that it computes what the reference computes."""
    return all(same_code(getattr(cls, name, None), ref) for name, ref in refs.items())


def super_forward_is(cls: type, base: type) -> bool:
    """Whether `super().forward` called from the class that defines cls's forward resolves to base.forward."""
    mro = cls.__mro__
    owner = next((i for i, k in enumerate(mro) if "forward" in vars(k)), None)
    if owner is None:
        return False
    nxt = next((k for k in mro[owner + 1:] if "forward" in vars(k)), None)
    return nxt is base


def _has_own_forward(cls: type, base: type) -> bool:
    return any("forward" in vars(k) for k in cls.__mro__[:cls.__mro__.index(base)])


def rule_for(name: str, mod: nn.Module) -> Tuple[Optional[Rule], Optional[str]]:
    """(rule, None) for a module with a rule, or (None, reason) (Note [exact-type rules])."""
    for _, pred, reason in _REFUSALS:
        if pred(name, mod):
            return None, reason
    cls = type(mod)
    rule = _BY_TYPE.get(cls) or _BY_NAME.get(_qualname(cls))
    if rule is None:
        for _, match, r in _PATTERNS:
            if match(mod):
                rule = r
                break
    if rule is None:
        for base in cls.__mro__[1:]:
            r = _BY_TYPE.get(base)
            if r is None:
                continue
            if _has_own_forward(cls, base):
                return None, (f"{cls.__name__} is a subclass of {base.__module__}.{base.__name__} with its own "
                              f"forward, and no rule is registered for it (hookstats.per_sample.register_rule)")
            rule = r
            break
    if rule is None:
        return None, f"no per-sample rule for {cls.__name__}"
    reason = rule.check(mod)
    return (None, reason) if reason else (rule, None)
