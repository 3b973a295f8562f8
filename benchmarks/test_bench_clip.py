"""hookstats clipping against the PyTorch way of doing the same thing, in the same run.

Groups, each holding the hookstats case beside the PyTorch way on the same input:
  clip_norm-{device}-{dtype}-2^{k}       k in 16, 20, 24; fp32 and bf16
    hookstats      hookstats.clip_norm_(x, max_norm)
    torch          n = torch.linalg.vector_norm(x); x.mul_(torch.clamp(max_norm / (n + 1e-6), max=1.0))
    roof           x.sum() on CPU (the cheapest full read); y.copy_(x) on CUDA (read + write)
  clip_grad_norm-{device}-{dtype}-{n}p   n in 10, 100, 1000, 10000 grads; fp32, and bf16 at 1000
    hookstats      hookstats.clip_grad_norm_(params, max_norm)
    torch_foreach  torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    torch_loop     the same with foreach=False: one norm and one mul_ per grad
  total_norm-{device}-{dtype}-{n}p       the same parameter sets; a pure reduction, nothing is written
    hookstats      hookstats.get_total_norm(grads)
    torch_foreach  torch.nn.utils.get_total_norm(grads, foreach=True)
    torch_loop     the same with foreach=False
  clip_value-{device}-float32-2^{k}      k in 20, 24
    hookstats      hookstats.clip_value_(x, LO, HI): clamps and returns how many elements it changed
    torch          ((x < LO) | (x > HI)).sum(), computed before x.clamp_(LO, HI): the count PyTorch needs
    roof           as for clip_norm

The parameter sets are transformer blocks of width d (LayerNorm weight and bias, qkv weight and bias, output
projection, LayerNorm, MLP up and down with biases: 12 tensors, ~12 d^2 elements), repeated and cut at n
tensors. d shrinks as n grows so that every set holds 2^22.6-2^23.4 elements (26-42 MB of fp32 grads): the
groups then differ in how many tensors the bytes come in, not in the bytes, and the suite stays within a
few minutes on a 2-core CPU. The params themselves are stride-0 expansions of one zero (no memory); only
the grads are real, each its own allocation as after a backward pass, with values ~1e-3.

Note [honest repeated clipping]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every timed call runs on the same tensors, and clipping only ever shrinks them. With a fixed max_norm the
first call brings the norm down to max_norm and every later call finds a coefficient of ~1: PyTorch then
multiplies by 1, and hookstats skips the write altogether when the coefficient is exactly 1, so the timing
would no longer compare the clipping work. Restoring the input before every call costs a full pass (as much
as the op) and is not possible outside the timed region when short calls are batched.

So the norm ops (clip_norm_, clip_grad_norm_) follow a schedule (`ClipSchedule`): call k gets
max_norm = FACTOR^k x the initial norm. The norm after each call equals that call's max_norm (to the
rounding of the norm and the coefficient, which the next call corrects), so every call finds the norm
1 / FACTOR above its max_norm and scales everything by ~FACTOR = 0.9: the full read + scaled write, on both
sides, every call. The norm must not shrink for long, though: the coefficient is max_norm / (norm + 1e-6),
so once the norm nears eps = 1e-6 it drops far below FACTOR and zeroes the tensors within a few calls. So
whenever the norm has fallen below MIN_NORM = 1e-3 (eps moves the coefficient by at most 0.1%), the
schedule multiplies the tensors and itself by the power of two that brings the norm back to its start
(2^11 for the grads here, 2^17 for a 2^16 input): exact in binary floating point, nothing rounds, and the
values never get near the subnormals either. That is one extra mul_ pass in every 70-110 calls, the same on
both sides, in a round whose time the median ignores. After timing, the tensors' norm is checked against
the schedule's last max_norm (the schedule held: every call clipped) and the number of calls and rescales
goes into extra_info.

clip_value_ cannot follow a schedule: a clamp destroys what it clips, so repeated clamps either clip nothing
(after the first call: hookstats only stores the elements it changes, so it would time a pure read) or
converge to all elements at the bounds. Its cases restore the input outside the timed region
(pytest-benchmark's `setup`, one call per round): every timed call clamps the same ~1.2% of values (LO, HI =
-2.5, 2.5 on standard normal data), as one clip of a fresh gradient does. Calls at 2^20 and up are long
enough to time one at a time.

Every hookstats case (and every PyTorch case) checks its result against float64 PyTorch before it is timed,
so a broken kernel cannot post a fast time. No timing is asserted here: the speed targets live in
`benchmarks/report.py` and `benchmarks/targets.json` (tables: REPORT below).
"""
from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Callable, Sequence

import pytest
import torch
from _benching import BUDGET_S, DTYPES, MAX_ROUNDS, MIN_ROUNDS, SEED, make_input, synced

FACTOR = 0.9  # the coefficient of every timed norm clip (Note [honest repeated clipping])
# The smallest norm a schedule reaches: 1000x the clipping eps (1e-6), so eps moves the coefficient by <= 0.1%.
MIN_NORM = 1e-3

CLIP_NORM_SIZES_LOG2 = (16, 20, 24)
CLIP_VALUE_SIZES_LOG2 = (20, 24)
LO, HI = -2.5, 2.5  # clips ~1.2% of standard normal values

# (number of grads, dtype): fp32 at every count, bf16 at 1,000.
GRAD_SETS = [(10, "float32"), (100, "float32"), (1000, "float32"), (10000, "float32"), (1000, "bfloat16")]
# Block width per parameter count: ~2^23 elements in every set (see the module docstring).
WIDTH = {10: 1024, 100: 256, 1000: 96, 10000: 32}
GRAD_SCALE = 1e-3

NORM_CASES = ("hookstats", "torch", "roof")
LIST_CASES = ("hookstats", "torch_foreach", "torch_loop")
# Budget kind (_benching.BUDGET_S) per case: the per-tensor loop costs ~0.1-0.3 s a call at 10,000 grads on a
# 2-core CPU, so it gets a few rounds only; the hookstats / foreach ratio is the number the report is about.
# The report's tables (benchmarks/report.py reads this literal; targets in benchmarks/targets.json).
REPORT = [
    {"id": "clip_single", "title": "Clipping one tensor in place", "family": "clip",
     "where": "op in ('clip_norm', 'clip_value')", "split": ["device"], "rows": ["op", "dtype", "size_log2"],
     "pivot": "case", "labels": {"clip_norm": "`clip_norm_`", "clip_value": "`clip_value_`"},
     "columns": [["op", "label(op)"], ["dtype", "dtype"], ["size", "'2^%d' % size_log2"],
                 ["hookstats µs", "t.hookstats", "us"], ["PyTorch µs", "t.torch", "us"],
                 ["speedup", "t.torch / t.hookstats", "x"], ["hookstats GB/s", "traffic_bytes / t.hookstats / 1e9", "gbps"]],
     "note": "PyTorch: `vector_norm` + `mul_` (clip_norm_), `((x < lo) | (x > hi)).sum()` + `clamp_` (clip_value_). "
             "GB/s: the bytes the op must move at least (a norm clip reads, then reads and writes; clip_value_ reads "
             "and writes the ~1.2% it clips) / median time. Every timed norm clip really scales: max_norm shrinks by "
             "0.9 a call on both sides (Note [honest repeated clipping])."},
    {"id": "clip_lists", "title": "Clipping a list of gradients", "family": "clip",
     "where": "op in ('clip_grad_norm', 'total_norm')", "split": ["device"], "rows": ["op", "dtype", "n_tensors"],
     "pivot": "case", "labels": {"clip_grad_norm": "`clip_grad_norm_`", "total_norm": "`get_total_norm`"},
     "columns": [["op", "label(op)"], ["dtype", "dtype"], ["tensors", "n_tensors", "int"],
                 ["elements (M)", "numel / 1e6", "f1"], ["hookstats µs", "t.hookstats", "us"],
                 ["foreach µs", "t.torch_foreach", "us"], ["loop µs", "t.torch_loop", "us"],
                 ["vs foreach", "t.torch_foreach / t.hookstats", "x"], ["vs loop", "t.torch_loop / t.hookstats", "x"]],
     "note": "foreach / loop: `torch.nn.utils.clip_grad_norm_` (`get_total_norm`) with foreach=True / False."},
]

KIND = {"hookstats": "hist", "torch": "hist", "torch_foreach": "hist", "roof": "hist", "torch_loop": "baseline"}


@pytest.fixture(scope="session")
def clip_ops(hookstats):
    """hookstats, or a skip when this build predates the clipping ops."""
    missing = [name for name in ("clip_norm_", "clip_value_", "clip_grad_norm_", "get_total_norm")
               if not hasattr(hookstats, name)]
    if not hasattr(torch.ops.hookstats, "norms"):
        missing.append("torch.ops.hookstats.norms")
    if missing:
        pytest.skip(f"this build of hookstats has no clipping ops (missing: {', '.join(missing)}); "
                    "rebuild it: `pip install --no-build-isolation -e .`")
    return hookstats


# ---------------------------------------------------------------------------------------------------------------
# Inputs


def block_shapes(d: int) -> list[tuple[int, ...]]:
    """The 12 parameter shapes of one pre-LayerNorm transformer block of width d, in module order."""
    return [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]


def grad_shapes(n: int) -> list[tuple[int, ...]]:
    block = block_shapes(WIDTH[n])
    return [block[i % len(block)] for i in range(n)]


@functools.lru_cache(maxsize=2)
def make_grads(n: int, dtype_name: str, device: str) -> tuple[torch.Tensor, ...]:
    """n grads of transformer shapes, seeded normal values times GRAD_SCALE, each its own allocation. Cached and
    never written: the cases that clip work on clones."""
    shapes = grad_shapes(n)
    numels = [torch.Size(s).numel() for s in shapes]
    g = torch.Generator().manual_seed(SEED + n)
    flat = torch.randn(sum(numels), generator=g) * GRAD_SCALE
    dtype = DTYPES[dtype_name]
    return tuple(
        piece.view(shape).to(device=device, dtype=dtype, copy=True)
        for piece, shape in zip(flat.split(numels), shapes)
    )


def make_params(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Leaf tensors that require grad, one per grad (stride-0 views of one zero: no memory), holding clones of
    `grads` as their .grad."""
    params = []
    for grad in grads:
        p = torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape).requires_grad_()
        p.grad = grad.clone()
        params.append(p)
    return params


def norm64(tensors: Sequence[torch.Tensor]) -> float:
    """The 2-norm of all the tensors together, in float64."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.double()) for t in tensors])).item()


class ClipSchedule:
    """max_norm for successive calls on the same tensors: FACTOR times the last one each call, and an exact
    power-of-two rescale of the tensors (`rescale`, the largest that keeps the norm >= MIN_NORM) each time they
    have shrunk by that much, so that every call clips by ~FACTOR (Note [honest repeated clipping])."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = list(tensors)
        self.max_norm = norm64(self.tensors)
        assert self.max_norm >= 4 * MIN_NORM, self.max_norm
        self.rescale = 2.0 ** min(64, math.floor(math.log2(self.max_norm / MIN_NORM)))
        self.floor = self.max_norm / self.rescale
        self.calls = 0
        self.rescales = 0

    def __call__(self) -> float:
        self.max_norm *= FACTOR
        if self.max_norm < self.floor:
            torch._foreach_mul_(self.tensors, self.rescale)
            self.max_norm *= self.rescale
            self.rescales += 1
        self.calls += 1
        return self.max_norm

    def check_held(self) -> None:
        """After timing: the tensors' norm is the last max_norm (each call clipped by ~FACTOR) and finite."""
        norm = norm64(self.tensors)
        assert self.calls > 0 and abs(norm / self.max_norm - 1) < 0.02, (self.calls, norm, self.max_norm)


# ---------------------------------------------------------------------------------------------------------------
# The PyTorch ways and the checks


def torch_clip_norm_(x: torch.Tensor, max_norm: float) -> torch.Tensor:
    """clip_norm_ the way it is written in PyTorch (torch.nn.utils.clip_grad_norm_'s rule, one tensor)."""
    n = torch.linalg.vector_norm(x)
    x.mul_(torch.clamp(max_norm / (n + 1e-6), max=1.0))
    return n


def torch_clip_value_(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """clip_value_ in PyTorch: the count hookstats returns has to be computed before the clamp."""
    count = ((x < lo) | (x > hi)).sum()
    x.clamp_(lo, hi)
    return count


# Relative error of a clipped value against float64: hookstats applies a float64-exact coefficient, so one
# rounding to the dtype; PyTorch's coefficient comes from a norm in the tensor's dtype (bf16 for bf16), and
# its float32 vector_norm on the CPU drifts with the size (6.4e-4 relative at 2^24 here, 1e-5 at 2^20), so
# the PyTorch cases are only checked to have clipped by about the right amount.
RTOL_VALUES = {("hookstats", torch.float32): 2**-22, ("hookstats", torch.bfloat16): 2**-8,
               ("torch", torch.float32): 2e-3, ("torch", torch.bfloat16): 2**-6}
# Relative error of a returned norm, by the dtype it is returned in (clip_norm_ returns float32 for bf16 input).
RTOL_NORM = {("hookstats", torch.float32): 1e-5, ("hookstats", torch.bfloat16): 2**-8,
             ("torch", torch.float32): 2e-3, ("torch", torch.bfloat16): 2**-6}


def _side(case: str) -> str:
    return "hookstats" if case == "hookstats" else "torch"


def check_clipped(after: Sequence[torch.Tensor], before: Sequence[torch.Tensor], max_norm: float, case: str) -> None:
    """Tensors clipped by `case` to `max_norm` against float64 PyTorch (clip_grad_norm_'s rule)."""
    total = norm64(before)
    coef = min(1.0, max_norm / (total + 1e-6))
    assert coef < 0.95  # the check does clip
    ref = torch.cat([t.double().flatten() for t in before]) * coef
    got = torch.cat([t.double().flatten() for t in after])
    rtol = RTOL_VALUES[(_side(case), before[0].dtype)]
    err = ((got - ref).abs() - rtol * ref.abs()).max().item()
    assert err <= 1e-30, (case, err)


def check_norm(norm: torch.Tensor, tensors: Sequence[torch.Tensor], case: str, dtype: torch.dtype) -> None:
    """A returned norm: dtype `dtype`, on the tensors' device, equal to the float64 norm within RTOL_NORM."""
    assert norm.dtype == dtype and norm.dim() == 0 and norm.device == tensors[0].device, (norm.dtype, norm.shape)
    ref = norm64(tensors)
    rtol = RTOL_NORM[(_side(case), dtype)]
    assert abs(norm.double().item() - ref) <= rtol * ref, (case, norm.item(), ref)


# ---------------------------------------------------------------------------------------------------------------
# Timing with the input restored before every call (clip_value_)


def plan_restored(fn: Callable[[], object], restore: Callable[[], None], kind: str) -> int:
    """Rounds of one call each for benchmark.pedantic(setup=restore), from the time of a warm call."""
    restore()
    fn()
    samples: list[float] = []
    while len(samples) < 3 and sum(samples) < BUDGET_S[kind] / 4:
        restore()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    t = max(statistics.median(samples), 1e-7)
    return max(MIN_ROUNDS[kind], min(MAX_ROUNDS, int(BUDGET_S[kind] / t)))


def cuda_event_seconds_restored(op: Callable[[], object], restore: Callable[[], None], reps: int = 15) -> float:
    """Median device time of one call of `op` on a freshly restored input, from CUDA events around the call
    (the restore is queued before the start event, so it is not timed)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps + 1):
        restore()
        start.record()
        op()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[1:])


@pytest.fixture
def measure_restored(benchmark):
    """measure_restored(op, restore, case, device, kind): like the conftest fixture `measure`, but `restore()` runs before
    every round of one call, untimed (pytest-benchmark's `setup`)."""

    def run(op: Callable[[], object], restore: Callable[[], None], case: str, device: str, kind: str) -> None:
        fn, setup = synced(op, device), synced(restore, device)
        rounds = 1 if benchmark.disabled else plan_restored(fn, setup, kind)
        benchmark.extra_info.update(case=case, rounds=rounds, iterations=1, restored=True)
        benchmark.pedantic(fn, setup=setup, rounds=rounds, warmup_rounds=1)
        if device == "cuda" and not benchmark.disabled:
            benchmark.extra_info["cuda_event_s"] = cuda_event_seconds_restored(op, restore)

    return run


def roof_op(x: torch.Tensor, device: str) -> Callable[[], object]:
    if device == "cuda":
        y = torch.empty_like(x)
        y.copy_(x)
        assert torch.equal(y, x)
        return lambda: y.copy_(x)
    return lambda: x.sum()


def _extra(benchmark, op: str, device: str, dtype_name: str, **more) -> None:
    benchmark.extra_info.update(
        family="clip",  # report.summarize (the stats table) skips these: they share the case name "roof"
        op=op,
        device=device,
        dtype=dtype_name,
        roof="copy" if device == "cuda" else "sum",
        torch_threads=torch.get_num_threads(),
        **more,
    )


# ---------------------------------------------------------------------------------------------------------------
# The benchmarks


@pytest.mark.parametrize("case", NORM_CASES)  # innermost, so that a group's cases run one after another
@pytest.mark.parametrize("size_log2", CLIP_NORM_SIZES_LOG2, ids=[f"2^{k}" for k in CLIP_NORM_SIZES_LOG2])
def test_clip_norm(benchmark, measure, clip_ops, device, dtype_name, size_log2, case):
    x0 = make_input(size_log2, dtype_name, device)  # cached and shared: never written
    if case == "roof":
        op = roof_op(x0, device)
    else:
        x = x0.clone()
        max_norm = FACTOR * norm64([x0])
        check = x0.clone()
        if case == "hookstats":
            norm = clip_ops.clip_norm_(check, max_norm)
            check_norm(norm, [x0], case, torch.float32)
        else:
            norm = torch_clip_norm_(check, max_norm)
            check_norm(norm, [x0], case, x0.dtype)
        check_clipped([check], [x0], max_norm, case)
        del check
        schedule = ClipSchedule([x])
        clip = clip_ops.clip_norm_ if case == "hookstats" else torch_clip_norm_
        op = lambda: clip(x, schedule())  # noqa: E731

    benchmark.group = f"clip_norm-{device}-{dtype_name}-2^{size_log2}"
    nbytes = x0.numel() * x0.element_size()
    # traffic: a norm read, then a read + write to scale (the roof is one read, or a copy's read + write)
    _extra(benchmark, "clip_norm", device, dtype_name, numel=x0.numel(), size_log2=size_log2, bytes=nbytes,
           traffic_bytes=3 * nbytes)
    measure(op, case, device, kind=KIND[case])
    if case != "roof":
        schedule.check_held()
        benchmark.extra_info.update(calls=schedule.calls, rescales=schedule.rescales)


@pytest.mark.parametrize("case", LIST_CASES)
@pytest.mark.parametrize("n,dtype_name", GRAD_SETS, ids=[f"{n}p-{d}" for n, d in GRAD_SETS])
def test_clip_grad_norm(benchmark, measure, clip_ops, device, n, dtype_name, case):
    grads0 = make_grads(n, dtype_name, device)
    max_norm = FACTOR * norm64(grads0)
    check = make_params(grads0)
    if case == "hookstats":
        total = clip_ops.clip_grad_norm_(check, max_norm)
    else:
        total = torch.nn.utils.clip_grad_norm_(check, max_norm, foreach=case == "torch_foreach")
    check_norm(total, grads0, case, grads0[0].dtype)  # clip_grad_norm_ returns the total in the grads' dtype
    check_clipped([p.grad for p in check], grads0, max_norm, case)
    del check

    params = make_params(grads0)
    schedule = ClipSchedule([p.grad for p in params])
    if case == "hookstats":
        op = lambda: clip_ops.clip_grad_norm_(params, schedule())  # noqa: E731
    else:
        foreach = case == "torch_foreach"
        op = lambda: torch.nn.utils.clip_grad_norm_(params, schedule(), foreach=foreach)  # noqa: E731

    benchmark.group = f"clip_grad_norm-{device}-{dtype_name}-{n}p"
    numel = sum(g.numel() for g in grads0)
    nbytes = sum(g.numel() * g.element_size() for g in grads0)
    _extra(benchmark, "clip_grad_norm", device, dtype_name, n_tensors=n, numel=numel, bytes=nbytes,
           traffic_bytes=3 * nbytes, width=WIDTH[n])
    measure(op, case, device, kind=KIND[case])
    schedule.check_held()
    benchmark.extra_info.update(calls=schedule.calls, rescales=schedule.rescales)


@pytest.mark.parametrize("case", LIST_CASES)
@pytest.mark.parametrize("n,dtype_name", GRAD_SETS, ids=[f"{n}p-{d}" for n, d in GRAD_SETS])
def test_total_norm(benchmark, measure, clip_ops, device, n, dtype_name, case):
    grads = list(make_grads(n, dtype_name, device))  # read only
    if case == "hookstats":
        op = lambda: clip_ops.get_total_norm(grads)  # noqa: E731
    else:
        foreach = case == "torch_foreach"
        op = lambda: torch.nn.utils.get_total_norm(grads, foreach=foreach)  # noqa: E731
    check_norm(op(), grads, case, grads[0].dtype)

    benchmark.group = f"total_norm-{device}-{dtype_name}-{n}p"
    numel = sum(g.numel() for g in grads)
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    _extra(benchmark, "total_norm", device, dtype_name, n_tensors=n, numel=numel, bytes=nbytes,
           traffic_bytes=nbytes, width=WIDTH[n])
    measure(op, case, device, kind=KIND[case])


@pytest.mark.parametrize("case", NORM_CASES)
@pytest.mark.parametrize("size_log2", CLIP_VALUE_SIZES_LOG2, ids=[f"2^{k}" for k in CLIP_VALUE_SIZES_LOG2])
def test_clip_value(benchmark, measure, measure_restored, clip_ops, device, size_log2, case):
    dtype_name = "float32"
    x0 = make_input(size_log2, dtype_name, device)  # cached and shared: never written
    nbytes = x0.numel() * x0.element_size()
    benchmark.group = f"clip_value-{device}-{dtype_name}-2^{size_log2}"
    # traffic: one read; the ~1.2% of values changed are written back (hookstats) or everything is (clamp_)
    _extra(benchmark, "clip_value", device, dtype_name, numel=x0.numel(), size_log2=size_log2, bytes=nbytes,
           traffic_bytes=nbytes, bounds=[LO, HI])
    if case == "roof":
        measure(roof_op(x0, device), case, device, kind=KIND[case])
        return

    expected = torch_clip_value_(x0.clone(), LO, HI).item()
    reference = x0.clamp(LO, HI)
    assert 0.005 * x0.numel() < expected < 0.02 * x0.numel()  # clips a realistic few values
    check = x0.clone()
    if case == "hookstats":
        count = clip_ops.clip_value_(check, LO, HI)
    else:
        count = torch_clip_value_(check, LO, HI)
    assert count.dtype == torch.int64 and count.dim() == 0 and count.item() == expected, (count, expected)
    assert torch.equal(check, reference)
    del check, reference

    x = x0.clone()
    clip = clip_ops.clip_value_ if case == "hookstats" else torch_clip_value_

    def restore() -> None:  # must return None: pytest-benchmark takes a setup's result as (args, kwargs)
        x.copy_(x0)

    benchmark.extra_info["clipped"] = expected
    measure_restored(lambda: clip(x, LO, HI), restore, case, device, kind=KIND[case])
    assert torch.equal(x, x0.clamp(LO, HI))  # the last timed call clamped a restored input
