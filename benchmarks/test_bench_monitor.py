"""hookstats.Monitor against plain-PyTorch hooks collecting the same statistics, and against no hooks, in one run.

Groups, each holding the Monitor cases beside the PyTorch way on the same model and data:
  monitor-step-transformer-{device}   one training step of nn.TransformerEncoder (d_model 256, 4 layers, 4 heads,
                                      feed-forward 1024, dropout 0, batch_first; 8 x 128 tokens; SGD lr 1e-3, MSE
                                      against a fixed random target): 42 modules, 37 of them called (74 hook
                                      calls, 74 tensors recorded a step)
  monitor-step-deep1000-{device}      the same step for nn.Sequential of 500 x (Linear(16, 16), ReLU): 1,001
                                      modules, batch 4; the per-hook cost dominates, the kernels are tiny
    none           no hooks
    empty_hooks    the hooks of the other cases, doing nothing: what PyTorch's hook machinery costs by itself (a
                   full backward pre-hook wraps every module's inputs and outputs in autograd Functions)
    torch_hooks    a forward hook and a full backward pre-hook on every module (model.modules(), the root included)
                   computing, for every floating tensor of the output / grad_output, vector_norm, aminmax, isnan().sum()
                   and torch.histc(64 bins over HIST_RANGE): results kept on the device in a list (no .item()), the
                   list cleared each step
    monitor_hist   hookstats.Monitor(model, kinds=("forward", "backward_pre"), histogram=(64, HIST_RANGE)): all 13
                   statistics and the same histogram, with mon.step() every step and mon.flush() every FLUSH_EVERY
    monitor        the same Monitor without a histogram (statistics only)
    none_after     no hooks again, last: the machine's speed drifts by ~10% over a minute here, so the report's
                   baseline is the mean of the two no-hooks medians, which bracket the other cases
  monitor-hook-{device}               one forward of Linear(4, 4) on a 1 x 4 input with one forward hook: the cost of
                                      a hook call on a tiny tensor
    none / empty (a Python hook that returns None) / record (hookstats.record().forward) / record_hist (with the
    histogram) / torch_hooks (the torch_hooks statistics above, list cleared each call)

Note [flush cost]
~~~~~~~~~~~~~~~~~
The Monitor cases flush inside the timed step, every FLUSH_EVERY-th call, as a training loop that logs every
FLUSH_EVERY steps does. The flush is the one host copy of the buffers plus building the record dicts; the median
step time leaves its rounds out (one in FLUSH_EVERY), so each flush is also timed on its own and its median goes into
extra_info["flush_s"]. The report counts it in: a Monitor step costs median step + flush_s / FLUSH_EVERY, and that is
the time its ratio to `none` uses.

Before timing, each step group runs one step with the torch_hooks and the Monitor on the same model and checks
that both saw the same tensors: the Monitor's norm, min, max, NaN count and in-range histogram against PyTorch's, so
a Monitor that records less (or nothing) cannot post a fast time. The step groups plan their rounds from a time
budget (STEP_BUDGET_S), at least STEP_MIN_ROUNDS so that at least two flushes fall in the timed rounds. No timing is
asserted here: the speed targets live in `benchmarks/targets.json`, the tables in REPORT below.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import pytest
import torch
from _benching import SEED, synced
from torch import nn

FLUSH_EVERY = 10


STEP_LABELS = {
    "none": "no hooks (timed first)", "none_after": "no hooks, again (timed last)",
    "empty_hooks": "empty Python hooks (PyTorch's hook machinery)",
    "torch_hooks": "plain-PyTorch hooks: norm, aminmax, NaN count, 64-bin `histc`",
    "monitor_hist": "`hookstats.Monitor` + 64-bin histogram", "monitor": "`hookstats.Monitor`, statistics only",
    "empty": "empty Python hook", "record": "`hookstats.record().forward`",
    "record_hist": "`hookstats.record(histogram=64 bins).forward`"}
# The report's tables (benchmarks/report.py reads this literal; targets in benchmarks/targets.json).
REPORT = [
    {"id": "monitor_step", "title": "hookstats.Monitor, one training step", "family": "monitor",
     "where": "bench == 'step'", "split": ["device", "model_desc"], "rows": ["case"], "labels": STEP_LABELS,
     "define": [["total", "time + (flush_s / flush_every if flush_s else 0)"],
                ["ratio", "total / mean([at(case='none').total, at(case='none_after').total])"]],
     "columns": [["case", "label(case)"], ["step ms", "time", "ms"], ["IQR", "iqr", "pct"],
                 ["flush ms", "flush_s", "ms"], ["step + flush share ms", "total", "ms"], ["vs no hooks", "ratio", "x"],
                 ["µs per recorded tensor", "(ratio - 1) * mean([at(case='none').total, at(case='none_after').total]) / records_per_step if case[:4] != 'none' else None", "us"]],
     "note": "Medians of single steps (forward, MSE loss, backward, SGD step); the Monitor cases flush inside the "
             "timed step every 10th call, and that flush's share is counted in (Note [flush cost]). vs no hooks: "
             "against the mean of the two no-hooks rows, timed first and last so that they bracket the others."},
    {"id": "monitor_hook", "title": "One hook call on a tiny tensor (Linear(4, 4), a 1 x 4 input)", "family": "monitor",
     "where": "bench == 'hook'", "split": ["device"], "rows": ["case"], "labels": STEP_LABELS,
     "columns": [["hook", "label(case)"], ["µs a forward", "time", "us"], ["IQR", "iqr", "pct"],
                 ["hook cost µs", "time - at(case='none').time if case != 'none' else None", "us"]]},
]


def monitored_step(step, mon, flush_s: list):
    """step() then mon.step(), with a flush every FLUSH_EVERY calls, timed into flush_s (Note [flush cost])."""
    calls = [0]

    def op():
        step()
        mon.step()
        calls[0] += 1
        if calls[0] % FLUSH_EVERY == 0:
            t0 = time.perf_counter()
            mon.flush()
            flush_s.append(time.perf_counter() - t0)

    return op
HIST_BINS, HIST_RANGE = 64, (-4.0, 4.0)  # a fixed range: histc with min=max=0 would read the data's range (2 passes)

STEP_CASES = ("none", "empty_hooks", "torch_hooks", "monitor_hist", "monitor", "none_after")
HOOK_CASES = ("none", "empty", "record", "record_hist", "torch_hooks")
# Seconds of timed steps per case, and the bounds in rounds (one step a round). A transformer step is ~0.3 s on
# a 2-core CPU (~0.7 s with torch_hooks): its group takes ~80 s; the deep model's ~40 s (20 rounds of 0.25-0.5 s).
STEP_BUDGET_S = {"transformer": 10.0, "deep1000": 3.0}
STEP_MIN_ROUNDS, STEP_MAX_ROUNDS = 2 * FLUSH_EVERY, 200


# ---------------------------------------------------------------------------------------------------------------
# Models and the training step


def make_transformer() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)  # the nested path is eval only
    return model, torch.randn(8, 128, 256), torch.randn(8, 128, 256)


def make_deep1000() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = nn.Sequential(*[m for _ in range(500) for m in (nn.Linear(16, 16), nn.ReLU())])
    # Near-identity weights on a positive input keep activations and grads O(1) through 500 layers; the default
    # init shrinks them to ~1e-20 (grads) or less, whose squares are float32 subnormals: slow, and not a real model.
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.weight.copy_(torch.eye(16) + 0.01 * torch.randn(16, 16))
                m.bias.zero_()
    return model, torch.rand(4, 16) + 0.5, torch.randn(4, 16)


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]]] = {
    "transformer": make_transformer,
    "deep1000": make_deep1000,
}
MODEL_DESC = {
    "transformer": "nn.TransformerEncoder, d_model 256, 4 layers, 4 heads, ff 1024, batch 8 x 128, SGD",
    "deep1000": "nn.Sequential of 500 x (Linear(16, 16), ReLU), batch 4, SGD",
}


class TrainStep:
    """One SGD step (lr 1e-3) of `model` on a fixed input and a fixed random target, MSE loss. Every case of a group
    builds the same model from the same seed."""

    def __init__(self, name: str, device: str):
        torch.manual_seed(SEED)
        model, x, target = MODELS[name]()
        self.model = model.to(device)
        self.x, self.target = x.to(device), target.to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def __call__(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(self.x), self.target)
        loss.backward()
        self.opt.step()


# ---------------------------------------------------------------------------------------------------------------
# The PyTorch way


def tensors_of(obj, out: list) -> list:
    """The tensors of a hook argument (a tensor, or tuples / lists / dicts of them), depth first, as Monitor sees
    them; None entries (nn.MultiheadAttention's weights, a grad_output that does not exist) are left out."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            tensors_of(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            tensors_of(o, out)
    return out


class TorchStatsHooks:
    """The torch_hooks case: on every module a forward hook (outputs) and a full backward pre-hook (grad_output)
    computing, per floating tensor, what people monitor: L2 norm, min and max (one aminmax), NaN count and a
    fixed-range histc. Results stay on the device in `results` (no .item(), so no sync), which the caller clears."""

    def __init__(self, modules, in_float64: bool = False):
        self.in_float64 = in_float64  # check_monitor's reference: norm and histc of the float64 values
        self.results: list[tuple[torch.Tensor, ...]] = []
        self.handles = []
        for mod in modules:
            self.handles.append(mod.register_forward_hook(self.forward))
            self.handles.append(mod.register_full_backward_pre_hook(self.backward_pre))

    def _record(self, obj) -> None:
        for t in tensors_of(obj, []):
            if t.is_floating_point():
                x = t.detach().double() if self.in_float64 else t.detach()
                mn, mx = torch.aminmax(x)
                self.results.append((torch.linalg.vector_norm(x), mn, mx, torch.isnan(x).sum(),
                                     torch.histc(x, HIST_BINS, *HIST_RANGE)))

    def forward(self, module, args, output) -> None:
        self._record(output)

    def backward_pre(self, module, grad_output) -> None:
        self._record(grad_output)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def make_monitor(hookstats, model: nn.Module, histogram: bool):
    return hookstats.Monitor(model, kinds=("forward", "backward_pre"),
                             histogram=(HIST_BINS, HIST_RANGE) if histogram else None)


@functools.lru_cache(maxsize=None)
def check_monitor(hookstats, name: str, device: str) -> dict:
    """One step with TorchStatsHooks and a Monitor (with the histogram) on the same model: both must have seen the
    same tensors, and the Monitor's norm, min, max, NaN count and in-range histogram must match PyTorch's. Returns
    the step's shape for extra_info: modules, hook_calls, records_per_step."""
    step = TrainStep(name, device)
    modules = list(step.model.modules())
    calls = [0]

    def count(*args):
        calls[0] += 1

    counters = [h for m in modules for h in (m.register_forward_hook(count), m.register_full_backward_pre_hook(count))]
    ref = TorchStatsHooks(modules, in_float64=True)
    mon = make_monitor(hookstats, step.model, histogram=True)
    step()
    recs = mon.records()
    mon.detach()
    ref.remove()
    for h in counters:
        h.remove()
    assert len(recs) == len(ref.results) > 0, (len(recs), len(ref.results))
    for rec, (l2, mn, mx, nan, hist) in zip(recs, ref.results):
        s, where = rec["stats"], (rec["module"], rec["kind"], rec["index"])
        l2 = l2.item()
        assert abs(s["l2"] - l2) <= 1e-6 * l2, (where, s["l2"], l2)
        assert (s["min"], s["max"], s["nan_count"]) == (mn.item(), mx.item(), nan.item()), where
        # In-range bins, against histc of the float64 values: hookstats bins as histc does in float64 (in float32,
        # x - lo rounds: grads of ~1e-7 around 0 land on the wrong side of the middle edge, thousands of them).
        assert rec["histogram"][:HIST_BINS] == hist.long().tolist(), where
    return {"modules": len(modules), "hook_calls": calls[0], "records_per_step": len(recs)}


# ---------------------------------------------------------------------------------------------------------------
# Timing


def plan_steps(fn: Callable[[], object], budget_s: float) -> int:
    """Rounds of one step each, from the time of a warm step (two warm steps first: allocator, Monitor buffers)."""
    fn()
    fn()
    t0 = time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    return max(STEP_MIN_ROUNDS, min(STEP_MAX_ROUNDS, int(budget_s / t)))


@pytest.mark.parametrize("case", STEP_CASES)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_monitor_step(benchmark, hookstats, device, model_name, case):
    shape = check_monitor(hookstats, model_name, device)  # cached: one checked step per model and device
    step = TrainStep(model_name, device)
    flush_s: list[float] = []
    cleanup: Callable[[], None] = lambda: None  # noqa: E731

    if case in ("none", "none_after"):
        op = step
    elif case == "empty_hooks":
        def nothing(*args) -> None:
            return None

        handles = [h for m in step.model.modules()
                   for h in (m.register_forward_hook(nothing), m.register_full_backward_pre_hook(nothing))]
        op = step
        cleanup = lambda: [h.remove() for h in handles]  # noqa: E731
    elif case == "torch_hooks":
        ref = TorchStatsHooks(step.model.modules())

        def op():
            ref.results.clear()
            step()

        cleanup = ref.remove
    else:
        mon = make_monitor(hookstats, step.model, histogram=case == "monitor_hist")
        op = monitored_step(step, mon, flush_s)

        cleanup = mon.detach

    fn = synced(op, device)

    benchmark.group = f"monitor-step-{model_name}-{device}"
    benchmark.extra_info.update(
        family="monitor",
        bench="step",
        device=device,
        model=model_name,
        model_desc=MODEL_DESC[model_name],
        flush_every=FLUSH_EVERY,
        hist_bins=HIST_BINS,
        torch_threads=torch.get_num_threads(),
        **shape,
    )
    rounds = 1 if benchmark.disabled else plan_steps(fn, STEP_BUDGET_S[model_name])
    benchmark.extra_info.update(case=case, rounds=rounds, iterations=1)
    try:
        benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)
    finally:
        cleanup()
    if flush_s:
        benchmark.extra_info.update(flush_s=statistics.median(flush_s), flushes=len(flush_s))


@pytest.mark.parametrize("case", HOOK_CASES)
def test_monitor_hook(benchmark, measure, hookstats, device, case):
    torch.manual_seed(SEED)
    lin = nn.Linear(4, 4).to(device)
    x = torch.randn(1, 4, device=device)
    ref = None
    if case == "empty":
        lin.register_forward_hook(lambda module, args, output: None)
    elif case in ("record", "record_hist"):
        rec = hookstats.record("lin", histogram=(HIST_BINS, HIST_RANGE) if case == "record_hist" else None)
        lin.register_forward_hook(rec.forward)
    elif case == "torch_hooks":
        ref = TorchStatsHooks([])
        lin.register_forward_hook(ref.forward)

    calls = [0]

    def op():
        calls[0] += 1
        if ref is not None:
            ref.results.clear()
        return lin(x)

    benchmark.group = f"monitor-hook-{device}"
    benchmark.extra_info.update(family="monitor", bench="hook", device=device, numel=4,
                                torch_threads=torch.get_num_threads())
    measure(op, case, device, kind="fused")
    if case in ("record", "record_hist") and not benchmark.disabled:
        got = rec.records()  # the hook recorded every call (growing its buffer on the device as needed)
        assert len(got) == calls[0] and got[-1]["stats"]["numel"] == 4, (len(got), calls[0])
