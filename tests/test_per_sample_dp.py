"""hookstats.PerSampleGradNorms for DP-SGD (issue #35): per-sample clipping exact under reentrant and non-reentrant
activation checkpointing (with and without a covered layer after the last segment, GPT-2 + peft LoRA with a frozen
head), against a per-sample loop in float64 on a twin without hooks or checkpointing."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hookstats

B = 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def per_sample_grads(twin: nn.Module, fwd, x, r: torch.Tensor):
    """([name], [B lists of per-parameter gradients]) of sample b's terms of sum(out * r), one backward per sample on
    the twin, over its trainable parameters."""
    params = {k: p for k, p in twin.named_parameters() if p.requires_grad}
    out = fwd(twin, x)
    per = []
    for b in range(r.shape[0]):
        rb = torch.zeros_like(r)
        rb[b] = r[b]
        gs = torch.autograd.grad((out * rb).sum(), list(params.values()), retain_graph=True, allow_unused=True)
        per.append([torch.zeros_like(p) if g is None else g for g, p in zip(gs, params.values())])
    return list(params), per


def clip_check(model: nn.Module, fwd, x, twin: nn.Module | None = None, twin_fwd=None, steps: int = 2,
               rtol: float = 1e-9, **kw):
    """max_norm = the median per-sample norm: after each backward, every trainable .grad == its value before +
    sum_b min(1, C / (||g_b|| + eps)) g_b, clip_coef() has one entry per sample, total() is the unclipped norm; the
    clipped gradient of every sample is at most C. `twin` (default: a deepcopy) computes the reference without
    hooks, with `twin_fwd` (default `fwd`)."""
    twin = copy.deepcopy(model) if twin is None else twin
    twin_fwd = twin_fwd or fwd
    psn = None
    for step in range(steps):
        xs = x(step) if callable(x) else x
        with torch.no_grad():
            out = twin_fwd(twin, xs)
        r = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(step + 1))
        names, per = per_sample_grads(twin, twin_fwd, xs, r)
        norms = torch.stack([torch.stack([g.square().sum() for g in gs]).sum().sqrt() for gs in per])
        c = float(norms.median())
        coef = torch.clamp(c / (norms + 1e-6), max=1.0)
        assert (coef < 1).any() and (coef == 1).any()
        if psn is None:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # every trainable parameter covered: no warning
                psn = hookstats.PerSampleGradNorms(model, max_norm=c, **kw)
        else:
            psn.max_norm = c
        params = dict(model.named_parameters())
        before = {k: (params[k].grad.clone() if params[k].grad is not None else torch.zeros_like(params[k]))
                  for k in names}
        (fwd(model, xs) * r).sum().backward()
        assert psn.clip_coef().shape == (xs.shape[0],)
        torch.testing.assert_close(psn.clip_coef(), coef, rtol=rtol, atol=0)
        torch.testing.assert_close(psn.total(), norms, rtol=rtol, atol=0)
        wants = {k: before[k] + sum(coef[b] * per[b][i] for b in range(len(per))) for i, k in enumerate(names)}
        scale = max(float(w.abs().max()) for w in wants.values())  # attention's key bias: 0 but for rounding
        for k, want in wants.items():
            torch.testing.assert_close(params[k].grad, want, rtol=rtol, atol=1e-14 * scale,
                                       msg=lambda m: f"step {step}, {k}: {m}")
        psn.step()
    psn.remove()
    return psn


# -- activation checkpointing ------------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.out(torch.tanh(self.fc(self.ln(x))))


class Stack(nn.Module):
    """inp -> blocks (each checkpointed: None, "reentrant" or "non_reentrant") -> final LayerNorm -> head."""

    def __init__(self, mode, d=6, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h) if self.mode is None else checkpoint(blk, h, use_reentrant=self.mode == "reentrant")
        return self.head(self.norm(h))


def _frozen(model: nn.Module, head: bool) -> nn.Module:
    """head=False: everything after the last block and before the first frozen (a LoRA-like setup: no covered
    layer after the last checkpointed segment, nor before the first)."""
    if not head:
        for m in (model.inp, model.norm, model.head):
            m.requires_grad_(False)
    return model


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("head", [True, False], ids=["covered_head", "frozen_head"])
def test_clipping_under_checkpointing(mode, head):
    model = _frozen(Stack(mode).double(), head)
    twin = copy.deepcopy(model)
    twin.mode = None
    if not head:  # reentrant checkpoint needs an input that requires grad to backpropagate into its segment
        x = lambda s: torch.randn(B, 4, 5, dtype=torch.float64,  # noqa: E731
                                  generator=torch.Generator().manual_seed(10 + s)).requires_grad_()
    else:
        x = lambda s: torch.randn(B, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + s))
    clip_check(model, lambda m, x: m(x), x, twin=twin)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_norms_under_checkpointing_with_gradient_accumulation(mode):
    """Two micro-batches of different sizes, each one forward and one backward, norms only: the recomputed calls
    are matched to their batch (per_param of B_1 + B_2 samples), nothing is left waiting."""
    model = Stack(mode).double()
    twin = copy.deepcopy(model)
    twin.mode = None
    psn = hookstats.PerSampleGradNorms(model)
    wants = []
    for s, b in enumerate((3, 2)):
        x = torch.randn(b, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(s)).requires_grad_()
        r = torch.randn(b, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7 + s))
        (model(x) * r).sum().backward()
        names, per = per_sample_grads(twin, lambda m, x: m(x), x, r)
        wants.append({k: torch.stack([per[i][j].square().sum() for i in range(b)]) for j, k in enumerate(names)})
    got = psn.per_param_sq()
    assert sorted(got) == sorted(wants[0]) and not any(psn._pending.values())
    for k in got:
        torch.testing.assert_close(got[k], torch.cat([w[k] for w in wants]), rtol=1e-9, atol=1e-300)
    psn.remove()


def test_reentrant_recompute_through_forwards_of_different_batch_sizes_is_refused():
    """One backward through two forwards of different batch sizes: a recomputed call cannot be matched to its
    samples (rows could also be a flattened batch); refused by name, never split wrong."""
    model = _frozen(Stack("reentrant").double(), head=False)
    psn = hookstats.PerSampleGradNorms(model)
    x1 = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    with pytest.warns(UserWarning, match=r"recomputed in the backward .* different batch sizes \[2, 3\]"):
        (model(x1).sum() + model(x2).sum()).backward()
    assert any("different batch sizes" in why for why in psn.coverage().not_covered.values())
    psn.remove()


# -- GPT-2 + peft LoRA, frozen head, HF gradient checkpointing ---------------------------------------------------------

def gpt2_lora():
    peft = pytest.importorskip("peft")
    import transformers as T

    torch.manual_seed(0)
    cfg = T.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=40, n_positions=16, bos_token_id=0, eos_token_id=0,
                       attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base = T.GPT2LMHeadModel(cfg).double()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                      lora_dropout=0.0, fan_in_fan_out=True, init_lora_weights=False))
    return model


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_gpt2_lora_frozen_head_checkpointed(reentrant):
    model = gpt2_lora()
    twin = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()  # what peft / the HF Trainer do for reentrant checkpointing
    model.train()
    twin.eval()
    assert not model.base_model.model.lm_head.weight.requires_grad
    ids = lambda s: torch.randint(0, 40, (B, 6), generator=torch.Generator().manual_seed(20 + s))  # noqa: E731
    clip_check(model, lambda m, x: m(input_ids=x).logits, ids, twin=twin)


# -- with max_norm, a trainable parameter that cannot be clipped is refused -------------------------------------------

class Scaled(nn.Linear):  # its own forward, no rule: not covered
    def forward(self, x):
        return 2 * super().forward(x)


def scaled_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), Scaled(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def test_uncovered_trainable_parameter_refused_with_max_norm():
    model = scaled_model()
    with pytest.raises(ValueError, match=r"2\.weight \(Scaled is a subclass of torch\.nn\.modules\.linear\.Linear with "
                                         r"its own forward.*2\.bias.*allow_unclipped=True"):
        hookstats.PerSampleGradNorms(model, max_norm=1.0)
    with pytest.warns(UserWarning, match=r"2\.weight"):  # norms only: a warning, as before
        hookstats.PerSampleGradNorms(model).remove()


def test_explicit_opt_outs_clip_what_is_covered():
    """Freezing the layer or excluding it: no error, and the covered parameters are clipped exactly; with
    allow_unclipped=True the uncovered layer keeps its unclipped gradient (warned at construction)."""
    x = torch.randn(B, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    frozen = scaled_model()
    frozen[2].requires_grad_(False)
    clip_check(frozen, lambda m, x: m(x), x, steps=1)

    for how in ("exclude", "allow_unclipped"):
        model = scaled_model()
        twin = copy.deepcopy(model)
        twin[2].requires_grad_(False)  # the reference: the clip over the other parameters
        kw = dict(exclude="2") if how == "exclude" else dict(allow_unclipped=True)
        out = model(x)
        r = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        names, per = per_sample_grads(twin, lambda m, x: m(x), x, r)
        norms = torch.stack([torch.stack([g.square().sum() for g in gs]).sum().sqrt() for gs in per])
        c = float(norms.median())
        coef = torch.clamp(c / (norms + 1e-6), max=1.0)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            psn = hookstats.PerSampleGradNorms(model, max_norm=c, **kw)
        assert any("2.weight" in str(w.message) for w in rec) == (how == "allow_unclipped")
        model.zero_grad()
        (model(x) * r).sum().backward()
        params = dict(model.named_parameters())
        for i, k in enumerate(names):
            torch.testing.assert_close(params[k].grad, sum(coef[b] * per[b][i] for b in range(B)), rtol=1e-9,
                                       atol=1e-15, msg=lambda m: f"{how}, {k}: {m}")
        twin[2].requires_grad_(True)
        twin.zero_grad()
        (twin(x) * r).sum().backward()
        assert torch.equal(params["2.weight"].grad, twin[2].weight.grad)  # left unclipped, as asked
        psn.remove()


class TableModel(nn.Module):
    """`table` is fed a [T, d] table shared by every sample: refused at run time."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.table = nn.Linear(4, 4)

    def forward(self, x):  # x [B, T, 4]
        return self.fc(x) + self.table(torch.ones(x.shape[1], 4, dtype=x.dtype))


def test_layer_refused_at_run_time_with_max_norm():
    m = TableModel().double()
    hookstats.PerSampleGradNorms(m, max_norm=1.0)
    with pytest.raises(RuntimeError, match=r"layer table cannot be split per sample: .*5 rows.*allow_unclipped=True"):
        m(torch.randn(3, 5, 4, dtype=torch.float64)).sum().backward()
    m = TableModel().double()
    psn = hookstats.PerSampleGradNorms(m, max_norm=1.0, allow_unclipped=True)
    with pytest.warns(UserWarning, match="layer table is refused"):
        m(torch.randn(3, 5, 4, dtype=torch.float64)).sum().backward()
    assert psn.clip_coef().shape == (3,) and sorted(psn.per_param()) == ["fc.bias", "fc.weight"]


def test_gradient_without_a_per_sample_term_refused_with_max_norm():
    """fc's weight is applied by the model itself (F.linear), not through fc's forward: autograd changes its .grad
    with no per-sample term; with max_norm the backward raises, naming it."""
    class Direct(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.inp = nn.Linear(4, 4)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return torch.nn.functional.linear(torch.tanh(self.inp(x)), self.fc.weight, self.fc.bias)

    m = Direct().double()
    psn = hookstats.PerSampleGradNorms(m, max_norm=1.0)
    with pytest.raises(RuntimeError, match=r"fc\.bias, fc\.weight got a gradient in this backward but no per-sample "
                                           r"term"):
        m(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    psn.remove()
    m = Direct().double()
    psn = hookstats.PerSampleGradNorms(m, max_norm=1.0, allow_unclipped=True)
    with pytest.warns(UserWarning, match=r"fc\.bias, fc\.weight got a gradient"):
        m(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    assert psn.clip_coef().shape == (3,) and psn.coverage().not_seen == ["fc.weight", "fc.bias"]
    psn.remove()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_opt_checkpointed_flattened_rows(reentrant):
    """OPT's fc1 / fc2 on [B*T, d] rows proved batch-major, in a recompute too: the clip under checkpointing."""
    import transformers as T

    torch.manual_seed(0)
    model = T.OPTForCausalLM(T.OPTConfig(hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
                                         vocab_size=40, max_position_embeddings=16, word_embed_proj_dim=16,
                                         pad_token_id=1, bos_token_id=0, eos_token_id=0, dropout=0.0,
                                         attn_implementation="eager")).double()
    twin = copy.deepcopy(model).eval()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    ids = lambda s: torch.randint(2, 40, (B, 6), generator=torch.Generator().manual_seed(30 + s))  # noqa: E731
    clip_check(model, lambda m, x: m(input_ids=x).logits, ids, twin=twin)


# -- book-keeping: the clipped weight gradient computed once, instead of autograd's (Note [book-keeping]) -------------

def _graph_reaches(t: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether autograd would compute a gradient for `param` in a backward from t (an edge to its AccumulateGrad; a
    _Tap node's edge gives none: Note [tapped outputs])."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        n = todo.pop()
        if n is None or n in seen or type(n).__name__ == "_TapBackward":
            continue
        seen.add(n)
        if getattr(n, "variable", None) is param:
            return True
        todo += [m for m, _ in n.next_functions]
    return False


def test_book_keeping_weights_leave_autograd_and_their_hooks_see_the_clipped_gradient():
    """The covered Linear weights are not in the forward's graph (autograd computes no weight gradient for them);
    the clipped gradient reaches each through AccumulateGrad once, at the end of the backward: a tensor hook and a
    post-accumulate-grad hook of the parameter see it, .grad accumulates it over micro-batches, and an optimizer
    step reads it."""
    model = Stack(None).double()
    x = torch.randn(B, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    r = torch.randn(B, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    names, per = per_sample_grads(copy.deepcopy(model), lambda m, x: m(x), x, r)
    norms = torch.stack([torch.stack([g.square().sum() for g in gs]).sum().sqrt() for gs in per])
    c = float(norms.median())
    coef = torch.clamp(c / (norms + 1e-6), max=1.0)
    want = {k: sum(coef[b] * per[b][i] for b in range(B)) for i, k in enumerate(names)}
    psn = hookstats.PerSampleGradNorms(model, max_norm=c)
    params = dict(model.named_parameters())
    hooked, posted = {}, {}
    for k, p in params.items():
        p.register_hook(lambda g, k=k: hooked.setdefault(k, []).append(g.clone()))
        p.register_post_accumulate_grad_hook(lambda p, k=k: posted.setdefault(k, []).append(p.grad.clone()))
    for step in range(2):  # two micro-batches of the same samples: .grad holds twice the clipped sum
        out = model(x)
        deferred = [k for k in names if k.endswith("weight") and not _graph_reaches(out, params[k])]
        assert deferred == ["inp.weight"] + [f"blocks.{i}.{n}.weight" for i in range(3) for n in ("fc", "out")] + [
            "head.weight"]  # the LayerNorm weights and the biases stay in autograd, corrected after
        (out * r).sum().backward()
        for k in names:
            torch.testing.assert_close(params[k].grad, (step + 1) * want[k], rtol=1e-9, atol=1e-15)
            assert len(hooked[k]) == len(posted[k]) == step + 1
            if k in deferred:  # the hooks see the clipped gradient: it is what autograd accumulates
                torch.testing.assert_close(hooked[k][-1], want[k], rtol=1e-9, atol=1e-15)
        psn.step()
    before = params["head.weight"].detach().clone()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    torch.testing.assert_close(params["head.weight"].detach(), before - 0.5 * 2 * want["head.weight"])
    psn.remove()


def test_book_keeping_taps_a_first_layer_on_data():
    """Note [tapped outputs]: a first layer on data without a bias (without the weight its output would need no
    gradient) has its weight deferred too, and its output made to need one by a tap: autograd computes no gradient
    of its parameters, the output stays an ordinary tensor (an in-place ReLU after it, on 2-D and 3-D inputs), and
    the clip is exact. A layer that is not deferred (allow_unclipped=True) keeps autograd's weight gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6, bias=False), nn.ReLU(inplace=True), nn.Linear(6, 3)).double()
    for shape in ((B + 2, 5), (B, 4, 5)):
        x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        clip_check(model, lambda m, x: m(x), x)
        psn = hookstats.PerSampleGradNorms(model, max_norm=1.0)
        out = model(x)
        assert type(out.grad_fn).__name__ != "_TapBackward"
        assert not _graph_reaches(out, model[0].weight) and not _graph_reaches(out, model[2].weight)
        psn.remove()
        # under non-reentrant checkpointing the recompute taps the same layer (the graphs match)
        clip_check(model, lambda m, x: checkpoint(m, x, use_reentrant=False), x, twin_fwd=lambda m, x: m(x))
    # the tap's edge goes to a leaf of hookstats' own: the weight's hooks see one gradient a backward, the clipped one
    seen = []
    model[0].weight.register_hook(lambda g: seen.append(("tensor", g is not None)))
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(("accumulated", p.grad is not None)))
    model.zero_grad(set_to_none=True)
    psn = hookstats.PerSampleGradNorms(model, max_norm=1.0)
    model(x).sum().backward()
    assert seen == [("tensor", True), ("accumulated", True)]
    from hookstats.per_sample.bookkeeping import _ANCHOR
    assert _ANCHOR.grad is None
    psn.remove()
    psn = hookstats.PerSampleGradNorms(model, max_norm=1.0, allow_unclipped=True)
    assert _graph_reaches(model(x), model[0].weight)
    psn.remove()


def test_book_keeping_defers_conv_biases():
    """A conv's bias is deferred with its weight (mkldnn computes the weight gradient whenever the bias's is asked
    for), a first conv on data too (its output tapped, an in-place ReLU after it); grouped and 1-d convs alike: the
    clip is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(4, 6, 3, stride=2, groups=2),
                          nn.Flatten(2), nn.Conv1d(6, 5, 2), nn.Flatten(1), nn.Linear(5 * 5, 2)).double()
    x = torch.randn(B + 2, 3, 7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    clip_check(model, lambda m, x: m(x), x)
    psn = hookstats.PerSampleGradNorms(model, max_norm=1.0)
    out = model(x)
    reached = {k: _graph_reaches(out, p) for k, p in model.named_parameters()}
    assert reached == {"0.weight": False, "0.bias": False, "2.weight": False, "2.bias": False, "4.weight": False,
                       "4.bias": False, "6.weight": False, "6.bias": True}
    psn.remove()


def test_book_keeping_restores_parameters_and_refuses_a_second_backward():
    """The detached alias a deferred call runs with is put back when its forward raises; a second backward through
    the same forward would have no clipped gradient to give (it is computed once per forward): refused."""
    model = Stack(None).double()
    psn = hookstats.PerSampleGradNorms(model, max_norm=1.0)
    w = model.head.weight
    with pytest.raises(RuntimeError):
        model.head(torch.randn(B, 4, 7, dtype=torch.float64, requires_grad=True))  # wrong width: F.linear raises
    assert model.head._parameters["weight"] is w and isinstance(w, nn.Parameter)
    x = torch.randn(B, 4, 5, dtype=torch.float64)
    out = model(x)
    assert model.head._parameters["weight"] is w
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"already backpropagated or cleared by step\(\).*one backward per forward"):
        out.sum().backward()
    psn.remove()


class Same(nn.Module):
    """Three Linear layers of one shape, the middle one called twice: per-sample products of one shape, four a
    backward."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def test_workspace_buffers_are_reused_across_steps_and_never_shared_within_one():
    """Note [workspace]: the per-sample products of the deferred weights go into buffers that the next backward
    reuses; within one backward each term has its own (a layer called twice, layers of the same shape), so the
    clipped gradients stay exact step after step, with batches of different sizes; remove() frees them."""
    torch.manual_seed(0)
    model = Same().double()
    xs = [torch.randn(n, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(n + s))
          for s, n in enumerate((B, B, B + 2, B))]
    clip_check(model, lambda m, x: m(x), lambda step: xs[step], steps=len(xs))
    psn = hookstats.PerSampleGradNorms(model, max_norm=0.1)
    held = []
    for x in xs[:2]:
        model(x).sum().backward()
        held.append(psn._ws.nbytes())
        psn.step()
    assert held[0] == held[1] == 4 * B * 6 * 6 * 8  # the four calls' [B, 6, 6] products, allocated once
    psn.remove()
    assert psn._ws.nbytes() == 0


class TiedLM(nn.Module):
    """Token embedding tied to the LM head, with repeated tokens: the head's per-sample products materialised (the
    clip computes its gradient) and the embedding's rows added into them (Note [tied rows folded])."""

    def __init__(self, v: int = 11, d: int = 8):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, v, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.fc(self.ln(self.emb(idx)))))


@pytest.mark.parametrize("t", [6, 1], ids=["seq", "one_token"])  # Index.sq by the Gram of equal indices
def test_clipping_tied_embedding_and_materialised_head(t, monkeypatch):
    from hookstats.per_sample import core, terms

    torch.manual_seed(0)
    model = TiedLM().double()
    idx = torch.randint(0, 11, (B + 2, t), generator=torch.Generator().manual_seed(3))
    idx[0, :] = 4  # a sample repeating one token
    crossed, folded = [], []
    cross, fold = terms.cross, core.fold_rows
    monkeypatch.setattr(terms, "cross", lambda a, b: crossed.append({type(a), type(b)}) or cross(a, b))
    monkeypatch.setattr(core, "fold_rows", lambda ts: folded.append(len(ts) - len(r := fold(ts))) or r)
    clip_check(model, lambda m, x: m(x), idx)
    if t > 1:  # the rows folded into the materialised head's products: one Dense term, no cross term
        assert folded.count(1) == 2 and not crossed  # once a step
    else:  # one token: Outer.materialize declines, the head's Outer crossed with the rows
        assert not any(folded) and crossed and all(c == {terms.Outer, terms.Index} for c in crossed)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied_head"])
def test_clipping_sparse_embedding(tied):
    """Embedding(sparse=True) under max_norm: its table deferred like the others (Note [book-keeping]), the clipped
    gradient delivered sparse as autograd's own backward gives it (dense when tied to a head, as autograd's sum is),
    equal to the per-sample loop on a dense twin, over two accumulated backwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 4, sparse=True), nn.Tanh(), nn.Linear(4, 11, bias=False)).double()
    if tied:
        model[2].weight = model[0].weight
    twin = copy.deepcopy(model)
    twin[0].sparse = False
    params = dict(model.named_parameters())
    got_before = {k: torch.zeros_like(p) for k, p in params.items()}
    psn = None
    for step in range(2):
        idx = torch.randint(0, 11, (B + 2, 6), generator=torch.Generator().manual_seed(3 + step))
        idx[0, :] = 4  # a sample repeating one token
        r = torch.randn(B + 2, 6, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        names, per = per_sample_grads(twin, lambda m, x: m(x), idx, r)
        norms = torch.stack([torch.stack([g.square().sum() for g in gs]).sum().sqrt() for gs in per])
        c = float(norms.median())
        coef = torch.clamp(c / (norms + 1e-6), max=1.0)
        if psn is None:
            psn = hookstats.PerSampleGradNorms(model, max_norm=c)
        psn.max_norm = c
        (model(idx) * r).sum().backward()
        torch.testing.assert_close(psn.clip_coef(), coef, rtol=1e-9, atol=0)
        for i, k in enumerate(names):
            g = params[k].grad
            assert g.is_sparse == (k == "0.weight" and not tied), k
            g = g.to_dense() if g.is_sparse else g
            want = got_before[k] + sum(coef[b] * per[b][i] for b in range(len(per)))
            torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-14)
            got_before[k] = g.clone()
        psn.step()
    psn.remove()
