"""Which parameters a PerSampleGradNorms covers, and why the others are not: decided once from the model's
modules and the registry, completed at run time with the layers refused there."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from torch import nn

from .registry import rule_for


@dataclass
class Coverage:
    """covered: {parameter name: how ("layer (Rule)", several layers for a tied parameter)}; not_covered:
    {parameter name: reason}; not_seen: covered parameters that got no per-sample value in this step's backwards
    while others did (their layer's forward did not run, or the parameter was used outside it). Names are those of
    model.named_parameters(); only trainable parameters are listed. `fraction`: the covered share of the trainable
    values (numel), without the covered parameters not seen (they are in no per-sample number)."""

    covered: Dict[str, str] = field(default_factory=dict)
    not_covered: Dict[str, str] = field(default_factory=dict)
    not_seen: List[str] = field(default_factory=list)
    fraction: float = 1.0

    def __str__(self) -> str:
        n = len(self.covered) + len(self.not_covered)
        lines = [f"per-sample coverage: {len(self.covered)} of {n} trainable parameters "
                 f"({100 * self.fraction:.1f}% of their values)"]
        by_reason: Dict[str, List[str]] = {}
        for name, why in self.not_covered.items():
            by_reason.setdefault(why, []).append(name)
        for why, names in by_reason.items():
            shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            lines.append(f"  not covered: {shown}: {why}")
        if self.not_seen:
            lines.append(f"  covered but not seen this step: {', '.join(self.not_seen[:6])}"
                         + (f" and {len(self.not_seen) - 6} more" if len(self.not_seen) > 6 else ""))
        return "\n".join(lines)


class StaticCoverage:
    def __init__(self):
        self.layers: List[str] = []
        self.rule: dict = {}
        self.attrs: Dict[str, list] = {}
        self.holders: Dict[int, List[str]] = {}
        self.pname: Dict[int, str] = {}
        self.param: Dict[int, nn.Parameter] = {}
        self.how: Dict[int, str] = {}
        self.why: Dict[int, str] = {}  # pid -> reason, trainable parameters not covered
        self.in_scope_uncovered: List[int] = []
        self.numel: Dict[int, int] = {}
        self.warning = ""

    def report(self, refused: Dict[str, str], dead: set, seen: set) -> Coverage:
        cov = Coverage()
        for pid, name in self.pname.items():
            p = self.param[pid]
            if not p.requires_grad:
                continue
            if pid in self.why:
                cov.not_covered[name] = self.why[pid]
            elif pid in dead:
                layers = [ly for ly in self.holders[pid] if ly in refused]
                cov.not_covered[name] = "; ".join(f"layer {ly or '<model>'} refused at run time: {refused[ly]}"
                                                  for ly in layers) or "a layer using it was refused at run time"
            else:
                cov.covered[name] = self.how[pid]
                if seen and name not in seen:
                    cov.not_seen.append(name)
        total = sum(self.numel[pid] for pid, p in self.param.items() if p.requires_grad)
        unseen = set(cov.not_seen)
        got = sum(self.numel[pid] for pid, name in self.pname.items() if name in cov.covered and name not in unseen)
        cov.fraction = got / total if total else 1.0
        return cov


def _may_claim(mod: nn.Module) -> bool:
    """A module without parameters of its own may still apply a child's (a ParameterDict's, the table of HF Swin's
    SwinRelativePositionBias): ask the registry for modules with a child that holds parameters itself."""
    return any(isinstance(c, (nn.ParameterDict, nn.ParameterList)) or c._parameters for c in mod.children())


def _is_ancestor(a: str, b: str) -> bool:
    return a == "" or b.startswith(a + ".")


def build_coverage(model: nn.Module, in_scope) -> StaticCoverage:
    """Each parameter's holders (a tied parameter has several), the rule of each holder in scope, and from them
    whether the parameter is covered: every module holding it must be hooked by a rule (a module without a rule
    that only holds it for a child that has one, BERT's LM-head bias, is taken to pass it on)."""
    st = StaticCoverage()
    for name, p in model.named_parameters():
        st.pname[id(p)] = name
        st.param[id(p)] = p
        st.numel[id(p)] = p.numel()
    holders: Dict[int, list] = {}
    rule_of: Dict[str, tuple] = {}
    claims: Dict[tuple, str] = {}  # (holder module, attr) -> (layer whose rule covers it, its path from the layer)
    for name, mod in model.named_modules():
        own = [(a, p) for a, p in mod._parameters.items() if p is not None]
        scope = in_scope(name, mod)
        rule = None
        if scope and (own or _may_claim(mod)):
            rule_of[name] = rule_for(name, mod)
            rule = rule_of[name][0]
        if rule is not None:
            for path in rule.param_paths(mod):
                owner, _, attr = path.rpartition(".")
                holder = f"{name}.{owner}" if name and owner else (owner or name)
                claims.setdefault((holder, attr), (name, path))
        for a, p in own:
            holders.setdefault(id(p), []).append((name, mod, a, scope))
    for pid, hs in holders.items():
        ruled = [claims[(n, a)] for n, m, a, s in hs if s and (n, a) in claims]
        why = None
        for n, m, a, s in hs:
            if (n, a) in claims and claims[(n, a)] in ruled or any(_is_ancestor(n, r) for r, _ in ruled):
                continue
            if not s:
                why = (f"used by {n or '<model>'}, outside include/exclude" if ruled else
                       "outside include/exclude")
            else:
                rule, reason = rule_of.get(n, (None, None))
                reason = reason or (f"{type(m).__name__}'s rule does not cover {a!r}" if rule is not None else
                                    f"no per-sample rule for {type(m).__name__}")
                why = (f"also used by {n or '<model>'}: {reason}" if ruled else reason)
            break
        if why is None and not ruled:
            why = "no holder module"
        if why is not None:
            st.why[pid] = why
            if why != "outside include/exclude" and pid in st.param and st.param[pid].requires_grad:
                st.in_scope_uncovered.append(pid)
            continue
        st.holders[pid] = [n for n, _ in ruled]
        st.how[pid] = ", ".join(f"{n or '<model>'} ({rule_of[n][0].name})" for n, _ in ruled)
        for n, a in ruled:
            st.attrs.setdefault(n, []).append((a, pid))
    mods = dict(model.named_modules())
    st.layers = [n for n in mods if n in st.attrs]
    st.rule = {n: rule_of[n][0] for n in st.layers}
    if st.in_scope_uncovered:
        items = [f"{st.pname[pid]} ({st.why[pid]})" for pid in st.in_scope_uncovered]
        total = sum(st.numel[pid] for pid, p in st.param.items() if p.requires_grad)
        miss = sum(st.numel[pid] for pid in st.in_scope_uncovered)
        shown = "; ".join(items[:8]) + (f"; and {len(items) - 8} more" if len(items) > 8 else "")
        st.warning = (f"hookstats.PerSampleGradNorms: {len(items)} trainable parameters ({miss} values, "
                      f"{100 * miss / max(total, 1):.1f}% of the model's trainable values) are not covered and are "
                      f"left out of the total: {shown} (see coverage())")
    return st
