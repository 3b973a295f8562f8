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
    __slots__ = ("L", "R")

    def __init__(self, L: torch.Tensor, R: torch.Tensor):
        if L.dim() == 3:  # [B, T, m]: one block
            L, R = L.unsqueeze(1), R.unsqueeze(1)
        self.L, self.R = L, R
        self.samples = L.shape[0]

    def rows_to_samples(self, k):
        if k == 1:
            return self
        f = lambda x: x.reshape(-1, k, *x.shape[1:]).transpose(1, 2).reshape(  # noqa: E731
            x.shape[0] // k, x.shape[1], k * x.shape[2], x.shape[3])
        return Outer(f(self.L), f(self.R))

    def sq(self):
        b, g, t, m = self.L.shape
        n = self.R.shape[-1]
        return outer_sq_norms(self.R.reshape(b * g, t, n), self.L.reshape(b * g, t, m)).reshape(b, g).sum(1)

    def materialize(self, workspace=None) -> Optional["Dense"]:
        """The per-sample gradients themselves ([B, G m n] by one bmm, into a buffer of `workspace` when given: Note
        [workspace]), when that is no larger than twice the L and R this term keeps, else None. When the clip
        computes the weight gradient instead of autograd (Note [book-keeping] in bookkeeping.py) they are the cheaper
        route: T m n flops per sample, then a weighted sum, against T^2 (m + n) for the Gram norm plus T m n for the
        clipped product (measured on the tied transformer of benchmarks/test_bench_per_sample.py: 1.55x against
        1.71x a plain step)."""
        b, g, t, m = self.L.shape
        n = self.R.shape[-1]
        if t == 1 or m * n > 2 * t * (m + n):
            return None
        out = None if workspace is None else workspace.take((b * g, m, n), self.L.dtype, self.L.device)
        ps = torch.bmm(self.L.reshape(b * g, t, m).transpose(1, 2), self.R.reshape(b * g, t, n), out=out)
        return Dense(ps.reshape(b, g * m * n))

    def delta(self, w, shape):
        b, g, t, m = self.L.shape
        lw = self.L * w.to(self.L.dtype).reshape(b, 1, 1, 1)
        if g == 1:
            return (lw.reshape(-1, m).t() @ self.R.reshape(-1, self.R.shape[-1])).reshape(shape)
        lw = lw.transpose(0, 1).reshape(g, b * t, m)
        return torch.bmm(lw.transpose(1, 2), self.R.transpose(0, 1).reshape(g, b * t, -1)).reshape(shape)


class Index(Term):
    __slots__ = ("idx", "R", "V", "transposed")

    def __init__(self, idx: torch.Tensor, R: torch.Tensor, V: int, transposed: bool = False):
        # idx [B, T] long, R [B, T, n] (rows that get no gradient are zero); transposed: the parameter is [n, V]
        self.idx, self.R, self.V, self.transposed = idx, R, V, transposed
        self.samples = idx.shape[0]

    def rows_to_samples(self, k):
        if k == 1:
            return self
        b = self.idx.shape[0] // k
        return Index(self.idx.reshape(b, -1), self.R.reshape(b, -1, self.R.shape[-1]), self.V, self.transposed)

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
        rw = (self.R * w.to(self.R.dtype).reshape(-1, 1, 1)).reshape(-1, d)
        out = torch.zeros(self.V, d, dtype=self.R.dtype, device=self.R.device).index_add_(0, self.idx.reshape(-1), rw)
        return (out.t() if self.transposed else out).reshape(shape)


class Dense(Term):
    __slots__ = ("D",)

    def __init__(self, D: torch.Tensor):
        self.D = D.reshape(D.shape[0], -1)
        self.samples = D.shape[0]

    def rows_to_samples(self, k):
        if k == 1:
            return self
        return Dense(self.D.reshape(-1, k, self.D.shape[1]).sum(1))

    def sq(self):
        return torch.linalg.vector_norm(self.D, dim=1).square()  # one pass, no [B, n] temporary

    def delta(self, w, shape):
        return torch.mv(self.D.t(), w.to(self.D.dtype)).reshape(shape)


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
                     t0.transposed)
    return Dense(sum(t.D.to(dt) for t in terms))


def term_dtype(t: Term) -> torch.dtype:
    """The dtype the term's tensors hold (that of its delta); float64 for a Term subclass of another form."""
    return (t.L.dtype if isinstance(t, Outer) else t.R.dtype if isinstance(t, Index) else t.D.dtype
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
