"""Small real models built from their own libraries with random weights (nothing downloaded), and the twins the
real-model tests compare the Monitor against (issue #23).

Each builder returns a RealModel: the model (train mode, every dropout probability 0, so that twins see the same
values), a batch maker and the loss of an output. Sizes are tiny (2 layers, hidden 32, vocab 100, 8 tokens, batch 2;
images 2 x 3 x 32 x 32) so that one step takes milliseconds. Transformers models use attn_implementation="eager".
The peft builders (LoRA on GPT-2, embedding LoRA on GPT-2, DoRA on Llama) wrap those models with a peft adapter.

Twins (tests compare hookstats with PyTorch on a copy with the same weights, never with both hooks on one model:
a PyTorch hook changes the tensors the Monitor sees):
  PreHookTwin  PyTorch's register_full_backward_pre_hook on every module: grad_output per output slot, where
               PyTorch gives one (an output that is a Tensor or a tuple; the top-level tensors of the tuple). Run
               under OutOfPlace, since PyTorch's full backward hooks refuse in-place ops on module outputs.
  SlotTwin     a plain-Python forward hook on every module that puts a view_as alias in place of every output
               tensor (nested ones and dict values too) and records the alias's gradient: the gradient through
               each slot, defined for every output structure (the Monitor's semantics, Note [grad_output by tensor
               hooks] in hookstats/monitor/hooks.py).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

VOCAB, SEQ, BATCH = 100, 8, 2


@dataclasses.dataclass
class RealModel:
    name: str
    model: nn.Module
    batch: Callable[[int], dict]  # seed -> forward kwargs
    loss: Callable[[object], torch.Tensor]

    def step_loss(self, model: nn.Module, seed: int = 0) -> torch.Tensor:
        return self.loss(model(**self.batch(seed)))

    def to(self, dtype: torch.dtype) -> "RealModel":
        self.model.to(dtype)
        inner = self.batch

        def batch(seed: int) -> dict:
            return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inner(seed).items()}

        return dataclasses.replace(self, batch=batch)


def _tokens(seed: int, n: int = SEQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (BATCH, n), generator=g)


def _lm(seed: int) -> dict:
    ids = _tokens(seed)
    return {"input_ids": ids, "labels": ids}


def _hf_loss(out) -> torch.Tensor:
    return out.loss


def gpt2(layers: int = 2) -> RealModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=layers, n_head=4, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return RealModel("gpt2", GPT2LMHeadModel(cfg), _lm, _hf_loss)


def llama(layers: int = 2) -> RealModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      attn_implementation="eager")
    return RealModel("llama", LlamaForCausalLM(cfg), _lm, _hf_loss)


def bert(layers: int = 2) -> RealModel:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return RealModel("bert", BertForMaskedLM(cfg), _lm, _hf_loss)


def t5(layers: int = 2) -> RealModel:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_heads=4, dropout_rate=0.0,
                   relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
                   attn_implementation="eager")

    def batch(seed: int) -> dict:
        return {"input_ids": _tokens(seed), "labels": _tokens(seed + 1000, 6)}

    return RealModel("t5", T5ForConditionalGeneration(cfg), batch, _hf_loss)


def mixtral(layers: int = 2) -> RealModel:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                        router_aux_loss_coef=0.1, attn_implementation="eager",
                        experts_implementation="eager")
    return RealModel("mixtral", MixtralForCausalLM(cfg), _lm, _hf_loss)


def _images(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(BATCH, 3, 32, 32, generator=g)}


def _timm(name: str) -> RealModel:
    import timm

    model = timm.create_model(name, pretrained=False, num_classes=10)
    targets = torch.arange(BATCH) % 10

    def loss(out) -> torch.Tensor:
        return nn.functional.cross_entropy(out, targets)

    return RealModel(name, model, _images, loss)


def resnet18(layers: int = 2) -> RealModel:  # layers: the transformers models' only
    return _timm("resnet18")


def convnext_atto(layers: int = 2) -> RealModel:
    return _timm("convnext_atto")


def _peft(rm: RealModel, kind: str, targets: list[str], **kw) -> RealModel:
    """`rm`'s model with a peft adapter (the base frozen, the adapter trainable, init_lora_weights=False so that
    lora_B is not zero and every adapter parameter gets a gradient)."""
    import peft

    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False, **kw)
    return dataclasses.replace(rm, name=f"{rm.name}_{kind}", model=peft.get_peft_model(rm.model, cfg))


def gpt2_lora(layers: int = 2) -> RealModel:  # LoRA on GPT-2's Conv1D attention and MLP projections
    return _peft(gpt2(layers), "lora", ["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)


def gpt2_lora_embedding(layers: int = 2) -> RealModel:  # LoRA on the token and position embeddings too
    return _peft(gpt2(layers), "lora_embedding", ["c_attn", "c_fc", "wte", "wpe"], fan_in_fan_out=True)


def llama_dora(layers: int = 2) -> RealModel:  # DoRA (a magnitude vector besides lora_A / lora_B) on Llama
    return _peft(llama(layers), "dora", ["q_proj", "v_proj", "up_proj", "down_proj"], use_dora=True)


BUILDERS: dict[str, Callable[..., RealModel]] = {
    "gpt2": gpt2, "llama": llama, "bert": bert, "t5": t5, "mixtral": mixtral, "resnet18": resnet18,
    "convnext_atto": convnext_atto, "gpt2_lora": gpt2_lora, "gpt2_lora_embedding": gpt2_lora_embedding,
    "llama_dora": llama_dora,
}


def build(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2) -> RealModel:
    torch.manual_seed(seed)
    rm = BUILDERS[name](layers)
    rm.model.train()
    return rm.to(dtype)


def twin(rm: RealModel) -> RealModel:
    """A copy with the same weights (and buffers: BatchNorm running statistics)."""
    return dataclasses.replace(rm, model=copy.deepcopy(rm.model))


# ---------------------------------------------------------------------------------------------------------------
# Twins

class OutOfPlace(TorchFunctionMode):
    """In-place ops as their out-of-place forms (same values): PyTorch's full backward hooks raise when a module's
    output is modified in place (ReLU(inplace=True), `x += shortcut`)."""

    _OPS = {torch.Tensor.__iadd__: torch.add, torch.Tensor.add_: torch.add, torch.Tensor.relu_: torch.relu,
            torch.relu_: torch.relu, torch.Tensor.__imul__: torch.mul, torch.Tensor.mul_: torch.mul}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.relu and kwargs.get("inplace"):
            kwargs = dict(kwargs, inplace=False)
        func = self._OPS.get(func, func)
        return func(*args, **kwargs)


def _slot_positions(out) -> list[int]:
    """The Monitor's flat index (hookstats._nested.flatten, None counted) of each top-level element of a module
    output as PyTorch's BackwardHook sees it (the output, or each element of a tuple); -1 for a non-tensor."""
    items = out if isinstance(out, tuple) else (out,)
    pos, idx = [], 0
    for o in items:
        n = []
        _count(o, n)
        pos.append(idx if isinstance(o, torch.Tensor) else -1)
        idx += len(n)
    return pos


def _count(o, acc: list) -> None:
    if isinstance(o, torch.Tensor) or o is None:
        acc.append(o)
    elif isinstance(o, (tuple, list)):
        for v in o:
            _count(v, acc)
    elif isinstance(o, dict):
        for v in o.values():
            _count(v, acc)


class PreHookTwin:
    """PyTorch's full backward pre-hook on every module of `model`: grads[(module, flat index)] is the list of the
    gradients it was given (one per backward call of that output), in float64."""

    def __init__(self, model: nn.Module):
        self.grads: dict[tuple, list] = {}
        self.handles = []
        for name, mod in model.named_modules():
            layout: list = []

            def fwd(module, args, out, layout=layout):
                layout.append(_slot_positions(out))

            def pre(module, grad_output, name=name, layout=layout):
                pos = layout.pop() if layout else []  # calls are undone last first
                for p, g in zip(pos, grad_output):
                    if p >= 0 and g is not None:
                        self.grads.setdefault((name, p), []).append(g.detach().double().clone())

            self.handles += [mod.register_forward_hook(fwd), mod.register_full_backward_pre_hook(pre)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class SlotTwin:
    """A view_as alias in place of every output tensor of every module (nested ones and dict values too), each
    with a tensor hook: grads[(module, flat index)] as PreHookTwin's, for every output structure."""

    def __init__(self, model: nn.Module):
        from hookstats.monitor.hooks import replace_outputs

        self.grads: dict[tuple, list] = {}
        self.handles = []
        for name, mod in model.named_modules():
            def fwd(module, args, out, name=name):
                flat: list = []
                _count(out, flat)
                aliases = {}
                for i, t in enumerate(flat):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        a = t.view_as(t)
                        a.register_hook(lambda g, key=(name, i): self._keep(key, g))
                        aliases[i] = a
                return replace_outputs(out, aliases) if aliases else None

            self.handles.append(mod.register_forward_hook(fwd))

    def _keep(self, key, g):
        if g is not None:
            self.grads.setdefault(key, []).append(g.detach().double().clone())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def monitor_grads(records: list) -> dict[tuple, list]:
    """The Monitor's backward_pre records as {(module, index): [stats, ...]} in record order."""
    out: dict[tuple, list] = {}
    for r in records:
        if r["kind"] == "backward_pre":
            out.setdefault((r["module"], r["index"]), []).append(dict(r["stats"], dtype=r["dtype"]))
    return out


def grad_stats(g: torch.Tensor) -> dict:
    g = g.double()
    return {"l2": float(g.norm()), "sum": float(g.sum()), "min": float(g.min()), "max": float(g.max()),
            "l1": float(g.abs().sum())}


def assert_grads_match(got: dict, want: dict, *, subset: bool = False, rtol: float = 1e-9) -> None:
    """Monitor records (monitor_grads) against a twin's gradients (PreHookTwin/SlotTwin.grads): the same
    (module, index) sites (with subset, every site of `want` is among the Monitor's) and, per site, the same
    multiset of gradients by l2, sum, min and max (float64: the twin's hooks may sum in another order; a float32
    gradient inside a float64 model, such as Mixtral's router after its .float(), within float32 rounding of
    those differences)."""
    if subset:
        assert set(want) <= set(got), sorted(set(want) - set(got))[:10]
    else:
        assert set(got) == set(want), (sorted(set(got) - set(want))[:10], sorted(set(want) - set(got))[:10])
    for k in want:
        a = sorted(got[k], key=lambda s: s["l2"])
        b = sorted((grad_stats(g) for g in want[k]), key=lambda s: s["l2"])
        assert len(a) == len(b), (k, len(a), len(b))
        for sa, sb in zip(a, b):
            tol = rtol if sa.get("dtype", "torch.float64") == "torch.float64" else 1e-6
            for f in ("l2", "sum", "min", "max"):
                scale = sb["l1"] if f == "sum" else abs(sb[f])  # a sum can cancel: its rounding scales with l1
                assert abs(sa[f] - sb[f]) <= tol * scale + 1e-300, (k, f, sa[f], sb[f])
