"""hookstats.detect_nonfinite beside torch.autograd.detect_anomaly on the same training step (issue #37).

Group anomaly-step-gpt12: the 12-layer GPT of test_bench_large_models.py (nanoGPT layout, n_embd 128, 4 heads,
vocab 512, 164 modules), batch 2 x 32 tokens; a step is forward, cross-entropy, backward, SGD step, zero_grad. Each
case has its own model (same seed) and optimizer; the cases run interleaved, PERIOD steps each in turn, ROUNDS times,
one torch thread:
  none            the plain step
  guard           inside `hookstats.detect_nonfinite(model)`, guard.step() after each step: every op output of
                  forward, backward and the optimizer checked (no host sync)
  guard_every10   detect_nonfinite(model, every=10): one checked step in ten (a period holds exactly one)
  detect_anomaly  inside torch.autograd.detect_anomaly() (check_nan=True): backward outputs, NaN only
The ratios (case / none, of each case's fastest period; medians beside them) go into extra_info; benchmarks/report.py
prints them (REPORT below) against benchmarks/targets.json: guard <= 1.30x, every=10 <= 1.05x. No timing is asserted.
"""
from __future__ import annotations

import statistics
import time
import warnings

import torch
from _benching import SEED
from test_bench_large_models import make_gpt

CASES = ("none", "guard", "guard_every10", "detect_anomaly")
PERIOD = 10  # steps a case runs in one turn (a multiple of 10: one checked step per turn with every=10)
ROUNDS = 10

# The report's tables (benchmarks/report.py reads this literal; targets in benchmarks/targets.json).
REPORT = [
    {"id": "anomaly_step", "title": "First non-finite op: hookstats.detect_nonfinite vs torch.autograd.detect_anomaly, "
                                    "one training step", "family": "anomaly",
     "where": "bench == 'step'", "explode": {"key": "case", "fields": ["step_s", "ratios", "median_ratios"]},
     "split": ["model"], "rows": ["case"],
     "labels": {"none": "plain step", "guard": "`detect_nonfinite(model)`, every step",
                "guard_every10": "`detect_nonfinite(model, every=10)`",
                "detect_anomaly": "`torch.autograd.detect_anomaly()`"},
     "columns": [["case", "label(case)"], ["step ms (fastest period)", "step_s", "ms"], ["vs plain", "ratios", "x"],
                 ["median ratio", "median_ratios", "x"]],
     "note": "A 12-layer GPT (nanoGPT layout, n_embd 128, 164 modules), batch 2 x 32: forward, cross-entropy, "
             "backward, SGD step, zero_grad. detect_nonfinite checks every floating op output of forward, backward "
             "and optimizer for NaN and Inf; detect_anomaly checks backward outputs for NaN. The cases run "
             "interleaved, 10 steps a turn, one thread; the ratio of each case's fastest 10-step period to the plain "
             "one's."},
]


class Case:
    def __init__(self, hookstats, case: str, smoke: bool):
        torch.manual_seed(SEED)
        self.case = case
        self.model, self.x, self.loss = make_gpt(smoke)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.guard = None
        if case == "guard":
            self.guard = hookstats.detect_nonfinite(self.model)
        elif case == "guard_every10":
            self.guard = hookstats.detect_nonfinite(self.model, every=10)

    def step(self) -> None:
        self.loss(self.model(self.x)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.guard is not None:
            self.guard.step()

    def run(self, n: int) -> float:
        """n steps inside the case's context (the guard, or anomaly mode), seconds a step."""
        if self.case == "detect_anomaly":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled"
                ctx = torch.autograd.detect_anomaly(check_nan=True)
        else:
            ctx = self.guard if self.guard is not None else _Nothing()
        with ctx:
            t0 = time.perf_counter()
            for _ in range(n):
                self.step()
            return (time.perf_counter() - t0) / n


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_anomaly_step(benchmark, hookstats, one_thread):
    smoke = benchmark.disabled
    cases = {c: Case(hookstats, c, smoke) for c in CASES}
    for c in cases.values():  # warm: allocator, first steps
        c.run(2 if smoke else PERIOD)
    times: dict[str, list] = {c: [] for c in CASES}
    for _ in range(1 if smoke else ROUNDS):
        for name, c in cases.items():
            times[name].append(c.run(2 if smoke else PERIOD))
    for name in ("guard", "guard_every10"):  # a finite run reports nothing, and the guard did read the ops
        g = cases[name].guard
        assert g.first() is None and g.checked > 0, (name, g.first())
    best = {c: min(v) for c, v in times.items()}
    med = {c: statistics.median(v) for c, v in times.items()}
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    benchmark.group = "anomaly-step-gpt12"
    benchmark.extra_info.update(family="anomaly", bench="step", model="gpt12", period=PERIOD, step_s=best,
                                ratios={c: best[c] / best["none"] for c in CASES}, median_step_s=med,
                                median_ratios={c: med[c] / med["none"] for c in CASES},
                                checked_per_step=cases["guard"].guard.checked / max(cases["guard"].guard.current_step,
                                                                                    1),
                                loadavg=load, torch_threads=torch.get_num_threads(), case="guard")
    guard = cases["guard"].guard
    with guard:
        benchmark.pedantic(cases["guard"].step, rounds=1 if smoke else 2 * PERIOD, iterations=1)
