"""Smoke stage of scripts/gpu_check.sh: every op of hookstats on a few shapes and dtypes on the GPU, against the
same op on the CPU kernels (which the CPU test suite checks against the float64 reference), in well under a minute.

Each check prints one line as it finishes and appends one row to --report at once, so that whatever happens later
(a crash, a hang killed by the stage's timeout) the rows of the checks that ran are kept. A check that fails does
not stop the others; one that leaves a CUDA error behind says so (later checks may then fail for that reason).
Exit status: 0 when every check passed, 1 otherwise, 2 when there is no usable GPU.

    python scripts/gpu_smoke.py --report $OUT/report.md
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import traceback

import torch

import hookstats

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
COUNT_FIELDS = {"numel", "nan_count", "inf_count", "zero_count"}
EXACT_FIELDS = COUNT_FIELDS | {"min", "max", "linf"}
CHECKS = []
DEV = "cuda"  # --device cpu runs the checks CPU against CPU: a self-test of this script on a machine without a GPU


def check(fn):
    CHECKS.append(fn)
    return fn


def rtol_of(dtype: torch.dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 2e-5


def inputs(dtype: torch.dtype, writable: bool = False) -> dict:
    """name -> CPU tensor: empty, one element, odd sizes, transposed, misaligned, past 2^20, channels_last, a NaN,
    and (read-only ops only) an expanded tensor."""
    g = torch.Generator().manual_seed(17)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    xs = {
        "empty": r(0),
        "one": r(1),
        "odd_4097": r(4097),
        "transposed_33x65": r(65, 33).t(),
        "misaligned": r(100003)[1:],
        "big_2^20+7": r(2**20 + 7) * 3,
        "channels_last": r(2, 3, 17, 19).contiguous(memory_format=torch.channels_last),
        "with_nan": torch.cat([r(999), torch.tensor([float("nan")], dtype=dtype)]),
    }
    if not writable:
        xs["expanded"] = r(1, 300).expand(50, 300)
    return xs


def same(a: float, b: float, rtol: float, atol: float = 0.0) -> bool:
    if a != a or b != b:
        return a != a and b != b
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(b)


def compare_stats(got: dict, want: dict, dtype: torch.dtype, what: str) -> None:
    rtol = rtol_of(dtype)
    for k, w in want.items():
        g = got[k]
        linf = want["linf"] if want["linf"] == want["linf"] and not math.isinf(want["linf"]) else 0.0
        if k in EXACT_FIELDS:
            ok = same(g, w, 0.0)
        elif k in ("sum", "mean"):  # the tests' rule: absolute, in units of l1 (mean: l1 / numel)
            l1 = want["l1"] if want["l1"] == want["l1"] and not math.isinf(want["l1"]) else 0.0
            scale = l1 / want["numel"] if k == "mean" and want["numel"] else l1
            ok = same(g, w, rtol, atol=rtol * scale)
        elif k == "std":
            ok = same(g, w, 10 * rtol, atol=1e-6 * linf)
        elif k == "var":
            ok = same(g, w, 20 * rtol, atol=1e-6 * linf * linf)
        else:
            ok = same(g, w, rtol)
        assert ok, f"{what}: {k} = {g!r} on CUDA, {w!r} on CPU"


def assert_tensors_close(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-30, equal_nan=True, msg=lambda m: f"{what}: {m}")


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


# ---------------------------------------------------------------------------------------------------------------
@check
def stats():
    for dtype in DTYPES:
        for name, x in inputs(dtype).items():
            compare_stats(hookstats.stats(x.to(DEV)).to_dict(), hookstats.stats(x).to_dict(), dtype, f"{dtype} {name}")


@check
def stats_hist():
    for dtype in DTYPES:
        for name, x in inputs(dtype).items():
            # 64 bins: thresholds by value (float64: a device table); 1000: a device table (Note [capture-safe tables])
            for h in ((64, (-2.0, 2.0)), (1000, (-2.0, 2.0)), "exp"):
                s_gpu, c_gpu = hookstats.stats(x.to(DEV), histogram=h)
                s_cpu, c_cpu = hookstats.stats(x, histogram=h)
                compare_stats(s_gpu.to_dict(), s_cpu.to_dict(), dtype, f"{dtype} {name} {h}")
                assert torch.equal(c_gpu.cpu(), c_cpu), f"{dtype} {name} {h}: histogram counts differ from the CPU's"


@check
def stats_into():
    for dtype in DTYPES:
        xs = inputs(dtype)
        h = hookstats.Histogram.range(32, -3.0, 3.0)
        buf = hookstats.stats_buffer(len(xs), device=DEV)
        hist = hookstats.histogram_buffer(len(xs), h, dtype=dtype, device=DEV)
        hexp = hookstats.histogram_buffer(len(xs), "exp", dtype=dtype, device=DEV)
        for i, x in enumerate(xs.values()):
            xc = x.to(DEV)
            hookstats.stats_into(xc, buf, i, hist=hexp, histogram="exp")
            hookstats.stats_into(xc, buf, i, hist=hexp, histogram="exp")  # written: the second leaves one count
            hookstats.stats_into(xc, buf, i, hist=hist, histogram=h)
            hookstats.stats_into(xc, buf, i, hist=hist, histogram=h, accumulate=True)  # added: two counts
        rows, hist, hexp = buf.cpu(), hist.cpu(), hexp.cpu()
        for i, (name, x) in enumerate(xs.items()):
            compare_stats(hookstats.Stats.from_row(rows[i]).to_dict(), hookstats.stats(x).to_dict(), dtype,
                          f"{dtype} {name} row")
            assert torch.equal(hist[i], 2 * hookstats.stats(x, histogram=h)[1]), f"{dtype} {name}: hist row"
            assert torch.equal(hexp[i], hookstats.stats(x, histogram="exp")[1]), f"{dtype} {name}: exp hist row"


@check
def stats_multi_into():
    for dtype in DTYPES:
        xs = list(inputs(dtype).values())
        h = hookstats.Histogram.range(32, -3.0, 3.0)
        buf = hookstats.stats_buffer(len(xs) + 2, device=DEV)
        hist = hookstats.histogram_buffer(len(xs) + 2, h, dtype=dtype, device=DEV)
        rows = [i + 2 for i in range(len(xs))]  # rows need not start at 0
        hookstats.stats_multi_into([x.to(DEV) for x in xs], buf, rows, hist=hist, histogram=h)
        buf, hist = buf.cpu(), hist.cpu()
        for x, r in zip(xs, rows):
            compare_stats(hookstats.Stats.from_row(buf[r]).to_dict(), hookstats.stats(x).to_dict(), dtype,
                          f"{dtype} {tuple(x.shape)} row {r}")
            assert torch.equal(hist[r], hookstats.stats(x, histogram=h)[1]), f"{dtype} {tuple(x.shape)}: hist row"


def mixed_list(writable: bool) -> list:
    out = []
    for dtype in DTYPES:
        out += [x for name, x in inputs(dtype, writable).items() if name != "with_nan"]
    return out


@check
def norms():
    xs = mixed_list(False)
    xs_gpu = [x.to(DEV) for x in xs]
    for p in (2.0, 1.0, math.inf, 3.0):
        per_g, tot_g = hookstats.norms(xs_gpu, p)
        per_c, tot_c = hookstats.norms(xs, p)
        assert_tensors_close(per_g, per_c, 2e-5, f"norms p={p} per tensor")
        assert_tensors_close(tot_g, tot_c, 2e-5, f"norms p={p} total")
        for x, xg in zip(xs[:3], xs_gpu[:3]):  # one tensor alone: the single-tensor launch
            assert_tensors_close(hookstats.norms([xg], p).total, hookstats.norms([x], p).total, 2e-5,
                                 f"norms p={p} of one {x.dtype}")


@check
def scale_by_norm_():
    xs = mixed_list(True)
    for total, policy in ((5.0, 0), (0.01, 0), (float("nan"), 1), (float("inf"), 0)):
        a = [x.clone() for x in xs]
        b = [x.clone().to(DEV) for x in xs]
        torch.ops.hookstats.scale_by_norm_(a, torch.tensor(total, dtype=torch.float64), 1.0, 1e-6, policy)
        torch.ops.hookstats.scale_by_norm_(b, torch.tensor(total, dtype=torch.float64, device=DEV), 1.0, 1e-6,
                                           policy)
        for x, y in zip(a, b):
            assert_tensors_close(y, x, eps(x.dtype), f"scale_by_norm_ total={total} {x.dtype} {tuple(x.shape)}")


@check
def clamp_count_():
    xs = mixed_list(True) + [x for x in inputs(torch.float32, True).values()]
    for lo, hi in ((-0.5, 0.7), (-10.0, 10.0), (0.0, 0.0)):
        a = [x.clone() for x in xs]
        b = [x.clone().to(DEV) for x in xs]
        ca = torch.ops.hookstats.clamp_count_(a, lo, hi)
        cb = torch.ops.hookstats.clamp_count_(b, lo, hi)
        assert int(cb) == int(ca), f"clamp_count_ [{lo}, {hi}]: {int(cb)} on CUDA, {int(ca)} on CPU"
        for x, y in zip(a, b):
            assert_tensors_close(y, x, 0.0, f"clamp_count_ [{lo}, {hi}] {x.dtype} {tuple(x.shape)}")
        one = inputs(torch.bfloat16, True)["odd_4097"]
        n_dev, n_cpu = hookstats.clip_value_(one.clone().to(DEV), lo, hi), hookstats.clip_value_(one.clone(), lo, hi)
        assert int(n_dev) == int(n_cpu), f"clip_value_ [{lo}, {hi}]: {int(n_dev)} vs {int(n_cpu)}"


@check
def clip_norm_paths():
    op = torch.ops.hookstats.clip_norm_.default
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float16):
        for name in ("one", "odd_4097", "big_2^20+7", "misaligned", "channels_last"):
            x = inputs(dtype, True)[name]
            for p in (2.0, math.inf):
                want = x.clone()
                want_total = op(want, p, 1.0, 1e-6, 0, 1)
                for path in (0, 1, 3, 2):
                    y = x.clone().to(DEV)
                    try:
                        total = op(y, p, 1.0, 1e-6, 0, path)
                    except ValueError as e:  # path 2 on what cannot take the fused path
                        assert path == 2 and (name in ("misaligned", "channels_last") or DEV == "cpu"), \
                            f"{name} path {path}: {e}"
                        continue
                    assert_tensors_close(total, want_total, 2e-5, f"clip_norm_ {dtype} {name} p={p} path {path} norm")
                    assert_tensors_close(y, want, 2 * eps(dtype) + 2e-5, f"clip_norm_ {dtype} {name} path {path}")


def twins(params: list, device) -> list:
    """Copies of parameters and their grads on device."""
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone().to(device))
        q.grad = p.grad.detach().clone().to(device)
        out.append(q)
    return out


@check
def clip_grad_norm_():
    torch.manual_seed(0)
    shapes = [(64, 32), (64,), (8, 64), (8,), (3, 5, 7)]
    for dtypes in ((torch.float32,), (torch.float32, torch.bfloat16, torch.float16, torch.float64)):
        params = [torch.nn.Parameter(torch.randn(s).to(dtypes[i % len(dtypes)])) for i, s in enumerate(shapes)]
        for p in params:
            p.grad = torch.randn(p.shape).to(p.dtype) * 3
        for norm_type in (2.0, math.inf):
            ref = twins(params, "cpu")
            t_cpu = hookstats.clip_grad_norm_(ref, 1.0, norm_type)
            work = twins(params, DEV)
            t_gpu = hookstats.clip_grad_norm_(work, 1.0, norm_type)
            assert t_gpu.dtype == t_cpu.dtype and t_gpu.device.type == DEV
            assert_tensors_close(t_gpu, t_cpu, 1e-5 if t_cpu.dtype != torch.bfloat16 else 1e-2,
                                 f"clip_grad_norm_ {dtypes} total")
            for a, b in zip(work, ref):
                assert_tensors_close(a.grad, b.grad, 2 * eps(b.dtype) + 2e-5, f"clip_grad_norm_ {b.dtype} grad")
        pt = twins(params, DEV)
        t_pt = torch.nn.utils.clip_grad_norm_(pt, 1.0, foreach=True)
        work = twins(params, DEV)
        t_hs = hookstats.clip_grad_norm_(work, 1.0)
        tol = 1e-5 if len(dtypes) == 1 else 2e-2
        assert_tensors_close(t_hs, t_pt, tol, "clip_grad_norm_ vs torch.nn.utils")


@check
def monitor():
    def tiny():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    x = torch.randn(8, 16)
    recs = {}
    for key, dev in (("cpu", "cpu"), ("gpu", DEV)):
        m = tiny().to(dev)
        mon = hookstats.Monitor(m, kinds=("forward", "backward_pre"), histogram="exp", slots=64)
        m(x.to(dev)).square().sum().backward()
        mon.step()
        mon.flush()
        recs[key] = {(r["module"], r["kind"]): r for r in mon.records()}
        mon.detach()
    assert recs["gpu"].keys() == recs["cpu"].keys() and len(recs["cpu"]) >= 6, sorted(recs["gpu"])
    for key, want in recs["cpu"].items():
        got = recs["gpu"][key]
        for f in ("numel", "nan_count", "inf_count"):
            assert got["stats"][f] == want["stats"][f], (key, f)
        for f in ("l2", "max", "mean"):
            assert same(got["stats"][f], want["stats"][f], 1e-4, 1e-6), (key, f, got["stats"][f], want["stats"][f])
        assert sum(got["histogram"]) == got["stats"]["numel"], key


@check
def monitor_graph_replays():
    """Note [monitor graph replays]: a captured monitored forward, replayed with new data: one step of records per
    replay, each equal to the eager statistics of its data; and stats_multi_into's one-launch rows equal stats_into's
    (Note [multi-tensor stats launches])."""
    if DEV == "cpu":
        return
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(DEV)
    mon = hookstats.Monitor(m, kinds=("forward",), histogram="exp", slots=8)
    x = torch.randn(8, 16, device=DEV)
    m(x)
    mon.step()
    mon.flush()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        m(x)
    mon.step()
    want = {}
    for i in range(3):
        x.copy_(torch.randn(8, 16, device=DEV) * (i + 1))
        g.replay()
        with torch.no_grad():
            want[mon.current_step] = float(m[0](x).max())
        mon.step()
    recs = mon.flush()
    got = {r["step"]: r["stats"]["max"] for r in recs if r["module"] == "0"}
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for st, v in want.items():
        assert same(got[st], v, 1e-5, 1e-6), (st, got[st], v)
    mon.detach()
    xs = [torch.randn(n, device=DEV) for n in (1, 7, 4096, 70001, 3 * 2**20 + 5)] + [torch.randn(64, 33, device=DEV).t()]
    a, b = hookstats.stats_buffer(len(xs), device=DEV), hookstats.stats_buffer(len(xs), device=DEV)
    hookstats.stats_multi_into(xs, a, range(len(xs)))
    for i, t in enumerate(xs):
        hookstats.stats_into(t, b, i)
    assert torch.equal(a.view(torch.int64), b.view(torch.int64)), (a - b).abs().max()


@check
def no_host_sync():
    if DEV == "cpu":
        return
    x = torch.randn(2**16, device=DEV)
    ps = [torch.nn.Parameter(torch.randn(s, device=DEV)) for s in ((100,), (30, 7))]
    for p in ps:
        p.grad = torch.randn_like(p)
    buf = hookstats.stats_buffer(4, device=DEV)

    def ops():
        hookstats.stats_into(x, buf, 0)
        hookstats.stats(x, histogram="exp")
        hookstats.norms([p.grad for p in ps])
        hookstats.clip_norm_(x, 1.0)
        hookstats.clip_grad_norm_(ps, 1.0)
        hookstats.clip_grad_value_(ps, 0.5)
        hookstats.clip_grads_with_norm_(ps, 1.0, torch.tensor(3.0))  # a CPU total

    ops()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@check
def graph_capture():
    if DEV == "cpu":
        return
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(DEV)
    static_x = torch.randn(16, 32, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m(static_x).square().sum().backward()
        hookstats.clip_grad_norm_(m.parameters(), 0.5)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m.zero_grad(set_to_none=False)
        m(static_x).square().sum().backward()
        total = hookstats.clip_grad_norm_(m.parameters(), 0.5)
    for scale in (1.0, 5.0):
        new_x = torch.randn(16, 32, device=DEV) * scale
        static_x.copy_(new_x)
        graph.replay()
        twin = copy.deepcopy(m)
        twin.zero_grad(set_to_none=True)
        twin(new_x).square().sum().backward()
        want = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
        assert same(float(total), float(want), 1e-5), (float(total), float(want))
        for p, q in zip(m.parameters(), twin.parameters()):
            assert_tensors_close(p.grad, q.grad, 1e-5, "captured clip_grad_norm_ grads")


# ---------------------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", default=None, help="markdown file to append one row per check to")
    ap.add_argument("-k", default="", help="run only the checks whose name contains this")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a self-test of the checks")
    args = ap.parse_args()
    global DEV
    DEV = args.device

    def sync() -> None:
        if DEV == "cuda":
            torch.cuda.synchronize()

    def emit(line: str) -> None:
        print(line, flush=True)
        if args.report:
            with open(args.report, "a") as f:
                f.write(line + "\n")

    if DEV == "cuda" and not (torch.cuda.is_available() and hookstats.cuda_kernels_built()):
        emit(f"smoke: skipped: no usable GPU (torch.cuda.is_available()={torch.cuda.is_available()}, "
             f"hookstats.cuda_kernels_built()={hookstats.cuda_kernels_built()})")
        return 2
    emit("")
    emit(f"| smoke check | result | s | detail |")
    emit("|---|---|---|---|")
    failed = ran = 0
    start = time.time()
    for fn in CHECKS:
        if args.k not in fn.__name__:
            continue
        t0 = time.time()
        status, detail = "PASS", ""
        try:
            fn()
            sync()
        except AssertionError as e:
            status, detail = "FAIL", str(e).splitlines()[0][:300] if str(e) else "assertion failed"
        except Exception as e:  # noqa: BLE001 - a smoke stage reports every error and carries on
            status, detail = "ERROR", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            if "CUDA error" in str(e) or "illegal" in str(e):
                detail += " (a CUDA error: later checks may fail because of it)"
            traceback.print_exc()
        failed += status != "PASS"
        ran += 1
        emit(f"| {fn.__name__} | {status} | {time.time() - t0:.1f} | {detail.replace('|', '/')} |")
    emit("")
    emit(f"smoke: {ran - failed} passed, {failed} failed in {time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
