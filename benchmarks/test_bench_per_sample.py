"""Per-sample gradient norms of every nn.Linear of a 12-layer GPT-style transformer (n_embd 128, 4 heads, batch 8 x 32
tokens, vocabulary 256), beside the plain training step and beside torch.func per-sample gradients.

Group `per-sample-{device}`:
  plain       forward, cross-entropy, backward (grads set to None after): the training step
  per_sample  the same step with hookstats.PerSampleGradNorms(model, include="*Linear*"), the [B] total norm
              computed on the device each step (no host sync), then .step()
  torch_func  torch.func.vmap(torch.func.grad(...)) per-sample gradients of the same loss (materialised, B copies of
              every gradient), then their norms: what people use today
`test_per_sample_interleaved` times plain and per_sample interleaved step by step and records the median ratio in
extra_info["overhead"] (the README's number), after checking that the hookstats norms equal the torch.func ones.
Smoke mode (--benchmark-disable): 2 layers, batch 2 x 8.
"""
from __future__ import annotations

import math
import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

VOCAB = 256


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, -1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)  # explicit attention: vmap-able
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int = 12, d: int = 128, heads: int = 4, block: int = 32):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[-1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


# The report's tables (benchmarks/report.py reads this literal; targets in benchmarks/targets.json).
REPORT = [
    {"id": "per_sample", "title": "Per-sample gradient norms, one training step", "family": "per_sample",
     "where": "case is not None", "split": ["device"], "rows": ["case"],
     "labels": {"plain": "the training step", "per_sample": "+ `PerSampleGradNorms` (norms and `[B]` total)",
                "torch_func": "`torch.func.vmap(grad(...))` per-sample gradients and their norms"},
     "columns": [["case", "label(case)"], ["ms", "time", "ms"], ["IQR", "iqr", "pct"], ["rounds", "rounds"]],
     "note": "A 12-layer GPT-style transformer, n_embd 128, 4 heads, batch 8 x 32 tokens, vocabulary 256, "
             "cross-entropy; norms of every `nn.Linear` (49 layers, 98 parameters). torch.func's per-sample gradients "
             "come on top of the training step, which they do not replace."},
    {"id": "per_sample_interleaved", "title": "Per-sample gradient norms, interleaved step by step",
     "family": "per_sample", "where": "case is None", "rows": ["device"],
     "columns": [["device", "device"], ["training step ms", "plain_ms / 1e3", "ms"],
                 ["with PerSampleGradNorms ms", "per_sample_ms / 1e3", "ms"], ["ratio", "overhead", "x"]],
     "note": "The same model twice (same weights), one step each in turn, 25 rounds, medians; the norms were first "
             "checked against torch.func's (rtol 1e-4 in float32)."},
]


def setup(device: str, smoke: bool):
    layers, b, t = (2, 2, 8) if smoke else (12, 8, 32)
    torch.manual_seed(0)
    model = GPT(layers=layers, block=t).to(device)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (b, t), generator=g).to(device)
    tgt = torch.randint(0, VOCAB, (b, t), generator=g).to(device)
    return model, idx, tgt


def train_step(model, idx, tgt):
    loss = F.cross_entropy(model(idx).reshape(-1, VOCAB), tgt.reshape(-1))
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return loss


def func_norms(model, idx, tgt):
    """Per-sample gradient norms of every Linear parameter from materialised per-sample gradients."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    n_tokens = idx.numel()

    def loss_one(p, i, y):
        logits = functional_call(model, p, (i.unsqueeze(0),))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum") / n_tokens

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, idx, tgt)
    linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return {k: v.reshape(v.shape[0], -1).norm(dim=1) for k, v in grads.items() if k.rsplit(".", 1)[0] in linear}


@pytest.mark.parametrize("case", ("plain", "per_sample", "torch_func"))
def test_per_sample_step(benchmark, hookstats, device, case):
    model, idx, tgt = setup(device, benchmark.disabled)
    if case == "per_sample":
        psn = hookstats.PerSampleGradNorms(model, include="*Linear*")

        def op():
            train_step(model, idx, tgt)
            psn.total()
            psn.step()
    elif case == "plain":
        def op():
            train_step(model, idx, tgt)
    else:
        def op():
            func_norms(model, idx, tgt)
    fn = op if device == "cpu" else (lambda: (op(), torch.cuda.synchronize()))
    benchmark.group = f"per-sample-{device}"
    benchmark.extra_info.update(family="per_sample", device=device, case=case, batch=tuple(idx.shape),
                                layers=len(model.blocks), torch_threads=torch.get_num_threads())
    rounds = 1 if benchmark.disabled else (5 if case == "torch_func" else 15)
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)


def test_per_sample_interleaved(benchmark, hookstats, device):
    model, idx, tgt = setup(device, benchmark.disabled)
    psn = hookstats.PerSampleGradNorms(model, include="*Linear*")
    # Correctness first: the hookstats norms equal the materialised ones.
    train_step(model, idx, tgt)
    got = psn.per_param()
    psn.step()
    want = func_norms(model, idx, tgt)
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k].double(), rtol=1e-4, atol=1e-7)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    twin, _, _ = setup(device, benchmark.disabled)  # the same weights, no hooks: the plain step
    reps = 2 if benchmark.disabled else 25
    t_plain, t_psn = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        train_step(twin, idx, tgt)
        sync()
        t_plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        train_step(model, idx, tgt)
        psn.total()
        psn.step()
        sync()
        t_psn.append(time.perf_counter() - t0)
    psn.remove()
    plain, with_psn = statistics.median(t_plain), statistics.median(t_psn)
    benchmark.group = f"per-sample-interleaved-{device}"
    benchmark.extra_info.update(family="per_sample", device=device, batch=tuple(idx.shape), layers=len(model.blocks),
                                torch_threads=torch.get_num_threads(), plain_ms=plain * 1e3,
                                per_sample_ms=with_psn * 1e3, overhead=with_psn / plain)
    benchmark.pedantic(lambda: train_step(model, idx, tgt), rounds=1, iterations=1)
