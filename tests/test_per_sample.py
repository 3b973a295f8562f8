"""hookstats.PerSampleGradNorms against per-sample gradients materialised by torch.func.vmap(torch.func.grad(...)),
in float64, for each layer type, with and without a sequence dimension."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import hookstats
from _testing import DEVICES


def reference_norms(model: nn.Module, x: torch.Tensor, r: torch.Tensor, batch_dim: int = 0):
    """Per-sample gradient norms of loss = sum_b <model(x)_b, r_b>, per parameter, from materialised per-sample
    gradients."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def loss(p, xb, rb):
        out = functional_call(model, p, (xb.unsqueeze(batch_dim),))
        return (out * rb.unsqueeze(batch_dim)).sum()

    g = vmap(grad(loss), in_dims=(None, batch_dim, batch_dim))(params, x, r)
    return {k: v.reshape(v.shape[0], -1).norm(dim=1) for k, v in g.items()}


def run(model, x, batch_dim=0, seed=0):
    """model(x) and a seeded random cotangent r of its shape: the loss is sum(out * r)."""
    out = model(x)
    r = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed)).to(out.device)
    return out, r


def check_model(model: nn.Module, x: torch.Tensor, batch_dim: int = 0, rtol: float = 1e-9):
    model = model.to(torch.float64)
    psn = hookstats.PerSampleGradNorms(model, batch_dim=batch_dim)
    out, r = run(model, x, batch_dim)
    (out * r).sum().backward()
    want = reference_norms(model, x, r, batch_dim)
    got = psn.per_param()
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == torch.float64 and got[k].device == x.device
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=1e-12, msg=lambda m: f"{k}: {m}")
    # per layer: weight and bias together; total: every layer together
    for layer, v in psn.per_layer().items():
        keys = [k for k in want if k.rsplit(".", 1)[0] == layer or (layer == "" and "." not in k)]
        torch.testing.assert_close(v, torch.stack([want[k] for k in keys]).square().sum(0).sqrt(), rtol=rtol, atol=1e-12)
    torch.testing.assert_close(psn.total(), torch.stack(list(want.values())).square().sum(0).sqrt(), rtol=rtol,
                               atol=1e-12)
    psn.remove()
    return psn, want


def f64(*shape, seed=0, device="cpu"):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,io", [((6, 16), (16, 12)), ((4, 3, 16), (16, 12)), ((4, 9, 5), (5, 3)),
                                      ((3, 2, 4, 7), (7, 6)), ((5, 1, 8), (8, 4))],
                         ids=["2d", "seq_gram", "seq_direct", "two_token_dims", "seq_one"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(device, shape, io, bias):
    torch.manual_seed(0)
    check_model(nn.Linear(*io, bias=bias).to(device), f64(*shape, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_linear_batch_dim_1(device):
    torch.manual_seed(0)
    check_model(nn.Linear(6, 5).to(device), f64(7, 4, 6, device=device), batch_dim=1)  # [T, B, in]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", [dict(), dict(stride=2, padding=1), dict(dilation=2, padding="same"),
                                dict(groups=2, bias=False), dict(padding=2, padding_mode="reflect")],
                         ids=["plain", "stride_pad", "dilation_same", "groups", "reflect"])
def test_conv1d(device, kw):
    torch.manual_seed(0)
    check_model(nn.Conv1d(4, 6, 3, **kw).to(device), f64(5, 4, 11, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", [dict(), dict(stride=(2, 1), padding=(1, 0)), dict(dilation=2, padding="same"),
                                dict(groups=3, bias=False), dict(padding=1, padding_mode="circular"),
                                dict(kernel_size=1)],
                         ids=["plain", "stride_pad", "dilation_same", "groups", "circular", "pointwise"])
def test_conv2d(device, kw):
    torch.manual_seed(0)
    kw = {"kernel_size": 3, **kw}
    check_model(nn.Conv2d(3, 6, **kw).to(device), f64(4, 3, 7, 6, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_conv2d_large_gram(device):
    """Few output positions and many weights: the Gram-matrix branch (L^2 < C_in k * out)."""
    torch.manual_seed(0)
    check_model(nn.Conv2d(8, 16, 3, stride=2).to(device), f64(3, 8, 7, 7, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("shape", [(6,), (5, 9), (3, 4, 5)], ids=["no_seq", "seq", "two_token_dims"])
@pytest.mark.parametrize("dim", [5, 16], ids=["narrow", "wide"])
def test_embedding(device, padding_idx, shape, dim):
    """Both ways of Index.sq: the sort (rows longer than min(64, dim)) and the Gram of equal indices (short rows:
    "wide" with 9 tokens, and one token)."""
    torch.manual_seed(0)
    emb = nn.Embedding(7, dim, padding_idx=padding_idx).to(device)
    idx = torch.randint(0, 7, shape, generator=torch.Generator().manual_seed(1)).to(device)
    idx.view(-1)[:3] = 2  # repeated tokens (and the padding token) in sample 0
    psn, want = check_model(emb, idx)
    if padding_idx is None:
        assert (want["weight"] > 0).all()
    elif len(shape) == 1:
        assert (want["weight"][:3] == 0).all()  # samples holding only the padding token


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ns,shape", [(8, (5, 8)), (8, (4, 3, 8)), ((3, 8), (4, 3, 8))],
                         ids=["no_seq", "seq", "two_dims"])
@pytest.mark.parametrize("bias", [True, False])
def test_layernorm(device, ns, shape, bias):
    torch.manual_seed(0)
    ln = nn.LayerNorm(ns, bias=bias).to(device)
    with torch.no_grad():  # affine parameters away from their initial 1 / 0
        ln.weight.add_(torch.randn(ln.weight.shape, dtype=ln.weight.dtype).to(device))
    check_model(ln, f64(*shape, device=device) * 3 + 1)


class _Ckpt(nn.Module):
    """Runs its module under non-reentrant activation checkpointing."""

    def __init__(self, mod: nn.Module):
        super().__init__()
        self.mod = mod

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.mod, x, use_reentrant=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["group_norm", "layer_norm"])
def test_norm_terms_from_saved_statistics(device, kind):
    """Note [saved norm statistics]: the GroupNorm / LayerNorm weight terms use the mean and rstd autograd saved
    (the kept value carries them), exact against the per-sample gradients; under non-reentrant checkpointing (a
    saved-tensor hook active) the input is normalised again, with the same norms, and no saved tensor is unpacked
    twice."""
    torch.manual_seed(0)
    norm = nn.GroupNorm(2, 4) if kind == "group_norm" else nn.LayerNorm(6)
    with torch.no_grad():
        norm.weight.add_(torch.randn(norm.weight.shape, dtype=norm.weight.dtype))
    x = f64(5, 4, 3, 6, device=device) * 3 + 1  # a mean far from 0: the statistics matter
    model = nn.Sequential(nn.Linear(6, 6), norm).double().to(device)
    psn = hookstats.PerSampleGradNorms(model)
    model(x)
    assert isinstance(psn._pending["1"][0].kept, tuple)  # (input, mean, rstd)
    psn.remove()
    model.zero_grad()
    _, want = check_model(model, x)
    ckpt = nn.Sequential(model[0], _Ckpt(model[1]))
    psn = hookstats.PerSampleGradNorms(ckpt)
    out, r = run(ckpt, x)
    assert isinstance(psn._pending["1.mod"][0].kept, torch.Tensor)
    (out * r).sum().backward()
    got = psn.per_param()
    for k, v in want.items():
        torch.testing.assert_close(got[k.replace("1.", "1.mod.")], v, rtol=1e-9, atol=1e-12)
    psn.remove()


class Tiny(nn.Module):
    """Embedding -> LayerNorm -> Linear -> GELU -> shared Linear used twice -> head: the kinds together, and a module
    called twice in one forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, idx):
        h = torch.nn.functional.gelu(self.fc(self.ln(self.emb(idx))))
        h = self.shared(torch.tanh(self.shared(h)))
        return self.head(h)


@pytest.mark.parametrize("device", DEVICES)
def test_model_with_shared_layer(device):
    idx = torch.randint(0, 11, (5, 6), generator=torch.Generator().manual_seed(2)).to(device)
    check_model(Tiny().to(device), idx)


def test_gradient_accumulation_appends_samples():
    model = Tiny().double()
    psn = hookstats.PerSampleGradNorms(model)
    gen = torch.Generator().manual_seed(3)
    idxs = [torch.randint(0, 11, (b, 4), generator=gen) for b in (3, 5)]
    wants = []
    for i, idx in enumerate(idxs):
        out, r = run(model, idx, seed=i)
        (out * r).sum().backward()
        wants.append(reference_norms(model, idx, r))
    assert psn.samples == 8
    got = psn.per_param()
    for k in got:
        torch.testing.assert_close(got[k], torch.cat([w[k] for w in wants]), rtol=1e-9, atol=1e-12)
    psn.step()
    assert psn.samples == 0 and psn.per_layer() == {}
    with pytest.raises(RuntimeError, match="no per-sample gradient since the last step"):
        psn.total()


def test_frozen_and_include():
    model = Tiny().double()
    model.fc.bias.requires_grad_(False)
    model.emb.weight.requires_grad_(False)
    psn = hookstats.PerSampleGradNorms(model, include=("fc", "*LayerNorm*"), exclude="head")
    assert psn.layers == ["ln", "fc"]
    idx = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(4))
    out, r = run(model, idx)
    (out * r).sum().backward()
    want = reference_norms(model, idx, r)
    got = psn.per_param()
    assert sorted(got) == ["fc.weight", "ln.bias", "ln.weight"]
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12)


def test_no_grad_forward_records_nothing():
    model = Tiny().double()
    psn = hookstats.PerSampleGradNorms(model)
    idx = torch.randint(0, 11, (4, 3))
    with torch.no_grad():
        model(idx)
    assert psn._pending == {} and psn.samples == 0


def test_top_samples_and_first_nonfinite():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    psn = hookstats.PerSampleGradNorms(model)
    x = torch.randn(10, 6)
    x[7] *= 50.0  # one sample with a huge gradient
    nn.functional.mse_loss(model(x), torch.zeros(10, 2)).backward()
    top = psn.top_samples(3)
    assert top[0][0] == 7 and top[0][1] > top[1][1] > top[2][1]
    tot = psn.total()
    assert math.isclose(top[0][1], float(tot[7]), rel_tol=1e-12)
    assert psn.first_nonfinite_sample() is None
    psn.step()
    x[3, 2] = float("nan")
    model.zero_grad()
    nn.functional.mse_loss(model(x), torch.zeros(10, 2)).backward()
    bad = psn.first_nonfinite_sample()
    assert bad["sample"] == 3 and bad["layers"] == ["0", "2"] and math.isnan(bad["norm"])
    finite = torch.isfinite(psn.total())
    assert finite.sum() == 9  # the other samples' norms stay finite although every .grad is NaN
    assert psn.top_samples(1)[0][0] == 3  # NaN ranks first
    psn.remove()
    model(x).sum().backward()
    assert psn.samples == 0


def test_errors():
    with pytest.raises(ValueError, match="no Linear"):
        hookstats.PerSampleGradNorms(nn.ReLU())
    with pytest.raises(NotImplementedError, match="scale_grad_by_freq"):
        hookstats.PerSampleGradNorms(nn.Embedding(4, 3, scale_grad_by_freq=True))
    with pytest.raises(ValueError, match="batch_dim"):
        hookstats.PerSampleGradNorms(nn.Linear(2, 2), batch_dim=-1)


def test_float32_and_bfloat16_models():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(6, 5, 8)
    ref_model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    ref_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    r = torch.randn(6, 5, 4)
    want = reference_norms(ref_model, x.double(), r.double())
    for dt, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        m = model.to(dt)
        psn = hookstats.PerSampleGradNorms(m)
        (m(x.to(dt)) * r.to(dt)).sum().backward()
        got = psn.per_param()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=1e-3 * float(want[k].max()))
        psn.remove()
        m.zero_grad()


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1, groups=1)
        self.conv2 = nn.Conv1d(4, 6, 3, groups=2)
        self.fc = nn.Linear(6 * 6, 2)

    def forward(self, x):
        h = torch.tanh(self.conv(x))  # [B, 4, 8, 8]
        h = self.conv2(h.mean(2))  # [B, 6, 6]
        return self.fc(h.flatten(1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["tiny", "conv"])
def test_per_sample_clipping(device, name):
    """max_norm=C: after backward, .grad == sum_b min(1, C / (||g_b|| + eps)) g_b, with g_b the materialised
    per-sample gradients over the hooked layers; the reported norms stay the unclipped ones."""
    if name == "tiny":
        model = Tiny().double().to(device)
        x = torch.randint(0, 11, (6, 5), generator=torch.Generator().manual_seed(5)).to(device)
    else:
        model = ConvNet().double().to(device)
        x = f64(6, 3, 8, 8, seed=5, device=device)
    out, r = run(model, x, seed=6)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xb, rb):
        return (functional_call(model, p, (xb.unsqueeze(0),)) * rb.unsqueeze(0)).sum()

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, r)
    norms = torch.stack([v.reshape(v.shape[0], -1).square().sum(1) for v in g.values()]).sum(0).sqrt()
    max_norm = float(norms.median())
    coef = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    assert (coef < 1).any() and (coef == 1).any()
    psn = hookstats.PerSampleGradNorms(model, max_norm=max_norm)
    for p in model.parameters():  # an earlier micro-batch's gradient stays as it was
        p.grad = torch.ones_like(p)
    (model(x) * r).sum().backward()
    for k, p in model.named_parameters():
        want = 1 + (g[k] * coef.reshape(-1, *[1] * (g[k].dim() - 1))).sum(0)
        torch.testing.assert_close(p.grad, want, rtol=1e-9, atol=1e-12, msg=lambda m: f"{k}: {m}")
    torch.testing.assert_close(psn.total(), norms, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(psn.clip_coef(), coef, rtol=1e-9, atol=1e-12)
    psn.remove()


def test_clipping_errors():
    with pytest.raises(ValueError, match="max_norm"):
        hookstats.PerSampleGradNorms(nn.Linear(2, 2), max_norm=-1.0)
    psn = hookstats.PerSampleGradNorms(nn.Linear(2, 2), max_norm=1.0)
    with pytest.raises(RuntimeError, match="no clipped backward"):
        psn.clip_coef()


class SeqFirst(nn.Module):
    """[T, B] token ids -> Embedding -> LayerNorm -> Linear -> in-place ReLU -> Linear: sequence-first inputs, and a
    Linear output modified in place (the tensor hook sees the gradient of the value before the in-place op)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(9, 6)
        self.ln = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 7)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(7, 3)

    def forward(self, idx):
        return self.head(self.act(self.fc(self.ln(self.emb(idx)))))


@pytest.mark.parametrize("device", DEVICES)
def test_sequence_first_and_inplace(device):
    idx = torch.randint(0, 9, (5, 4), generator=torch.Generator().manual_seed(7)).to(device)  # [T=5, B=4]
    check_model(SeqFirst().to(device), idx, batch_dim=1)
