"""Per-sample gradient norms without per-sample gradients: `PerSampleGradNorms`, and the rules it is made of.

For each layer with a rule (one file per layer type in rules/, registered by exact type: Note [exact-type rules]),
a forward hook keeps what the backward needs (the input, a tensor autograd keeps anyway) and puts a tensor hook on
the output; in the backward, that hook receives the output's gradient and the rule describes each parameter's
per-sample gradient as a term (Note [per-sample terms]) from which the squared norms, the clip delta and the cross
terms of tied parameters follow, with batched matrix products and no per-sample gradient unless that is the cheaper
product. docs/guide/per-sample.md has the user's side.
"""
from .core import PerSampleGradNorms
from .coverage import Coverage
from .registry import Rule, register_pattern, register_refusal, register_rule, rule_for
from .rules.refused import Refused
from .terms import Dense, Index, Outer, outer_sq_norms

__all__ = ["PerSampleGradNorms", "Coverage", "Rule", "Refused", "register_rule", "register_pattern",
           "register_refusal", "rule_for", "Outer", "Index", "Dense", "outer_sq_norms"]
