"""hookstats.Monitor under torch.compile: one training step eager and compiled, each with and without a Monitor, in
one run (Note [monitor under torch.compile] in hookstats/monitor/compile.py).

Group compile-step-{model}-{device}: the training step of test_bench_monitor.py (nn.TransformerEncoder, d_model 256,
4 layers, 8 x 128 tokens, MSE, SGD), with the Monitor of its monitor case (kinds forward + backward_pre, statistics
only), flushed every FLUSH_EVERY steps inside the timed step (its own median in extra_info["flush_s"], Note [flush
cost] in test_bench_monitor.py):
    eager                no hooks
    eager_monitor        the Monitor
    compiled             torch.compile(model, backend=BACKEND); the backward is AOTAutograd's compiled backward
    compiled_ca          the same under compiled autograd (forward and backward inside
                         torch._dynamo.compiled_autograd._enable(torch.compile(backend=BACKEND))): no hooks
    compiled_ca_monitor  compiled_ca with the Monitor: its forward hooks traced into the forward graph, its backward
                         pre-hooks into the compiled autograd graph (without compiled autograd dynamo breaks the
                         graph at every module that has a backward hook: not a configuration to time)
    eager_after          no hooks again, last: the machine's speed drifts, so the eager baseline is the mean of the
                         two no-hooks medians, which bracket the other cases
The report's ratios: each case against eager, and compiled_ca_monitor against compiled_ca (what the Monitor costs in
a compiled step). BACKEND is HOOKSTATS_BENCH_COMPILE_BACKEND (default inductor: up to a minute per compiled case to
compile the transformer's forward and backward on a 2-core CPU with cold caches; aot_eager compiles in seconds).

Each case runs WARMUP_STEPS steps first (the compiles); extra_info counts the graphs compiled by then (graphs, and
graph_breaks), and new_graphs_while_timed those compiled during the timed rounds (0: no recompiles). The compiled
Monitor case first checks one step against an eager Monitor on the same model: the same records, with the same
statistics, so a compiled Monitor that records less (or nothing) cannot post a fast time. No timing is asserted.
"""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import time

import pytest
import torch
from _benching import SEED, synced
from test_bench_monitor import FLUSH_EVERY, MODEL_DESC, MODELS, monitored_step
from torch import nn
from torch._dynamo.utils import counters

BACKEND = os.environ.get("HOOKSTATS_BENCH_COMPILE_BACKEND", "inductor")
CASES = ("eager", "eager_monitor", "compiled", "compiled_ca", "compiled_ca_monitor", "eager_after")
KINDS = ("forward", "backward_pre")
STEP_BUDGET_S = 6.0
STEP_MIN_ROUNDS, STEP_MAX_ROUNDS = 2 * FLUSH_EVERY, 200
WARMUP_STEPS = 3  # the compiles (the first step), then steps that must compile nothing


class Step:
    """One SGD step (lr 1e-3, MSE against a fixed random target) of the model, eager or compiled, optionally under
    compiled autograd; every case builds the same model from the same seed."""

    def __init__(self, name: str, device: str, compiled: bool, ca: bool):
        torch.manual_seed(SEED)
        model, x, target = MODELS[name]()
        self.model = model.to(device)
        self.x, self.target = x.to(device), target.to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.forward = torch.compile(self.model, backend=BACKEND) if compiled else self.model
        self.ca = ca

    def __call__(self) -> None:
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend=BACKEND)) if self.ca \
                else contextlib.nullcontext():
            self.opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(self.forward(self.x), self.target)
            loss.backward()
        self.opt.step()


# The report's table (benchmarks/report.py reads this literal).
REPORT = [
    {"id": "compile", "title": "torch.compile and the Monitor, one training step", "family": "compile",
     "split": ["device", "model_desc"], "rows": ["case"],
     "labels": {"eager": "eager, no hooks", "eager_monitor": "eager + Monitor", "compiled": "torch.compile",
                "compiled_ca": "torch.compile + compiled autograd",
                "compiled_ca_monitor": "torch.compile + compiled autograd + Monitor",
                "eager_after": "eager, no hooks, again (timed last)"},
     "define": [["total", "time + (flush_s / flush_every if flush_s else 0)"]],
     "columns": [["case", "label(case)"], ["step ms", "time", "ms"], ["IQR", "iqr", "pct"],
                 ["step + flush share ms", "total", "ms"],
                 ["vs eager", "total / mean([at(case='eager').total, at(case='eager_after').total])", "x"],
                 ["Monitor: vs the same without", "total / {'eager_monitor': mean([at(case='eager').total, "
                  "at(case='eager_after').total]), 'compiled_ca_monitor': at(case='compiled_ca').total}.get(case)", "x"],
                 ["first step s", "first_step_s", "f1"], ["graphs", "graphs"],
                 ["new graphs while timed", "new_graphs_while_timed"], ["graph breaks", "graph_breaks"]],
     "note": "first step: the step that compiles. new graphs while timed: graphs compiled during the timed rounds "
             "(0: no recompiles)."},
]


def _key(r: dict) -> tuple:
    return r["module"], r["kind"], r["index"]


def check_compiled_monitor(hookstats, name: str, device: str) -> None:
    """One step of the compiled Monitor case against an eager Monitor on the same model and data: the same records,
    in the same order, with the same counts and statistics within 1e-4 (sum and mean: 1e-5 of l1, as they can cancel
    to ~0), since the compiled kernels round differently."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        step = Step(name, device, compiled=compiled, ca=compiled)
        mon = hookstats.Monitor(step.model, kinds=KINDS)
        step()
        runs.append(mon.records())
        mon.detach()
    want, got = runs
    # The same records: every (module, kind, index) as often, each call's statistics alike. Their order across sites
    # is the autograd engine's: where compiled autograd gives a container and its last child's shared output an alias
    # each, the container's record comes first, as PyTorch's own pre-hooks order them (Note [grad_output per output
    # slot]); eagerly a shared tensor hook runs the child's first.
    assert sorted(map(_key, got)) == sorted(map(_key, want)) and want, (len(got), len(want))
    forward = [_key(r) for r in want if r["kind"] != "backward_pre"]
    assert [_key(r) for r in got if r["kind"] != "backward_pre"] == forward  # the forward records keep their order
    by_key: dict = {}
    for b in want:
        by_key.setdefault(_key(b), []).append(b)
    for a in got:
        b = by_key[_key(a)].pop(0)
        scale = {"sum": b["stats"]["l1"], "mean": b["stats"]["l1"] / max(b["stats"]["numel"], 1)}
        for f, v in a["stats"].items():
            w = b["stats"][f]
            close = math.isclose(v, w, rel_tol=1e-4, abs_tol=1e-5 * scale.get(f, 0.0))  # sums: relative to l1
            assert v == w or close or (v != v and w != w), (_key(a), f, v, w)
    torch._dynamo.reset()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("model_name", ["transformer"])
def test_compile_step(benchmark, hookstats, device, model_name, case):
    if case == "compiled_ca_monitor":
        check_compiled_monitor(hookstats, model_name, device)
    torch._dynamo.reset()  # PyTorch does not guard compiled code on module hooks: no case may reuse another's
    counters.clear()
    compiled = case.startswith("compiled")
    step = Step(model_name, device, compiled=compiled, ca=case.startswith("compiled_ca"))
    flush_s: list[float] = []
    mon = None
    if case.endswith("monitor"):
        mon = hookstats.Monitor(step.model, kinds=KINDS)
        op = monitored_step(step, mon, flush_s)  # Note [flush cost] in test_bench_monitor.py
    else:
        op = step

    fn = synced(op, device)

    t0 = time.perf_counter()
    fn()
    compile_s = time.perf_counter() - t0
    for _ in range(WARMUP_STEPS - 1):
        fn()
    graphs = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    fn()
    rounds = 1 if benchmark.disabled else max(STEP_MIN_ROUNDS,
                                                min(STEP_MAX_ROUNDS, int(STEP_BUDGET_S / (time.perf_counter() - t0))))

    benchmark.group = f"compile-step-{model_name}-{device}"
    benchmark.extra_info.update(
        family="compile", bench="step", device=device, model=model_name, model_desc=MODEL_DESC[model_name],
        backend=BACKEND if compiled else "eager", case=case, kinds=list(KINDS) if mon else [],
        flush_every=FLUSH_EVERY if mon else None, torch_threads=torch.get_num_threads(), rounds=rounds,
        iterations=1, first_step_s=compile_s, graphs=graphs,
        graph_breaks=sum(counters["graph_break"].values()))
    try:
        benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)
        if mon is not None:
            benchmark.extra_info["records_per_step"] = len(mon.records()) / mon.current_step
    finally:
        if mon is not None:
            mon.detach()
    benchmark.extra_info["new_graphs_while_timed"] = counters["stats"]["unique_graphs"] - graphs
    if flush_s:
        benchmark.extra_info.update(flush_s=statistics.median(flush_s), flushes=len(flush_s))
    torch._dynamo.reset()
