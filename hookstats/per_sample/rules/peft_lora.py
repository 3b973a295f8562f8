"""peft LoRA on an embedding (peft.tuners.lora.layer.Embedding), matched by the code of its forward and _embed (Note
[exact-type rules]): for each active vanilla adapter, after_A = embedding(ids, A^T) [B, T, r], adapter output =
(after_A @ B^T) * scaling (* the base layer's embed_scale), added to the frozen base embedding's output. With G the
output gradient times the scales, as the products' backward computes it:

  lora_embedding_B [d, r]: grad_b = sum_t G_bt after_A_bt^T                     (Outer)
  lora_embedding_A [r, V]: row v of its transpose gets sum over the sample's
                           positions holding v of (G_bt @ B)                    (Index, transposed)

lora_embedding_A / B are ParameterDicts the module applies itself: the rule names them by path ("lora_embedding_A.
default"). A call with merged or disabled adapters, per-sample adapter names, an adapter variant (DoRA), tensor-
parallel input/output functions, or an embedding option that changes the gradient (max_norm, scale_grad_by_freq) is
refused. peft's LoRA on Linear / Conv layers needs no rule of its own: lora_A / lora_B are plain nn.Linear / Conv
modules, covered by theirs; the frozen base layer is skipped."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Rule, register_pattern, same_code
from ..terms import Dense, Index, Outer, compute_dtype
from .refused import Refused

VARIANT_KWARG_KEYS = ()  # a name the reference's code reads; never called


def _forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    # TODO: no dtype conversion here, unlike in Linear, is that correct?
    self._check_forward_args(x, *args, **kwargs)
    adapter_names = kwargs.pop("adapter_names", None)
    variant_kwargs = {k: kwargs.pop(k, None) for k in VARIANT_KWARG_KEYS}  # don't pass these to base_layer
    if self.disable_adapters:
        if self.merged:
            self.unmerge()
        result = self.base_layer(x, *args, **kwargs)
    elif adapter_names is not None:
        result = self._mixed_batch_forward(x, *args, adapter_names=adapter_names, **kwargs)
    elif self.merged:
        result = self.base_layer(x, *args, **kwargs)
    else:
        result = self.base_layer(x, *args, **kwargs)
        torch_result_dtype = result.dtype

        # Some embedding layers (e.g., Gemma3TextScaledWordEmbedding) apply scaling in their forward method.
        # Since base_layer(x) already includes this scaling, we need to apply it to LoRA contributions too.
        embed_scale = self._get_embed_scale()

        for active_adapter in self.active_adapters:
            if active_adapter not in self.lora_embedding_A:
                continue

            if active_adapter not in self.lora_variant:  # vanilla LoRA
                embedding_A = self.lora_embedding_A[active_adapter].T
                embedding_B = self.lora_embedding_B[active_adapter].T
                scaling = self.scaling[active_adapter]
                # input and output function hooks for TP support.
                input_fn = self.input_fns.get(active_adapter, None)
                output_fn = self.output_fns.get(active_adapter, None)
                after_A = self._embed(x, embedding_A, input_fn=input_fn, output_fn=output_fn)
                adapter_output = (after_A @ embedding_B) * scaling

                # Apply embed_scale to match the base layer's scaling
                if embed_scale is not None:
                    adapter_output = adapter_output * embed_scale.to(adapter_output.dtype)

                result = result + adapter_output
            else:
                result = self.lora_variant[active_adapter].forward(
                    self,
                    active_adapter=active_adapter,
                    x=x,
                    result=result,
                    **variant_kwargs,
                    **kwargs,
                )
        result = result.to(torch_result_dtype)

    return result


def _embed(
    self,
    input: torch.Tensor,
    weight: torch.Tensor,
    input_fn: Callable[[tuple[torch.Tensor]], torch.Tensor] | None = None,
    output_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    base_layer = self.get_base_layer()
    if input_fn is not None:
        input = input_fn((input,))
    output = F.embedding(
        input,
        weight,
        padding_idx=base_layer.padding_idx,
        max_norm=base_layer.max_norm,
        norm_type=base_layer.norm_type,
        scale_grad_by_freq=base_layer.scale_grad_by_freq,
        sparse=base_layer.sparse,
    )
    if output_fn is not None:
        output = output_fn(output)
    return output


def _adapters(mod) -> list:
    """The active vanilla adapters the forward applies."""
    return [a for a in mod.active_adapters if a in mod.lora_embedding_A and a not in mod.lora_variant]


class LoraEmbeddingRule(Rule):
    rowwise = True
    def param_paths(self, mod):
        return [p for a in mod.lora_embedding_A if a not in mod.lora_variant
                for p in (f"lora_embedding_A.{a}", f"lora_embedding_B.{a}")]

    def is_batched(self, mod, x):
        return x.dim() > 0

    def expands(self, mod, x):  # LoRA on position embeddings fed [1, T] ids (Note [broadcast layers])
        return x.dim() > 1

    def keep(self, mod, x, args=(), kwargs=None):
        base = mod.get_base_layer()
        why = ("its adapters are disabled" if mod.disable_adapters else "its adapters are merged" if mod.merged else
               "adapter_names= (a different adapter per sample)" if (kwargs or {}).get("adapter_names") is not None
               else "an adapter variant (DoRA) on an embedding" if any(
                   a in mod.lora_variant for a in mod.active_adapters if a in mod.lora_embedding_A)
               else "tensor-parallel input/output functions" if any(
                   mod.input_fns.get(a) or mod.output_fns.get(a) for a in _adapters(mod))
               else "the base embedding's max_norm / scale_grad_by_freq" if (
                   base.max_norm is not None or base.scale_grad_by_freq) else None)
        if why:
            raise Refused(f"peft LoRA embedding called with {why}: no per-sample rule")
        scale = mod._get_embed_scale()
        return x, (None if scale is None else scale.detach()), base.padding_idx

    def terms(self, mod, kept, g, attrs):
        idx, embed_scale, padding_idx = kept
        b = idx.shape[0]
        idx = idx.reshape(b, -1)
        dt = compute_dtype(g)
        out = {}
        for a in _adapters(mod):
            pa, pb = f"lora_embedding_A.{a}", f"lora_embedding_B.{a}"
            if pa not in attrs and pb not in attrs:
                continue
            A = mod.lora_embedding_A[a].detach()  # [r, V]
            Bw = mod.lora_embedding_B[a].detach()  # [d, r]
            ga = g.reshape(b, -1, g.shape[-1]).to(Bw.dtype)
            if embed_scale is not None:  # the backward of (... * scaling) * embed_scale: embed_scale first
                ga = ga * embed_scale.to(ga.dtype)
            ga = (ga * mod.scaling[a]).to(dt)
            if pb in attrs:
                after_a = F.embedding(idx, A.t()).to(dt)  # [B, T, r]
                out[pb] = Outer(ga, after_a)
            if pa in attrs:
                rows = ga @ Bw.to(dt)  # gradient of after_A, [B, T, r]
                if padding_idx is not None:
                    rows = rows * (idx != padding_idx).unsqueeze(-1).to(dt)
                out[pa] = Index(idx, rows, A.shape[1], transposed=True)
        return out


def _match(mod: nn.Module) -> bool:
    cls = type(mod)
    return (cls.__module__ == "peft.tuners.lora.layer" and cls.__name__ == "Embedding"
            and same_code(cls.forward, _forward) and same_code(getattr(cls, "_embed", None), _embed))


register_pattern("peft LoRA Embedding", _match, LoraEmbeddingRule())


# -- DoRA's magnitude (peft.tuners.lora.dora.DoraLinearLayer) ----------------------------------------------------------

class _DoraRef(nn.Module):  # the reference is defined in a class body, like the code it is compared with
    def forward(self, x, *, lora_A, lora_B, scaling, base_layer, base_result=None, adapter_name="default"):
        """
        For DoRA, calculate the extra output from LoRA with DoRA applied. This should be added on top of the base layer
        output.
        """
        lora_weight = self.get_lora_weight(lora_A=lora_A, lora_B=lora_B, adapter_name=adapter_name)
        lora_weight = lora_weight.to(x.dtype)

        magnitude = self.weight
        weight = dequantize_module_weight(base_layer)  # noqa: F821  (resolved in peft's module)
        weight = weight.to(x.dtype)
        weight_norm = self.get_weight_norm(
            weight=weight, lora_weight=lora_weight.detach(), scaling=scaling, adapter_name=adapter_name
        )
        # see section 4.3 of DoRA (https://huggingface.co/papers/2402.09353)
        # "[...] we suggest treating ||V +∆V ||_c in
        # Eq. (5) as a constant, thereby detaching it from the gradient
        # graph. This means that while ||V + ∆V ||_c dynamically
        # reflects the updates of ∆V , it won’t receive any gradient
        # during backpropagation"
        weight_norm = weight_norm.detach()
        mag_norm_scale = (magnitude / weight_norm).view(1, -1)

        lora_result = lora_B(lora_A(x))

        bias = None
        if base_result is not None:
            bias = base_layer.bias
            if bias is not None:
                base_result = base_result - bias
        else:
            base_result = F.linear(x, transpose(weight, self.fan_in_fan_out))  # noqa: F821

        result_dora = (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling
        return result_dora


class DoraMagnitudeRule(Rule):
    """result = (m / n - 1) * base + (m / n) * lora_B(lora_A(x)) * scaling, with n the detached weight norm: grad m_b =
    (sum_t g_bt * base_bt + sum_t (g_bt * scaling) * lora_bt) / n (Dense), base and lora recomputed from the call's
    arguments by the module's own functions (no gradient kept)."""

    params = ("weight",)
    rowwise = True

    def keep(self, mod, x, args=(), kwargs=None):
        import sys

        kw = kwargs or {}
        peft_mod = sys.modules[type(mod).__module__]
        lora_a, lora_b, base_layer = kw["lora_A"], kw["lora_B"], kw["base_layer"]
        adapter = kw.get("adapter_name", "default")
        x0 = args[0]
        with torch.no_grad():
            lora_weight = mod.get_lora_weight(lora_A=lora_a, lora_B=lora_b, adapter_name=adapter).to(x0.dtype)
            weight = peft_mod.dequantize_module_weight(base_layer).to(x0.dtype)
            norm = mod.get_weight_norm(weight=weight, lora_weight=lora_weight, scaling=kw["scaling"],
                                       adapter_name=adapter)
            lora = lora_b(lora_a(x0))
            base = kw.get("base_result")
            if base is not None:
                base = base.detach()
                if base_layer.bias is not None:
                    base = base - base_layer.bias
            else:
                base = F.linear(x0, peft_mod.transpose(weight, mod.fan_in_fan_out))
        return base, lora, kw["scaling"], norm

    def terms(self, mod, kept, g, attrs):
        base, lora, scaling, norm = kept
        b = g.shape[0]
        dt = compute_dtype(g)
        g = g.reshape(b, -1, g.shape[-1])
        d = ((g * base.reshape(g.shape)).to(dt).sum(1) + ((g * scaling) * lora.reshape(g.shape)).to(dt).sum(1))
        return {"weight": Dense(d / norm.to(dt))}


def _dora_match(mod: nn.Module) -> bool:
    cls = type(mod)
    return (cls.__module__ == "peft.tuners.lora.dora" and cls.__name__ == "DoraLinearLayer"
            and same_code(cls.forward, _DoraRef.forward))


register_pattern("peft DoRA magnitude (DoraLinearLayer)", _dora_match, DoraMagnitudeRule())
