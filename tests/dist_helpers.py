"""Multi-process workers for tests/test_distributed.py, and the launcher that runs them with a deadline.

`launch(script, args, out_dir)` starts one `python script args...` process per rank (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment; gloo on 127.0.0.1, a free port), waits for all of them up to a deadline, and kills
the rest when the deadline passes or when one rank fails (its peers would wait in a collective until gloo's own
timeout). A rank that hangs then fails the test instead of hanging CI.

Run as a script (`python tests/dist_helpers.py SCENARIO OUT_DIR`), this file is the worker: it runs each section of
SCENARIO in turn and, after each one, saves what it found to OUT_DIR/rank{r}.pt (torch.save of a dict: section ->
{"ok": True, ...results} or {"ok": False, "error": traceback}), so that the sections done before a hang are still
reported. The test process loads those files and asserts; the workers only compute.

Sections issue the same collectives in the same order on every rank; an exception that only one rank raises leaves
the other in a collective, which the launcher's deadline ends.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import torch
from torch import nn

WORLD = 2


# ---------------------------------------------------------------------------------------------------------------
# Launcher (runs in the test process)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch(NamedTuple):
    returncodes: list  # negative: killed by that signal
    timed_out: bool
    seconds: float
    logs: list  # each rank's stdout + stderr (the tail)

    def describe(self) -> str:
        parts = [f"ranks exited with {self.returncodes} after {self.seconds:.1f} s"
                 + (" (deadline passed: the rest were killed)" if self.timed_out else "")]
        for r, log in enumerate(self.logs):
            parts.append(f"--- rank {r} output (tail) ---\n{log}")
        return "\n".join(parts)


def launch(script: str | os.PathLike, args: Sequence[str], out_dir: str | os.PathLike, world: int = WORLD,
           timeout: float = 120.0, grace: float = 15.0) -> Launch:
    """Runs `python script *args` once per rank and waits for all of them (see the module docstring). When a rank
    exits with an error, the others get `grace` seconds to finish before they are killed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        log = open(out_dir / f"rank{rank}.log", "wb")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, os.fspath(script), *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    t0 = time.monotonic()
    deadline = t0 + timeout
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if any(p.returncode not in (None, 0) for p in procs):
                deadline = min(deadline, now + grace)
            if now >= deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    tails = []
    for rank in range(world):
        text = (out_dir / f"rank{rank}.log").read_bytes().decode(errors="replace")
        tails.append(text[-6000:])
    return Launch([p.returncode for p in procs], timed_out, time.monotonic() - t0, tails)


def load_results(out_dir: str | os.PathLike, world: int = WORLD) -> list[Optional[dict]]:
    """Each rank's saved results (None for a rank that saved nothing)."""
    res = []
    for rank in range(world):
        f = Path(out_dir) / f"rank{rank}.pt"
        res.append(torch.load(f, weights_only=False) if f.exists() else None)
    return res


# ---------------------------------------------------------------------------------------------------------------
# Worker pieces


def _flatten(obj, out: list) -> None:
    """Tensors of a hook argument, depth first, None kept as a placeholder (the Monitor's record index)."""
    if isinstance(obj, torch.Tensor) or obj is None:
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _flatten(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _flatten(o, out)


class Capture:
    """Plain hooks beside a Monitor's, keeping a copy of every floating tensor they see, keyed like the Monitor's
    records: (step, module, kind, index). Kinds: forward_pre, forward, backward_pre, grad."""

    def __init__(self, model: nn.Module, kinds: Sequence[str]):
        self.step = 0
        self.seen: dict[tuple, torch.Tensor] = {}
        self.handles = []
        for name, mod in model.named_modules():
            if "forward_pre" in kinds:
                self.handles.append(mod.register_forward_pre_hook(
                    lambda m, a, name=name: self._put(name, "forward_pre", a)))
            if "forward" in kinds:
                self.handles.append(mod.register_forward_hook(
                    lambda m, a, o, name=name: self._put(name, "forward", o)))
            if "backward_pre" in kinds:
                self.handles.append(mod.register_full_backward_pre_hook(
                    lambda m, g, name=name: self._put(name, "backward_pre", g)))
        if "grad" in kinds:
            for pname, p in model.named_parameters():
                self.handles.append(p.register_post_accumulate_grad_hook(
                    lambda p, pname=pname: self._put(pname, "grad", p.grad)))

    def _put(self, name: str, kind: str, obj) -> None:
        ts: list = []
        _flatten(obj, ts)
        for i, t in enumerate(ts):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.seen[(self.step, name, kind, i)] = t.detach().clone()
        return None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Feed(nn.Module):
    """Returns its input: a Monitor's forward record of it is the statistics of exactly the tensor fed."""

    def forward(self, x):
        return x


class Const(nn.Module):
    """Returns a stored tensor (a DTensor here)."""

    def __init__(self, t):
        super().__init__()
        self.t = t

    def forward(self):
        return self.t


@contextlib.contextmanager
def count_all_reduce():
    """Counts calls of torch.distributed.all_reduce (hookstats calls it through the module attribute)."""
    import torch.distributed as dist

    calls = []
    orig = dist.all_reduce

    def counting(*args, **kw):
        calls.append(kw.get("op"))
        return orig(*args, **kw)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = orig


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# Per-rank tensors fed to a Feed module, one record each: (name, rank -> tensor). Seeds depend on the rank unless the
# case wants both ranks to hold the same values.
def special_cases(rank: int) -> list[tuple[str, torch.Tensor]]:
    f64, f32 = torch.float64, torch.float32
    g = _gen(1000 + rank)
    same = _gen(77)

    def rn(n, dtype=f64, scale=1.0, gen=g):
        return torch.randn(n, generator=gen, dtype=torch.float64).mul(scale).to(dtype)

    nan0 = rn(20)
    if rank == 0:
        nan0[3] = math.nan
    nan1 = rn(21)
    if rank == 1:
        nan1[0] = math.nan
    inf1 = rn(22)
    if rank == 1:
        inf1[5] = math.inf
    infs = rn(9)
    infs[2] = -math.inf if rank == 0 else math.inf
    cases = [
        ("plain_f64", rn(100 + 37 * rank)),
        ("plain_f32", rn(64 + rank, f32, 3.0)),
        ("plain_bf16", rn(50, torch.bfloat16)),
        ("plain_f16", rn(30, torch.float16, 0.01)),
        ("nan_on_rank0", nan0),
        ("nan_on_rank1", nan1),
        ("inf_on_rank1", inf1),
        ("-inf_and_+inf", infs),
        ("empty_on_rank0", rn(0) if rank == 0 else rn(40, scale=5.0)),
        ("empty_on_rank1", rn(0) if rank == 1 else rn(40, scale=5.0)),
        ("empty_on_both", rn(0)),
        ("one_each", torch.tensor([2.5 if rank == 0 else -1.0], dtype=f64)),
        ("one_and_empty", torch.tensor([3.0], dtype=f64) if rank == 0 else rn(0)),
        ("mean_gg_std_f64", 1e3 + rn(1000, scale=1e-3)),
        ("mean_gg_std_f32", (1e3 + rn(1000, scale=1e-2)).to(f32)),
        ("negative_mean_gg_std", -5e6 + rn(500, scale=1e-4) + (1e-4 if rank else 0.0)),
        ("identical", rn(33, gen=same)),
        ("zeros_on_rank0", torch.zeros(10, dtype=f64) if rank == 0 else rn(10)),
        ("all_zero", torch.zeros(7, dtype=f64)),
        ("constant_per_rank", torch.full((10,), 5.0 if rank == 0 else 7.0, dtype=f64)),
        ("huge_f64", rn(100, scale=1e300)),
        ("tiny_f64", rn(100, scale=1e-300)),
    ]
    return cases


# ---------------------------------------------------------------------------------------------------------------
# Scenario "monitor": Monitor(process_group="world") merges on plain models


def sec_model(rank: int, world: int, out: Path) -> dict:
    import hookstats

    torch.manual_seed(0)
    m64 = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).double()
    m32 = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    kinds = ("forward_pre", "forward", "backward_pre", "grad")
    mon_exp = hookstats.Monitor(m64, kinds=kinds, histogram="exp", process_group="world")
    mon_rng = hookstats.Monitor(m64, kinds=kinds, histogram=(8, (-2.0, 2.0)), process_group="world")
    mon_32 = hookstats.Monitor(m32, kinds=kinds, histogram=(8, (-2.0, 2.0)), process_group="world")
    cap64, cap32 = Capture(m64, kinds), Capture(m32, kinds)
    g = _gen(100 + rank)
    for _ in range(2):
        # different data and batch sizes per rank
        m64(torch.randn(3 + rank, 5, generator=g, dtype=torch.float64)).square().mean().backward()
        m32(torch.randn(4 + 2 * rank, 6, generator=g) * 2).square().mean().backward()
        for mon in (mon_exp, mon_rng, mon_32):
            mon.step()
        cap64.step += 1
        cap32.step += 1
    pending_before = [len(mon_exp.records()), len(mon_rng.records())]  # no flush with a group
    for mon in (mon_exp, mon_rng, mon_32):
        mon.flush()
    res = {"exp": mon_exp.records(), "range": mon_rng.records(), "f32": mon_32.records(),
           "seen64": cap64.seen, "seen32": cap32.seen, "records_before_flush": pending_before}
    for mon in (mon_exp, mon_rng, mon_32):
        mon.detach()
    return res


def sec_special(rank: int, world: int, out: Path) -> dict:
    import hookstats

    feed = Feed()
    mon_exp = hookstats.Monitor(feed, kinds=("forward",), histogram="exp", process_group="world")
    mon_rng = hookstats.Monitor(feed, kinds=("forward",), histogram=(8, (-2.0, 2.0)), process_group="world")
    mon_none = hookstats.Monitor(feed, kinds=("forward",), process_group="world")
    names, seen = [], []
    for name, x in special_cases(rank):
        feed(x)
        names.append(name)
        seen.append(x.clone())
        for mon in (mon_exp, mon_rng, mon_none):
            mon.step()
    for mon in (mon_exp, mon_rng, mon_none):
        mon.flush()
    res = {"names": names, "seen": seen, "exp": mon_exp.records(), "range": mon_rng.records(),
           "none": mon_none.records()}
    for mon in (mon_exp, mon_rng, mon_none):
        mon.detach()
    return res


def sec_flush_every(rank: int, world: int, out: Path) -> dict:
    import hookstats
    from hookstats.runlog import JSONLWriter

    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(3, 3)).double()
    path = out / f"log_rank{rank}.jsonl"
    writer = JSONLWriter(path)
    mon = hookstats.Monitor(m, kinds=("forward",), flush_every=2, exporters=[writer], process_group="world")
    cap = Capture(m, ("forward",))
    g = _gen(200 + rank)
    counts = []
    for _ in range(5):
        m(torch.randn(2 + rank, 3, generator=g, dtype=torch.float64))
        mon.step()
        cap.step += 1
        counts.append(len(mon.records()))
    mon.detach()  # flushes the fifth step (a collective) and closes rank 0's writer
    counts.append(len(mon.records()))
    writer.close()  # rank 1's writer is never used by the Monitor; close the file it opened
    return {"counts": counts, "records": mon.records(), "seen": cap.seen, "path": str(path)}


class Calls:
    """forward records' tensors of every call, in call order: (step, module) -> [tensor of call 0, call 1, ...]."""

    def __init__(self, model: nn.Module):
        self.step = 0
        self.seen: dict[tuple, list] = {}
        self.handles = [mod.register_forward_hook(lambda m, a, o, name=name: self._put(name, o))
                        for name, mod in model.named_modules()]

    def _put(self, name, o):
        self.seen.setdefault((self.step, name), []).append(o.detach().clone())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Experts(nn.Module):
    """Mixture-of-experts routing: each token goes to expert argmax(router), experts called once per routed chunk
    (twice when a chunk of tokens is split), so that experts run a different number of times on each rank."""

    def __init__(self, d: int = 4, n: int = 3):
        super().__init__()
        self.router = nn.Linear(d, n)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        which = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (which == e).nonzero()[:, 0]
            for part in idx.split(3):  # chunks of 3 tokens: more calls where more tokens are routed
                if len(part):
                    out[part] = expert(x[part])
        return out


def sec_uneven(rank: int, world: int, out: Path) -> dict:
    """Sites that record on some ranks only: the issue's ModuleDict case (with a JSONL log on rank 0), and MoE routing
    (experts called a different number of times per rank), with flush_every (asynchronous merges) and histograms."""
    import hookstats
    from hookstats.runlog import JSONLWriter

    torch.manual_seed(4)
    m = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)}).double()
    path = out / f"uneven_rank{rank}.jsonl"
    writer = JSONLWriter(path)
    mon = hookstats.Monitor(m, kinds=("forward",), include=("a", "b"), process_group="world", exporters=[writer],
                            histogram=(8, (-2.0, 2.0)))
    calls = Calls(m)
    x = torch.randn(2 + rank, 3, generator=_gen(40 + rank), dtype=torch.float64)
    m["a"](x)
    m["b"](x)
    mon.step()
    calls.step += 1
    m["a" if rank == 0 else "b"](x)
    mon.flush()
    res = {"records": mon.records(), "summary": mon.summary_rows(), "seen": calls.seen, "path": str(path)}
    mon.detach()
    writer.close()
    calls.remove()

    torch.manual_seed(5)
    moe = Experts().double()
    mon = hookstats.Monitor(moe, kinds=("forward",), process_group="world", flush_every=2, histogram="exp")
    calls = Calls(moe)
    g = _gen(50 + rank)
    for _ in range(4):
        moe(torch.randn(6 + 5 * rank, 4, generator=g, dtype=torch.float64) + (rank - 0.5))
        mon.step()
        calls.step += 1
    res["moe_records"] = mon.records()  # the last step's flush may still be merging: this read ends it
    mon.detach()
    res["moe_seen"] = calls.seen
    calls.remove()
    return res


def sec_mismatch(rank: int, world: int, out: Path) -> dict:
    """Records that differ between ranks: a record more, or from another module, merge (item 1); another dtype, or
    Monitors with other settings, raise on every rank, drop that flush's records, and the next flush merges."""
    import torch.distributed as dist

    import hookstats

    res = {"errors": {}, "after": {}}
    x = torch.randn(4, dtype=torch.float64, generator=_gen(5))

    def attempt(case: str, mon, feed) -> None:
        try:
            res["after"][case] = {"flushed": [dict(r) for r in mon.flush()]}
            res["errors"][case] = None
        except RuntimeError as e:
            res["errors"][case] = str(e)
            res["after"][case] = {"error_type": type(e).__name__}
        # recovery: the next step merges normally
        mon.step()
        feed(x)
        res["after"][case].update(next=[dict(r) for r in mon.flush()], failures=mon.merge_failures,
                                  dropped=mon.dropped_records)
        mon.detach()

    feed = Feed()
    mon = hookstats.Monitor(feed, kinds=("forward",), process_group="world")
    feed(x)
    if rank == 1:
        feed(x * 2)  # one extra call
    attempt("extra_record", mon, feed)

    two = nn.Sequential(Feed(), Feed())
    mon = hookstats.Monitor(two, kinds=("forward",), process_group="world")
    two[rank](x)  # as many records, from different modules
    attempt("other_module", mon, lambda x: two(x))

    feed = Feed()
    mon = hookstats.Monitor(feed, kinds=("forward",), process_group="world")
    feed(x if rank == 0 else x.float())  # the same record, different dtypes
    feed(x)
    attempt("other_dtype", mon, feed)

    feed = Feed()
    mon = hookstats.Monitor(feed, kinds=("forward",), process_group="world",
                            histogram=None if rank == 0 else (4, (-1.0, 1.0)))  # different settings
    feed(x)
    try:
        mon.flush()
        res["errors"]["other_settings"] = None
    except RuntimeError as e:
        res["errors"]["other_settings"] = str(e)
    # detach() after a failed merge: the hooks go, whatever the flush raises
    feed(x)
    try:
        mon.detach()
        res["detach_error"] = None
    except RuntimeError as e:
        res["detach_error"] = str(e)
    res["hooks_after_detach"] = len(feed._forward_hooks)
    res["failures_settings"] = mon.merge_failures

    # a rank that recorded on several devices (simulated: one CPU here) still joins the gather, so every rank raises
    from hookstats.monitor import recorder

    feed = Feed()
    mon = hookstats.Monitor(feed, kinds=("forward",), process_group="world")
    feed(x)
    if rank == 1:
        real = mon._rec.take

        def several(**kw):
            real(**kw)
            raise recorder.SeveralDevices("recorded on cpu and cuda:0")

        mon._rec.take = several
    try:
        mon.flush()
        res["errors"]["several_devices"] = None
    except RuntimeError as e:
        res["errors"]["several_devices"] = str(e)
    mon._rec.__dict__.pop("take", None)
    mon.step()
    feed(x)
    res["several_devices_next"] = [(r["ranks"], r["stats"]["numel"]) for r in mon.flush()]
    mon.detach()

    t = torch.ones(3)
    dist.all_reduce(t)  # the group still works
    res["all_reduce_after"] = t.tolist()
    return res


@contextlib.contextmanager
def count_collectives():
    """Counts calls of the torch.distributed collectives a Monitor could use, by name."""
    import torch.distributed as dist

    names = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast",
             "all_gather_object", "barrier")
    names = tuple(n for n in names if hasattr(dist, n))
    calls: list = []
    orig = {n: getattr(dist, n) for n in names}

    def wrap(n):
        def counting(*args, **kw):
            calls.append(n)
            return orig[n](*args, **kw)
        return counting

    for n in names:
        setattr(dist, n, wrap(n))
    try:
        yield calls
    finally:
        for n in names:
            setattr(dist, n, orig[n])


def sec_collectives(rank: int, world: int, out: Path) -> dict:
    """One collective per flush: step()'s flush (flush_every=1) starts one all_gather and returns with it pending; a
    read ends it without a collective; a flush whose payload outgrows the agreed capacity sends twice, once."""
    import hookstats

    torch.manual_seed(7)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    res = {"per_step": [], "pending": [], "read_calls": [], "counts": []}
    with count_collectives() as calls:
        mon = hookstats.Monitor(m, kinds=("forward", "backward_pre"), process_group="world", flush_every=1)
        g = _gen(70 + rank)
        for _ in range(3):
            m(torch.randn(2 + rank, 4, generator=g, dtype=torch.float64)).sum().backward()
            n0 = len(calls)
            mon.step()
            res["per_step"].append(calls[n0:])
            res["pending"].append(mon._merge.pending)
            n0 = len(calls)
            res["counts"].append(len(mon.records()))
            res["read_calls"].append(calls[n0:])
        mon.detach()
        feed = Feed()
        big = hookstats.Monitor(feed, kinds=("forward",), process_group="world", histogram="exp")
        res["big"] = []
        for step in range(3):
            for _ in range(8 if step < 2 else 1):  # exponent histograms of float64: 2,100+ counts a record
                feed(torch.randn(5, generator=g, dtype=torch.float64))
            n0 = len(calls)
            big.flush()
            res["big"].append(calls[n0:])
            big.step()
        res["big_records"] = len(big.records())
        res["big_capacity"] = big._merge._capacity
        big.detach()
    return res


class Poison(nn.Module):
    """Puts a NaN into its output on one rank, at one element, at one step."""

    def __init__(self, rank: int, at_rank: int, at_step: int, where: tuple):
        super().__init__()
        self.rank, self.at_rank, self.at_step, self.where, self.step = rank, at_rank, at_step, where, 0

    def forward(self, x):
        if self.rank == self.at_rank and self.step == self.at_step:
            x = x.clone()
            x[self.where] = math.nan
        return x


def sec_nonfinite(rank: int, world: int, out: Path) -> dict:
    """A NaN on rank 1 only: the merged first_nonfinite() names rank 1 on every rank, the summary too, and with
    locations=True the element and its rank."""
    import hookstats

    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 5), Poison(rank, 1, 1, (1, 2)), nn.Linear(5, 2)).double()
    mons = {loc: hookstats.Monitor(model, kinds=("forward",), process_group="world", locations=loc)
            for loc in (False, True)}
    calls = Calls(model)
    g = _gen(60 + rank)
    for step in range(3):
        model[1].step = step
        model(torch.randn(3 + rank, 4, generator=g, dtype=torch.float64))
        for mon in mons.values():
            mon.step()
        calls.step += 1
    calls.remove()
    res = {"seen": calls.seen}
    for loc, mon in mons.items():
        mon.flush()
        first = mon.first_nonfinite()
        res[loc] = {"first": dict(first) if first else None, "str": str(first), "summary": mon.summary_rows(),
                    "text": mon.summary(), "records": mon.records()}
        mon.detach()
    return res


# ---------------------------------------------------------------------------------------------------------------
# Scenario "parallel": DDP, FSDP2 and DTensor placements


def sec_ddp(rank: int, world: int, out: Path) -> dict:
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hookstats

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    ref = copy.deepcopy(model)
    ddp = DDP(model)
    kinds = ("forward", "backward_pre")
    mon = hookstats.Monitor(model, kinds=kinds, histogram=(8, (-2.0, 2.0)), process_group="world")
    cap = Capture(model, kinds)
    gen = _gen(7)  # the same global batch on every rank; each takes its chunk
    X = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    Y = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    xs, ys = X.chunk(world)[rank], Y.chunk(world)[rank]
    F.mse_loss(ddp(xs), ys).backward()  # DDP averages the grads: the grads of the whole batch's mean loss
    mon.flush()
    records = mon.records()
    mon.detach()
    cap.remove()

    full_fwd = Capture(ref, ("forward",))
    F.mse_loss(ref(X), Y).backward()  # the unsharded copy on the whole batch
    full_fwd.remove()

    ref_params = list(ref.parameters())
    totals, ref_totals, calls_norm = {}, {}, {}
    for p in (2.0, math.inf, 1.0, 3.0):
        with count_all_reduce() as calls:
            totals[p] = hookstats.get_total_norm([q.grad for q in ddp.parameters()], p)
        calls_norm[p] = len(calls)
        ref_totals[p] = torch.nn.utils.get_total_norm([q.grad for q in ref_params], p)
    grads_before = [q.grad.clone() for q in ddp.parameters()]
    max_norm = 0.5 * float(ref_totals[2.0])
    with count_all_reduce() as calls:
        tn = hookstats.clip_grad_norm_(ddp.parameters(), max_norm)
    rn = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
    return {
        "records": records, "seen": cap.seen, "full_forward": full_fwd.seen,
        "totals": {k: float(v) for k, v in totals.items()}, "ref_totals": {k: float(v) for k, v in ref_totals.items()},
        "total_dtype": str(totals[2.0].dtype), "calls_norm": calls_norm, "calls_clip": len(calls),
        "clip_total": float(tn), "ref_clip_total": float(rn), "max_norm": max_norm,
        "grads_before": grads_before, "grads": [q.grad.clone() for q in ddp.parameters()],
        "ref_grads": [q.grad.clone() for q in ref_params],
    }


class Branchy(nn.Module):
    """A branch used on rank 0 only (DDP find_unused_parameters=True)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x, use_b: bool):
        y = self.a(x)
        return y + self.b(x) if use_b else y


def sec_ddp_grads(rank: int, world: int, out: Path) -> dict:
    """The grad kind under DDP (Note [grad records across ranks]): the Monitor on the DDP module records the averaged
    grads once per syncing backward (none in no_sync()), with optimizer= the grads at the step, on the plain module
    without optimizer= each rank's local grads (merged as their concatenation); find_unused_parameters=True with a
    branch used on one rank."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hookstats

    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    ref = copy.deepcopy(model)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon_ddp = hookstats.Monitor(ddp, kinds=("grad",), process_group="world")
    mon_opt = hookstats.Monitor(model, kinds=("grad",), process_group="world", optimizer=opt)
    mon_local = hookstats.Monitor(model, kinds=("grad",), process_group="world")
    cap = Capture(model, ("grad",))
    gen = _gen(9)
    X = torch.randn(3, 8, 6, generator=gen, dtype=torch.float64)
    Y = torch.randn(3, 8, 3, generator=gen, dtype=torch.float64)
    # step 0: one backward; step 1: a no_sync() micro-batch, then a syncing one (grads accumulate)
    F.mse_loss(ddp(X[0].chunk(world)[rank]), Y[0].chunk(world)[rank]).backward()
    opt.step()
    grads0 = [q.grad.clone() for q in model.parameters()]
    F.mse_loss(ref(X[0]), Y[0]).backward()
    ref_grads = [[q.grad.clone() for q in ref.parameters()]]
    for mon in (mon_ddp, mon_opt, mon_local):
        mon.step()
    cap.step += 1
    opt.zero_grad()
    ref.zero_grad()
    with ddp.no_sync():
        F.mse_loss(ddp(X[1].chunk(world)[rank]), Y[1].chunk(world)[rank]).backward()
    F.mse_loss(ddp(X[2].chunk(world)[rank]), Y[2].chunk(world)[rank]).backward()
    opt.step()
    for i in (1, 2):
        F.mse_loss(ref(X[i]), Y[i]).backward()
    ref_grads.append([q.grad.clone() for q in ref.parameters()])
    res = {"names": [n for n, _ in model.named_parameters()], "ref_grads": ref_grads, "local_seen": cap.seen,
           "grads": [grads0, [q.grad.clone() for q in model.parameters()]]}
    for name, mon in (("ddp", mon_ddp), ("opt", mon_opt), ("local", mon_local)):
        mon.flush()
        res[name] = mon.records()
        mon.detach()
    cap.remove()

    torch.manual_seed(10)
    br = Branchy().double()
    dbr = DDP(br, find_unused_parameters=True)
    mon = hookstats.Monitor(dbr, kinds=("forward", "backward_pre", "grad"), process_group="world")
    x = torch.randn(4, 6, generator=_gen(12 + rank), dtype=torch.float64)
    dbr(x, use_b=rank == 0).square().mean().backward()
    mon.flush()
    res["unused"] = mon.records()
    res["unused_grads"] = {n: (None if q.grad is None else q.grad.clone()) for n, q in dbr.named_parameters()}
    mon.detach()
    return res


def tiny_models() -> dict:
    """Small transformers models with random weights (float64, no dropout, eager attention)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    return {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32, attn_implementation="eager")),
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(
            vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager")),
    }


def sec_models(rank: int, world: int, out: Path) -> dict:
    """Llama and GPT-2 (transformers, random weights) under DDP, each rank half of the batch: a Monitor on the DDP
    module (forward and grad records, merged) beside a single-process Monitor on a copy run on the whole batch, and
    hookstats.clip_grad_norm_ against torch's on that copy."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hookstats

    res = {}
    for name, make in tiny_models().items():
        torch.manual_seed(13)
        model = make().double()
        ref = copy.deepcopy(model)
        ddp = DDP(model)
        mon = hookstats.Monitor(ddp, kinds=("forward", "grad"), process_group="world")
        ref_mon = hookstats.Monitor(ref, kinds=("forward", "grad"))
        ids = torch.randint(0, 64, (4, 8), generator=_gen(14))
        mine = ids.chunk(world)[rank]
        ddp(input_ids=mine, labels=mine).loss.backward()
        ref(input_ids=ids, labels=ids).loss.backward()
        mon.flush()
        recs = mon.records()
        mon.detach()
        ref_recs = ref_mon.records()
        ref_mon.detach()
        ref_total = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
        max_norm = 0.5 * ref_total
        tn = hookstats.clip_grad_norm_(ddp.parameters(), max_norm)
        rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        err = max(float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-300))
                  for p, q in zip(model.parameters(), ref.parameters()))
        res[name] = {"records": recs, "ref_records": ref_recs, "clip_total": float(tn), "ref_clip_total": float(rn),
                     "grad_rel_error": err}
    return res


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def sec_fsdp(rank: int, world: int, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hookstats

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(2)
    # 7x5 and 7: rows 4 + 3 (uneven); 6x7 and 6: 3 + 3; 1x6 and 1: 1 + 0 (an empty shard on rank 1)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    ref = copy.deepcopy(model)
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    # after fully_shard: it replaces the parameters by DTensors, and hooks on the old ones would be lost
    mon = hookstats.Monitor(model, kinds=("forward", "grad"), process_group="world")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon_opt = hookstats.Monitor(model, kinds=("grad",), process_group="world", optimizer=opt)
    cap = Capture(model, ("forward",))
    X = torch.randn(8, 5, generator=_gen(11), dtype=torch.float64) * 2
    xs = X.chunk(world)[rank]
    model(xs).square().sum().backward()
    opt.step()  # optimizer=: the sharded grads at the step, merged into the full ones (not as replicas)
    (ref(X).square().sum() / world).backward()  # FSDP2 averages the grads over ranks
    mon.flush()
    records = mon.records()
    mon.detach()
    mon_opt.flush()
    opt_records = mon_opt.records()
    mon_opt.detach()
    cap.remove()

    names = [n for n, _ in model.named_parameters()]
    params, ref_params = list(model.parameters()), list(ref.parameters())
    local_shapes = [tuple(p.grad._local_tensor.shape) for p in params]
    all_dtensor = all(_is_dtensor(p) and _is_dtensor(p.grad) for p in params)
    full_grads = [p.grad.full_tensor().clone() for p in params]
    grads = [p.grad for p in params]

    totals, ref_totals, calls_norm, total_types = {}, {}, {}, {}
    for p in (2.0, math.inf, 1.0, 3.0):
        with count_all_reduce() as calls:
            t = hookstats.get_total_norm(grads, p)
        calls_norm[p] = len(calls)
        total_types[p] = type(t).__name__
        totals[p] = float(t)
        ref_totals[p] = float(torch.nn.utils.get_total_norm([q.grad for q in ref_params], p))

    res = {"records": records, "opt_records": opt_records, "seen": cap.seen, "names": names, "local_shapes": local_shapes,
           "all_dtensor": all_dtensor, "full_grads": full_grads, "totals": totals, "ref_totals": ref_totals,
           "calls_norm": calls_norm, "total_types": total_types}

    # clip_grad_norm_: clips (max_norm is half the total)
    max_norm = 0.5 * ref_totals[2.0]
    with count_all_reduce() as calls:
        tn = hookstats.clip_grad_norm_(params, max_norm)
    rn = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
    res.update(clip_total=float(tn), ref_clip_total=float(rn), calls_clip=len(calls),
               clip_total_type=type(tn).__name__,
               clipped=[p.grad.full_tensor().clone() for p in params], ref_clipped=[q.grad.clone() for q in ref_params])

    # clip_grads_with_norm_ given PyTorch's own total of the DTensor grads (a DTensor there)
    torch_total = torch.nn.utils.get_total_norm([p.grad for p in params])
    ref_total = torch.nn.utils.get_total_norm([q.grad for q in ref_params])
    max2 = 0.5 * float(ref_total)
    with count_all_reduce() as calls:
        hookstats.clip_grads_with_norm_(params, max2, torch_total)
    torch.nn.utils.clip_grads_with_norm_(ref_params, max2, ref_total)
    res.update(torch_total_type=type(torch_total).__name__, calls_with_norm=len(calls),
               with_norm=[p.grad.full_tensor().clone() for p in params],
               ref_with_norm=[q.grad.clone() for q in ref_params])

    # clip_grad_value_: a clip value half way between two grad magnitudes, so rounding cannot move an element across
    a = torch.cat([q.grad.reshape(-1).abs() for q in ref_params]).sort().values
    k = a.numel() // 2
    cv = float(0.5 * (a[k] + a[k + 1]))
    ref_count = int((a > cv).sum())
    with count_all_reduce() as calls:
        count = hookstats.clip_grad_value_(params, cv)
    torch.nn.utils.clip_grad_value_(ref_params, cv)
    res.update(clip_value=cv, count=int(count), ref_count=ref_count, calls_value=len(calls),
               value_clipped=[p.grad.full_tensor().clone() for p in params],
               ref_value_clipped=[q.grad.clone() for q in ref_params])
    return res


def sec_placements(rank: int, world: int, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import hookstats

    mesh = init_device_mesh("cpu", (world,))
    t = torch.randn(10, 3, generator=_gen(21), dtype=torch.float64)  # the same on every rank
    rep = distribute_tensor(t, mesh, [Replicate()])
    sh = distribute_tensor(t, mesh, [Shard(0)])
    res = {"t": t}
    with count_all_reduce() as calls:
        res["norm_rep"] = float(hookstats.get_total_norm([rep]))
    res["calls_rep"] = len(calls)
    with count_all_reduce() as calls:
        res["norm_rep_inf"] = float(hookstats.get_total_norm([rep], math.inf))
    res["calls_rep_inf"] = len(calls)
    with count_all_reduce() as calls:
        res["norm_rep_sh"] = float(hookstats.get_total_norm([rep, sh]))  # the norm of cat(t, t)
    res["calls_rep_sh"] = len(calls)

    # grads with a Replicate placement: count and clip without double counting
    p = nn.Parameter(distribute_tensor(torch.zeros(10, 3, dtype=torch.float64), mesh, [Replicate()]))
    p.grad = distribute_tensor(t.clone(), mesh, [Replicate()])
    cv = float(t.abs().reshape(-1).sort().values[14:16].mean())
    with count_all_reduce() as calls:
        res["count_rep"] = int(hookstats.clip_grad_value_([p], cv))
    res["calls_count_rep"] = len(calls)
    res["count_cv"] = cv
    p.grad = distribute_tensor(t.clone(), mesh, [Replicate()])
    res["clip_rep_total"] = float(hookstats.clip_grad_norm_([p], 0.5 * float(t.norm())))
    res["clip_rep_grad"] = p.grad.full_tensor().clone()

    # a Partial placement is refused (a norm of pending partial sums is not a partial norm)
    part = DTensor.from_local(t * 0.5, mesh, [Partial()])
    try:
        hookstats.get_total_norm([part])
        res["partial_error"] = None
    except ValueError as e:
        res["partial_error"] = str(e)

    # Monitor records of DTensors: the replicated one counted once, the sharded one whole
    holder = nn.ModuleDict({"rep": Const(rep), "sh": Const(sh)})
    mon = hookstats.Monitor(holder, kinds=("forward",), histogram="exp", process_group="world")
    holder["rep"]()
    holder["sh"]()
    mon.flush()
    res["records"] = mon.records()
    mon.detach()
    return res


# ---------------------------------------------------------------------------------------------------------------
# Scenario "per_sample": DP-SGD clipping under DDP


class Block(nn.Module):
    """Linear weights (their clipped gradient computed by the clip and delivered through autograd: Note
    [book-keeping]) beside biases and LayerNorm parameters (autograd's gradient plus the clip's correction)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):  # x [B, T, 6]
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def clipped_sums(model: nn.Module, x: torch.Tensor, y: torch.Tensor, max_norm: float, scale: float,
                 eps: float = 1e-6) -> tuple[list, torch.Tensor]:
    """sum_b min(1, max_norm / (||g_b|| + eps)) g_b over the samples of x, g_b the gradient of scale * (sample b's
    squared error summed over its tokens and outputs), one float64 backward per sample; and the coefficients."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    coefs = []
    for b in range(x.shape[0]):
        loss = scale * (model(x[b:b + 1]) - y[b:b + 1]).square().sum()
        gs = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum(g.square().sum() for g in gs))
        c = torch.clamp(max_norm / (norm + eps), max=1.0)
        coefs.append(c)
        for t, g in zip(total, gs):
            t.add_(c * g)
    return total, torch.stack(coefs)


CLIP_DDP = ("default", "bucket_view", "find_unused", "static_graph")  # DDP options of sec_ddp_clip


def sec_ddp_clip(rank: int, world: int, out: Path) -> dict:
    """PerSampleGradNorms(max_norm=) on the module inside DDP, each rank a chunk of the batch, two steps (the second
    with a no_sync() micro-batch first), under DDP's defaults, gradient_as_bucket_view, find_unused_parameters and
    static_graph (the last two: nothing deferred, Note [clipping under DDP]): the all-reduced .grad must be
    the average over the ranks of each rank's sum of clipped per-sample gradients (Note [clipping under DDP]); a
    DDP with a communication hook is refused."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hookstats

    gen = _gen(22)
    X = torch.randn(3, 8, 4, 6, generator=gen, dtype=torch.float64)  # 3 micro-batches of 8 samples of 4 tokens
    Y = torch.randn(3, 8, 4, 3, generator=gen, dtype=torch.float64)
    local = 8 // world
    res: dict = {}
    for how in CLIP_DDP:
        torch.manual_seed(21)
        model = Block().double()
        ref = copy.deepcopy(model)
        psn = hookstats.PerSampleGradNorms(model, max_norm=0.05)
        ddp = DDP(model, gradient_as_bucket_view=how == "bucket_view", find_unused_parameters=how == "find_unused",
                  static_graph=how == "static_graph")

        def loss(i: int) -> torch.Tensor:  # each rank's mean over its samples: DDP's average is the global mean
            x, y = X[i].chunk(world)[rank], Y[i].chunk(world)[rank]
            return (ddp(x) - y).square().sum((1, 2)).mean()

        got: dict = {"grads": [], "coef": [], "want": [], "want_coef": []}
        for micro in ([0], [1, 2]):
            ddp.zero_grad()
            for i in micro:
                with ddp.no_sync() if i != micro[-1] else contextlib.nullcontext():
                    loss(i).backward()
            got["grads"].append([p.grad.clone() for p in model.parameters()])
            got["coef"].append(psn.clip_coef().clone())
            psn.step()
            # the reference: every rank's chunks clipped per sample, summed per rank, averaged over the ranks (no
            # collective: every rank has the whole batch)
            want = [torch.zeros_like(p) for p in ref.parameters()]
            coefs = []
            for i in micro:
                for r in range(world):
                    sums, c = clipped_sums(ref, X[i].chunk(world)[r], Y[i].chunk(world)[r], 0.05, 1.0 / local)
                    for w, s_ in zip(want, sums):
                        w.add_(s_ / world)
                    if r == rank:
                        coefs.append(c)
            got["want"].append(want)
            got["want_coef"].append(torch.cat(coefs))
        got["names"] = [n for n, _ in model.named_parameters()]
        psn.remove()
        res[how] = got

    torch.manual_seed(21)
    model = Block().double()
    psn = hookstats.PerSampleGradNorms(model, max_norm=0.05)
    ddp = DDP(model)
    ddp.register_comm_hook(None, allreduce_hook)
    try:
        ddp(X[0].chunk(world)[rank])
        res["comm_hook"] = "no error"
    except RuntimeError as e:
        res["comm_hook"] = str(e)
    psn.remove()
    return res


SCENARIOS = {
    "monitor": [("model", sec_model), ("special", sec_special), ("flush_every", sec_flush_every),
                ("uneven", sec_uneven), ("mismatch", sec_mismatch), ("nonfinite", sec_nonfinite),
                ("collectives", sec_collectives)],
    "parallel": [("ddp", sec_ddp), ("ddp_grads", sec_ddp_grads), ("fsdp", sec_fsdp), ("placements", sec_placements),
                 ("models", sec_models)],
    "per_sample": [("ddp_clip", sec_ddp_clip)],
}


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    scenario, out = argv[0], Path(argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    results: dict = {}
    for name, fn in SCENARIOS[scenario]:
        t0 = time.perf_counter()
        try:
            results[name] = {"ok": True, **fn(rank, world, out)}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - t0
        torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
