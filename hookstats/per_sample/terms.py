"""The forms a per-sample parameter gradient takes, and the algebra on them: squared norm, clip delta, sum of uses.

Note [per-sample terms]: a rule (hookstats/per_sample/rules/) describes the gradient one forward call of a layer gives
one of its parameters, for every sample b at once, in one of three forms, without materialising it unless that is
its natural form:

  Outer(L [B, G, T, m], R [B, G, T, n])   grad_b = sum_t L_bgt R_bgt^T for each of G row blocks of the parameter
                                          viewed as [G * m, n] (Linear: L = output grad, R = input; conv: R = patches,
                                          G = groups; HF Conv1D: L = input, R = output grad)
  Index(idx [B, T], R [B, T, n], V)       grad_b = sum_t onehot(idx_bt) R_bt^T, the parameter viewed as [V, n]
                                          (embedding rows: the one-hot left factor is never built), or as [n, V]
                                          with transposed=True (peft's lora_embedding_A)
  Dense(D [B, n])                         grad_b = D_b, the parameter flattened (biases, norm weights)

A parameter's per-sample gradient is the sum of the terms of all its uses (a layer called twice, weights tied
between an embedding and an LM head): terms of one form are concatenated along T (or summed, Dense), and the squared
norm of the sum is the sum of the squared norms plus twice the cross terms, e.g. for Outer x Index
sum_{t,s} L_s[idx_t] <R1_t, R2_s> (a gather of the Gram), never a [B, V, n] per-sample gradient.
Every method is linear algebra on the device, with no host sync. Results are in the terms' dtype (float64 for
float64 models, float32 otherwise).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def as_dtype(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """t in dtype dt: t itself when it has it (no dispatch on the hot path)."""
    return t if t.dtype == dt else t.to(dt)


def outer_sq_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """||sum_t g[b, t] a[b, t]^T||_F^2 for every b, from a [B, T, p] and g [B, T, q], without the [B, q, p] per-sample
    products unless they are the cheaper computation: two Gram matrices cost T^2 (p + q) per sample, the products
    T p q."""
    b, t, p = a.shape
    q = g.shape[-1]
    if t == 1:
        return a.square().sum((1, 2)) * g.square().sum((1, 2))
    if t * (p + q) < p * q:
        ga = torch.bmm(a, a.transpose(1, 2))
        gg = torch.bmm(g, g.transpose(1, 2))
        return torch.bmm(ga.reshape(b, 1, t * t), gg.reshape(b, t * t, 1)).reshape(b)
    return torch.bmm(g.transpose(1, 2), a).square().sum((1, 2))


class Term:
    """One use's per-sample gradient of one parameter (Note [per-sample terms])."""

    samples: int

    def rows_to_samples(self, k: int) -> "Term":
        """Rows of k consecutive items per sample (a batch-major flattened input [B * k, ...]): summed per sample."""
        raise NotImplementedError

    def sq(self) -> torch.Tensor:
        raise NotImplementedError

    def delta(self, w: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """sum_b w_b grad_b, in the parameter's shape."""
        raise NotImplementedError

    @classmethod
    def cat(cls, terms: Sequence["Term"]) -> "Term":
        """One term for several uses of one parameter, all of this class (a form of its own: combine())."""
        raise RuntimeError(f"hookstats.PerSampleGradNorms: a parameter whose per-sample gradient is a {cls.__name__} "
                           f"was used {len(terms)} times in one backward, which that form has no sum for")


class Outer(Term):
    # L [B, G, T, m], R [B, G, T, n]; one block ([B, T, m] given) is kept 3-D, its 4-D view made when asked for
    __slots__ = ("_L", "_R", "_L3", "_R3")

    def __init__(self, L: torch.Tensor, R: torch.Tensor):
        if L.dim() == 3:  # [B, T, m]: one block
            self._L3, self._R3, self._L, self._R = L, R, None, None
        else:
            self._L3, self._R3, self._L, self._R = None, None, L, R
        self.samples = L.shape[0]

    @property
    def L(self) -> torch.Tensor:
        if self._L is None:
            self._L = self._L3.unsqueeze(1)
        return self._L

    @property
    def R(self) -> torch.Tensor:
        if self._R is None:
            self._R = self._R3.unsqueeze(1)
        return self._R

    @property
    def dtype(self) -> torch.dtype:
        return (self._L3 if self._L3 is not None else self._L).dtype

    def _blocks(self):
        """(L, R) as [B G, T, m] and [B G, T, n], and B, G."""
        if self._L3 is not None:
            return self._L3, self._R3, self._L3.shape[0], 1
        b, g, t, m = self._L.shape
        return self._L.reshape(b * g, t, m), self._R.reshape(b * g, t, self._R.shape[-1]), b, g

    def rows_to_samples(self, k):
        if k == 1:
            return self
        f = lambda x: x.reshape(-1, k, *x.shape[1:]).transpose(1, 2).reshape(  # noqa: E731
            x.shape[0] // k, x.shape[1], k * x.shape[2], x.shape[3])
        return Outer(f(self.L), f(self.R))

    def sq(self):
        l, r, b, g = self._blocks()
        sq = outer_sq_norms(r, l)
        return sq if g == 1 else sq.reshape(b, g).sum(1)

    def materialize(self, workspace=None) -> Optional["Dense"]:
        """The per-sample gradients themselves ([B, G m n] by one bmm, into a buffer of `workspace` when given: Note
        [workspace]), when that is no larger than twice the L and R this term keeps, else None. When the clip
        computes the weight gradient instead of autograd (Note [book-keeping] in bookkeeping.py) they are the cheaper
        route: T m n flops per sample, then a weighted sum, against T^2 (m + n) for the Gram norm plus T m n for the
        clipped product (measured on the tied transformer of benchmarks/test_bench_per_sample.py: 1.55x against
        1.71x a plain step)."""
        l, r, b, g = self._blocks()
        t, m, n = l.shape[1], l.shape[2], r.shape[2]
        if t == 1 or m * n > 2 * t * (m + n):
            return None
        if workspace is None:
            return Dense(torch.bmm(l.transpose(1, 2), r).view(b, g * m * n), owned=True)
        out, flat = workspace.take_pair((b * g, m, n), (b, g * m * n), l.dtype, l.device)
        torch.bmm(l.transpose(1, 2), r, out=out)
        return Dense(flat, owned=True)

    def delta(self, w, shape):
        if self._L3 is not None:
            l, r = self._L3, self._R3
            lw = l * as_dtype(w, l.dtype).view(-1, 1, 1)
            return (lw.reshape(-1, l.shape[-1]).t() @ r.reshape(-1, r.shape[-1])).reshape(shape)
        b, g, t, m = self.L.shape
        lw = self.L * as_dtype(w, self.L.dtype).reshape(b, 1, 1, 1)
        lw = lw.transpose(0, 1).reshape(g, b * t, m)
        return torch.bmm(lw.transpose(1, 2), self.R.transpose(0, 1).reshape(g, b * t, -1)).reshape(shape)


class Index(Term):
    __slots__ = ("idx", "R", "V", "transposed", "sparse")

    def __init__(self, idx: torch.Tensor, R: torch.Tensor, V: int, transposed: bool = False, sparse: bool = False):
        # idx [B, T] long, R [B, T, n] (rows that get no gradient are zero); transposed: the parameter is [n, V];
        # sparse: delta() gives a sparse COO tensor, as the backward of Embedding(sparse=True) does
        self.idx, self.R, self.V, self.transposed, self.sparse = idx, R, V, transposed, sparse and not transposed
        self.samples = idx.shape[0]

    def rows_to_samples(self, k):
        if k == 1:
            return self
        b = self.idx.shape[0] // k
        return Index(self.idx.reshape(b, -1), self.R.reshape(b, -1, self.R.shape[-1]), self.V, self.transposed,
                     self.sparse)

    def sq(self):
        b, t, d = self.R.shape
        if t <= min(64, d):
            # Short rows: ||sum_t e_{idx_t} R_t^T||^2 = sum_{t,s} [idx_t == idx_s] <R_t, R_s>, one [B, T, T] Gram (no
            # larger than R, at most 64 T d flops per sample) and a mask: 5 ops where the sort below takes ~20
            gram = torch.bmm(self.R, self.R.transpose(1, 2))
            return (gram * (self.idx.unsqueeze(2) == self.idx.unsqueeze(1))).sum((1, 2))
        # A row's gradient is the sum over the sample's positions holding that index: a sort of (sample, index) keys
        # and a segment sum, then squares summed per sample.
        n = b * t
        dev = self.idx.device
        key = (torch.arange(b, device=dev).unsqueeze(1) * self.V + self.idx).reshape(n)
        skey, perm = key.sort()
        new = torch.ones(n, dtype=torch.bool, device=dev)
        new[1:] = skey[1:] != skey[:-1]
        seg = new.cumsum(0) - 1
        rows = torch.zeros(n, d, dtype=self.R.dtype, device=dev).index_add_(0, seg, self.R.reshape(n, d)[perm])
        sample_of_seg = torch.zeros(n, dtype=torch.long, device=dev).scatter_(0, seg, skey // self.V)
        return torch.zeros(b, dtype=self.R.dtype, device=dev).index_add_(0, sample_of_seg, rows.square().sum(1))

    def delta(self, w, shape):
        d = self.R.shape[-1]
        rw = (self.R * as_dtype(w, self.R.dtype).reshape(-1, 1, 1)).reshape(-1, d)
        if self.sparse:  # uncoalesced, one row per position, as Embedding(sparse=True)'s own backward gives
            return torch.sparse_coo_tensor(self.idx.reshape(1, -1), rw, (self.V, d), check_invariants=False)
        out = torch.zeros(self.V, d, dtype=self.R.dtype, device=self.R.device).index_add_(0, self.idx.reshape(-1), rw)
        return (out.t() if self.transposed else out).reshape(shape)


class Dense(Term):
    __slots__ = ("D", "owned")

    def __init__(self, D: torch.Tensor, owned: bool = False):
        # owned: D is a fresh tensor (a materialised product) no one else holds: fold_rows may add into it
        self.D = D if D.dim() == 2 else D.reshape(D.shape[0], -1)
        self.samples = D.shape[0]
        self.owned = owned

    def rows_to_samples(self, k):
        if k == 1:
            return self
        return Dense(self.D.reshape(-1, k, self.D.shape[1]).sum(1))

    def sq(self):
        return torch.linalg.vector_norm(self.D, dim=1).square()  # one pass, no [B, n] temporary

    def delta(self, w, shape):
        return torch.mv(self.D.t(), as_dtype(w, self.D.dtype)).view(shape)


_FORMS = (Outer, Index, Dense)  # the forms combine() joins, and cross() pairs


def _cat(terms: Sequence[Term]) -> Optional[Term]:
    if not terms:
        return None
    if len(terms) == 1:
        return terms[0]
    dt = torch.float64 if any(term_dtype(t) == torch.float64 for t in terms) else torch.float32
    t0 = terms[0]
    if isinstance(t0, Outer):
        shapes = {(t.L.shape[1], t.L.shape[3], t.R.shape[3]) for t in terms}
        if len(shapes) > 1:
            raise RuntimeError(f"hookstats.PerSampleGradNorms: one parameter's uses have different block shapes "
                               f"{sorted(shapes)}; sharing it that way has no per-sample rule")
        return Outer(torch.cat([t.L.to(dt) for t in terms], 2), torch.cat([t.R.to(dt) for t in terms], 2))
    if isinstance(t0, Index):
        if len({t.transposed for t in terms}) > 1:
            raise RuntimeError("hookstats.PerSampleGradNorms: one parameter used as an embedding table both ways "
                               "([V, n] and [n, V]) has no per-sample rule")
        return Index(torch.cat([t.idx for t in terms], 1), torch.cat([t.R.to(dt) for t in terms], 1), t0.V,
                     t0.transposed, all(t.sparse for t in terms))
    return Dense(sum(t.D.to(dt) for t in terms))


def term_dtype(t: Term) -> torch.dtype:
    """The dtype the term's tensors hold (that of its delta); float64 for a Term subclass of another form."""
    return (t.dtype if isinstance(t, Outer) else t.R.dtype if isinstance(t, Index) else t.D.dtype
            if isinstance(t, Dense) else torch.float64)


def combine(terms: List[Term]) -> List[Term]:
    """At most one term of each form, with the same sum; a Term of a form of its own (a rule's) joins its uses by its
    cat()."""
    out = [_cat([t for t in terms if isinstance(t, cls)]) for cls in _FORMS]
    for cls in dict.fromkeys(type(t) for t in terms if not isinstance(t, _FORMS)):
        same = [t for t in terms if type(t) is cls]
        out.append(same[0] if len(same) == 1 else cls.cat(same))
    return [t for t in out if t is not None]


def cross(a: Term, b: Term) -> torch.Tensor:
    """<grad_a, grad_b> per sample, for two terms of different forms (combine() has merged those of one form)."""
    if not isinstance(a, _FORMS) or not isinstance(b, _FORMS):
        odd = type(a if not isinstance(a, _FORMS) else b).__name__
        raise RuntimeError(f"hookstats.PerSampleGradNorms: a parameter whose per-sample gradient is a {odd} was also "
                           f"used by another kind of layer, which has no per-sample rule")
    if any(isinstance(t, Index) and t.transposed for t in (a, b)):
        raise RuntimeError("hookstats.PerSampleGradNorms: a transposed embedding table ([n, V]) used by another kind "
                           "of layer too has no per-sample rule")
    if isinstance(a, Dense):
        a, b = b, a
    dt = torch.promote_types(term_dtype(a), term_dtype(b))
    if isinstance(b, Dense):
        d = b.D.to(dt)
        if isinstance(a, Outer):  # sum_t L_t^T D_b R_t, per block
            bs, g, t, m = a.L.shape
            dm = d.reshape(bs * g, m, -1)
            lr = torch.bmm(a.L.to(dt).reshape(bs * g, t, m), dm)  # [B G, T, n]
            return (lr * a.R.to(dt).reshape(bs * g, t, -1)).sum((1, 2)).reshape(bs, g).sum(1)
        # Index: the sample's gradient rows at its indices, by row (index_select: 5-10x a gather of every element)
        bs, v = d.shape[0], a.V
        key = (torch.arange(bs, device=d.device).unsqueeze(1) * v + a.idx).reshape(-1)
        picked = d.reshape(bs * v, -1).index_select(0, key)
        return torch.linalg.vecdot(picked.reshape(bs, -1), a.R.to(dt).reshape(bs, -1), dim=1)
    if isinstance(a, Index):
        a, b = b, a
    # a: Outer with one block, L [B, S, V]; b: Index idx [B, T], R [B, T, n]
    if a.L.shape[1] != 1:
        raise RuntimeError("hookstats.PerSampleGradNorms: an embedding tied to a grouped layer has no per-sample rule")
    lo, ro = a.L[:, 0].to(dt), a.R[:, 0].to(dt)  # [B, S, V], [B, S, n]
    s, t = lo.shape[1], b.idx.shape[1]
    picked = torch.gather(lo, 2, b.idx.unsqueeze(1).expand(-1, s, t))  # L_s[idx_t]: [B, S, T]
    return (picked * torch.bmm(ro, b.R.to(dt).transpose(1, 2))).sum((1, 2))


def fold_rows(ts: List[tuple]) -> List[tuple]:
    """[(term, deferred)] of one parameter, with the same sum: each embedding-row term (Index) added into an owned
    Dense term of the same parameter with the same `deferred` (Note [tied rows folded])."""
    if len(ts) < 2:
        return ts
    into = next(((t, d) for t, d in ts if type(t) is Dense and t.owned), None)
    if into is None:
        return ts
    dense, deferred = into
    out = []
    for t, d in ts:
        if (type(t) is Index and not t.transposed and d == deferred and t.R.dtype == dense.D.dtype
                and t.samples == dense.samples and dense.D.shape[1] == t.V * t.R.shape[-1]):
            b, n = t.R.shape[0], t.R.shape[-1]
            key = (torch.arange(b, device=t.idx.device).unsqueeze(1) * t.V + t.idx).reshape(-1)
            dense.D.view(b * t.V, n).index_add_(0, key, t.R.reshape(-1, n))
        else:
            out.append((t, d))
    return out


# Note [tied rows folded]: a parameter used as an LM head whose per-sample gradients were materialised (Note
# [book-keeping]) and as an embedding table (Index: rows of the output gradient at the sample's tokens) has, per
# sample, the gradient D_b + sum_t e_{idx_bt} R_bt^T. Added into D_b's rows (one index_add_ over the B T rows, into
# the buffer the product was written to), it is one Dense term: its squared norm one pass, its clip one weighted
# sum, instead of ||D||^2 + ||Index||^2 + 2 <D, Index> (a Gram, a mask, a row gather) and two weighted sums. Only when
# both uses are clipped the same way (both deferred, or neither): the weights of their clip sums must agree.


def sum_sq(terms: List[Term]) -> torch.Tensor:
    """||sum of the terms||^2 per sample."""
    if len(terms) == 1:
        return terms[0].sq()
    parts = combine(terms)
    sq = parts[0].sq()
    for i, a in enumerate(parts):
        if i:
            sq = sq + a.sq()
        for b in parts[i + 1:]:
            sq = sq + 2 * cross(a, b)
    return sq


def sum_same_length(vs: List[torch.Tensor], what: str) -> torch.Tensor:
    """The sum of per-sample vectors that must hold the same samples."""
    n = {v.numel() for v in vs}
    if len(n) > 1:
        raise RuntimeError(f"hookstats.PerSampleGradNorms: {what} saw different numbers of samples this step "
                           f"({sorted(n)}): a layer ran in only some backward passes; read per_param() instead")
    return torch.stack(vs).sum(0)
