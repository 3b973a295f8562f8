"""hookstats.PerSampleGradNorms on every rule and on real models (issue #23): against a per-sample loop in float64
(one forward on a twin without hooks, then each sample's own backward: the gradient of sample b's terms of the
loss), total and per layer, with coverage asserted; Opacus's GradSampleModule where it covers the layer; outputs and
gradients bitwise unchanged by the hooks; max_norm clipping with tied weights."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookstats
from _testing import TableOverBatch
from hookstats.per_sample import Dense, Rule, register_rule

B = 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def loop_sq(twin: nn.Module, fwd, inputs, r: torch.Tensor) -> dict:
    """{parameter name: [B] squared norm of sample b's gradient}, one backward per sample on the twin, for its
    trainable parameters."""
    params = {k: p for k, p in twin.named_parameters() if p.requires_grad}
    out = fwd(twin, inputs)
    res = {k: [] for k in params}
    for b in range(r.shape[0]):
        rb = torch.zeros_like(r)
        rb[b] = r[b]
        gs = torch.autograd.grad((out * rb).sum(), list(params.values()), retain_graph=True, allow_unused=True)
        for k, g in zip(params, gs):
            res[k].append(torch.zeros((), dtype=torch.float64) if g is None else g.double().square().sum())
    return {k: torch.stack(v) for k, v in res.items()}


def check(model: nn.Module, fwd, inputs, *, covered=None, not_covered=(), rtol=1e-9, bitwise=True, **kw):
    """Attaches PerSampleGradNorms to `model` (float64, eval), runs sum(out * r), and checks per_param, per_layer
    and total against the loop on a twin, the coverage, and (bitwise=True) that the outputs and every .grad equal
    the twin's bit for bit. Returns the PerSampleGradNorms."""
    model = model.double().eval()
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        psn = hookstats.PerSampleGradNorms(model, **kw)
    out = fwd(model, inputs)
    r = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    (out * r).sum().backward()
    want = loop_sq(twin, fwd, inputs, r)
    if bitwise:
        out_t = fwd(twin, inputs)
        (out_t * r).sum().backward()
        assert torch.equal(out, out_t)
        for (k, p), pt in zip(model.named_parameters(), twin.parameters()):
            assert (p.grad is None) == (pt.grad is None) and (p.grad is None or torch.equal(p.grad, pt.grad)), k
    cov = psn.coverage()
    if covered is not None:
        assert sorted(cov.covered) == sorted(covered)
    for name in not_covered:
        assert name in cov.not_covered, (name, cov)
    got = psn.per_param_sq()
    assert sorted(got) == sorted(cov.covered) and not cov.not_seen
    scale = max(float(w.max()) for w in want.values())  # a gradient that is 0 in exact arithmetic (attention's key
    for k in got:                                        # bias) is rounding noise in both: compared to the largest
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=1e-14 * max(float(want[k].max()), 1e-12 * scale)
                                   + 1e-300, msg=lambda m: f"{k}: {m}")
    torch.testing.assert_close(psn.total().square(), sum(want[k] for k in cov.covered), rtol=rtol, atol=0)
    names = {id(p): n for n, p in model.named_parameters()}
    mods = dict(model.named_modules())
    for layer, v in psn.per_layer().items():  # a layer's own parameters, or those its rule names by path
        paths = psn._rule[layer].param_paths(mods[layer])
        keys = [names[id(p)] for p in (mods[layer].get_parameter(a) for a in paths if _has(mods[layer], a))
                if p is not None and names[id(p)] in got]
        torch.testing.assert_close(v.square(), sum(want[k] for k in keys), rtol=rtol, atol=0)
    psn.remove()
    return psn


def _has(mod: nn.Module, path: str) -> bool:
    try:
        return mod.get_parameter(path) is not None
    except AttributeError:
        return False


def ids(v=40, t=5, seed=2):
    return torch.randint(0, v, (B, t), generator=torch.Generator().manual_seed(seed))


def f64(*shape, seed=3):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


call = lambda m, x: m(x)  # noqa: E731


# -- every rule on its own ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(stride=2, padding=1, groups=2), dict(dilation=(1, 2, 1), padding="same"),
                                dict(padding=1, padding_mode="replicate", bias=False)],
                         ids=["plain", "stride_groups", "dilation_same", "replicate"])
def test_conv3d(kw):
    torch.manual_seed(0)
    check(nn.Conv3d(2, 4, 3, **kw), call, f64(B, 2, 5, 6, 4))


@pytest.mark.parametrize("groups,affine", [(2, True), (1, True), (4, True)])
def test_group_norm(groups, affine):
    torch.manual_seed(0)
    gn = nn.GroupNorm(groups, 4)
    with torch.no_grad():
        gn.weight.normal_()
        gn.bias.normal_()
    check(nn.Sequential(nn.Conv2d(3, 4, 3), gn), call, f64(B, 3, 6, 5))


@pytest.mark.parametrize("eps", [None, 1e-3])
def test_rms_norm(eps):
    torch.manual_seed(0)
    rn = nn.RMSNorm(6, eps=eps)
    with torch.no_grad():
        rn.weight.normal_()
    check(nn.Sequential(nn.Linear(5, 6), rn), call, f64(B, 4, 5))


@pytest.mark.parametrize("mode,psw,padding_idx", [("sum", False, None), ("mean", False, 0), ("sum", True, None),
                                                  ("mean", False, None)])
def test_embedding_bag(mode, psw, padding_idx):
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(11, 4, mode=mode, padding_idx=padding_idx)
    x = torch.randint(0, 11, (B, 6), generator=torch.Generator().manual_seed(4))
    x[0, :3] = 5  # a repeated row
    x[1, 0] = 0
    w = f64(B, 6).abs() if psw else None
    check(nn.Sequential(bag, nn.Linear(4, 2)) if not psw else bag,
          (lambda m, x: m(x, per_sample_weights=w)) if psw else call, x)


def test_embedding_bag_refusals():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        psn = hookstats.PerSampleGradNorms(nn.Sequential(nn.EmbeddingBag(5, 3, mode="max"), nn.Linear(3, 2)))
    assert "mode='max'" in psn.coverage().not_covered["0.weight"]
    bag = nn.EmbeddingBag(5, 3)
    psn = hookstats.PerSampleGradNorms(bag)
    with pytest.warns(UserWarning, match="ragged bags"):
        bag(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])).sum().backward()
    assert "ragged" in psn.coverage().not_covered["weight"]


def test_hf_conv1d():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    check(nn.Sequential(Conv1D(6, 5), nn.Tanh(), Conv1D(3, 6)), call, f64(B, 4, 5))


def test_hf_rms_norms_matched_by_pattern():
    """Llama / Mistral / Qwen2 RMSNorm (float32 normalisation, cast back) and T5LayerNorm: each by the code pattern;
    a float64 model runs them with the float32 rounding, which the rule reproduces."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    for cls in (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, T5LayerNorm):
        torch.manual_seed(0)
        norm = cls(6)
        with torch.no_grad():
            norm.weight.normal_()
        rule, why = hookstats.per_sample.rule_for("n", norm)
        assert why is None and rule.name in ("LlamaRMSNormRule", "T5LayerNormRule"), cls
        check(nn.Sequential(nn.Linear(5, 6), norm, nn.Linear(6, 2)), call, f64(B, 4, 5))
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    for cls in (GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm):  # (1 + weight), the product in float32
        torch.manual_seed(0)
        norm = cls(6)
        with torch.no_grad():
            norm.weight.normal_()
        assert hookstats.per_sample.rule_for("n", norm)[0].name == "GemmaRMSNormRule"
        check(nn.Sequential(nn.Linear(5, 6), norm, nn.Linear(6, 2)), call, f64(B, 4, 5), rtol=1e-5)

    class Shifted(GemmaRMSNorm):  # one constant changed: another computation, refused
        def forward(self, x):
            output = self._norm(x.float())
            output = output * (2.0 + self.weight.float())
            return output.type_as(x)

    rule, why = hookstats.per_sample.rule_for("n", Shifted(6))
    assert rule is None and "no per-sample rule for Shifted" in why


# -- timm subclasses ---------------------------------------------------------------------------------------------------

def test_timm_layers():
    """LayerNorm2d (dim 1 of NCHW), Conv2dSame (TF padding from the input size), StdConv2d / StdConv2dSame (weight
    standardisation: per-sample gradient through the standardisation's Jacobian)."""
    from timm.layers import Conv2dSame, LayerNorm2d, StdConv2d, StdConv2dSame

    torch.manual_seed(0)
    model = nn.Sequential(StdConv2d(3, 8, 3, stride=2), nn.GroupNorm(2, 8), nn.ReLU(), Conv2dSame(8, 6, 3, stride=2),
                          LayerNorm2d(6), StdConv2dSame(6, 4, 3, stride=2, bias=True), nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(1, 3, 9, 11))  # materialise the lazy layer
    with torch.no_grad():
        model[4].weight.normal_()
    psn = check(model, call, f64(B, 3, 9, 11))
    assert sorted(psn.layers) == ["0", "1", "3", "4", "5", "7"]


def test_subclass_with_own_forward_is_refused():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Plain(nn.Linear):  # no forward of its own: nn.Linear's rule holds
        pass

    model = nn.Sequential(Scaled(4, 4), Plain(4, 2))
    with pytest.warns(UserWarning, match=r"0\.weight.*Scaled is a subclass of torch\.nn\.modules\.linear\.Linear"):
        psn = hookstats.PerSampleGradNorms(model)
    assert psn.layers == ["1"]
    assert sorted(psn.coverage().not_covered) == ["0.bias", "0.weight"]
    model(torch.randn(3, 4)).sum().backward()
    assert sorted(psn.per_param()) == ["1.bias", "1.weight"]


def test_register_rule_for_a_new_layer():
    class Scale(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.scale = nn.Parameter(torch.randn(d))

        def forward(self, x):
            return x * self.scale

    @register_rule(Scale)
    class ScaleRule(Rule):
        params = ("scale",)

        def terms(self, mod, x, g, attrs):  # grad scale_b = sum over the sample's tokens of g * x
            b = x.shape[0]
            return {"scale": Dense((g * x).reshape(b, -1, x.shape[-1]).sum(1).double())}

    torch.manual_seed(0)
    check(nn.Sequential(nn.Linear(3, 5), Scale(5)), call, f64(B, 4, 3))


# -- real models -------------------------------------------------------------------------------------------------------

V = 40


def hf(name: str, **over):
    import transformers as T

    torch.manual_seed(0)
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=V, attn_implementation="eager")
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=V, n_positions=16,
                                              bos_token_id=0, eos_token_id=0, attn_implementation="eager", **over))
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**{**small, **over}))
    if name == "bert":
        return T.BertForMaskedLM(T.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                              intermediate_size=32, vocab_size=V, max_position_embeddings=16,
                                              attn_implementation="eager"))
    if name == "t5":
        return T.T5ForConditionalGeneration(T.T5Config(d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8,
                                                       vocab_size=V, decoder_start_token_id=0,
                                                       relative_attention_num_buckets=8,
                                                       attn_implementation="eager"))
    if name == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2,
                                                    experts_implementation="eager"))
    raise KeyError(name)


lm = lambda m, x: m(input_ids=x).logits  # noqa: E731


def test_gpt2():
    """Tied wte / lm_head (Index x Outer cross term), Conv1D, position embeddings on [1, T] ids (expanded)."""
    model = hf("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    psn = check(model, lm, ids(), covered=[n for n, _ in model.named_parameters()])
    assert "transformer.wpe" in psn.layers and "lm_head" in psn.layers


@pytest.mark.parametrize("tied", [True, False])
def test_llama(tied):
    model = hf("llama", tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    psn = check(model, lm, ids(), covered=[n for n, _ in model.named_parameters()])
    assert psn._rule["model.norm"].name == "LlamaRMSNormRule"


def test_bert():
    """Tied word embeddings and decoder bias (held by BertLMPredictionHead, applied by its decoder), position
    embeddings on [1, T], token-type ids expanded from a buffer."""
    model = hf("bert")
    check(model, lm, ids(), covered=[n for n, _ in model.named_parameters()])


def test_t5_relative_bias_refused():
    model = hf("t5")
    rel = [n for n, _ in model.named_parameters() if "relative_attention_bias" in n]
    assert len(rel) == 2
    check(model, lambda m, x: m(input_ids=x, decoder_input_ids=x[:, :4]).logits, ids(),
          covered=[n for n, _ in model.named_parameters() if n not in rel], not_covered=rel)


def test_mixtral_experts_covered():
    """Mixtral's experts (the eager loop of Qwen2MoeExperts' code, Note [routed experts]) and its router on the
    [B * T, d] token rows: every parameter covered, exact."""
    model = hf("mixtral")
    experts = [n for n, _ in model.named_parameters() if ".experts." in n]
    assert len(experts) == 4
    psn = check(model, lm, ids(), covered=[n for n, _ in model.named_parameters()])
    assert psn._rule["model.layers.0.mlp.experts"].name == "RoutedExpertsRule"
    assert psn._rule["model.layers.0.mlp.gate"].name == "TopKRouterRule"  # [B * T, d] rows split per sample


@pytest.mark.parametrize("name", ["resnet18", "convnext_atto"])
def test_timm_models(name):
    """ResNet (eval-mode BatchNorm), ConvNeXt (its layer scale gamma, applied by ConvNeXtBlock itself: the block's
    rule reads the product's kept operand): every parameter covered."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("gamma"):
                p.normal_()
    side = 16 if name == "resnet18" else 32  # convnext_atto downsamples by 32
    psn = check(model, call, f64(2, 3, side, side),
                covered=[n for n, _ in model.named_parameters()])
    if name == "convnext_atto":
        assert psn._rule["stages.0.blocks.0"].name == "ConvNeXtGammaRule"


def test_coverage_warning_and_monitor():
    """One warning names the uncovered parameters; Monitor(per_sample=True) steps on a model with position
    embeddings (once: 'stack expects each tensor to be equal size') and reports coverage and the tied total."""
    model = hf("t5").double()
    with pytest.warns(UserWarning, match="relative_attention_bias.weight") as rec:
        mon = hookstats.Monitor(model, kinds="forward", per_sample=True)
    assert sum("not covered" in str(w.message) for w in rec) == 1
    assert "relative_attention_bias" in str(mon.coverage())
    gpt = hf("gpt2").double()
    mon2 = hookstats.Monitor(gpt, kinds="forward", per_sample=True)
    for step in range(2):
        x = ids(seed=step)
        gpt(input_ids=x, labels=x).loss.backward()
        mon2.step()
    rows = mon2.sample_norms()
    assert len(rows) == 2 and rows[0][2].shape == (len(rows[0][1]), B)
    top = mon2.top_samples(1)[0]
    assert top["norm"] > 0 and "per-sample coverage: 28 of 28" in mon2.summary()
    mon.detach()
    mon2.detach()


def test_dim0_not_the_batch_is_refused():
    """A layer fed rows that are not samples (here a [T, d] table, as T5's bias or routed experts) is refused at
    run time, when a gradient reaches that call: one warning, its parameters out of the total; with max_norm it
    raises."""
    torch.manual_seed(0)
    m = TableOverBatch()
    psn = hookstats.PerSampleGradNorms(m)
    with pytest.warns(UserWarning, match="layer table is refused"):
        m(torch.randn(3, 5, 4)).sum().backward()
    assert sorted(psn.per_param()) == ["fc.bias", "fc.weight"]
    assert "5 rows" in psn.coverage().not_covered["table.weight"]
    mm = TableOverBatch()
    hookstats.PerSampleGradNorms(mm, max_norm=1.0)
    with pytest.raises(RuntimeError, match="cannot be split per sample"):  # when its gradient arrives
        mm(torch.randn(3, 5, 4)).sum().backward()


def clip_check(model: nn.Module, fwd, x):
    """max_norm: .grad == sum_b min(1, C / ||g_b||) g_b with g_b the whole per-sample gradient (a tied parameter's
    uses summed), from the loop; every clipped sample's gradient norm is at most C."""
    model = model.double().eval()
    twin = copy.deepcopy(model)
    out = fwd(twin, x)
    r = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    params = dict(twin.named_parameters())
    per = []
    for b in range(B):
        rb = torch.zeros_like(r)
        rb[b] = r[b]
        per.append(torch.autograd.grad((out * rb).sum(), list(params.values()), retain_graph=True))
    norms = torch.stack([torch.stack([g.square().sum() for g in gs]).sum().sqrt() for gs in per])
    c = float(norms.median())
    coef = torch.clamp(c / (norms + 1e-6), max=1.0)
    assert (coef < 1).any() and (coef == 1).any()
    psn = hookstats.PerSampleGradNorms(model, max_norm=c)
    (fwd(model, x) * r).sum().backward()
    torch.testing.assert_close(psn.total(), norms, rtol=1e-9, atol=0)
    for i, (k, p) in enumerate(model.named_parameters()):
        want = sum(coef[b] * per[b][i] for b in range(B))
        torch.testing.assert_close(p.grad, want, rtol=1e-9, atol=1e-13, msg=lambda m: f"{k}: {m}")
    clipped = torch.stack([torch.stack([(coef[b] * g).square().sum() for g in per[b]]).sum().sqrt() for b in range(B)])
    assert (clipped <= c * (1 + 1e-9)).all()
    psn.remove()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_clipping_with_tied_weights(name):
    clip_check(hf(name, **({} if name == "gpt2" else {"tie_word_embeddings": True})), lm, ids())


def test_clipping_every_term_form():
    """The clip delta of each term form: conv by per-sample kernel (Dense) and unfolded (Outer, grouped), Embedding
    (Index), EmbeddingBag, norms (Dense), StdConv2d."""
    from timm.layers import StdConv2d

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 4)
            self.bag = nn.EmbeddingBag(11, 4, mode="mean")
            self.c1 = StdConv2d(4, 4, 3, padding=1)
            self.gn = nn.GroupNorm(2, 4)
            self.c2 = nn.Conv2d(4, 24, 3, stride=2, groups=2)  # 12 filters per group > 9 positions: Outer
            self.ln = nn.LayerNorm(24 * 9)
            self.fc = nn.Linear(24 * 9, 3)

        def forward(self, x):  # x [B, 64] ids
            h = (self.emb(x) + self.bag(x).unsqueeze(1)).reshape(-1, 8, 8, 4).permute(0, 3, 1, 2)
            return self.fc(self.ln(self.c2(self.gn(self.c1(h))).flatten(1)))

    torch.manual_seed(0)
    clip_check(M(), call, ids(v=11, t=64))


def test_against_opacus():
    """Opacus GradSampleModule's per-sample gradients (loss_reduction="sum": the same quantity; "mean" reports B
    times it) on the layers it covers, with a tied embedding / head."""
    from opacus import GradSampleModule

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, 8)
            self.ln = nn.LayerNorm(8)
            self.gn = nn.GroupNorm(2, 8)
            self.conv = nn.Conv1d(8, 8, 3, padding=1)
            self.head = nn.Linear(8, V, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            h = self.ln(self.emb(x))
            h = h + self.conv(self.gn(h.transpose(1, 2))).transpose(1, 2)
            return self.head(torch.tanh(h))

    torch.manual_seed(0)
    model = Tied().double()
    copies = {r: copy.deepcopy(model) for r in ("sum", "mean")}
    x = ids()
    target = ids(seed=9)
    psn = hookstats.PerSampleGradNorms(model)
    for reduction in ("sum", "mean"):
        gsm = GradSampleModule(copies[reduction], loss_reduction=reduction)

        def loss(m):  # per-sample loss summed over tokens, then summed or averaged over the batch
            per = F.cross_entropy(m(x).transpose(1, 2), target, reduction="none").sum(1)
            return per.sum() if reduction == "sum" else per.mean()

        loss(gsm).backward()
        loss(model).backward()
        scale = 1.0 if reduction == "sum" else B
        got = psn.per_param()
        for n, p in gsm._module.named_parameters():
            want = p.grad_sample.reshape(B, -1).norm(dim=1)
            torch.testing.assert_close(got[n] * scale, want, rtol=1e-9, atol=0, msg=lambda m: f"{n}: {m}")
        psn.step()
        model.zero_grad()
        gsm.remove_hooks()


class Broadcasts(nn.Module):
    """Tokens flattened to [B * T, d] before a Linear (split per sample); learned positions [1, T, d] through a Linear
    and a learned query [1, d] through a Linear, broadcast over the batch (refused: expanding them would move the
    batch sum after the next layer's backward, or split it, and change the gradients' last bits)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 4, 6))
        self.pproj = nn.Linear(6, 6)
        self.q = nn.Parameter(torch.randn(1, 6))
        self.qproj = nn.Linear(6, 6)
        self.flat = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):  # x [B, T, 6]
        b, t, d = x.shape
        h = self.flat(x.reshape(-1, d)).reshape(b, t, d) + self.pproj(self.pos)
        return self.head(torch.tanh(h + self.qproj(self.q).unsqueeze(1)))


def test_broadcast_and_flattened_inputs():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="layer qproj is refused"):
        psn = check(Broadcasts(), call, f64(B, 4, 6))
    cov = psn.coverage()
    assert sorted(cov.covered) == ["flat.bias", "flat.weight", "head.bias", "head.weight"]
    assert "1 rows where the model's batch has 3" in cov.not_covered["qproj.weight"]
    assert "pproj.weight" in cov.not_covered and "no holder module" not in cov.not_covered["pos"]


def test_deepcopy_of_a_hooked_model_feeds_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    psn = hookstats.PerSampleGradNorms(model)
    other = copy.deepcopy(model)  # carries the hooks
    other(f64(5, 4)).sum().backward()
    assert psn.samples == 0
    model(f64(B, 4)).sum().backward()
    assert psn.samples == B


def test_not_seen_parameters_are_reported():
    """nn.MultiheadAttention applies out_proj's weight itself (F.multi_head_attention_forward): the Linear rule's
    hook never fires; coverage() says so once a backward has run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.MultiheadAttention(8, 2, batch_first=True))
    fwd = lambda m, x: m[1](*(m[0](x),) * 3)[0]  # noqa: E731
    with pytest.warns(UserWarning, match="in_proj_weight"):
        psn = hookstats.PerSampleGradNorms(model)
    fwd(model, torch.randn(B, 5, 4)).sum().backward()
    cov = psn.coverage()
    assert sorted(cov.not_seen) == ["1.out_proj.bias", "1.out_proj.weight"]
    assert "not seen" in str(cov)
    seen = sum(p.numel() for n, p in model.named_parameters() if n in cov.covered and "out_proj" not in n)
    assert cov.fraction == seen / sum(p.numel() for p in model.parameters()) < 1  # in no per-sample number


def test_against_opacus_convs_and_norms():
    """Conv2d by the per-sample weight-gradient kernel and (grouped, more filters than positions) by the unfolded
    Outer term, GroupNorm, RMSNorm, Linear: against Opacus's grad samplers, loss_reduction="sum"."""
    from opacus import GradSampleModule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                          nn.Conv2d(4, 24, 3, stride=2, groups=2), nn.Flatten(2), nn.RMSNorm(9), nn.Flatten(),
                          nn.Linear(24 * 9, 3)).double()
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    psn = hookstats.PerSampleGradNorms(model)
    x = f64(B, 3, 8, 8)
    r = f64(B, 3, seed=5)
    (gsm(x) * r).sum().backward()
    (model(x) * r).sum().backward()
    assert isinstance(hookstats.per_sample.rules.conv.conv_terms(model[3], torch.zeros(1, 4, 8, 8, dtype=torch.float64),
                                                               torch.zeros(1, 24, 3, 3, dtype=torch.float64),
                                                               ("weight",))["weight"], hookstats.per_sample.Outer)
    got = psn.per_param()
    for n, p in gsm._module.named_parameters():
        torch.testing.assert_close(got[n], p.grad_sample.reshape(B, -1).norm(dim=1), rtol=1e-9, atol=0,
                                   msg=lambda m: f"{n}: {m}")
    gsm.remove_hooks()


# -- the models people fine-tune (issue #35): every trainable value covered, or refused with its true reason -----------

def family(name: str):
    """(model, forward) of a tiny random-weight model of the family, built from its library."""
    import transformers as T

    torch.manual_seed(0)
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=V, attn_implementation="eager", pad_token_id=0, bos_token_id=0,
                 eos_token_id=0)
    if name == "opt":
        return T.OPTForCausalLM(T.OPTConfig(hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
                                            vocab_size=V, max_position_embeddings=16, word_embed_proj_dim=16,
                                            pad_token_id=1, bos_token_id=0, eos_token_id=0,
                                            attn_implementation="eager")), lm
    if name == "falcon":
        return T.FalconForCausalLM(T.FalconConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                  vocab_size=V, bos_token_id=0, eos_token_id=0, bias=True,
                                                  attn_implementation="eager")), lm
    if name in ("gemma", "gemma2", "gemma3"):
        cls, cfg = {"gemma": (T.GemmaForCausalLM, T.GemmaConfig), "gemma2": (T.Gemma2ForCausalLM, T.Gemma2Config),
                    "gemma3": (T.Gemma3ForCausalLM, T.Gemma3TextConfig)}[name]
        model = cls(cfg(**small, head_dim=8))
        with torch.no_grad():  # norm weights away from their initial 0 (the (1 + w) form)
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_()
        return model, lm
    if name == "olmoe":
        return T.OlmoeForCausalLM(T.OlmoeConfig(**small, num_experts=4, num_experts_per_tok=2,
                                                experts_implementation="eager")), lm
    if name == "qwen2_moe":
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**small, moe_intermediate_size=8, num_experts=4,
                                                      shared_expert_intermediate_size=16, num_experts_per_tok=2,
                                                      experts_implementation="eager")), lm
    if name == "bart":
        return T.BartForConditionalGeneration(T.BartConfig(
            d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=V, max_position_embeddings=16, pad_token_id=1,
            bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, scale_embedding=True)), \
            lambda m, x: m(input_ids=x, decoder_input_ids=x[:, :4]).logits
    if name == "distilbert":
        return T.DistilBertForMaskedLM(T.DistilBertConfig(dim=16, hidden_dim=32, n_layers=2, n_heads=2, vocab_size=V,
                                                          max_position_embeddings=16)), lm
    if name == "whisper":  # the encoder's positions are frozen by the model; the decoder's covered
        return T.WhisperForConditionalGeneration(T.WhisperConfig(
            d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=V, num_mel_bins=8, max_source_positions=8,
            max_target_positions=16, pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)), \
            lambda m, x: m(input_features=f64(B, 8, 16, seed=5), decoder_input_ids=x).logits
    vit = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=16,
               patch_size=8, num_labels=3)
    if name == "vit":
        return T.ViTForImageClassification(T.ViTConfig(**vit)), lambda m, x: m(pixel_values=x).logits
    if name == "deit":
        return T.DeiTForImageClassificationWithTeacher(T.DeiTConfig(**vit)), lambda m, x: m(pixel_values=x).logits
    if name == "vit_masked":  # mask_token used on the masked patches
        mask = torch.tensor([[True, False, False, True], [False] * 4, [True] * 4])
        return T.ViTForMaskedImageModeling(T.ViTConfig(**vit, encoder_stride=8)), \
            lambda m, x: m(pixel_values=x, bool_masked_pos=mask).reconstruction
    if name == "clip_vision":  # the class embedding; the position table an Embedding on [1, N] ids, expanded
        return T.CLIPVisionModelWithProjection(T.CLIPVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16,
            patch_size=8, projection_dim=8)), lambda m, x: m(pixel_values=x).image_embeds
    if name.startswith("dinov2"):  # class and mask tokens, the table as is, the layer scales
        model = T.Dinov2Model(T.Dinov2Config(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                             mlp_ratio=2, image_size=16, patch_size=8))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lambda1" in n or "mask_token" in n:
                    p.normal_()
        mask = torch.tensor([[True, False, False, True], [False] * 4, [True] * 4])
        kw = {"bool_masked_pos": mask} if name == "dinov2_masked" else {}
        return model, lambda m, x: m(pixel_values=x, **kw).last_hidden_state
    raise KeyError(name)


def _vision(seed=3):
    return f64(B, 3, 16, 16, seed=seed)


@pytest.mark.parametrize("name,rtol", [("opt", 1e-9), ("falcon", 1e-9), ("gemma", 1e-5), ("gemma2", 1e-5),
                                       ("gemma3", 1e-5), ("bart", 1e-9), ("distilbert", 1e-9), ("vit", 1e-9),
                                       ("deit", 1e-9), ("vit_masked", 1e-9), ("whisper", 1e-9),
                                       ("clip_vision", 1e-9), ("dinov2", 1e-9), ("dinov2_masked", 1e-9)])
def test_fine_tuned_families_fully_covered(name, rtol):
    """OPT (fc1 / fc2 on [B*T, d] rows proved batch-major; the positional embedding with its offset), Falcon
    (FalconLinear by its code), Gemma 1/2/3 (the (1 + w) RMSNorm: float32 products as the module's backward, so to
    float32 rounding; the scaled word embedding tied to the head), BART (scaled embedding, positions of batch 1
    expanded), ViT / DeiT / DINOv2 (class, distillation and mask tokens, position table: parameters their embeddings
    module applies itself; DINOv2's layer scales), CLIP vision (its class embedding): every trainable parameter
    covered, against the per-sample loop."""
    model, fwd = family(name)
    x = _vision() if name.startswith(("vit", "deit", "clip", "dinov2")) else ids()
    check(model, fwd, x, covered=[n for n, p in model.named_parameters() if p.requires_grad], rtol=rtol)


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe"])
def test_moe_experts_routers_and_shared_expert_covered(name):
    """Qwen2-MoE (routers, shared expert and its gate, the experts) and OLMoE: every parameter covered, exact against
    the per-sample loop: the experts' [E, m, n] weights per sample from the routing the experts module is called with
    (Note [routed experts])."""
    model, fwd = family(name)
    experts = [n for n, _ in model.named_parameters() if ".experts." in n]
    assert len(experts) == 4
    psn = check(model, fwd, ids(), covered=[n for n, _ in model.named_parameters()])
    assert psn._rule["model.layers.0.mlp.experts"].name == "RoutedExpertsRule"
    assert psn._rule["model.layers.0.mlp.gate"].name == "TopKRouterRule"
    if name == "qwen2_moe":
        assert "model.layers.0.mlp.shared_expert.down_proj" in psn.layers


def test_moe_experts_clipping():
    model, fwd = family("qwen2_moe")
    clip_check(model, fwd, ids())


def test_moe_experts_called_twice_in_one_backward():
    """Two forwards of the model, then one backward (two views of a batch): the experts module's terms of both calls
    join (RoutedOuter.cat), norms and clipping against the per-sample loop."""
    model, fwd = family("qwen2_moe")
    twice = lambda m, x: torch.cat([fwd(m, x), fwd(m, x.flip(1))], 1)  # noqa: E731
    psn = check(model, twice, ids(), covered=[n for n, _ in model.named_parameters()])
    assert psn._rule["model.layers.0.mlp.experts"].name == "RoutedExpertsRule"
    model, fwd = family("qwen2_moe")
    clip_check(model, twice, ids())


def test_moe_experts_refused_with_another_implementation():
    """A fused experts kernel (grouped_mm) is not the eager loop the rule replays: refused from the start, with the
    reason and what to do; max_norm= then raises, naming them."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.Qwen2MoeConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=V, moe_intermediate_size=8, num_experts=4,
                           shared_expert_intermediate_size=16, num_experts_per_tok=2,
                           experts_implementation="grouped_mm")
    model = T.Qwen2MoeForCausalLM(cfg)
    with pytest.warns(UserWarning, match="grouped_mm"):
        psn = hookstats.PerSampleGradNorms(model)
    why = psn.coverage().not_covered
    assert set(why) == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    assert "experts_implementation='eager'" in why["model.layers.0.mlp.experts.down_proj"]
    psn.remove()
    with pytest.raises(ValueError, match="gate_up_proj"):
        hookstats.PerSampleGradNorms(model, max_norm=1.0)


def test_moe_experts_of_another_layout_refused():
    """Experts whose forward is not that code (a subclass with its own loop) keep the refusal, with its reason."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    class MyExperts(Qwen2MoeExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states * top_k_weights.sum(-1, keepdim=True)

    import transformers as T

    cfg = T.Qwen2MoeConfig(hidden_size=16, num_experts=4, moe_intermediate_size=8, experts_implementation="eager")
    model = nn.ModuleDict({"experts": MyExperts(cfg), "head": nn.Linear(2, 2)})
    with pytest.warns(UserWarning, match="routed-experts rule does not match"):
        psn = hookstats.PerSampleGradNorms(model)
    assert "Note [routed experts]" in psn.coverage().not_covered["experts.down_proj"]
    psn.remove()


@pytest.mark.parametrize("name", ["resnet18", "efficientnet_b0", "regnetx_002"])
def test_batchnorm_in_eval_mode_covered_refused_in_training(name):
    """Eval-mode BatchNorm (nn.BatchNorm2d, timm BatchNormAct2d with its activation) is a per-channel affine map:
    covered and exact. In training mode it mixes the samples: refused at run time, by name, with the reason."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=3)
    with torch.no_grad():  # running statistics and affine parameters away from their defaults
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
                m.weight.normal_()
                m.bias.normal_()
    check(model, call, f64(2 if name == "resnet18" else B, 3, 32, 32), covered=[n for n, _ in model.named_parameters()],
          bitwise=False)
    model.train()
    with pytest.warns(UserWarning, match="BatchNorm in training mode"):
        psn = hookstats.PerSampleGradNorms(model)
        model(f64(2, 3, 32, 32)).sum().backward()
    assert any("BatchNorm in training mode" in why for why in psn.coverage().not_covered.values())
    psn.remove()


def peft_model(kind: str):
    """GPT-2 with a peft adapter: "lora" (attention and MLP Conv1D), "lora_embedding" (wte and wpe too), "dora"."""
    peft = pytest.importorskip("peft")
    base = hf("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    targets = ["c_attn", "c_proj", "c_fc"] + (["wte", "wpe"] if kind == "lora_embedding" else [])
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, fan_in_fan_out=True,
                          init_lora_weights=False, use_dora=kind == "dora")
    return peft.get_peft_model(base, cfg)


@pytest.mark.parametrize("kind", ["lora", "lora_embedding", "dora"])
def test_peft_adapters(kind):
    """peft LoRA (lora_A / lora_B Linears), LoRA on the embeddings (lora_embedding_A / B applied by the peft
    Embedding from its ParameterDicts, the tied head frozen), DoRA (the magnitude vector by its rule; lora_A / lora_B
    also called on an identity matrix for the weight norm, a detached side computation that must not refuse them)."""
    model = peft_model(kind)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if kind == "dora":  # the magnitude by its rule; lora_A / lora_B also run on an identity (detached): not refused
        assert any("lora_magnitude_vector" in n for n in trainable)
    if kind == "lora_embedding":
        assert any("lora_embedding_A" in n for n in trainable)
    psn = check(model, lm, ids(), covered=trainable)
    assert psn.coverage().fraction == 1.0


def swin(impl: str, depths=(2, 2)):
    """A tiny HF Swin: stage 0 has 4 windows of 2 x 2 per sample, its second block shifted (the cyclic roll and the
    window mask); stage 1 one window per sample."""
    import transformers as T

    torch.manual_seed(0)
    return T.SwinForImageClassification(T.SwinConfig(embed_dim=8, depths=list(depths), num_heads=[1, 2],
                                                     window_size=2, image_size=16, patch_size=4, num_labels=3,
                                                     attn_implementation=impl))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_swin_window_attention_covered(impl):
    """HF Swin: the attention's q/k/v and output projections on [B * windows, N, C] rows, proved batch-major through
    the window partition, the cyclic shift, the attention product and the head merge (Note [batch layouts]), and the
    relative-position table, from the scores' gradient per window (Note [relative-position table]): every parameter
    covered, exact (the table to float32 rounding: the model's softmax runs in float32 and autograd differentiates
    it there, the rule in float64)."""
    model = swin(impl)
    table = [n for n, _ in model.named_parameters() if n.endswith("relative_position_bias_table")]
    assert len(table) == 4 and model.swin.encoder.layers[0].blocks[1].shift_size > 0
    psn = check(model, lambda m, x: m(pixel_values=x).logits, _vision(),
                covered=[n for n, _ in model.named_parameters()], rtol=1e-5)
    assert psn._rule["swin.encoder.layers.0.blocks.1.attention"].name == "SwinRelativePositionTableRule"
    assert "swin.encoder.layers.0.blocks.1.attention.o_proj" in psn.layers
    assert psn.coverage().fraction == 1.0


def _f64_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' eager_attention_forward with its softmax in the model's dtype (no float32 round trip)."""
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1)
    return torch.matmul(attn_weights, value).transpose(1, 2).contiguous(), attn_weights


def test_swin_relative_position_table_exact():
    """The table's per-sample norms to float64 rounding where the model's attention is differentiated in float64
    (an attention function registered with transformers: the eager one without the float32 softmax)."""
    from transformers import AttentionInterface

    AttentionInterface.register("hookstats_f64_eager", _f64_attention)
    model = swin("hookstats_f64_eager")
    psn = check(model, lambda m, x: m(pixel_values=x).logits, _vision(),
                covered=[n for n, _ in model.named_parameters()])
    assert psn._rule["swin.encoder.layers.0.blocks.0.attention"].name == "SwinRelativePositionTableRule"


def test_swin_clipping():
    """max_norm on HF Swin (every parameter covered: the window projections, the table by its Index term):
    .grad is the clipped sum of the loop's per-sample gradients."""
    from transformers import AttentionInterface

    AttentionInterface.register("hookstats_f64_eager", _f64_attention)
    clip_check(swin("hookstats_f64_eager"), lambda m, x: m(pixel_values=x).logits, _vision())


def test_swin_table_refused_with_attention_dropout():
    model = swin("eager")
    model.config.attention_probs_dropout_prob = 0.1
    for m in model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.1
    model.train()
    with pytest.warns(UserWarning, match="attention's dropout is active"):
        psn = hookstats.PerSampleGradNorms(model)
        model(pixel_values=_vision().float()).logits.sum().backward()
    why = psn.coverage().not_covered
    table = [n for n in why if n.endswith("relative_position_bias_table")]
    assert len(table) == 4 and "random mask" in why[table[0]]
    psn.remove()


def test_timm_swin_window_attention_covered():
    """timm Swin: qkv split by a permute that moves the heads' q/k/v axis in front of the windows, then unbind; the
    window mask added through a [B, windows, ...] view; the output projection and the relative-position table
    (WindowAttention's rule, by its code) covered: every parameter, exact (timm's softmax runs in the model's
    dtype)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=3, img_size=32,
                              window_size=2, embed_dim=8, depths=(2, 2), num_heads=(1, 2))
    assert sum(n.endswith("relative_position_bias_table") for n, _ in model.named_parameters()) == 4
    psn = check(model, call, f64(B, 3, 32, 32), covered=[n for n, _ in model.named_parameters()])
    assert "layers.0.blocks.1.attn.proj" in psn.layers
    assert psn._rule["layers.0.blocks.1.attn"].name == "TimmWindowAttentionTableRule"


class Windows(nn.Module):
    """[B, T, d] tokens cut into windows of 2, attention within each window, an output projection on the windows'
    rows, then a head on [B, T, d]. `mode` says how the windows are formed: "batch_major" (rows of sample b
    together: covered), "sdpa" (the same through scaled_dot_product_attention's fused node: covered), "interleaved"
    (a transpose puts the batch inside each window's index: rows of all samples alternate), "across" (the attention
    runs over one token position of every sample), "softmax_across" (scores normalised over the whole flattened
    batch)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.qkv = nn.Linear(4, 12)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):  # x [B, T, 4]
        b, t, d = x.shape
        if self.mode == "interleaved":
            w = x.transpose(0, 1).reshape(-1, 2, d)  # a copy: not a view of the batch, rows of all samples alternate
        else:
            w = x.reshape(-1, 2, d)  # [B * T/2, 2, d], a view: batch-major windows
        q, k, v = self.qkv(w).reshape(w.shape[0], 2, 3, d).permute(2, 0, 1, 3).unbind(0)
        if self.mode == "across":  # windows regrouped by position: [T/2, B, 2, d] -> attention over samples
            q, k, v = (z.reshape(b, t // 2, 2, d).transpose(0, 1).reshape(t // 2, b * 2, d) for z in (q, k, v))
        if self.mode == "sdpa":  # the fused node (ScaledDotProductFlashAttentionForCpuBackward0 here)
            o = F.scaled_dot_product_attention(q, k, v)
        else:
            s = q @ k.transpose(-2, -1)
            s = torch.softmax(s.reshape(-1), 0).reshape(s.shape) if self.mode == "softmax_across" else s.softmax(-1)
            o = s @ v
        if self.mode == "across":
            o = o.reshape(t // 2, b, 2, d).transpose(0, 1)
        return self.head(self.proj(o.reshape(-1, 2, d)).reshape(b, t, d))


@pytest.mark.parametrize("mode", ["batch_major", "sdpa", "interleaved", "across", "softmax_across"])
def test_window_rows_proved_or_refused(mode):
    """Note [batch layouts]: the output projection of windowed attention is split per sample only when the graph
    proves each window's rows stay with their sample; rows that alternate between samples, an attention that runs
    across samples, or a softmax over the whole batch leave it refused, by name, with the reason."""
    torch.manual_seed(0)
    model = Windows(mode)
    if mode in ("batch_major", "sdpa"):
        check(model, call, f64(B, 4, 4), covered=[n for n, _ in model.named_parameters()])
        return
    with pytest.warns(UserWarning, match="layer proj is refused"):
        if mode == "interleaved":  # the samples stay independent: what is covered is exact
            psn = check(model, call, f64(B, 4, 4))
        else:  # the model mixes the samples: no per-sample gradient to compare with, only the refusal
            psn = hookstats.PerSampleGradNorms(model.double())
            model(f64(B, 4, 4)).sum().backward()
    why = psn.coverage().not_covered
    assert "not provably the batch's samples flattened batch-major" in why["proj.weight"]
    assert ("qkv.weight" in why) == (mode == "interleaved")  # a copy in the batch's transposed order: not a view


def swinv2(lib: str, **over):
    """A tiny Swin V2 (timm or HF): stage 0 has 4 windows of 2 x 2 per sample, its second block shifted; the q / v
    biases, the logit scales and the post-norms away from their initial 0, log(10) and 0 (timm starts the residual
    post-norms at 0: the attention would get no gradient), one head's logit scale above the clamp at log(100) (its
    gradient is 0)."""
    import timm
    import transformers as T

    torch.manual_seed(0)
    if lib == "timm":
        model = timm.create_model("swinv2_tiny_window8_256", pretrained=False, num_classes=3, img_size=32,
                                  window_size=2, embed_dim=8, depths=(2, 2), num_heads=(1, 2), **over)
        fwd = call
    else:
        model = T.Swinv2ForImageClassification(T.Swinv2Config(
            embed_dim=8, depths=[2, 2], num_heads=[1, 2], window_size=2, image_size=16, patch_size=4, num_labels=3,
            attn_implementation="eager", **over))
        fwd = lambda m, x: m(pixel_values=x).logits  # noqa: E731
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_bias", "v_bias")) or ("query" in n or "value" in n) and n.endswith("bias") or "norm" in n:
                p.normal_()
            if n.endswith("logit_scale"):
                p.uniform_(0.5, 3.0)
                if p.numel() > 1:
                    p[1] = 5.0  # above log(100): clamped
    return model, fwd


@pytest.mark.parametrize("lib,over", [("timm", {}), ("timm", {"qkv_bias": False}), ("hf", {})])
def test_swinv2_cosine_attention_covered(lib, over):
    """Swin V2 (Note [cosine window attention]): logit_scale, the continuous position-bias MLP, timm's fused qkv weight
    with its q / v biases and the output projection, HF's output projection proved batch-major through F.normalize's
    norms: every parameter covered, exact against the per-sample loop (both libraries' softmax runs in the model's
    dtype)."""
    model, fwd = swinv2(lib, **over)
    x = f64(B, 3, 32, 32) if lib == "timm" else _vision()
    psn = check(model, fwd, x, covered=[n for n, _ in model.named_parameters()])
    attn = "layers.0.blocks.1.attn" if lib == "timm" else "swinv2.encoder.layers.0.blocks.1.attention.self"
    assert psn._rule[attn].name == ("TimmSwinV2WindowAttentionRule" if lib == "timm" else "Swinv2SelfAttentionRule")
    assert psn.coverage().fraction == 1.0


@pytest.mark.parametrize("lib", ["timm", "hf"])
def test_swinv2_clipping(lib):
    model, fwd = swinv2(lib)
    clip_check(model, fwd, f64(B, 3, 32, 32) if lib == "timm" else _vision())


@pytest.mark.parametrize("lib", ["timm", "hf"])
def test_swinv2_called_twice_in_one_backward(lib):
    """Two forwards, then one backward: each attention's position-bias MLP terms of both calls join (MlpTerm.cat),
    against the per-sample loop."""
    model, fwd = swinv2(lib)
    twice = lambda m, x: torch.cat([fwd(m, x), fwd(m, x.flip(-1))], 1)  # noqa: E731
    check(model, twice, f64(B, 3, 32, 32) if lib == "timm" else _vision(),
          covered=[n for n, _ in model.named_parameters()])


@pytest.mark.parametrize("lib", ["timm", "hf"])
def test_swinv2_refused_with_attention_dropout(lib):
    model, fwd = swinv2(lib)
    for m in model.modules():
        if lib == "timm" and hasattr(m, "attn_drop"):
            m.attn_drop.p = 0.1
        if lib == "hf" and hasattr(m, "logit_scale"):
            m.dropout.p = 0.1
    model.train()
    with pytest.warns(UserWarning, match="attention's dropout is active"):
        psn = hookstats.PerSampleGradNorms(model)
        fwd(model, f64(B, 3, 32, 32).float() if lib == "timm" else _vision().float()).sum().backward()
    why = psn.coverage().not_covered
    scales = [n for n in why if n.endswith("logit_scale")]
    assert len(scales) == 4 and "random mask" in why[scales[0]]
    psn.remove()


def _timm(name: str, **kw):
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=3, **kw)
    with torch.no_grad():  # layer scales and GRN away from their initial 1e-5 / 0
        for n, p in model.named_parameters():
            if n.endswith(("gamma", "grn.weight", "grn.bias")):
                p.normal_()
    return model


@pytest.mark.parametrize("name", ["deit3_small_patch16_224", "convnextv2_atto"])
def test_timm_layer_scale_and_grn(name):
    """timm LayerScale (DeiT III: out = x * gamma over the channels) and GlobalResponseNorm (ConvNeXt V2: weight and
    bias of x + bias + weight * x * n(x), n from the sample's own spatial norms): covered, exact."""
    vit = name.startswith("deit3")
    model = _timm(name, **(dict(img_size=32, patch_size=8, depth=2, embed_dim=16, num_heads=2) if vit else {}))
    psn = check(model, call, f64(2, 3, 32, 32), covered=[n for n, _ in model.named_parameters()])
    layer = "blocks.0.ls1" if vit else "stages.0.blocks.0.mlp.grn"
    assert psn._rule[layer].name == ("ChannelScaleRule" if vit else "GlobalResponseNormRule")


def test_layer_scale_clipping():
    clip_check(_timm("convnextv2_atto"), call, f64(B, 3, 32, 32))


def test_layer_scale_refusals():
    """An in-place layer scale overwrites the input its gradient needs; ConvNeXt's drop path in training is a random
    per-sample mask: both refused by name, with the reason."""
    from timm.layers import LayerScale

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LayerScale(4, init_values=0.5, inplace=True), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="in place"):
        psn = hookstats.PerSampleGradNorms(model)
        model(torch.randn(B, 4)).sum().backward()
    assert "inplace=True" in psn.coverage().not_covered["1.gamma"]
    psn.remove()
    model = _timm("convnext_atto", drop_path_rate=0.5).train()
    with pytest.warns(UserWarning, match="drop path is active"):
        psn = hookstats.PerSampleGradNorms(model)
        model(torch.randn(2, 3, 32, 32)).sum().backward()
    why = psn.coverage().not_covered
    assert "random per-sample mask" in why["stages.1.blocks.0.gamma"] and "stages.0.blocks.0.gamma" not in why
    psn.remove()


_TINY_VIT = dict(img_size=32, patch_size=8, depth=2, embed_dim=16, num_heads=2)


@pytest.mark.parametrize("name,kw", [("vit_tiny_patch16_224", {}),
                                     ("vit_small_patch16_224", dict(reg_tokens=2)),
                                     ("vit_small_patch16_224", dict(reg_tokens=2, class_token=False,
                                                                    global_pool="avg", no_embed_class=True)),
                                     ("deit_tiny_distilled_patch16_224", {}),
                                     ("deit3_small_patch16_224", {})])
def test_timm_vit_tokens_covered(name, kw):
    """timm ViT / DeiT / DeiT III / registers: the class, register and distillation tokens and the position table
    (with and without no_embed_class), parameters of the model applied by its _pos_embed, read at its pos_drop
    (Rule.hook_site): every parameter covered, exact."""
    model = _timm(name, **_TINY_VIT, **kw)
    own = [n for n, _ in model.named_parameters() if "." not in n]
    assert "pos_embed" in own and len(own) >= 2
    psn = check(model, call, f64(B, 3, 32, 32), covered=[n for n, _ in model.named_parameters()])
    assert psn._rule[""].name == "TimmViTTokensRule"


def test_timm_vit_tokens_clipping():
    clip_check(_timm("vit_small_patch16_224", **_TINY_VIT, reg_tokens=2), call, f64(B, 3, 32, 32))


def test_timm_vit_tokens_refusals_and_copies():
    """dynamic_img_size (a table resampled per input) is refused from the start, an active position dropout at run
    time; a deepcopy of the hooked model (its pos_drop carries the hook) feeds nothing."""
    model = _timm("vit_tiny_patch16_224", **_TINY_VIT, dynamic_img_size=True)
    with pytest.warns(UserWarning, match="resampled"):
        psn = hookstats.PerSampleGradNorms(model)
    assert "dynamic_img_size=True" in psn.coverage().not_covered["pos_embed"]
    psn.remove()
    model = _timm("vit_tiny_patch16_224", **_TINY_VIT, pos_drop_rate=0.1).train()
    with pytest.warns(UserWarning, match="position dropout is active"):
        psn = hookstats.PerSampleGradNorms(model)
        model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert "random mask" in psn.coverage().not_covered["cls_token"]
    psn.remove()
    model = _timm("vit_tiny_patch16_224", **_TINY_VIT).double().eval()
    psn = hookstats.PerSampleGradNorms(model)
    copy.deepcopy(model)(f64(5, 3, 32, 32)).sum().backward()
    assert psn.samples == 0 and not psn.per_param_sq()
    model(f64(B, 3, 32, 32)).sum().backward()
    assert psn.samples == B and psn.per_param_sq()["cls_token"].shape == (B,)


def test_dinov2_resampled_table_refused():
    """DINOv2 resamples its position table (bicubic) for another number of patches: refused at run time, with the
    reason; the table as is (the image size of the config) is covered (test_fine_tuned_families_fully_covered)."""
    model, fwd = family("dinov2")
    with pytest.warns(UserWarning, match="resampled"):
        psn = hookstats.PerSampleGradNorms(model)
        fwd(model, torch.randn(2, 3, 24, 24)).sum().backward()
    why = psn.coverage().not_covered
    assert set(why) == {"embeddings.cls_token", "embeddings.mask_token", "embeddings.position_embeddings"}
    assert "interpolate_pos_encoding" in why["embeddings.position_embeddings"]
    psn.remove()


def test_term_of_its_own_form_without_a_sum_refused():
    """A rule's Term of a form of its own that has no cat(): two uses in one backward, or a use beside another form,
    are refused with the reason (before, combine() dropped such a term from the norm's sum without a word)."""
    from hookstats.per_sample import terms

    class Odd(terms.Term):
        samples = 2

        def sq(self):
            return torch.ones(2, dtype=torch.float64)

    dense = terms.Dense(torch.ones(2, 3, dtype=torch.float64))
    torch.testing.assert_close(terms.sum_sq([Odd()]), torch.ones(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="a Odd was used 2 times in one backward"):
        terms.sum_sq([Odd(), Odd()])
    with pytest.raises(RuntimeError, match="Odd was also used by another kind of layer"):
        terms.sum_sq([Odd(), dense])


@pytest.mark.parametrize("s,m,n", [(12, 2, 3), (4, 16, 16)])
def test_routed_outer_term(s, m, n):
    """RoutedOuter (Note [routed experts]) against the per-sample [E, m, n] gradients materialised: the squared norms
    by (sample, expert) groups (many pairs, small blocks) and by the masked Grams (few pairs, large blocks), dropped
    slots (expert index E) included; the clip's weighted sum, and rows_to_samples."""
    from hookstats.per_sample.rules.hf_moe_experts import RoutedOuter

    g = torch.Generator().manual_seed(0)
    b, e_ = 6, 3
    L = torch.randn(b, s, m, generator=g, dtype=torch.float64)
    R = torch.randn(b, s, n, generator=g, dtype=torch.float64)
    e = torch.randint(0, e_ + 1, (b, s), generator=g)
    L[e == e_] = 0  # a dropped slot carries no gradient
    full = torch.zeros(b, e_, m, n, dtype=torch.float64)
    for i in range(b):
        for p in range(s):
            if e[i, p] < e_:
                full[i, e[i, p]] += torch.outer(L[i, p], R[i, p])
    term = RoutedOuter(L, R, e, e_)
    torch.testing.assert_close(term.sq(), full.square().sum((1, 2, 3)), rtol=1e-12, atol=0)
    w = torch.rand(b, generator=g, dtype=torch.float64)
    torch.testing.assert_close(term.delta(w, (e_, m, n)), (full * w.reshape(-1, 1, 1, 1)).sum(0), rtol=1e-12, atol=0)
    two = term.rows_to_samples(2)
    torch.testing.assert_close(two.sq(), full.reshape(b // 2, 2, -1).sum(1).square().sum(1), rtol=1e-12, atol=0)
    cut = s // 2  # one call's pairs and another's, joined (an experts module called twice in one backward)
    halves = [RoutedOuter(L[:, a:z], R[:, a:z], e[:, a:z], e_) for a, z in ((0, cut), (cut, s))]
    joined = RoutedOuter.cat(halves)
    torch.testing.assert_close(joined.sq(), full.square().sum((1, 2, 3)), rtol=1e-12, atol=0)
    torch.testing.assert_close(sum(h.delta(w, (e_, m, n)) for h in halves), term.delta(w, (e_, m, n)), rtol=1e-12,
                               atol=1e-14)
    with pytest.raises(RuntimeError, match="different expert counts"):
        RoutedOuter.cat([halves[0], RoutedOuter(L, R, e, e_ + 1)])
