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


# ---------------------------------------------------------------------------------------------------------------
# Against Opacus, on a small CNN and a small transformer with tied weights (issue #23)
#
# `test_per_sample_vs_opacus[cnn|tied]` times, interleaved step by step, one thread:
#   plain          forward, loss, backward (the training step)
#   hookstats      the same with PerSampleGradNorms(model) on every layer with a rule, [B] total each step
#   hookstats_clip PerSampleGradNorms(model, max_norm=C): per-sample clipped .grad, one backward
#   opacus         opacus GradSampleModule (per-sample gradients, grad_sample) and their [B] total norm
#   opacus_ghost   opacus GradSampleModuleFastGradientClipping (ghost clipping): norms in a first backward, the
#                  clipped gradient by a second one (Opacus's DPTensorFastGradientClipping.backward); Opacus 1.6
#                  refuses tied parameters there (extra_info["opacus_ghost_refused"] says so)
# and records each median (31 rounds after 3 of warm-up, the cases' order rotated from round to round) and its ratio to
# plain in extra_info (overhead_<case>). The [B] totals of hookstats and
# Opacus's GradSampleModule are checked equal first (Opacus sums a tied parameter's uses too). On the CPU it also
# records each case's minor page faults a step (faults_<case>): the C allocator hands large freed blocks back to the
# system and faults them in again, which can take a third of the plain CNN step, and how often it does depends on what
# the other cases allocated; ratios taken with very different fault counts are not comparable. It records too each
# case's ratio of the thread's CPU time a step (cpu_overhead_<case>, time.thread_time): on a machine shared with other
# processes, the wall-clock ratio counts the time the step waited for a core, the CPU-time one does not. On the CPU the
# whole comparison runs a second time in a fresh process whose allocator keeps freed memory (keep_freed_<field>): no
# page faults, so those ratios are each case's own arithmetic and Python, and do not move with the cases' order (the
# plain CNN step took 5.6-11.9 ms with the default allocator, 300-3,100 faults a step, depending on what ran before).

class SmallCNN(nn.Module):
    def __init__(self, c: int = 16, classes: int = 10):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(3, c, 3, padding=1), nn.GroupNorm(4, c)
        self.c2, self.n2 = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.GroupNorm(4, 2 * c)
        self.c3 = nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1)
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, x):
        h = F.relu(self.n1(self.c1(x)))
        h = F.relu(self.n2(self.c2(h)))
        return self.fc(F.relu(self.c3(h)).mean((2, 3)))


class TiedGPT(GPT):
    """GPT with its LM head tied to the token embedding and positions fed as [B, T] ids (Opacus needs a batch dim on
    every layer input)."""

    def __init__(self, layers: int, d: int, block: int):
        super().__init__(layers=layers, d=d, heads=4, block=block)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[-1], device=idx.device).expand(idx.shape[0], -1)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def small_setup(name: str, device: str, smoke: bool):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "cnn":
        b = 4 if smoke else 32
        model = SmallCNN().to(device)
        x = torch.randn(b, 3, 32, 32, generator=g).to(device)
        y = torch.randint(0, 10, (b,), generator=g).to(device)
        per_sample_loss = lambda m: F.cross_entropy(m(x), y, reduction="none")  # noqa: E731
    else:
        b, t = (2, 8) if smoke else (16, 32)
        model = TiedGPT(layers=1 if smoke else 2, d=64, block=t).to(device)
        x = torch.randint(0, VOCAB, (b, t), generator=g).to(device)
        y = torch.randint(0, VOCAB, (b, t), generator=g).to(device)
        per_sample_loss = lambda m: F.cross_entropy(  # noqa: E731
            m(x).reshape(-1, VOCAB), y.reshape(-1), reduction="none").reshape(b, t).mean(1)
    return model, per_sample_loss, b


def vs_opacus(hookstats, name: str, device: str, smoke: bool) -> dict:
    """Times plain / hookstats / hookstats_clip / opacus / opacus_ghost interleaved, one thread (see above); returns
    the extra_info fields, and the hookstats step to hand to pytest-benchmark under "_ours"."""
    import copy
    import warnings

    from _benching import interleaved_timer, minor_faults

    import opacus
    from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, per_sample_loss, b = small_setup(name, device, smoke)
        max_norm = 0.1
        m_plain, m_clip, m_op, m_ghost = (copy.deepcopy(model) for _ in range(4))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus's notes on its own hooks
            psn = hookstats.PerSampleGradNorms(model)
            psn_clip = hookstats.PerSampleGradNorms(m_clip, max_norm=max_norm)
            gsm = GradSampleModule(m_op, loss_reduction="mean")
            ghost = GradSampleModuleFastGradientClipping(m_ghost, loss_reduction="mean", max_grad_norm=max_norm,
                                                         use_ghost_clipping=True)

        def plain():
            per_sample_loss(m_plain).mean().backward()
            for p in m_plain.parameters():
                p.grad = None

        def ours():
            per_sample_loss(model).mean().backward()
            psn.total()
            psn.step()
            for p in model.parameters():
                p.grad = None

        def ours_clip():
            per_sample_loss(m_clip).mean().backward()
            psn_clip.step()
            for p in m_clip.parameters():
                p.grad = None

        def op_norms():
            per_sample_loss(gsm).mean().backward()
            total = torch.stack([p.grad_sample.reshape(b, -1).square().sum(1) for p in m_op.parameters()]).sum(0)
            for p in m_op.parameters():
                p.grad = None
                p.grad_sample = None
            return total.sqrt()

        def op_ghost():
            loss = per_sample_loss(ghost)
            loss.mean().backward(retain_graph=True)
            for p in m_ghost.parameters():
                p.grad = None
            coeff = ghost.get_clipping_coef()
            ghost.disable_hooks()
            (coeff * loss).sum().backward()
            ghost.enable_hooks()
            for p in m_ghost.parameters():
                p.grad = None

        # the same per-sample norms (Opacus with loss_reduction="mean" reports B times hookstats' contribution)
        per_sample_loss(model).mean().backward()
        ours_total = psn.total() * b
        psn.step()
        model.zero_grad()
        torch.testing.assert_close(ours_total, op_norms().double(), rtol=1e-4, atol=1e-6)

        ghost_refused = None
        try:
            op_ghost()
        except NotImplementedError as e:  # Opacus 1.6: "Parameter tying is not supported with Ghost Clipping"
            ghost, ghost_refused = None, str(e)
        fns = {"plain": plain, "hookstats": ours, "hookstats_clip": ours_clip, "opacus": op_norms}
        if ghost is not None:
            fns["opacus_ghost"] = op_ghost
        faults = {case: 0 for case in fns}
        cpu = {case: [] for case in fns}  # the thread's CPU seconds a step: what another process's load leaves out
        if device == "cpu":
            def counted(case, fn):
                def run():
                    f0, c0 = minor_faults(), time.thread_time()
                    fn()
                    cpu[case].append(time.thread_time() - c0)
                    if f0 is not None:
                        faults[case] += minor_faults() - f0
                return run
            fns = {case: counted(case, fn) for case, fn in fns.items()}
        times, timed = interleaved_timer(fns, device)
        reps = 1 if smoke else 31
        for _ in range(1 if smoke else 3):  # warm-up: buffers kept between steps, the allocator's pools, lazily
            for case in fns:                # built state
                fns[case]()
        faults.update(dict.fromkeys(faults, 0))  # the timed steps only
        for v in cpu.values():
            v.clear()
        order = list(fns)
        for r in range(reps):  # each case in each position in turn: no case always follows the same other case
            for case in order[r % len(order):] + order[:r % len(order)]:
                timed(case)
        med = {case: statistics.median(v) for case, v in times.items()}
        info = dict(family="per_sample", device=device, model=name, batch=b, torch_threads=1,
                    opacus=opacus.__version__, opacus_ghost_refused=ghost_refused,
                    **{f"{c}_ms": v * 1e3 for c, v in med.items()},
                    **{f"overhead_{c}": v / med["plain"] for c, v in med.items() if c != "plain"},
                    **({f"cpu_overhead_{c}": statistics.median(v) / statistics.median(cpu["plain"])
                        for c, v in cpu.items() if c != "plain"} if device == "cpu" else {}),
                    **({f"faults_{c}": n / reps for c, n in faults.items()}
                       if minor_faults() is not None and device == "cpu" else {}))
        ours()
        psn.remove()
        psn_clip.remove()
        return info
    finally:
        torch.set_num_threads(threads)


def vs_opacus_keeping_freed(name: str, device: str, smoke: bool) -> dict:
    """vs_opacus in a fresh Python process whose C allocator keeps freed memory (_benching.KEEP_FREED)."""
    from _benching import run_keeping_freed

    return run_keeping_freed(__file__, name, device, "smoke" if smoke else "timed")


@pytest.mark.parametrize("name", ["cnn", "tied"])
def test_per_sample_vs_opacus(benchmark, hookstats, device, name):
    """The comparison twice: in this process (glibc's default allocator, which hands large freed blocks back to the
    system, so that steps fault their memory in again as often as the other cases' allocations make it do; the
    faults_<case> fields count them), and in a fresh process whose allocator keeps freed memory (the same fields
    prefixed with keep_freed_: each case's own arithmetic and Python, with no page faults). The first is what a
    default CPU setup sees; the second does not move with the order the cases run in."""
    pytest.importorskip("opacus")
    info = vs_opacus(hookstats, name, device, benchmark.disabled)
    if device == "cpu":
        kept = vs_opacus_keeping_freed(name, device, benchmark.disabled)
        info.update({f"keep_freed_{k}": v for k, v in kept.items()
                     if k.endswith("_ms") or k.startswith(("overhead_", "cpu_overhead_", "faults_"))})
    benchmark.group = f"per-sample-opacus-{device}"
    benchmark.extra_info.update(info)
    model, per_sample_loss, _ = small_setup(name, device, True)
    psn = hookstats.PerSampleGradNorms(model, max_norm=0.1)

    def clipped_step():
        per_sample_loss(model).mean().backward()
        psn.step()
        model.zero_grad(set_to_none=True)
    benchmark.pedantic(clipped_step, rounds=1, iterations=1)
    psn.remove()


if __name__ == "__main__":  # vs_opacus_keeping_freed's worker: prints the fields as one JSON line
    import json
    import sys

    import hookstats as _hs

    _name, _device, _mode = sys.argv[1:4]
    print(json.dumps(vs_opacus(_hs, _name, _device, _mode == "smoke")))
