"""HF mixture-of-experts experts (Qwen2MoeExperts and the ~50 classes with its forward's code: Mixtral, OLMoE,
Qwen3-MoE, DeepSeek-V2/V3, ...), run with experts_implementation="eager", matched by the code of the forward their
@use_experts_implementation wraps (Note [routed experts]).

Note [routed experts]: the experts module gets the flattened tokens x [B * T, d] (a view of the batch: rows proved
batch-major, Note [flattened batches]) with the routing (top_k_index, top_k_weights) [B * T, K] as arguments, and
returns y_t = sum_k w_tk E_e(x_t), e = index_tk, E_e(x) = Down_e (act(Gate_e x) * (Up_e x)) (gate_up_proj[e] =
[Gate_e; Up_e], an index E drops the slot). So the rule sees the routing, and from the output's gradient g_t each routed
pair (t, k) gets its expert's output gradient o = w_tk g_t; replaying the expert's backward on the pair's recomputed
activations (expert by expert, as the forward runs them; act's backward by autograd on the module's own act_fn):
  down_proj[e]     sum over the pairs routed to e of o h^T,  h = act(gate) * up
  gate_up_proj[e]  sum of [d gate; d up] x^T, d h = Down_e^T o, d up = d h * act(gate), d gate = vjp of act at gate
A sample's gradient of the [E, m, n] parameter is, per expert, the sum over its pairs routed there (RoutedOuter):
squared norm sum_e ||sum_{p in e} L_p R_p^T||^2, per (sample, expert) group of pairs by the Linear rule's choice of
two Grams or the product (the groups padded to the largest), or, where routing is so unbalanced that the padding would
outgrow them, sum_{p, q same expert} <L_p, L_q> <R_p, R_q> from two Grams over the sample's T * K pairs masked to
equal experts; the clip's weighted sum runs expert by expert. Refused: another experts implementation (grouped_mm,
batched_mm: a kernel the rule does not replay), a class whose forward is not that code (gpt-oss, DBRX, Llama 4, ...:
their layouts differ). The router is a Linear on the token rows (mixtral_router.py); the experts' weights never meet
the other layers' parameters (no tying). An experts module called more than once in one backward (two forwards, then
one backward; a module shared by layers) gives one RoutedOuter per call: terms.combine joins them (RoutedOuter.cat),
a sample's pairs of every call side by side, which is the sum of its gradients.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Rule, register_pattern, same_code
from ..terms import Term, compute_dtype, outer_sq_norms
from .refused import MOE_COVERED, Refused


class _Experts(nn.Module):  # transformers' Qwen2MoeExperts.forward, before @use_experts_implementation wraps it
    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()

        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current_hidden_states = self.act_fn(gate) * up
            current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

        return final_hidden_states



class RoutedOuter(Term):
    """grad_b of an [E, m, n] parameter = sum over sample b's routed pairs p of onehot(e_p) L_p R_p^T: L [B, S, m],
    R [B, S, n], e [B, S] (S pairs per sample, e = E for a dropped slot, whose L is 0)."""

    __slots__ = ("L", "R", "e", "E", "samples")

    def __init__(self, L: torch.Tensor, R: torch.Tensor, e: torch.Tensor, E: int):
        self.L, self.R, self.e, self.E = L, R, e, E
        self.samples = L.shape[0]

    def rows_to_samples(self, k):
        if k == 1:
            return self
        f = lambda x: x.reshape(x.shape[0] // k, k * x.shape[1], *x.shape[2:])  # noqa: E731
        return RoutedOuter(f(self.L), f(self.R), f(self.e), self.E)

    def sq(self):
        b, s, m = self.L.shape
        n = self.R.shape[-1]
        keep = self.e < self.E
        key = (torch.arange(b, device=self.e.device).unsqueeze(1) * self.E + self.e)[keep]  # (sample, expert) groups
        counts = torch.bincount(key, minlength=b * self.E)
        c = int(counts.max()) if key.numel() else 0
        if c == 0:
            return self.L.new_zeros(b)
        if b * self.E * c * (m + n) > b * s * s:  # unbalanced routing: the sample's Grams masked to equal experts
            same = (self.e.unsqueeze(2) == self.e.unsqueeze(1)) & keep.unsqueeze(2)
            gl = torch.bmm(self.L, self.L.transpose(1, 2))
            gr = torch.bmm(self.R, self.R.transpose(1, 2))
            return (gl * gr * same).sum((1, 2))
        # each (sample, expert) group's pairs padded to c rows (zeros add nothing): sum_t L_t R_t^T per group
        order = torch.argsort(key, stable=True)
        skey = key[order]
        start = torch.cumsum(counts, 0) - counts
        slot = torch.arange(skey.numel(), device=skey.device) - start[skey]
        lp = self.L.new_zeros(b * self.E, c, m)
        rp = self.R.new_zeros(b * self.E, c, n)
        lp[skey, slot] = self.L[keep][order]
        rp[skey, slot] = self.R[keep][order]
        return outer_sq_norms(rp, lp).reshape(b, self.E).sum(1)

    @classmethod
    def cat(cls, terms):
        """The uses of one experts module's parameter in one backward (called more than once: two forwards before
        one backward, a module shared by layers) as one term: a sample's gradient sums its pairs of every call."""
        if len({(t.E, t.L.shape[-1], t.R.shape[-1]) for t in terms}) > 1:
            raise RuntimeError("hookstats.PerSampleGradNorms: one experts parameter used with different expert "
                               "counts or shapes has no per-sample rule")
        dt = torch.promote_types(terms[0].L.dtype, terms[-1].L.dtype)
        return cls(torch.cat([t.L.to(dt) for t in terms], 1), torch.cat([t.R.to(dt) for t in terms], 1),
                   torch.cat([t.e for t in terms], 1), terms[0].E)

    def delta(self, w, shape):
        m, n = self.L.shape[-1], self.R.shape[-1]
        lw = (self.L * w.to(self.L.dtype).reshape(-1, 1, 1)).reshape(-1, m)
        r, e = self.R.reshape(-1, n), self.e.reshape(-1)
        out = torch.zeros(self.E, m, n, dtype=self.L.dtype, device=self.L.device)
        for x in torch.unique(e).tolist():
            if x < self.E:
                sel = e == x
                out[x] = lw[sel].t() @ r[sel]
        return out.reshape(shape)


class RoutedExpertsRule(Rule):
    params = ("gate_up_proj", "down_proj")
    rowwise = True  # output row t from input row t and its routing alone

    def check(self, mod):
        impl = getattr(getattr(mod, "config", None), "_experts_implementation", None)
        if impl not in (None, "eager"):
            return (f"experts_implementation={impl!r}: the experts run through that registered kernel, not the eager "
                    f"loop whose code the rule replays; build the model with experts_implementation='eager'")
        return None

    def keep(self, mod, x, args=(), kwargs=None):
        kw = dict(kwargs or {})
        rest = list(args[1:])
        idx = rest.pop(0) if rest else kw.get("top_k_index")
        w = rest.pop(0) if rest else kw.get("top_k_weights")
        if not isinstance(idx, torch.Tensor) or not isinstance(w, torch.Tensor) or idx.shape[0] != x.shape[0]:
            raise Refused("the routing (top_k_index, top_k_weights) is not one [tokens, k] row per input row")
        return x, idx.detach(), w.detach()

    def terms(self, mod, kept, g, attrs):
        x, idx, w = kept
        dt = compute_dtype(g)
        x, g, w = x.to(dt), g.to(dt), w.to(dt)
        n_tok, k = idx.shape
        n_exp = mod.num_experts
        gu = mod.gate_up_proj.detach().to(dt)
        dn = mod.down_proj.detach().to(dt)
        inter = dn.shape[-1]
        l_gu = torch.zeros(n_tok, k, gu.shape[1], dtype=dt, device=g.device)
        l_dn = torch.zeros(n_tok, k, dn.shape[1], dtype=dt, device=g.device)
        r_dn = torch.zeros(n_tok, k, inter, dtype=dt, device=g.device)
        for e in torch.unique(idx).tolist():
            if e >= n_exp:
                continue
            tok, pos = torch.where(idx == e)
            xs = x[tok]
            gate, up = F.linear(xs, gu[e]).chunk(2, dim=-1)
            with torch.enable_grad():
                gate_ = gate.detach().requires_grad_(True)
                act = mod.act_fn.forward(gate_)  # forward(): no module hooks run for this replay
            o = g[tok] * w[tok, pos, None]
            d_h = o @ dn[e]
            (d_gate,) = torch.autograd.grad(act, gate_, d_h * up)
            l_gu[tok, pos] = torch.cat((d_gate, d_h * act.detach()), -1)
            l_dn[tok, pos] = o
            r_dn[tok, pos] = act.detach() * up
        out = {}
        if "gate_up_proj" in attrs:
            out["gate_up_proj"] = RoutedOuter(l_gu, x.unsqueeze(1).expand(-1, k, -1), idx, n_exp)
        if "down_proj" in attrs:
            out["down_proj"] = RoutedOuter(l_dn, r_dn, idx, n_exp)
        return out


def routed_experts(mod: nn.Module) -> bool:
    fwd = getattr(type(mod), "forward", None)
    return (isinstance(mod._parameters.get("gate_up_proj"), nn.Parameter)
            and isinstance(mod._parameters.get("down_proj"), nn.Parameter) and mod.gate_up_proj.dim() == 3
            and same_code(getattr(fwd, "__wrapped__", fwd), _Experts.forward))


MOE_COVERED.append(routed_experts)
register_pattern("HF routed experts (the eager loop of Qwen2MoeExperts and its copies)", routed_experts,
                 RoutedExpertsRule())
