"""The model's batch, as each hooked call sees it: the batch size of the model's forward, a batch-major flattened input
proved row by row (Note [flattened batches]), and the forwards that run inside the backward under activation
checkpointing (Note [checkpointed layers])."""
from __future__ import annotations

from typing import Dict, Optional

import torch

# Note [flattened batches]: a layer fed [B * k, ...] rows (tokens flattened before an MLP: OPT's fc1 / fc2, the
# shared expert of Qwen2-MoE, a router; the windows of Swin's attention) is split per sample, k consecutive rows
# each, only when that layout is proved, never because the row count divides: routed tokens could have any count.
# Proved are (1) a view of a contiguous [B, ...] tensor with the same storage and size; (2) the output of a row-wise
# layer (Rule.rowwise: output row r is computed from input row r alone, Linear, the norms over the last dim,
# embeddings) fed proved rows, recorded by its autograd node for the rest of the forward; (3) what the autograd graph
# makes of those (Note [batch layouts]). Anything else is refused, with that reason.
#
# Note [batch layouts]: proved_rows walks the autograd graph from the layer's input back to recorded outputs and
# follows, for each tensor on the way, which of its dims hold the batch: a tuple D of dims (outer to inner) such that
# the sample of an element is its row-major index over the dims D divided by prod(shape[D]) / B (B divides that
# product; D is cut to its shortest such start). Rows [B * k, ...] of k per sample have D = (0,); a recorded output
# has the shortest prefix whose sizes B divides (sample = flat index // (numel / B), whatever its shape). Followed,
# with the shapes read from the nodes' input metadata:
# - views and reshapes (View, UnsafeView, ReshapeAlias) of a tensor whose D is a prefix: the flat order is kept;
# - permute / transpose: D moves with its dims; unsqueeze / squeeze, select / unbind / slice on a dim outside D, roll
#   and constant pad over dims outside D, softmax and vector norms (linalg.vector_norm, F.normalize's denominator)
#   over dims outside D: each element stays with its sample;
# - expand: D's dims keep their sizes (a dim broadcast outside D copies within a sample);
# - elementwise ops (_ELEMENTWISE: activations, dropout, +, *, where, masked_fill, casts, clone) whose proved inputs
#   all give the same D with D's sizes, the others computed from parameters and constants alone (_FREE: AccumulateGrad,
#   then layout, elementwise, index and cat ops on such tensors; an input without a gradient edge is a constant, as in
#   (3) before), or of size 1 on D (the same for every sample);
# - batched products: bmm of operands with D = (0,) or free, mm / addmm of (0,) rows by a free or constant matrix,
#   and scaled_dot_product_attention's fused nodes with query, key and value of one D among the batch dims.
# Not followed: a gather of activations or a reduction over a batch dim, any op not listed, a view of a tensor whose
# batch dims are not a prefix, a product with a constant batched operand, a walk past 64 nodes deep or 4096 visits.
# Swin's attention is the case in point: the q/k/v projections' outputs (recorded: their input windows are a view of
# the contiguous [B, windows, ...] partition) lead through the head split, the scores (plus the relative-position bias
# and the shifted-window mask, free), the softmax, the product with the values and the head merge to the output
# projection's input, whose window rows stay with their sample.


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


# Note [broadcast layers]: a layer fed a batch of 1 whose output is broadcast over the batch afterwards (GPT-2 /
# BERT position embeddings on [1, T] ids) gets the batch's gradient summed by the broadcast's backward before
# its own output sees it: no per-sample split is left. Returning output.expand(B, ...) from the forward hook
# moves the broadcast to the layer's output: every value the model computes is the same (the broadcasting op
# reads the same numbers), the expand's backward sums exactly as the broadcast's did (both sum_to_size), and the
# expanded tensor's gradient is the per-sample one. That sum is bit for bit the broadcast's only when the
# expanded output feeds the broadcasting elementwise op directly and is broadcast over the batch dim alone
# ([1, T, d] + [B, T, d]): fed to another layer first, that layer would run on B copies and the batch sum would
# move after its backward; broadcast over tokens too, the sum would be split in two. So only the rules that
# know their use expand (Rule.expands: Embedding on [1, T] position ids); other layers fed a batch of 1 are
# refused, as is a layer whose batch dim is something else (T5's [T, T] relative-bias table, routed tokens).


def rows_refusal(bd: int, rows: int, b: int) -> str:
    """Why a layer whose input's dim `bd` holds `rows` rows, the model's batch `b` samples, is refused."""
    if rows < b:
        return (f"its input's dim {bd} holds {rows} rows where the model's batch has {b} samples: a value broadcast "
                f"over the batch after the layer has its gradient summed over the samples before the layer sees it "
                f"(Note [broadcast layers]: only rules that know the broadcast, such as position embeddings, expand)")
    return (f"its input's dim {bd} holds {rows} rows where the model's batch has {b} samples, and they are not "
            f"provably the batch's samples flattened batch-major (Note [batch layouts]: the batch's dims followed back "
            f"through views, permutes, row-wise layers, elementwise ops and batched matmuls): routed tokens, windows "
            f"that mix samples, or a table shared by every sample")


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


# Autograd nodes of elementwise ops: output element i depends on element i of each input, broadcast (Note [batch
# layouts]).
_ELEMENTWISE = frozenset("""
    AbsBackward0 AddBackward0 AddBackward1 AliasBackward0 ClampBackward1 ClampMinBackward0 CloneBackward0 DivBackward0
    DivBackward1
    EluBackward0 ExpBackward0 GeluBackward0 HardsigmoidBackward0 HardswishBackward0 HardtanhBackward0
    LeakyReluBackward0 LogSigmoidBackward0 MaskedFillBackward0 MishBackward0 MulBackward0 MulBackward1
    NativeDropoutBackward0 NegBackward0 PowBackward0 ReluBackward0 RsqrtBackward0 SigmoidBackward0 SiluBackward0
    SoftplusBackward0 SqrtBackward0 SubBackward0 SubBackward1 TanhBackward0 ThresholdBackward0 ToCopyBackward0
    WhereBackward0
""".split())
_VIEWS = frozenset("ViewBackward0 UnsafeViewBackward0 ReshapeAliasBackward0 _ReshapeAliasBackward0".split())
_SOFTMAX = frozenset("SoftmaxBackward0 LogSoftmaxBackward0 SafeSoftmaxBackward0".split())
_FREE_ONLY = frozenset("IndexBackward0 TBackward0 CatBackward0".split())  # followed for tensors of parameters alone
_FREE = "free"  # a tensor computed from parameters and constants alone


def _dim(d, n: int) -> int:
    """A dim saved by an autograd node (a negative one reads back as a large unsigned number), in 0 .. n-1."""
    d = int(d)
    if d >= 1 << 63:
        d -= 1 << 64
    return d % n if n else d


class _Layouts:
    """Note [batch layouts]: the batch dims of the tensors of one autograd graph, for a batch of `b` samples."""

    def __init__(self, rows: dict, b: int):
        self.rows, self.b = rows, b
        self.memo: Dict[tuple, object] = {}
        self.visits = 0

    def canon(self, dims, shape):
        """The shortest start of `dims` whose sizes the batch divides, or None."""
        p = 1
        for m in range(len(dims) + 1):
            if p % self.b == 0:
                return tuple(dims[:m])
            if m < len(dims):
                p *= int(shape[dims[m]])
        return None

    @staticmethod
    def shape(node, nr: int):
        md = getattr(node, "_input_metadata", None)
        return None if md is None or nr >= len(md) else tuple(md[nr].shape)

    def of(self, node, nr: int = 0, depth: int = 0):
        """D (a tuple of dims), _FREE, or None (not proved) for output `nr` of the forward op of `node`."""
        key = (node, nr)
        if key in self.memo:
            return self.memo[key]
        self.visits += 1
        if depth > 64 or self.visits > 4096:
            return None
        self.memo[key] = None  # a cycle proves nothing
        res = self._of(node, nr, depth)
        self.memo[key] = res
        return res

    def _of(self, node, nr: int, depth: int):
        name = type(node).__name__
        if name == "AccumulateGrad":
            return _FREE
        out = self.shape(node, nr)
        if out is None:
            return None
        if node in self.rows:
            return self.canon(tuple(range(len(out))), out) if nr == 0 and self.rows[node][0] == self.b else None
        edges = [(n, i) for n, i in node.next_functions]
        ins = [None if n is None else self.of(n, i, depth + 1) for n, i in edges]
        shapes = [None if n is None else self.shape(n, i) for n, i in edges]
        grad_ins = [v for (n, _), v in zip(edges, ins) if n is not None]
        free = bool(grad_ins) and all(v is _FREE for v in grad_ins)
        # a product with a constant operand may be a layer applied to the data: never free
        if free and (name in _ELEMENTWISE or name in _VIEWS or name in _SOFTMAX or name in _FREE_ONLY
                     or name in _ONE_INPUT):
            return _FREE
        if name in _ELEMENTWISE:
            return self.elementwise(out, ins, shapes, edges)
        if name in ("BmmBackward0", "MmBackward0", "AddmmBackward0"):
            return self.product(name, out, ins, edges)
        if name.startswith("ScaledDotProduct") and name.endswith("Backward0"):
            return self.attention(nr, out, ins, shapes, edges)
        if name in _FREE_ONLY or len(edges) != 1 or edges[0][0] is None:
            return None
        d, s = ins[0], shapes[0]
        if not isinstance(d, tuple) or s is None:
            return None
        if name in _VIEWS:
            return self.canon(tuple(range(len(out))), out) if d == tuple(range(len(d))) else None
        if name in _SOFTMAX:
            return d if _dim(node._saved_dim, len(s)) not in d else None
        rule = _ONE_INPUT.get(name)
        return None if rule is None else rule(self, node, d, s, out)

    def elementwise(self, out, ins, shapes, edges):
        found, unproved = set(), []
        for (n, _), v, s in zip(edges, ins, shapes):
            if n is None or v is _FREE:
                continue
            if v is None:
                unproved.append(s)
                continue
            off = len(out) - len(s)
            if off < 0 or any(s[d] != out[d + off] for d in v):
                return None  # the batch dims broadcast
            found.add(tuple(d + off for d in v))
        if len(found) != 1:
            return None
        d = found.pop()
        for s in unproved:  # the same for every sample: size 1 (or absent) on the batch dims
            if s is None:
                return None
            off = len(out) - len(s)
            if any(d_ - off >= 0 and s[d_ - off] != 1 for d_ in d):
                return None
        return d

    def product(self, name, out, ins, edges):
        ops = list(zip(edges, ins))
        if name == "AddmmBackward0":  # (bias, mat1, mat2): the bias broadcast over the rows
            (nb, _), vb = ops.pop(0)
            if nb is not None and vb is not _FREE:
                return None
        (na, _), va = ops[0]
        (nm, _), vm = ops[1]
        if name != "BmmBackward0":  # rows of mat1 by a free matrix
            return (0,) if va == (0,) and (nm is None or vm is _FREE) else None
        if any(n is None or v is not _FREE and v != (0,) for (n, _), v in ops):
            return None  # a constant operand of a batched product: its rows' samples are unknown
        return (0,) if (0,) in (va, vm) else None

    def attention(self, nr, out, ins, shapes, edges):
        if nr != 0 or len(edges) < 3:
            return None
        qkv = ins[:3]
        d = qkv[0]
        if not isinstance(d, tuple) or any(v != d for v in qkv) or any(x >= len(out) - 2 for x in d):
            return None
        if any(s is None or len(s) != len(out) or any(s[x] != out[x] for x in d) for s in shapes[:3]):
            return None
        for (n, _), v, s in zip(edges[3:], ins[3:], shapes[3:]):  # the additive mask / bias
            if n is None or v is _FREE or v == d:
                continue
            off = len(out) - len(s) if s is not None else 0
            if s is None or any(x - off >= 0 and s[x - off] != 1 for x in d):
                return None
        return d


def _permute(lay, node, d, s, out):
    perm = [_dim(p, len(s)) for p in node._saved_dims]
    inv = {p: i for i, p in enumerate(perm)}
    return lay.canon(tuple(inv[x] for x in d), out)


def _transpose(lay, node, d, s, out):
    if hasattr(node, "_saved_dim0"):
        a, b = _dim(node._saved_dim0, len(s)), _dim(node._saved_dim1, len(s))
    else:  # TBackward0 on a 2-D tensor
        a, b = 0, 1
    swap = {a: b, b: a}
    return lay.canon(tuple(swap.get(x, x) for x in d), out)


def _expand(lay, node, d, s, out):
    off = len(out) - len(s)
    return tuple(x + off for x in d) if all(s[x] == out[x + off] for x in d) else None


def _unsqueeze(lay, node, d, s, out):
    at = _dim(node._saved_dim, len(out))
    return tuple(x + (x >= at) for x in d)


def _squeeze(lay, node, d, s, out):
    saved = getattr(node, "_saved_dim", None)
    if saved is None:
        dims = set(range(len(s)))
    else:
        dims = {_dim(x, len(s)) for x in (saved if isinstance(saved, (tuple, list)) else [saved])}
    gone = {x for x in dims if s[x] == 1}
    if len(s) - len(gone) != len(out):
        return None
    return lay.canon(tuple(x - sum(g < x for g in gone) for x in d if x not in gone), out)


def _drop_dim(lay, node, d, s, out):  # select / unbind: that dim removed
    at = _dim(node._saved_dim, len(s))
    return None if at in d else tuple(x - (x > at) for x in d)


def _within(lay, node, d, s, out):  # slice: sizes change outside D only
    return None if _dim(node._saved_dim, len(s)) in d else d


def _norm(lay, node, d, s, out):  # a vector norm over dims outside D (F.normalize's denominator)
    saved = node._saved_dim
    if saved is None:
        return None
    dims = {_dim(x, len(s)) for x in (saved if isinstance(saved, (tuple, list)) else [saved])}
    if dims & set(d):
        return None
    return d if node._saved_keepdim else tuple(x - sum(g < x for g in dims) for x in d)


def _roll(lay, node, d, s, out):
    dims = [_dim(x, len(s)) for x in node._saved_dims]
    return d if dims and not set(dims) & set(d) else None


def _pad(lay, node, d, s, out):
    pad = list(node._saved_pad)
    padded = {len(s) - 1 - i // 2 for i, p in enumerate(pad) if p}
    return None if padded & set(d) else d


_ONE_INPUT = {"PermuteBackward0": _permute, "TransposeBackward0": _transpose, "TBackward0": _transpose,
              "ExpandBackward0": _expand, "UnsqueezeBackward0": _unsqueeze, "SqueezeBackward0": _squeeze,
              "SqueezeBackward1": _squeeze, "SqueezeBackward2": _squeeze, "SelectBackward0": _drop_dim,
              "UnbindBackward0": _drop_dim, "SliceBackward0": _within, "RollBackward0": _roll,
              "ConstantPadNdBackward0": _pad, "LinalgVectorNormBackward0": _norm}


def proved_rows(rows: dict, x: torch.Tensor, b: int, k: int) -> bool:
    """Whether x [b * k, ...] holds b samples of k consecutive rows each, proved from the autograd nodes of the
    outputs already proved in this forward (`rows`: node -> (b, k); Note [batch layouts])."""
    node = x.grad_fn
    if node is None or not rows or x.dim() == 0 or x.shape[0] != b * k:
        return False
    d = _Layouts(rows, b).of(node, x.output_nr)
    return d == (0,) or (d == () and b == 1)


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
