"""The model's batch, as each hooked call sees it: the batch size of the model's forward, a batch-major flattened input
proved row by row (Note [flattened batches]), and the forwards that run inside the backward under activation
checkpointing (Note [checkpointed layers])."""
from __future__ import annotations

from typing import Dict, Optional

import torch

# Note [flattened batches]: a layer fed [B * k, ...] rows (tokens flattened before an MLP: OPT's fc1 / fc2, the
# shared expert of Qwen2-MoE, a router) is split per sample, k consecutive rows each, only when that layout is
# proved, never because the row count divides: routed tokens or windows could have any count. Proved are (1) a
# view of a contiguous [B, ...] tensor with the same storage and size; (2) the output of a row-wise layer (Rule.
# rowwise: output row r is computed from input row r alone, Linear, the norms over the last dim, embeddings) fed
# proved rows, recorded by its autograd node for the rest of the forward; (3) the result of elementwise autograd
# nodes (_ROWWISE: activations, dropout, +, *, casts) whose inputs are proved rows of the same layout, parameters, or
# constants (no gradient edge). Anything else (a matmul between activations, a gather, a permute) is not
# followed, and the layer is refused with that reason.


# Note [checkpointed layers]: with activation checkpointing a layer's forward also runs inside the backward.
# - Non-reentrant (use_reentrant=False): the first forward's outputs get the gradients; the recompute (run while
#   checkpoint's recomputation saved-tensor hook is on top) only refills saved tensors, so it is replayed with
#   the same graph (the same expand, Note [broadcast layers]) and nothing is recorded.
# - Reentrant (use_reentrant=True): the first forward runs without grad and is not seen; the recompute's outputs
#   get their gradients in a nested backward, one per checkpointed segment. The clip must wait for the end of
#   the outermost backward, when every segment's terms are in: the model's output tensors get a hook that
#   queues the flush there (autograd reaches them first), with a recompute's own backward as the fallback.
# The model's forward is not running during a recompute: its batch size is the one of the forwards whose output
# this backward has reached (a recompute of forward k runs only after autograd has gone through forward k's
# output), refused when those differ.


def first_batch(args, kwargs, bd: int) -> Optional[int]:
    for v in list(args) + list((kwargs or {}).values()):
        if isinstance(v, torch.Tensor) and v.dim() > bd:
            return int(v.shape[bd])
    return None


def flattened(x: torch.Tensor, b: int) -> bool:
    """x [B * k, ...] is a batch-major flattening of a contiguous [B, ...] tensor: rows b*k .. b*k+k-1 are sample b."""
    base = x._base
    return (base is not None and base.dim() >= 2 and base.shape[0] == b and base.is_contiguous()
            and x.is_contiguous() and x.data_ptr() == base.data_ptr() and x.numel() == base.numel())


# Autograd nodes of elementwise ops: output row r depends on row r of each input (and on constants / parameters,
# broadcast over the rows). Note [flattened batches].
_ROWWISE = frozenset("""
    AbsBackward0 AddBackward0 AddBackward1 ClampBackward1 CloneBackward0 DivBackward0 DivBackward1 EluBackward0
    ExpBackward0 GeluBackward0 HardsigmoidBackward0 HardswishBackward0 HardtanhBackward0 LeakyReluBackward0
    LogSigmoidBackward0 MishBackward0 MulBackward0 MulBackward1 NativeDropoutBackward0 NegBackward0 PowBackward0
    ReluBackward0 RsqrtBackward0 SigmoidBackward0 SiluBackward0 SoftplusBackward0 SqrtBackward0 SubBackward0
    SubBackward1 TanhBackward0 ThresholdBackward0 ToCopyBackward0
""".split())


def _params_only(node, depth: int) -> bool:
    """Whether an autograd node computes from parameters alone (AccumulateGrad, or a few ops on them)."""
    if type(node).__name__ == "AccumulateGrad":
        return True
    if depth >= 3:
        return False
    nxt = [n for n, _ in node.next_functions if n is not None]
    return bool(nxt) and all(_params_only(n, depth + 1) for n in nxt)


def proved_rows(rows: dict, x: torch.Tensor, b: int, k: int) -> bool:
    """Whether x's rows are proved to be b samples of k consecutive rows each (Note [flattened batches]), from the
    autograd nodes of the outputs already proved in this forward (`rows`: node -> (b, k))."""
    node = x.grad_fn
    if node is None or not rows:
        return False
    seen: Dict[object, bool] = {}

    def proved(n, depth: int) -> bool:
        if n in rows:
            return rows[n] == (b, k)
        if depth > 24 or type(n).__name__ not in _ROWWISE:
            return False
        if n in seen:
            return seen[n]
        seen[n] = False
        ok, any_rows = True, False
        for nxt, _ in n.next_functions:
            if nxt is None or _params_only(nxt, 0):
                continue
            if not proved(nxt, depth + 1):
                ok = False
                break
            any_rows = True
        seen[n] = ok and any_rows
        return seen[n]

    return proved(node, 0)


def nonreentrant_recompute() -> bool:
    """Whether torch.utils.checkpoint(use_reentrant=False) is recomputing (its saved-tensor hook is on top)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and bool(getattr(hooks[0], "_checkpoint_internal", False))


def output_tensors(out, depth: int = 0):
    """The tensors of a model's output: a tensor, or those in a tuple / list / dict (HF ModelOutput), two deep."""
    if isinstance(out, torch.Tensor):
        yield out
    elif depth < 2 and isinstance(out, (tuple, list)):
        for v in out:
            yield from output_tensors(v, depth + 1)
    elif depth < 2 and isinstance(out, dict):
        for v in out.values():
            yield from output_tensors(v, depth + 1)
