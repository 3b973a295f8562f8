"""Per-sample clipping from the terms, and what it refuses."""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .terms import term_dtype

OPT_OUT = ("Freeze it (requires_grad_(False)), leave its layer out (exclude=...), register a rule for it "
           "(hookstats.per_sample.register_rule), or pass allow_unclipped=True to clip only the covered parameters "
           "(the others keep their unclipped gradients: the per-sample bound, and DP, then do not hold for them)")

# Note [clipping refuses what it cannot bound]: DP-SGD needs every sample's whole gradient scaled to at most
# max_norm. A trainable parameter with no per-sample term would keep its unclipped gradient, and the bound would
# silently fail for the optimizer's update (Opacus refuses unsupported trainable layers for the same reason). So with
# max_norm, a trainable parameter in scope that is not covered is an error at construction; a layer refused at run
# time is an error when it is refused (in its forward, or when a gradient reaches a call whose rows are not the
# batch); and a covered parameter whose .grad autograd changed in a backward (a post-accumulate-grad hook) without a
# per-sample term of that backward is an error when the backward ends. The opt-outs are explicit: requires_grad=False,
# include/exclude, or allow_unclipped=True.

# Note [per-sample clipping]: each sample's gradient (over the covered parameters) scaled to at most max_norm before
# the batch sum. Autograd has summed the unclipped per-sample gradients into .grad; this adds sum_b (coef_b - 1)
# grad_b, from the same terms (one weighted product per use), so .grad becomes (what it held before this backward) +
# sum_b coef_b grad_b. No second backward, no per-sample gradients. A tied parameter's uses each add their part: the
# coefficient is the one of the sample's whole gradient, norm of the sum. It runs once, when the outermost backward
# is done (Note [checkpointed layers]).


def refuse_unclipped(names: List[str], allow_unclipped: bool) -> None:
    """Note [clipping refuses what it cannot bound]: parameters whose .grad autograd changed in this backward with no
    per-sample term: an error, or with allow_unclipped a warning."""
    msg = (f"hookstats.PerSampleGradNorms(max_norm=...): {', '.join(names)} got a gradient in this backward but no "
           f"per-sample term (used outside the layer whose rule covers it, or that layer's hook did not see the call): "
           f"its gradient is not clipped")
    if not allow_unclipped:
        raise RuntimeError(f"{msg}. {OPT_OUT}")
    warnings.warn(msg, stacklevel=3)


def apply_clip(entries: List[tuple], max_norm: float, eps: float, params: Dict[int, torch.nn.Parameter], *,
               groups: Sequence[tuple] = (), keep_corrections: Optional[Dict[int, torch.Tensor]] = None
               ) -> Tuple[Optional[torch.Tensor], Dict[int, torch.Tensor]]:
    """Clips the gradients of each entry's parameter (entries: (pid, samples, squared norm, [(term, deferred)]) of
    this backward; groups: (pids, samples, C [B, k n], squared norms [B, k], deferred), k parameters of n values with
    one Dense term each, side by side: Note [stacked small terms] in stacked.py). A term autograd has already summed
    into .grad gets sum_b (coef_b - 1) grad_b added there (or, given keep_corrections, put there by pid, in the term's
    dtype, for the caller to add later: Note [clipping under DDP] in ddp.py); a deferred one (Note [book-keeping] in
    bookkeeping.py: autograd did not compute it) contributes sum_b coef_b grad_b to the returned {pid: gradient},
    which the caller delivers through autograd. Returns ([samples] float64 coefficients min(1, max_norm / (norm +
    eps)) or None without entries, that dict)."""
    if not entries and not groups:
        return None, {}
    batches = {e[1] for e in entries} | {g[1] for g in groups}
    if len(batches) > 1:
        raise RuntimeError(f"hookstats.PerSampleGradNorms(max_norm=...): one backward saw batches of sizes "
                           f"{sorted(batches)}; per-sample clipping needs one batch of samples per backward")
    deliver: Dict[int, torch.Tensor] = {}
    with torch.no_grad():
        # every squared norm as rows of [k, B] blocks, summed in float64 in one op
        rows = [g[3].t() for g in groups]
        if entries:
            sqs = [e[2] for e in entries]
            rows.append(torch.stack(sqs) if len(sqs) > 1 and all(v.dtype == sqs[0].dtype for v in sqs)
                        else torch.stack([v.to(torch.float64) for v in sqs]))
        if len(rows) > 1 and any(r.dtype != rows[0].dtype for r in rows):
            rows = [r.to(torch.float64) for r in rows]
        sq = (torch.cat(rows) if len(rows) > 1 else rows[0]).to(torch.float64).sum(0)
        coef = torch.clamp(max_norm / (sq.sqrt() + eps), max=1.0)
        weights: Dict[tuple, torch.Tensor] = {}  # (minus one, dtype) -> coef (or coef - 1) in that dtype, made once

        def weight(minus_one: bool, dtype: torch.dtype) -> torch.Tensor:
            w = weights.get((minus_one, dtype))
            if w is None:
                w = weights[minus_one, dtype] = (coef - 1.0 if minus_one else coef).to(dtype)
            return w

        corrections: Dict[int, torch.Tensor] = {}  # pid -> what its .grad gets added, in the .grad's dtype

        def put(pid: int, d: torch.Tensor, deferred: bool) -> None:
            p = params[pid]
            if deferred:
                d = d if d.dtype == p.dtype else d.to(p.dtype)
                deliver[pid] = d if pid not in deliver else _plus(deliver[pid], d)
            elif keep_corrections is not None:
                d = d.to_dense() if d.is_sparse else d  # all-reduced flat (Note [clipping under DDP])
                keep_corrections[pid] = d if pid not in keep_corrections else keep_corrections[pid].add_(d)
            elif p.grad is not None:
                d = d if d.dtype == p.grad.dtype else d.to(p.grad.dtype)
                corrections[pid] = d if pid not in corrections else _plus(corrections[pid], d)

        for pids, _, c, _, deferred in groups:  # one weighted sum for k parameters
            n = c.shape[1] // len(pids)
            out = torch.mv(c.t(), weight(not deferred, c.dtype)).view(len(pids), n)
            for pid, d in zip(pids, out.unbind(0)):
                shape = params[pid].shape
                put(pid, d if d.shape == shape else d.view(shape), deferred)
        for pid, _, _, ts in entries:
            shape = params[pid].shape
            for t, deferred in ts:
                put(pid, t.delta(weight(not deferred, term_dtype(t)), shape), deferred)
        sparse = [pid for pid, d in corrections.items() if d.is_sparse or params[pid].grad.is_sparse]
        for pid in sparse:  # Embedding(sparse=True): its .grad, or the correction of a sparse term, sparse
            p, d = params[pid], corrections.pop(pid)
            if p.grad.is_sparse and not d.is_sparse:
                p.grad = d.add_(p.grad)
            else:
                p.grad.add_(d)
        if corrections:  # one call for every parameter (each once)
            torch._foreach_add_([params[pid].grad for pid in corrections], list(corrections.values()))
    return coef, deliver


def _plus(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b, in place in a dense one (a sparse tensor cannot take a dense one in place)."""
    if not a.is_sparse:
        return a.add_(b)
    return b.add_(a) if not b.is_sparse else a + b


def deliver(grads: Dict[int, torch.Tensor], params: Dict[int, torch.nn.Parameter], owner=None) -> None:
    """Accumulates each gradient into its parameter through a backward of its own (Note [book-keeping] in
    bookkeeping.py), rooted at the parameters themselves: the engine hands each gradient to the parameter's
    AccumulateGrad node, which adds it to .grad (or sets it), and the parameter's hooks, post-accumulate-grad hooks
    and DDP's reducer see it, as they would autograd's."""
    if not grads:
        return
    pids = list(grads)
    if owner is not None:
        owner._delivering = True  # its post-accumulate-grad hooks: the clip's own gradient, not autograd's
    try:
        _engine.run_backward(tuple(params[pid] for pid in pids), tuple(grads[pid] for pid in pids), False, False, (),
                             True, True)  # (keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad)
    finally:
        if owner is not None:
            owner._delivering = False


_engine = torch.autograd.Variable._execution_engine
