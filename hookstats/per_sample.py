"""Per-sample gradient norms without per-sample gradients: `PerSampleGradNorms`.

For each chosen layer, a forward hook keeps the layer's input (a tensor autograd keeps anyway) and puts a tensor
hook on its output; in the backward, that hook receives the output's gradient and computes, for every sample b, the
squared Frobenius norm of the sample's parameter gradient from the two, with batched matrix products (MKL / cuBLAS)
and no [B, out, in] per-sample gradient unless that is the cheaper product:

  Linear, inputs [B, in] or [B, T..., in]: W_b = sum_t g_bt x_bt^T, so ||W_b||^2 = ||g_b||^2 ||x_b||^2 when T = 1,
      <X_b X_b^T, G_b G_b^T> (two [B, T, T] Gram matrices) when T^2 < in * out, else ||G_b^T X_b||^2 (one bmm);
      bias ||sum_t g_bt||^2.
  Conv1d / Conv2d: the same on the unfolded input (patches [B, L, C_in k / groups] per group, L output positions).
  Embedding: a token's gradient row is the sum of the output gradients of every position holding that token in the
      sample, so rows of repeated tokens are summed before squaring (a sort of (sample, token) keys and a segment
      sum, no host sync); padding_idx rows get no gradient.
  LayerNorm (elementwise affine): weight sum_t g_bt * xhat_bt (xhat recomputed from the kept input), bias sum_t g_bt.

Everything stays on the device; `per_layer()`, `per_param()` and `total()` return device tensors; `top_samples(k)`
and `first_nonfinite_sample()` copy once to the host.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def outer_sq_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """||sum_t g[b, t] a[b, t]^T||_F^2 for every b, from a [B, T, p] and g [B, T, q], without the [B, q, p] per-sample
    products unless they are the cheaper computation."""
    b, t, p = a.shape
    q = g.shape[-1]
    if t == 1:
        return a.square().sum((1, 2)) * g.square().sum((1, 2))
    if t * t < p * q:
        ga = torch.bmm(a, a.transpose(1, 2))
        gg = torch.bmm(g, g.transpose(1, 2))
        return torch.bmm(ga.reshape(b, 1, t * t), gg.reshape(b, t * t, 1)).reshape(b)
    return torch.bmm(g.transpose(1, 2), a).square().sum((1, 2))


class _Call:
    """One forward call of a layer whose gradient is awaited: what the backward needs."""

    __slots__ = ("kind", "a", "mod", "attrs", "grad", "batch")

    def __init__(self, kind: str, a: torch.Tensor, mod: nn.Module, batch: int):
        self.kind, self.a, self.mod, self.batch = kind, a, mod, batch
        self.attrs: tuple = ()
        self.grad: Optional[torch.Tensor] = None


def _glob_match(name: str, mod: nn.Module, patterns) -> bool:
    keys = (name, type(mod).__name__)
    return any(fnmatch.fnmatchcase(k, p) for p in patterns for k in keys)


class PerSampleGradNorms:
    """Per-sample gradient norms of chosen layers, accumulated on the device, without materialising per-sample
    gradients.

    `PerSampleGradNorms(model, include="*", exclude=(), batch_dim=0)` hooks every nn.Linear, nn.Conv1d, nn.Conv2d,
    nn.Embedding and elementwise-affine nn.LayerNorm whose qualified name or class name matches a glob of `include`
    and none of `exclude` (other modules are left alone). Only parameters that require grad count.

    - What is measured: sample b's contribution to each parameter's `.grad` in this backward, i.e. the gradient of
      the loss you backpropagate with respect to the parameter, restricted to sample b's terms. With a mean-reduced
      loss that is 1/B times the gradient of the sample's own loss (as in Opacus); with a sum, exactly that gradient.
      The samples must be independent through the layer (no BatchNorm mixing them before it).
    - Batch dimension: dim `batch_dim` (default 0) of the inputs of Linear, Embedding and LayerNorm is the sample
      (use 1 for sequence-first [T, B, ...] inputs); every other leading dimension is a token dimension. Conv inputs
      are [B, C, ...] as PyTorch requires; an unbatched input (a 1-D Linear input, a [C, L] Conv1d input) is one
      sample.
    - Gradient accumulation: each backward appends its samples. With micro-batches (forward + backward each) the
      vector of a step is [B_1 + B_2 + ...], samples in the order the micro-batches ran.
    - A module called several times before its gradients arrive in one backward (a shared layer, tied weights used
      twice): calls with the same batch size are taken to be the same samples, and their contributions are summed
      per sample before the norm, exactly (the calls' tokens are concatenated); calls with different batch sizes
      are different samples and are appended. (Two micro-batches forwarded before one common backward would
      therefore be summed: run a backward per micro-batch.)
    - `max_norm=C`: per-sample clipping. When a backward is done, each sample's gradient over the hooked layers is
      scaled to at most C before the batch sum: sum_b (coef_b - 1) grad_b is added to every hooked `.grad` (one
      weighted matrix product per layer from the kept tensors, which then live until the end of the backward),
      coef_b = min(1, C / (norm_b + eps)) (`clip_coef()`). Norms read afterwards are the unclipped ones.
    - `step()` clears the current vectors (and any forward whose gradient never came); call it once per optimizer
      step, after reading. Nothing is copied to the host until `top_samples` / `first_nonfinite_sample` / `.tolist()`.
    """

    def __init__(self, model: nn.Module, include: Sequence[str] | str = "*", exclude: Sequence[str] | str = (),
                 batch_dim: int = 0, max_norm: Optional[float] = None, eps: float = 1e-6):
        if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm >= 0):
            raise ValueError(f"hookstats.PerSampleGradNorms: max_norm must be a number >= 0 or None, got {max_norm!r}")
        self.max_norm = None if max_norm is None else float(max_norm)
        self.eps = float(eps)
        self._clip: list = []
        self._coef: List[torch.Tensor] = []
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(f"hookstats.PerSampleGradNorms: batch_dim must be an int >= 0, got {batch_dim!r}")
        inc = [include] if isinstance(include, str) else list(include)
        exc = [exclude] if isinstance(exclude, str) else list(exclude)
        self.batch_dim = batch_dim
        self.layers: List[str] = []
        self._params: Dict[str, List[tuple]] = {}  # layer -> [(param name, attribute)]
        self._handles = []
        self._pending: Dict[str, List[_Call]] = {}
        self._sq: Dict[str, List[torch.Tensor]] = {}  # param name -> [per-backward [B_i] squared norms]
        self._layer_of: Dict[str, str] = {}
        self._flush_queued = False
        for name, mod in model.named_modules():
            if not isinstance(mod, SUPPORTED) or not _glob_match(name, mod, inc) or _glob_match(name, mod, exc):
                continue
            if isinstance(mod, nn.LayerNorm) and not mod.elementwise_affine:
                continue
            if isinstance(mod, nn.Embedding) and mod.scale_grad_by_freq:
                raise NotImplementedError(
                    f"hookstats.PerSampleGradNorms: {name or '<model>'} has scale_grad_by_freq=True, whose gradient "
                    "scales each row by its frequency in the whole batch: a per-sample gradient is not defined; "
                    "exclude it")
            attrs = [a for a in ("weight", "bias") if isinstance(getattr(mod, a, None), nn.Parameter)]
            if not attrs:
                continue
            self.layers.append(name)
            self._params[name] = [(f"{name}.{a}" if name else a, a) for a in attrs]
            for pname, _ in self._params[name]:
                self._layer_of[pname] = name
            self._handles.append(mod.register_forward_hook(self._forward_hook(name)))
        if not self.layers:
            raise ValueError(f"hookstats.PerSampleGradNorms: no Linear, Conv1d, Conv2d, Embedding or affine "
                             f"LayerNorm matches include={include!r}, exclude={exclude!r}")

    # -- forward: keep what the backward needs -------------------------------------------------------------------
    def _forward_hook(self, name: str):
        def hook(mod, args, output):
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return None
            if _is_functorch(output):  # inside torch.func transforms (vmap / grad): not this object's backward
                return None
            active = [(pn, a) for pn, a in self._params[name] if getattr(mod, a).requires_grad]
            if not active:
                return None
            call = self._make_call(mod, args[0].detach())
            call.attrs = tuple(a for _, a in active)
            self._pending.setdefault(name, []).append(call)
            # Linear / Embedding outputs of [B, T, ...] inputs are views of a fresh 2-D result. A hook on such a
            # view never fires once a later op modifies it in place (ReLU(inplace=True): autograd rebases the view,
            # and the gradient reaches the base through CopySlices); a hook on the base always fires, with the
            # gradient of the value before any in-place change.
            target, shape = output, output.shape
            base = output._base
            if (base is not None and base.requires_grad and base.numel() == output.numel()
                    and base.is_contiguous() and output.is_contiguous()):
                target = base
            target.register_hook(
                lambda g, name=name, call=call, shape=shape: self._grad_hook(
                    name, call, None if g is None else g.reshape(shape)))
            return None
        return hook

    def _make_call(self, mod: nn.Module, x: torch.Tensor) -> _Call:
        bd = self.batch_dim
        if isinstance(mod, nn.Linear):
            if x.dim() == 1:
                x = x.unsqueeze(0)
            elif bd:
                x = x.movedim(bd, 0)
            return _Call("linear", x, mod, x.shape[0])
        if isinstance(mod, (nn.Conv1d, nn.Conv2d)):
            nd = 1 if isinstance(mod, nn.Conv1d) else 2
            if x.dim() == nd + 1:
                x = x.unsqueeze(0)
            return _Call("conv", x, mod, x.shape[0])
        if isinstance(mod, nn.Embedding):
            if x.dim() == 0:
                x = x.reshape(1)
            if bd:
                x = x.movedim(bd, 0)
            return _Call("embedding", x, mod, x.shape[0])
        # LayerNorm
        nsd = len(mod.normalized_shape)
        if x.dim() == nsd:
            x = x.unsqueeze(0)
        elif bd:
            x = x.movedim(bd, 0)
        return _Call("layernorm", x, mod, x.shape[0])

    # -- backward ------------------------------------------------------------------------------------------------
    def _grad_hook(self, name: str, call: _Call, grad: Optional[torch.Tensor]):
        if grad is None:
            return None
        call.grad = grad.detach()
        if self.max_norm is not None and not self._flush_queued:  # clipping runs when this backward is done
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush_all)
        pend = self._pending.get(name, [])
        if len(pend) == 1 and pend[0] is call:  # the common case: compute now, free the tensors
            pend.clear()
            self._compute(name, [call])
            return None
        if all(c.grad is not None for c in pend):
            self._flush_layer(name)
        elif not self._flush_queued:
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush_all)
        return None

    def _flush_all(self) -> None:
        self._flush_queued = False
        for name in list(self._pending):
            self._flush_layer(name)
        if self._clip:
            self._apply_clip()

    # Per-sample clipping: each sample's gradient (over the hooked layers) scaled to at most max_norm before the
    # batch sum. Autograd has summed the unclipped per-sample gradients into .grad; this adds
    # sum_b (coef_b - 1) grad_b, one weighted matrix product per layer from the same kept tensors, so .grad becomes
    # (what it held before this backward) + sum_b coef_b grad_b. No second backward, no per-sample gradients.
    def _apply_clip(self) -> None:
        entries, self._clip = self._clip, []
        batches = {b for _, b, _, _ in entries}
        if len(batches) > 1:
            raise RuntimeError(f"hookstats.PerSampleGradNorms(max_norm=...): one backward saw batches of sizes "
                               f"{sorted(batches)}; per-sample clipping needs one batch of samples per backward")
        with torch.no_grad():
            sq = torch.stack([v.to(torch.float64) for _, _, out, _ in entries for v in out.values()]).sum(0)
            coef = torch.clamp(self.max_norm / (sq.sqrt() + self.eps), max=1.0)
            self._coef.append(coef)
            for mod, _, out, ctx in entries:
                w = (coef - 1.0).to(ctx[2].dtype)
                for attr, delta in _clip_deltas(ctx, w, tuple(out)).items():
                    p = getattr(mod, attr)
                    if p.grad is not None:
                        p.grad.add_(delta.reshape(p.shape).to(p.grad.dtype))

    def clip_coef(self) -> torch.Tensor:
        """The per-sample clipping coefficients min(1, max_norm / (norm + eps)) of this step, [samples] float64."""
        if not self._coef:
            raise RuntimeError("hookstats.PerSampleGradNorms: no clipped backward since the last step()")
        return torch.cat(self._coef) if len(self._coef) > 1 else self._coef[0]

    def _flush_layer(self, name: str) -> None:
        pend = self._pending.get(name, [])
        ready = [c for c in pend if c.grad is not None]
        if not ready:
            return
        self._pending[name] = [c for c in pend if c.grad is None]
        by_batch: Dict[int, List[_Call]] = {}
        for c in ready:
            by_batch.setdefault(c.batch, []).append(c)
        for calls in by_batch.values():
            self._compute(name, calls)

    def _compute(self, name: str, calls: List[_Call]) -> None:
        """Adds one [B] squared norm per parameter of `name` for these calls, taken as the same samples."""
        with torch.no_grad():
            kind = calls[0].kind
            attrs = calls[0].attrs
            mod_params = dict((a, pn) for pn, a in self._params[name])
            out, ctx = getattr(self, f"_sq_{kind}")(calls, attrs)
            for a, v in out.items():
                self._sq.setdefault(mod_params[a], []).append(v)
            if self.max_norm is not None:  # kept until the end of this backward (Note: per-sample clipping)
                self._clip.append((calls[0].mod, calls[0].batch, out, ctx))
        for c in calls:
            c.a = c.grad = c.mod = None

    # token representations: a [B, T, p] and g [B, T, q] per call, concatenated along T when calls are summed
    def _tokens_linear(self, c: _Call):
        x, g = c.a, c.grad
        if g.dim() == 1:
            g = g.unsqueeze(0)
        elif self.batch_dim:
            g = g.movedim(self.batch_dim, 0)
        dt = _compute_dtype(x)
        b = x.shape[0]
        return x.reshape(b, -1, x.shape[-1]).to(dt), g.reshape(b, -1, g.shape[-1]).to(dt)

    def _sq_linear(self, calls, attrs):
        parts = [self._tokens_linear(c) for c in calls]
        a = torch.cat([p[0] for p in parts], 1) if len(parts) > 1 else parts[0][0]
        g = torch.cat([p[1] for p in parts], 1) if len(parts) > 1 else parts[0][1]
        out = {}
        if "weight" in attrs:
            out["weight"] = outer_sq_norms(a, g)
        if "bias" in attrs:
            out["bias"] = g.sum(1).square().sum(1)
        return out, ("linear", a, g)

    def _sq_conv(self, calls, attrs):
        mod = calls[0].mod
        nd = 1 if isinstance(mod, nn.Conv1d) else 2
        groups = mod.groups
        us, gs = [], []
        for c in calls:
            x, g = c.a, c.grad
            if g.dim() == nd + 1:
                g = g.unsqueeze(0)
            dt = _compute_dtype(x)
            u = _unfold(mod, x.to(dt), nd)  # [B, C_in * K, L]
            b, ck, length = u.shape
            u = u.reshape(b, groups, ck // groups, length).reshape(b * groups, ck // groups, length)
            gg = g.to(dt).reshape(b, groups, mod.out_channels // groups, -1).reshape(b * groups, -1, length)
            us.append(u.transpose(1, 2))
            gs.append(gg.transpose(1, 2))
        a = torch.cat(us, 1) if len(us) > 1 else us[0]  # [B*groups, L, C_in K / groups]
        g = torch.cat(gs, 1) if len(gs) > 1 else gs[0]  # [B*groups, L, out / groups]
        b = calls[0].batch
        out = {}
        if "weight" in attrs:
            out["weight"] = outer_sq_norms(a, g).reshape(b, groups).sum(1)
        if "bias" in attrs:
            out["bias"] = g.sum(1).reshape(b, -1).square().sum(1)
        return out, ("conv", a, g, groups, b)

    def _sq_embedding(self, calls, attrs):
        mod = calls[0].mod
        idx = torch.cat([c.a.reshape(c.batch, -1) for c in calls], 1)  # [B, T]
        gs = []
        for c in calls:
            g = c.grad
            if self.batch_dim and g.dim() > 1:
                g = g.movedim(self.batch_dim, 0)
            gs.append(g.reshape(c.batch, -1, mod.embedding_dim))
        g = torch.cat(gs, 1) if len(gs) > 1 else gs[0]
        g = g.to(_compute_dtype(g))
        b, t, d = g.shape
        if mod.padding_idx is not None:
            g = g * (idx != mod.padding_idx).unsqueeze(-1).to(g.dtype)
        n = b * t
        key = (torch.arange(b, device=idx.device).unsqueeze(1) * mod.num_embeddings + idx).reshape(n)
        skey, perm = key.sort()
        new = torch.ones(n, dtype=torch.bool, device=idx.device)
        new[1:] = skey[1:] != skey[:-1]
        seg = new.cumsum(0) - 1
        rows = torch.zeros(n, d, dtype=g.dtype, device=g.device).index_add_(0, seg, g.reshape(n, d)[perm])
        sample_of_seg = torch.zeros(n, dtype=torch.long, device=idx.device).scatter_(0, seg, skey // mod.num_embeddings)
        sq = torch.zeros(b, dtype=g.dtype, device=g.device).index_add_(0, sample_of_seg, rows.square().sum(1))
        return {"weight": sq}, ("embedding", idx, g, mod.num_embeddings)

    def _sq_layernorm(self, calls, attrs):
        mod = calls[0].mod
        nsd = len(mod.normalized_shape)
        d = math.prod(mod.normalized_shape)
        xs, gs = [], []
        for c in calls:
            x, g = c.a, c.grad
            if g.dim() == nsd:
                g = g.unsqueeze(0)
            elif self.batch_dim:
                g = g.movedim(self.batch_dim, 0)
            dt = _compute_dtype(x)
            xhat = F.layer_norm(x.to(dt), mod.normalized_shape, None, None, mod.eps)
            xs.append(xhat.reshape(c.batch, -1, d))
            gs.append(g.to(dt).reshape(c.batch, -1, d))
        xhat = torch.cat(xs, 1) if len(xs) > 1 else xs[0]
        g = torch.cat(gs, 1) if len(gs) > 1 else gs[0]
        out = {}
        if "weight" in attrs:
            out["weight"] = (g * xhat).sum(1).square().sum(1)
        if "bias" in attrs:
            out["bias"] = g.sum(1).square().sum(1)
        return out, ("layernorm", xhat, g)

    # -- results ---------------------------------------------------------------------------------------------------
    def per_param_sq(self) -> Dict[str, torch.Tensor]:
        """Squared per-sample gradient norms per parameter, [samples] float64 on the device (no sync)."""
        return {pn: (torch.cat(v) if len(v) > 1 else v[0]).to(torch.float64) for pn, v in self._sq.items()}

    def per_param(self) -> Dict[str, torch.Tensor]:
        """Per-sample gradient norm of each parameter: {"fc1.weight": [samples], ...}, float64, on the device."""
        return {pn: v.sqrt() for pn, v in self.per_param_sq().items()}

    def per_layer(self) -> Dict[str, torch.Tensor]:
        """Per-sample gradient norm of each layer (weight and bias together), [samples] float64 on the device."""
        sq = self.per_param_sq()
        out: Dict[str, torch.Tensor] = {}
        for layer in self.layers:
            vs = [sq[pn] for pn, _ in self._params[layer] if pn in sq]
            if vs:
                out[layer] = _sum_same_length(vs, layer).sqrt()
        return out

    def total(self) -> torch.Tensor:
        """Per-sample norm of the gradient of every hooked parameter together, [samples] float64 on the device."""
        sq = self.per_param_sq()
        if not sq:
            raise RuntimeError("hookstats.PerSampleGradNorms: no gradient has been seen since the last step(); run a "
                               "backward first")
        return _sum_same_length(list(sq.values()), "the hooked layers").sqrt()

    def top_samples(self, k: int = 1) -> List[tuple]:
        """The k samples with the largest total gradient norm, as (sample index, norm) pairs, largest first (one host
        copy). Non-finite norms rank first."""
        tot = self.total()
        k = min(int(k), tot.numel())
        key = torch.where(torch.isnan(tot), torch.full_like(tot, math.inf), tot)
        idx = torch.topk(key, k).indices
        vals = torch.stack([idx.to(torch.float64), tot[idx]]).cpu()
        return [(int(i), float(v)) for i, v in zip(vals[0].tolist(), vals[1].tolist())]

    def first_nonfinite_sample(self) -> Optional[dict]:
        """The first sample whose gradient norm is NaN or Inf: {"sample": index, "norm": value, "layers": the layers
        where that sample's norm is non-finite, in model order}, or None (one host copy)."""
        layers = self.per_layer()
        if not layers:
            return None
        names = list(layers)
        stacked = torch.stack([layers[n] for n in names]).cpu()  # [layers, samples]
        bad = ~torch.isfinite(stacked)
        hit = bad.any(0).nonzero()
        if hit.numel() == 0:
            return None
        s = int(hit[0, 0])
        total = float(stacked[:, s].square().sum().sqrt())
        return {"sample": s, "norm": total, "layers": [names[i] for i in bad[:, s].nonzero()[:, 0].tolist()]}

    @property
    def samples(self) -> int:
        """How many samples the current vectors hold (0 before the first backward)."""
        sq = self.per_param_sq()
        return next(iter(sq.values())).numel() if sq else 0

    def step(self) -> None:
        """Starts a new step: clears the vectors and any kept input still waiting for a gradient."""
        self._sq.clear()
        self._pending.clear()
        self._clip.clear()
        self._coef.clear()

    reset = step

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.step()

    def __enter__(self) -> "PerSampleGradNorms":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _clip_deltas(ctx, w: torch.Tensor, attrs) -> Dict[str, torch.Tensor]:
    """sum_b w_b grad_b for each parameter of one layer, from the tensors its norms were computed from."""
    kind = ctx[0]
    out: Dict[str, torch.Tensor] = {}
    if kind == "linear":
        _, a, g = ctx
        gw = g * w[:, None, None]
        if "weight" in attrs:
            out["weight"] = gw.reshape(-1, g.shape[-1]).t() @ a.reshape(-1, a.shape[-1])
        if "bias" in attrs:
            out["bias"] = gw.sum((0, 1))
    elif kind == "conv":
        _, a, g, groups, b = ctx  # [B*groups, L, K], [B*groups, L, O/groups]
        gw = (g.reshape(b, groups, *g.shape[1:]) * w[:, None, None, None])
        if "weight" in attrs:
            out["weight"] = torch.einsum("bglo,bglk->gok", gw, a.reshape(b, groups, *a.shape[1:]))
        if "bias" in attrs:
            out["bias"] = gw.sum((0, 2)).reshape(-1)
    elif kind == "embedding":
        _, idx, g, vocab = ctx
        gw = (g * w[:, None, None]).reshape(-1, g.shape[-1])
        out["weight"] = torch.zeros(vocab, g.shape[-1], dtype=g.dtype, device=g.device).index_add_(
            0, idx.reshape(-1), gw)
    else:  # layernorm
        _, xhat, g = ctx
        gw = g * w[:, None, None]
        if "weight" in attrs:
            out["weight"] = (gw * xhat).sum((0, 1))
        if "bias" in attrs:
            out["bias"] = gw.sum((0, 1))
    return out


def _is_functorch(t: torch.Tensor) -> bool:
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check is not None and check(t))


def _sum_same_length(vs: List[torch.Tensor], what: str) -> torch.Tensor:
    n = {v.numel() for v in vs}
    if len(n) > 1:
        raise RuntimeError(f"hookstats.PerSampleGradNorms: {what} saw different numbers of samples this step "
                           f"({sorted(n)}): a layer ran in only some backward passes; read per_param() instead")
    return torch.stack(vs).sum(0)


def _unfold(mod, x: torch.Tensor, nd: int) -> torch.Tensor:
    """The im2col patches of a Conv1d/Conv2d input, [B, C_in * prod(kernel), L], with the module's padding
    (numeric, 'same', 'valid', or a non-zeros padding_mode), stride and dilation."""
    k, s, d = mod.kernel_size, mod.stride, mod.dilation
    if mod.padding_mode != "zeros":
        x = F.pad(x, mod._reversed_padding_repeated_twice, mode=mod.padding_mode)
        pad = (0,) * nd
    elif mod.padding == "same":
        pads = []
        for i in reversed(range(nd)):
            total = d[i] * (k[i] - 1)
            pads += [total // 2, total - total // 2]
        x = F.pad(x, pads)
        pad = (0,) * nd
    elif mod.padding == "valid":
        pad = (0,) * nd
    else:
        pad = tuple(mod.padding)
    if nd == 1:
        return F.unfold(x.unsqueeze(2), (1, k[0]), dilation=(1, d[0]), padding=(0, pad[0]), stride=(1, s[0]))
    return F.unfold(x, k, dilation=d, padding=pad, stride=s)
