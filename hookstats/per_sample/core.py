"""PerSampleGradNorms: per-sample gradient norms without per-sample gradients, from a rule per layer type."""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from . import ranking as _ranking
from . import rules as _rules  # noqa: F401  (registers the shipped rules)
from .._owned_hooks import in_backward, register
from .._select import Selection
from .batch import first_batch, flattened, nonreentrant_recompute, output_tensors, proved_rows, rows_refusal
from .bookkeeping import _is_functorch, defer_hook, param_at, restore_hook, untracked
from .clip import OPT_OUT, deliver, refuse_unclipped
from .coverage import Coverage, build_coverage
from .ddp import active_ddp, clip_with
from .rules.refused import Refused
from .stacked import STACK_MAX, stack_small
from .terms import Dense, fold_rows, sum_same_length, sum_sq
from .workspace import _ACTIVE, Workspace


class _Call:
    """One forward call of a layer whose gradient is awaited."""

    __slots__ = ("kept", "active", "batched", "bd", "k", "shape", "deferred")

    def __init__(self, kept, active, batched, bd, k, shape, deferred=()):
        self.kept, self.active, self.batched, self.bd, self.k, self.shape = kept, active, batched, bd, k, shape
        self.deferred = deferred  # attributes whose gradient autograd does not compute (Note [book-keeping])


class PerSampleGradNorms:
    """Per-sample gradient norms of chosen layers, accumulated on the device, without materialising per-sample
    gradients (docs/guide/per-sample.md).

    `PerSampleGradNorms(model, include="*", exclude=(), batch_dim=0)` hooks every module whose qualified name or class
    name matches a glob of `include` and none of `exclude` and that has a per-sample rule for its exact type
    (hookstats.per_sample.rules: Linear, Conv1d/2d/3d, Embedding, EmbeddingBag, LayerNorm, GroupNorm, RMSNorm, the HF
    RMSNorms, HF Conv1D, timm LayerNorm2d / Conv2dSame / StdConv2d, ...; `register_rule` adds others). Every
    trainable parameter is either covered or reported with the reason it is not (`coverage()`, `summary()`, one
    warning at construction).

    - What is measured: sample b's contribution to each parameter's `.grad` in this backward: the gradient of the
      loss you backpropagate restricted to sample b's terms (with a mean-reduced loss, 1/B times the gradient of the
      sample's own loss; Opacus with loss_reduction="mean" reports B times this). A parameter used by several layers
      (tied embeddings and LM head) gets the sum of its uses' contributions before the norm. The samples must be
      independent through the layer (no BatchNorm mixing them in training).
    - Batch dimension: dim `batch_dim` (default 0) of the inputs of Linear-like layers (1 for [T, B, ...]); conv and
      [B, C, ...] norms use dim 0. The model's batch size is read from its first tensor input at each call: an
      embedding fed a batch of 1 (position ids [1, T]) has its output expanded to the batch (the broadcast then
      happens there, values unchanged), a layer fed a batch-major flattening [B * T, ...] is split per sample, and
      any other layer whose dim 0 is not the batch is refused (named in a warning, left out of the total).
    - Gradient accumulation: each backward appends its samples ([B_1 + B_2 + ...] a step). Calls of one layer with
      the same batch size before one backward are the same samples and are summed per sample.
    - `max_norm=C`: per-sample clipping of every covered parameter's `.grad` when the backward is done (`clip_coef()`);
      the norms read afterwards are the unclipped ones. The per-sample bound must hold for every trainable
      parameter (Note [clipping refuses what it cannot bound]): a trainable parameter in scope that is not covered
      raises a ValueError naming it and why, and so does, in the backward, a layer refused at run time or a parameter
      whose gradient arrived without a per-sample term; freeze it, leave it out with include/exclude, or pass
      `allow_unclipped=True` to clip what is covered and leave the rest unclipped (warned, not DP).
    - `step()` clears the current vectors; nothing is copied to the host until `top_samples` /
      `first_nonfinite_sample` / `summary` / `.tolist()`.
    """

    def __init__(self, model: nn.Module, include: Sequence[str] | str = "*", exclude: Sequence[str] | str = (),
                 batch_dim: int = 0, max_norm: Optional[float] = None, eps: float = 1e-6,
                 allow_unclipped: bool = False):
        if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm >= 0):
            raise ValueError(f"hookstats.PerSampleGradNorms: max_norm must be a number >= 0 or None, got {max_norm!r}")
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(f"hookstats.PerSampleGradNorms: batch_dim must be an int >= 0, got {batch_dim!r}")
        self.max_norm = None if max_norm is None else float(max_norm)
        self.allow_unclipped = bool(allow_unclipped)
        self.eps = float(eps)
        self.batch_dim = batch_dim
        in_scope = Selection(include, exclude).matches
        cov = build_coverage(model, in_scope)
        self._static = cov
        self.layers: List[str] = cov.layers
        self._rule = cov.rule  # layer -> Rule
        self._attrs = cov.attrs  # layer -> [(attr, pid)] covered
        self._holders = cov.holders  # pid -> hooked layers
        self._pname = cov.pname  # pid -> canonical name
        self._param = cov.param  # pid -> Parameter
        self._params = {layer: [(self._pname[pid], a) for a, pid in v] for layer, v in self._attrs.items()}
        self._handles = []
        self._pending: Dict[str, List[_Call]] = {}
        self._terms: Dict[int, list] = {}
        self._sq: Dict[str, List[torch.Tensor]] = {}
        self._clip: list = []
        self._small: list = []  # (pid, samples, D, deferred): lone small Dense terms (Note [stacked small terms])
        self._coef: List[torch.Tensor] = []
        self._refused: Dict[str, str] = {}  # layer -> reason, found at run time
        self._dead: set = set()  # pids left out because a use of theirs was refused at run time
        self._flush_queued = False
        self._batch: Optional[int] = None
        self._bwd_batches: set = set()  # batch sizes of the root forwards this backward has reached
        self._fwd_batches: set = set()  # batch sizes of the root forwards since the last backward's end
        self._accumulated: set = set()  # pids whose .grad autograd changed in this backward (max_norm)
        self._termed: set = set()  # pids that got a per-sample term in this backward
        self._rows: dict = {}  # autograd node -> (batch, rows per sample): outputs proved batch-major flattened
        # Note [book-keeping]: layer -> a stack of [(attr, Parameter)] detached for its running calls; layer -> the
        # attributes its call just deferred; whether the clip is delivering its own gradient; the DDP reducing (ddp.py)
        self._swapped, self._deferred, self._delivering, self._ddp = {}, {}, False, None
        self._ws = Workspace()  # Note [workspace]: the materialised per-sample products of the deferred weights
        if self.max_norm is not None and cov.in_scope_uncovered and not self.allow_unclipped:
            items = [f"{self._pname[pid]} ({cov.why[pid]})" for pid in cov.in_scope_uncovered]
            shown = "; ".join(items[:12]) + (f"; and {len(items) - 12} more" if len(items) > 12 else "")
            raise ValueError(f"hookstats.PerSampleGradNorms(max_norm=...): {len(items)} trainable parameters have no "
                             f"per-sample rule, so their gradients could not be clipped and the per-sample bound "
                             f"would not hold: {shown}. {OPT_OUT}")
        if not self.layers:
            raise ValueError(f"hookstats.PerSampleGradNorms: no Linear, Conv, Embedding, norm or other layer with a "
                             f"per-sample rule matches include={include!r}, exclude={exclude!r}")
        mods = dict(model.named_modules())
        self._defer = self.max_norm is not None and not self.allow_unclipped  # Note [book-keeping]
        for name in self.layers:
            can = self._rule[name].deferrable(mods[name]) if self._defer else ()
            defer = [(a, pid) for a, pid in self._attrs[name] if a in can]
            if defer:
                self._handles += [register(mods[name], "register_forward_pre_hook", defer_hook(self, name, defer),
                                           with_kwargs=True),
                                  register(mods[name], "register_forward_hook", restore_hook(self, name),
                                           always_call=True)]
            site = self._rule[name].hook_site(mods[name])  # the layer itself, or the child whose call it reads
            self._handles.append(register(site, "register_forward_hook", self._forward_hook(name, mods[name], site),
                                          with_kwargs=True))
        if self.max_norm is not None:  # Note [clipping refuses what it cannot bound]
            for pid, p in self._param.items():
                if p.requires_grad and pid not in cov.why:  # the uncovered ones raised above, or were allowed
                    self._handles.append(p.register_post_accumulate_grad_hook(
                        lambda p, pid=pid: self._on_accumulate(pid)))
        self._handles.append(register(model, "register_forward_pre_hook", self._root_pre, with_kwargs=True))
        self._handles.append(register(model, "register_forward_hook", self._root_post, always_call=True))
        if cov.warning:
            warnings.warn(cov.warning, stacklevel=2)

    # -- the model's batch size, while its forward runs and in the backward -------------------------------------
    def _root_pre(self, mod, args, kwargs):
        self._batch = first_batch(args, kwargs, self.batch_dim)
        self._ddp = active_ddp(mod, self.max_norm)

    def _root_post(self, mod, args, output):
        b, self._batch = self._batch, None
        self._rows.clear()
        if b is None or not torch.is_grad_enabled() or in_backward():
            return
        self._fwd_batches.add(b)
        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(lambda g, b=b: self._root_grad(b))

    def _root_grad(self, b: int) -> None:
        # The backward reaches the model's output before any layer of that forward, in the outermost backward
        # (Note [checkpointed layers])
        self._bwd_batches.add(b)
        self._queue_flush()

    def _recompute_batch(self, name: str) -> Optional[int]:
        """The model's batch size for a layer run in the backward (Note [checkpointed layers]), or a Refused."""
        sizes = self._bwd_batches or self._fwd_batches
        if len(sizes) == 1:
            return next(iter(sizes))
        raise Refused(f"it was recomputed in the backward (reentrant activation checkpointing) through forwards of "
                      f"{'different batch sizes ' + str(sorted(sizes)) if sizes else 'an unknown batch size'}: the "
                      "recomputed call cannot be matched to its samples; run one backward per forward, or "
                      "use_reentrant=False")

    # -- forward: keep what the backward needs -------------------------------------------------------------------
    def _forward_hook(self, name: str, owner: nn.Module, site: nn.Module):
        rule = self._rule[name]

        def hook(mod, args, kwargs, output):
            mod = owner if mod is site else mod  # Rule.hook_site; a deepcopy's module holds none of our parameters
            deferred = self._deferred.pop(name, ())
            if not torch.is_grad_enabled() or not args or name in self._refused:
                return untracked(name, deferred)
            out = rule.output(mod, output)
            if out is None or not out.requires_grad or _is_functorch(out):
                return untracked(name, deferred)
            recompute = in_backward()
            replay = recompute and nonreentrant_recompute()
            # `is`: a deepcopy of the model carries these hooks too; its parameters are not ours
            active = [(a, pid) for a, pid in self._attrs[name] if param_at(mod, a) is self._param[pid]
                      and self._param[pid].requires_grad and pid not in self._dead]
            b = self._batch
            if recompute and b is None:
                try:
                    b = self._recompute_batch(name)
                except Refused as e:
                    if replay or not active:
                        return None
                    self._refuse(name, str(e))
                    return untracked(name, deferred)
            x0 = rule.input(mod, args, kwargs)
            if not isinstance(x0, torch.Tensor):
                return untracked(name, deferred)
            x = x0.detach()
            batched = rule.is_batched(mod, x)
            bd = self.batch_dim if rule.batch_dim_applies else 0
            if not batched:
                x = x.unsqueeze(0)
            elif bd:
                x = x.movedim(bd, 0)
            rows, k, expand = x.shape[0], 1, False
            if batched and b is not None and rows != b:
                if rows == 1 and rule.expands(mod, x) and out is output and out.dim() > bd and out.shape[bd] == 1:
                    expand = True  # broadcast over the batch: make it happen at this output (Note [broadcast layers])
                    x = x.expand(b, *x.shape[1:])
                elif bd == 0 and rows % b == 0 and (flattened(x0, b) or proved_rows(self._rows, x0, b, rows // b)):
                    k = rows // b
                    if rule.rowwise and out.shape[0] == rows and out.grad_fn is not None:
                        self._rows[out.grad_fn] = (b, k)  # Note [flattened batches]
                elif replay or not active:
                    return None if replay else untracked(name, deferred)
                else:
                    why = rows_refusal(bd, rows, b)
                    # refused when a gradient reaches this output: a side computation whose result is detached
                    # (DoRA's lora_B(lora_A(eye)) for its weight norm) leaves the layer's other calls covered
                    out.register_hook(lambda g, name=name, why=why: self._refuse(name, why))
                    return untracked(name, deferred)
            if not active:
                return untracked(name, deferred)
            if replay:  # the gradient comes through the first forward's call; the graph must be the same
                if expand:
                    shape = list(out.shape)
                    shape[bd] = b
                    return out.expand(shape)
                return None
            try:
                kept = rule.keep_call(mod, x, args, kwargs, output)
            except Refused as e:
                self._refuse(name, str(e))
                return untracked(name, deferred)
            target, ret = out, None
            if expand:
                shape = list(out.shape)
                shape[bd] = b
                target = ret = out.expand(shape)
            else:
                # Linear / Embedding outputs of [B, T, ...] inputs are views of a fresh 2-D result. A hook on such a
                # view never fires once a later op modifies it in place (ReLU(inplace=True): autograd rebases the
                # view); a hook on the base always fires, with the gradient of the value before any in-place change.
                base = out._base
                if (base is not None and base.requires_grad and base.numel() == out.numel()
                        and base.is_contiguous() and out.is_contiguous()):
                    target = base
            call = _Call(kept, active, batched, bd, k, target.shape if expand else out.shape, deferred)
            self._pending.setdefault(name, []).append(call)
            target.register_hook(lambda g, name=name, call=call, mod=mod: self._grad_hook(name, mod, call, g))
            if recompute:
                self._queue_flush()  # on the backward running the recompute, if the model's output did not
            return ret
        return hook


    def _refuse(self, name: str, reason: str) -> None:
        if name in self._refused:
            return
        if self.max_norm is not None and not self.allow_unclipped:
            raise RuntimeError(f"hookstats.PerSampleGradNorms(max_norm=...): layer {name or '<model>'} cannot be split "
                               f"per sample: {reason}; its parameters' gradients could not be clipped. {OPT_OUT}")
        self._refused[name] = reason
        self._pending.pop(name, None)
        for _, pid in self._attrs[name]:  # a shared parameter missing one use's part would be wrong: drop it
            self._dead.add(pid)
            self._terms.pop(pid, None)
            self._sq.pop(self._pname[pid], None)
        warnings.warn(f"hookstats.PerSampleGradNorms: layer {name or '<model>'} is refused: {reason}; its parameters "
                      f"are left out of the total (see coverage())", stacklevel=3)

    # -- backward ------------------------------------------------------------------------------------------------
    def _grad_hook(self, name: str, mod: nn.Module, call: _Call, grad: Optional[torch.Tensor]):
        if grad is None:
            return None
        try:  # (_Call has no __eq__: by identity)
            self._pending[name].remove(call)
        except (KeyError, ValueError):  # cleared by step() or refused since the forward
            return untracked(name, call.deferred, again=True)
        if torch.is_grad_enabled():  # a backward with create_graph=True: the terms stay out of its graph
            with torch.no_grad():
                self._take_grad(name, mod, call, grad)
        else:
            self._take_grad(name, mod, call, grad)
        if self.max_norm is not None:
            self._queue_flush()
        return None

    def _take_grad(self, name: str, mod: nn.Module, call: _Call, grad: torch.Tensor) -> None:
        g = grad.detach() if grad.requires_grad else grad
        if g.shape != call.shape:
            g = g.reshape(call.shape)
        if not call.batched:
            g = g.unsqueeze(0)
        elif call.bd:
            g = g.movedim(call.bd, 0)
        _ACTIVE.append(self._ws)  # the rule's large temporaries from the workspace (workspace.scratch)
        try:
            terms = self._rule[name].terms(mod, call.kept, g, tuple(a for a, _ in call.active))
        finally:
            _ACTIVE.pop()
        call.kept = None
        for a, pid in call.active:
            if pid in self._dead:
                continue
            self._termed.add(pid)
            term = terms[a] if call.k == 1 else terms[a].rows_to_samples(call.k)
            deferred = a in call.deferred
            if deferred:  # Note [book-keeping]: the per-sample gradients, when the cheaper route
                mat = getattr(term, "materialize", None)
                term = (mat(self._ws) if mat is not None else None) or term
            self._terms.setdefault(pid, []).append((term, deferred))
            holders = self._holders[pid]
            if (not self._pending.get(holders[0]) if len(holders) == 1
                    else all(not self._pending.get(layer) for layer in holders)):
                self._finalize(pid)
            else:
                self._queue_flush()

    def _queue_flush(self) -> None:
        if not self._flush_queued:  # runs when this backward is done
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush_all)

    def _finalize(self, pid: int) -> None:
        """The squared norm of the parameter's per-sample gradient: the sum of its uses' terms, per group of calls
        with the same number of samples (grad mode off: the caller's). A lone small Dense term waits for the end of
        the backward, where such terms are stacked (Note [stacked small terms])."""
        ts = self._terms.pop(pid, None) or []
        by: Dict[int, list] = {ts[0][0].samples: ts} if len(ts) == 1 else {}
        for t, deferred in ts if len(ts) > 1 else ():
            by.setdefault(t.samples, []).append((t, deferred))
        for n, ts in by.items():
            ts = fold_rows(ts)
            if len(ts) == 1 and type(ts[0][0]) is Dense and ts[0][0].D.shape[1] <= STACK_MAX:
                self._small.append((pid, n, ts[0][0].D, ts[0][1]))
                self._queue_flush()
                continue
            sq = sum_sq([t for t, _ in ts])
            self._sq.setdefault(self._pname[pid], []).append(sq)
            if self.max_norm is not None:  # kept until the end of this backward (Note [per-sample clipping])
                self._clip.append((pid, n, sq, ts))

    def _on_accumulate(self, pid: int) -> None:
        if self._delivering:  # the clip's own gradient (Note [book-keeping])
            return
        self._accumulated.add(pid)
        self._queue_flush()

    def _flush_all(self) -> None:
        self._flush_queued = False
        self._bwd_batches.clear()
        self._fwd_batches.clear()
        self._rows.clear()
        try:
            with torch.no_grad():
                for pid in list(self._terms):
                    self._finalize(pid)
                small = stack_small(self._small, self._dead, self._sq, self._pname, self.max_norm is not None)
            unclipped = sorted(self._pname[pid] for pid in self._accumulated - self._termed if pid not in self._dead)
            self._accumulated.clear()
            self._termed.clear()
            if unclipped:
                refuse_unclipped(unclipped, self.allow_unclipped)
            if self._clip or small or self._ddp is not None:  # under DDP the ranks' collectives must line up
                self._apply_clip(small)
        finally:  # no term outlives the backward: their workspace buffers are free again (Note [workspace])
            self._terms.clear()
            self._small.clear()
            self._clip.clear()
            self._ws.release()

    def _apply_clip(self, small: list) -> None:  # Note [per-sample clipping]
        entries, self._clip = [e for e in self._clip if e[0] not in self._dead], []
        coef, grads = clip_with(self._ddp, self._pname)(entries, self.max_norm, self.eps, self._param, groups=small)
        if coef is not None:
            self._coef.append(coef)
        deliver(grads, self._param, self)

    def clip_coef(self) -> torch.Tensor:
        """The per-sample clipping coefficients min(1, max_norm / (norm + eps)) of this step, [samples] float64."""
        if not self._coef:
            raise RuntimeError("hookstats.PerSampleGradNorms: no clipped backward since the last step()")
        return torch.cat(self._coef) if len(self._coef) > 1 else self._coef[0]

    # -- results ---------------------------------------------------------------------------------------------------
    def per_param_sq(self) -> Dict[str, torch.Tensor]:
        """Squared per-sample gradient norms per parameter (named as in model.named_parameters(); a tied parameter
        once), [samples] float64 on the device (no sync)."""
        return {pn: (torch.cat(v) if len(v) > 1 else v[0]).to(torch.float64) for pn, v in self._sq.items()}

    def per_param(self) -> Dict[str, torch.Tensor]:
        """Per-sample gradient norm of each parameter: {"fc1.weight": [samples], ...}, float64, on the device."""
        return {pn: v.sqrt() for pn, v in self.per_param_sq().items()}

    def per_layer(self) -> Dict[str, torch.Tensor]:
        """Per-sample gradient norm of each layer's parameters together, [samples] float64 on the device. A tied
        parameter counts in full in each layer holding it (the sum of all its uses): layers' squares then add up
        to more than total()."""
        sq = self.per_param_sq()
        out: Dict[str, torch.Tensor] = {}
        for layer in self.layers:
            vs = [sq[pn] for pn, _ in self._params[layer] if pn in sq]
            if vs:
                out[layer] = sum_same_length(vs, layer).sqrt()
        return out

    def total(self) -> torch.Tensor:
        """Per-sample norm of the gradient of every covered parameter together (each once), [samples] float64 on the
        device."""
        sq = self.per_param_sq()
        if not sq:
            refused = f" ({len(self._refused)} layers refused at run time)" if self._refused else ""
            raise RuntimeError(f"hookstats.PerSampleGradNorms: no per-sample gradient since the last step(): no "
                               f"backward ran, or none reached a covered parameter through its layer{refused}; see "
                               f"coverage()")
        return sum_same_length(list(sq.values()), "the covered parameters").sqrt()

    def coverage(self) -> Coverage:
        """Which trainable parameters count and which do not, by name and reason (hookstats.per_sample.Coverage),
        including layers refused at run time and covered parameters not seen in this step's backwards."""
        return self._static.report(self._refused, self._dead, set(self._sq))

    def summary(self) -> str:
        """Coverage, then each layer's mean and max per-sample norm this step (one host copy)."""
        lines = [str(self.coverage())]
        layers = self.per_layer()
        if layers:
            names = list(layers)
            t = torch.stack([layers[n] for n in names]).cpu()
            lines.append(f"per-sample gradient norms, {t.shape[1]} samples this step (mean / max):")
            w = max(len(n) for n in names)
            lines += [f"  {n or '<model>':<{w}}  {float(r.mean()):.4g} / {float(r.max()):.4g}"
                      for n, r in zip(names, t)]
            tot = self.total().cpu()
            lines.append(f"  {'total':<{w}}  {float(tot.mean()):.4g} / {float(tot.max()):.4g}")
        return "\n".join(lines)

    def top_samples(self, k: int = 1) -> List[tuple]:
        """The k samples with the largest total gradient norm, as (sample index, norm) pairs, largest first (one host
        copy): NaN first, then inf, equal norms in sample order (Note [ranking samples])."""
        return [(r.sample, r.norm) for r in _ranking.top_samples([(None, self.total())], k)]

    def first_nonfinite_sample(self) -> Optional[dict]:
        """The first sample whose gradient norm is NaN or Inf: {"sample": index, "norm": its total norm, "layers": the
        layers where that sample's norm is non-finite, in model order}, or None (one host copy; Note [ranking
        samples])."""
        layers = self.per_layer()
        if not layers:
            return None
        names = list(layers)
        hit = _ranking.first_nonfinite_sample([(None, names, torch.stack([layers[n] for n in names]), self.total())])
        return None if hit is None else {"sample": hit.sample, "norm": hit.norm, "layers": hit.layers}

    @property
    def samples(self) -> int:
        """How many samples the current vectors hold (0 before the first backward)."""
        sq = self.per_param_sq()
        return next(iter(sq.values())).numel() if sq else 0

    def step(self) -> None:
        """Starts a new step: clears the vectors and any kept input still waiting for a gradient. Layers refused at
        run time stay refused (reset() forgets them too)."""
        self._sq.clear()
        self._pending.clear()
        self._terms.clear()
        self._small.clear()
        self._clip.clear()
        self._coef.clear()
        self._ws.release()

    def reset(self) -> None:
        """Back to the state right after construction, the hooks kept: what step() clears, and also the layers
        refused at run time (with the parameters they left out) and the batch sizes seen, so that a new run (another
        batch layout, another data set) is judged afresh."""
        self.step()
        for s in (self._refused, self._dead, self._bwd_batches, self._fwd_batches, self._accumulated, self._termed,
                  self._rows):
            s.clear()
        self._batch = None

    def remove(self) -> None:
        """Removes every hook and clears the vectors."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.step()
        self._ws.clear()

    def __enter__(self) -> "PerSampleGradNorms":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

