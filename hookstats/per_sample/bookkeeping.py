"""Book-keeping: the clipped weight gradient of a covered layer computed once by the clip, instead of autograd's
weight gradient plus a correction (Note [book-keeping])."""
from __future__ import annotations

import torch

from .._owned_hooks import in_backward
from .ddp import graph_ddp
from .rules.refused import Refused

# Note [book-keeping]: with max_norm, autograd's weight gradient of a covered layer (x^T g over the batch) is wasted
# work: the clip needs sum_b coef_b grad_b, which the layer's terms give in one product with the output gradient
# scaled per sample (Bu et al., "Differentially private optimization on large model at small cost"), while the
# unclipped sum would then need sum_b (coef_b - 1) grad_b added, a second product. So for the parameters a rule can
# defer (Rule.defer: Linear and conv weights, conv biases) the forward pre-hook puts a detached alias of the parameter
# in mod._parameters for the call (restored by an always-call forward hook, also when the forward raises): the op sees
# a tensor that needs no gradient and autograd computes only the input's (and the bias's). At the end of the outermost
# backward, when the coefficients are known, the clipped gradient of the deferred uses is handed to each parameter by
# a backward of its own through one node whose edges are the parameters' AccumulateGrad (clip.deliver): .grad
# accumulates as autograd accumulates it (set, or added to an earlier micro-batch's), and the parameter's hooks,
# post-accumulate-grad hooks and DDP's reducer see that gradient. A call is deferred only when the forward hook will
# keep it: grad mode, a batched input of the model's batch size, not refused; an output that would need no gradient
# without the deferred parameters (a first layer on data) is tapped (Note [tapped outputs]). An embedding on token
# ids, a flattened or broadcast batch keep autograd's gradient and get the correction. A conv defers its bias with its
# weight: on the CPU (mkldnn) the conv's backward computes the weight gradient whenever the bias's is asked for. Under
# non-reentrant checkpointing the recompute makes the same decision (the graphs must match); under reentrant
# checkpointing the recomputed calls are deferred too, and their terms wait for the end of the outermost backward like
# the others. allow_unclipped=True defers nothing (a layer refused at run time must keep autograd's gradient).


def defer_hook(self, name: str, defer: list):
    """The forward pre-hook that runs one layer's call with detached aliases of its deferrable parameters
    (`self`: the PerSampleGradNorms)."""
    rule = self._rule[name]

    def hook(mod, args, kwargs):
        # Note [book-keeping]: decided before the call, from what the forward hook will check after it: a
        # deferred call must be kept (its gradient exists nowhere else)
        self._swapped.setdefault(name, []).append([])
        if not torch.is_grad_enabled() or not args or name in self._refused or graph_ddp(self._ddp):
            return None
        x0 = rule.input(mod, args, kwargs)
        if not isinstance(x0, torch.Tensor) or _is_functorch(x0):
            return None
        bd = self.batch_dim if rule.batch_dim_applies else 0
        if not rule.is_batched(mod, x0) or x0.dim() <= bd:
            return None
        b = self._batch
        if b is None and in_backward():
            try:
                b = self._recompute_batch(name)
            except Refused:
                return None
        if b is None or x0.shape[bd] != b:
            return None
        attrs = [a for a, pid in defer if mod._parameters.get(a) is self._param[pid]
                 and self._param[pid].requires_grad and pid not in self._dead]
        if not attrs:
            return None
        swapped = self._swapped[name][-1]
        for a in attrs:
            p = mod._parameters[a]
            swapped.append((a, p))
            mod._parameters[a] = p.detach()
        # the output must still require grad without them, or no gradient reaches the layer: when nothing else
        # makes it (a first layer on data), restore_hook taps it (Note [tapped outputs])
        if not (x0.requires_grad or any(p is not None and p.requires_grad for p in mod._parameters.values())):
            swapped.append(_TAP)
        return None
    return hook


# Note [tapped outputs]: a layer whose every input needing a gradient was deferred (a first conv or a bias-free
# Linear on data) computes an output that needs none: no gradient would reach its forward hook, and autograd would
# not run the layer's backward at all. Keeping one parameter in autograd to make it need one costs that backward (on
# the CPU a conv's bias gradient computes its weight gradient too: as much as the batch weight gradient the
# deferral saves). So instead the output is made to need a gradient by a node of its own, _Tap: an identity that
# marks the output as modified in place (the same tensor object, so later in-place ops on it are ordinary), whose
# one edge goes to _ANCHOR, a leaf of hookstats' own that its backward gives nothing (not to a parameter: the engine
# would run that parameter's tensor, post-accumulate-grad and DDP hooks with no gradient). The layer's backward is then
# this node alone: the output's gradient reaches the hook, and the parameters' gradients come from the clip (deliver).
_TAP = ("", None)
_ANCHOR = torch.zeros((), requires_grad=True)


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, anchor):
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, None


def restore_hook(self, name: str):
    """The always-call forward hook that puts the parameters back and tells the forward hook what was deferred."""
    def hook(mod, args, output):
        stack = self._swapped.get(name)
        swapped = stack.pop() if stack else []
        tap = bool(swapped) and swapped[-1] is _TAP
        if tap:
            swapped.pop()
        for a, p in swapped:
            mod._parameters[a] = p
        self._deferred[name] = tuple(a for a, _ in swapped)
        if tap and isinstance(output, torch.Tensor) and not output.requires_grad:
            base = output._base  # Linear on [B, T, in]: a view of a fresh 2-D result; tap that, view it again
            with torch.enable_grad():
                if base is None:
                    return _Tap.apply(output, _ANCHOR)
                if (base._base is None and not base.requires_grad and base.is_contiguous() and output.is_contiguous()
                        and base.numel() == output.numel()):
                    return _Tap.apply(base, _ANCHOR).view(output.shape)
        return None
    return hook


def param_at(mod, path: str):
    """The Parameter `mod` holds at `path` (a dotted path names a child's), or None."""
    if "." not in path:
        return mod._parameters.get(path)
    owner, _, attr = path.rpartition(".")
    try:
        return mod.get_submodule(owner)._parameters.get(attr)
    except AttributeError:
        return None


_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)


def _is_functorch(t: torch.Tensor) -> bool:
    return bool(_functorch_wrapped is not None and _functorch_wrapped(t))


def untracked(name: str, deferred: tuple, again: bool = False) -> None:
    """A call the forward hook does not keep (again: a gradient reaching a call already used): one whose parameters'
    gradient was deferred would lose it."""
    if deferred and again:
        raise RuntimeError(f"hookstats.PerSampleGradNorms(max_norm=...): a gradient reached a call of layer "
                           f"{name or '<model>'} that was already backpropagated or cleared by step(): its "
                           f"{', '.join(deferred)} gradient is computed by the clip, once per forward (Note "
                           f"[book-keeping]); run one backward per forward")
    if deferred:
        raise RuntimeError(f"hookstats.PerSampleGradNorms(max_norm=...): layer {name or '<model>'}'s call ran "
                           f"without autograd's gradient of {', '.join(deferred)} (Note [book-keeping]) but could "
                           f"not be kept for the clip: its gradient would be lost")
    return None
