"""The Monitor's hook path under CUDA graph capture: no host sync inside a hook, so a training step with a Monitor
attached can be captured, and each replay records a new step's rows (Note [monitor graph replays] in
csrc/monitor/recorder.h; the CPU side of it is tests/test_graph_replays.py). Runs on the GPU machine (scripts/gpu_check.sh); skipped without CUDA."""
import copy

import pytest
import torch

import hookstats
from hookstats import reference

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not (torch.cuda.is_available() and hookstats.cuda_kernels_built()),
                                                   reason="needs a CUDA GPU and the CUDA kernels")]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()


def _warm_up(fn, n=2):
    """The usual recipe: eager iterations on a side stream before capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(s)


def _check_forward_records(recs, m, x, histogram):
    fwd = {r["module"]: r for r in recs if r["kind"] == "forward"}
    with torch.no_grad():
        hidden = m[1](m[0](x))
        expect = {"0": m[0](x), "1": hidden, "2": m[2](hidden)}
    for name, t in expect.items():
        ref = reference.stats(t).to_dict()
        got = fwd[name]["stats"]
        assert got["numel"] == ref["numel"]
        assert got["max"] == pytest.approx(ref["max"], rel=1e-5)
        assert got["l2"] == pytest.approx(ref["l2"], rel=1e-5)
        if histogram is not None:
            want = reference.histogram_of(t, hookstats._ops.as_histogram(histogram)).tolist()
            assert sum(fwd[name]["histogram"]) == ref["numel"]
            diff = sum(abs(a - b) for a, b in zip(fwd[name]["histogram"], want))
            assert diff <= 2  # values on a bin edge may round differently between the GEMMs


@pytest.mark.parametrize("histogram", [None, "exp", (16, (-2.0, 2.0))])
def test_each_replay_of_a_captured_step_records_its_own_step(histogram):
    """Note [monitor graph replays]: warm-up steps, a capture (which records nothing: no kernel runs), then replays
    with new data and mon.step() after each: every replay's records carry its step and its data's statistics."""
    m = _model()
    mon = hookstats.Monitor(m, kinds=("forward", "backward_pre"), histogram=histogram, slots=8)
    static_x = torch.randn(16, 32, device="cuda")

    def step():
        m.zero_grad(set_to_none=False)
        m(static_x).square().sum().backward()

    def eager_step():
        step()
        mon.step()

    _warm_up(eager_step)  # steps 0, 1
    mon.flush()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):  # raises on a host sync during capture
        step()
    mon.step()  # the capture's step (2) records nothing
    assert mon._rec.rec.num_rings == 1
    datas = {}
    for i in range(3):  # steps 3, 4, 5
        new_x = torch.randn(16, 32, device="cuda") * (i + 1)
        static_x.copy_(new_x)
        graph.replay()
        datas[mon.current_step] = new_x
        mon.step()
    recs = mon.flush()
    assert sorted({r["step"] for r in recs}) == [3, 4, 5]
    for st, x in datas.items():
        _check_forward_records([r for r in recs if r["step"] == st], m, x, histogram)
        assert any(r["kind"] == "backward_pre" and r["step"] == st for r in recs)
    step(); mon.step()  # eager again, after the replays
    assert {r["step"] for r in mon.flush()} == {6}
    mon.detach()


@pytest.mark.parametrize("histogram", [None, (16, (-2.0, 2.0))])
def test_ring_rows_survive_temporaries_the_capture_freed_before_its_first_hook(histogram):
    """Note [ring memory] (csrc/cuda/ring_cuda.cu): the ring is allocated at the capture's first record. Temporaries
    freed earlier in the same capture (one in each of the allocator's pools) are rewritten by every replay; a ring
    on their memory would lose the rows of earlier replays. Four replays with new data, one flush: every replay's
    rows equal the statistics of an eager twin (same weights, no hooks) on that replay's input."""
    m = _model()
    twin = copy.deepcopy(m)
    mon = hookstats.Monitor(m, kinds=("forward",), histogram=histogram, slots=8)
    static_x = torch.randn(16, 32, device="cuda")

    def step():
        small = torch.full((64 * 1024,), 7.0, device="cuda")  # 256 KB: the small-block pool, like a ring
        large = torch.full((16 * 1024 * 1024,), 7.0, device="cuda")  # 64 MB: the large-block pool
        zero = (small.sum() + large.sum()) * 0.0
        del small, large  # freed inside the capture, before the first hook
        m(static_x + zero)

    def eager_step():
        step()
        mon.step()

    _warm_up(eager_step)
    mon.flush()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        step()
    mon.step()
    datas = {}
    for i in range(4):
        x = torch.randn(16, 32, device="cuda") * (i + 1) + i
        static_x.copy_(x)
        graph.replay()
        datas[mon.current_step] = x
        mon.step()
    recs = mon.flush()
    assert sorted({r["step"] for r in recs}) == sorted(datas)
    for st, x in datas.items():
        fwd = {r["module"]: r for r in recs if r["step"] == st and r["kind"] == "forward"}
        with torch.no_grad():
            h0 = twin[0](x)
            h1 = twin[1](h0)
            expect = {"0": h0, "1": h1, "2": twin[2](h1)}
        for name, t in expect.items():
            ref = reference.stats(t).to_dict()
            got = fwd[name]["stats"]
            assert got["numel"] == ref["numel"] and got["nan_count"] == 0
            for key in ("sum", "l2", "min", "max"):
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6 * (1 + ref["l1"])), (st, name, key)
            if histogram is not None:
                want = reference.histogram_of(t, hookstats._ops.as_histogram(histogram)).tolist()
                assert sum(fwd[name]["histogram"]) == ref["numel"]
                assert sum(abs(a - b) for a, b in zip(fwd[name]["histogram"], want)) <= 2  # GEMM rounding at edges
    mon.detach()


def test_replays_beyond_the_ring_are_counted():
    m = _model()
    mon = hookstats.Monitor(m, kinds=("forward",), slots=4)
    x = torch.randn(16, 32, device="cuda")
    _warm_up(lambda: (m(x), mon.step()))
    mon.flush()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m(x)
    mon.step()
    for _ in range(7):
        graph.replay()
        mon.step()
    with pytest.warns(RuntimeWarning, match="3 replays"):
        recs = mon.flush()
    assert len({r["step"] for r in recs}) == 4 and mon.dropped_replays == 3
    mon.detach()


def test_captured_training_step_with_optimizer_grads():
    """The whole step captured: forward, backward, the "grad" kind's one stats_multi_into at opt.step(), the
    optimizer itself (capturable Adam). Each replay records its grads, equal to the grads left after it."""
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, capturable=True)
    mon = hookstats.Monitor(m, kinds=("forward", "grad"), optimizer=opt, histogram="exp", slots=8)
    static_x = torch.randn(16, 32, device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        m(static_x).square().sum().backward()
        opt.step()

    _warm_up(lambda: (step(), mon.step()), n=3)
    mon.flush()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    mon.step()
    for i in range(3):
        static_x.copy_(torch.randn(16, 32, device="cuda"))
        graph.replay()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
        st = mon.current_step
        mon.step()
        recs = [r for r in mon.flush() if r["kind"] == "grad" and r["step"] == st]
        assert len(recs) == len(grads)
        for r in recs:
            ref = reference.stats(grads[r["module"]]).to_dict()
            assert r["stats"]["l2"] == pytest.approx(ref["l2"], rel=1e-6)
    mon.detach()


# One block (writes its row itself, Note [single-block rows] in csrc/cuda/kernels/stats_launch.h) and several (zeroed row,
# atomics)
SIZES = [1000, 3 * 4096 + 5]


@pytest.mark.parametrize("n", SIZES)
def test_stats_into_ring_in_a_graph_writes_a_new_row_each_replay(n):
    """The op-level mechanism (Note [ring rows]): a captured _ring_advance, then stats_into with ring."""
    x = torch.randn(n, device="cuda")
    out = torch.full((4, 1, 13), float("nan"), dtype=torch.float64, device="cuda")
    hist = torch.zeros(4, 1, hookstats._ops.as_histogram("exp").length(torch.float32), dtype=torch.int64,
                       device="cuda")
    state = torch.zeros(2, dtype=torch.int64, device="cuda")
    steps = torch.zeros(4, dtype=torch.int64, device="cuda")
    step = torch.zeros(1, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.hookstats._ring_advance(state, steps, step)
        hookstats.stats_into(x, out, 0, hist, 0, "exp", ring=state[1:])
    for i in range(6):
        x.copy_(torch.randn(n, device="cuda") * (i + 1))
        step.fill_(10 + i)
        graph.replay()
        want = hookstats.stats_buffer(1, device="cuda")
        hookstats.stats_into(x, want, 0)
        assert torch.equal(out[i % 4, 0], want[0])
        assert torch.equal(hist[i % 4, 0], hookstats.exp_histogram(x))
    assert state.tolist() == [6, 1] and steps.tolist() == [14, 15, 12, 13]


def test_monitor_hooks_do_not_sync():
    m = _model()
    x = torch.randn(16, 32, device="cuda")
    with hookstats.Monitor(m, kinds=("forward", "backward_pre", "grad"), histogram="exp", slots=256) as mon:
        m(x).sum().backward()
        mon.step()
        mon.flush()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                m(x).sum().backward()
                mon.log("loss_like", x.sum())
                mon.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert len(mon.records()) > 0


# Multi-tensor ops (norms, scale_by_norm_, clamp_count_) under capture: the tensor table is written by fill kernels
# captured into the graph, so replays never read a stale or freed table (csrc/cuda/clip_cuda.cu,
# Note [capture-safe tables]).

def _eager_clip(m, x, max_norm):
    """Grads of the step on x, clipped by torch.nn.utils (the oracle), and its total norm."""
    twin = copy.deepcopy(m)
    twin.zero_grad(set_to_none=True)
    twin(x).square().sum().backward()
    total = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm, foreach=True)
    return [p.grad for p in twin.parameters()], total


def _check_replays(graph, m, static_x, outs, max_norm):
    for scale in (1.0, 3.0, 0.01):  # 0.01: a total under max_norm, so nothing is scaled
        new_x = torch.randn(static_x.shape, device="cuda") * scale
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        want_grads, want_total = _eager_clip(m, new_x, max_norm)
        assert float(outs["total"]) == pytest.approx(float(want_total), rel=1e-5), scale
        for p, w in zip(m.parameters(), want_grads):
            torch.testing.assert_close(p.grad, w, rtol=1e-5, atol=1e-7)
        per = outs["per"].tolist()
        for p, v in zip(m.parameters(), per):  # norms of the clipped grads, captured after the clip
            assert v == pytest.approx(float(torch.linalg.vector_norm(p.grad.double())), rel=1e-5)
        # Eager calls on the same grads after the replays see the right tables too.
        eager_per, _ = hookstats.norms([p.grad for p in m.parameters()])
        assert eager_per.tolist() == pytest.approx(per, rel=1e-12)


def test_clip_grad_norm_capture_replays_after_a_warm_up_step():
    m = _model()
    static_x = torch.randn(16, 32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # the usual eager warm-up, hookstats ops included (their tables get cached)
        for _ in range(2):
            m.zero_grad(set_to_none=False)
            m(static_x).square().sum().backward()
            hookstats.clip_grad_norm_(m.parameters(), 0.5)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    outs = {}
    with torch.cuda.graph(graph):
        m.zero_grad(set_to_none=False)
        m(static_x).square().sum().backward()
        outs["total"] = hookstats.clip_grad_norm_(m.parameters(), 0.5)
        outs["per"] = hookstats.norms([p.grad for p in m.parameters()]).per_tensor
    _check_replays(graph, m, static_x, outs, 0.5)


def test_multi_tensor_ops_capture_on_grads_allocated_in_the_graph():
    """No hookstats call before capture, and grads set to None: they are allocated inside the graph, so no table for
    them exists before capture. clip_grad_value_ (clamp_count_) is captured too."""
    m = _model()
    static_x = torch.randn(16, 32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m(static_x).square().sum().backward()  # warms up the model's kernels only
    torch.cuda.current_stream().wait_stream(s)
    m.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    outs = {}
    with torch.cuda.graph(graph):
        m(static_x).square().sum().backward()
        outs["count"] = hookstats.clip_grad_value_(m.parameters(), 1e30)  # counts nothing, writes nothing
        outs["total"] = hookstats.clip_grad_norm_(m.parameters(), 0.5)
        outs["per"] = hookstats.norms([p.grad for p in m.parameters()]).per_tensor
    _check_replays(graph, m, static_x, outs, 0.5)
    assert int(outs["count"]) == 0


def test_clip_norm_captures_the_two_launch_path():
    """Inside auto's fused size window, a captured clip_norm_ takes the two launches; requiring the fused path
    (path 2) during capture is a clear error, raised before anything is captured."""
    x = torch.randn(2**20, device="cuda")  # 4 MiB
    op = torch.ops.hookstats.clip_norm_.default
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total = op(x, 2.0, 1.0, 1e-6, 0, 0)
    for scale in (2.0, 1e-9):
        x0 = torch.randn(2**20, device="cuda") * scale
        x.copy_(x0)
        graph.replay()
        torch.cuda.synchronize()
        norm = float(torch.linalg.vector_norm(x0.double()))
        assert float(total) == pytest.approx(norm, rel=1e-5)
        torch.testing.assert_close(x, (x0.double() * min(1.0, 1.0 / (norm + 1e-6))).float(), rtol=2e-6, atol=0)
    with pytest.raises(ValueError, match="not under CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            op(x, 2.0, 1.0, 1e-6, 0, 2)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("histogram", ["exp", (16, (-2.0, 2.0))])
def test_stats_into_hist_row_is_written_on_every_replay(histogram, n):
    """Note [histogram rows] (csrc/core/bindings.h): a captured stats_into leaves, after each replay, the histogram
    of that replay's input in its row, as it does the statistics; with accumulate=True the replays' counts add up."""
    h = hookstats._ops.as_histogram(histogram)
    x = torch.randn(n, device="cuda")
    out = hookstats.stats_buffer(2, device="cuda")
    written = hookstats.histogram_buffer(1, h, device="cuda")
    summed = hookstats.histogram_buffer(1, h, device="cuda")

    def step():
        hookstats.stats_into(x, out, 0, hist=written, histogram=h)
        hookstats.stats_into(x, out, 1, hist=summed, histogram=h, accumulate=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    summed.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    total = torch.zeros(h.length(torch.float32), dtype=torch.int64)
    for k in (1, 2, 3):
        x.copy_(torch.randn(n, device="cuda") * k)
        graph.replay()
        torch.cuda.synchronize()
        want = reference.histogram_of(x.cpu(), h)
        total += want
        assert torch.equal(written[0].cpu(), want), f"replay {k}: the written row is not this replay's histogram"
        assert torch.equal(summed[0].cpu(), total), f"replay {k}: the accumulated row is not the replays' sum"
        ref = hookstats.stats_buffer(1)
        hookstats.stats_into(x.cpu(), ref, 0)
        torch.testing.assert_close(out[0].cpu(), ref[0], rtol=1e-5, atol=1e-6, equal_nan=True)
        torch.testing.assert_close(out[1].cpu(), ref[0], rtol=1e-5, atol=1e-6, equal_nan=True)


def _edge_data(n, h, dtype, gen):
    """Values on the bin edges of h (as dtype), their neighbours either side, ReLU-style zeros and spread values:
    the inputs the thresholds decide (Note [exact bin thresholds])."""
    k = torch.arange(h.bins + 1, dtype=torch.float64)
    edges = (h.lo + (h.hi - h.lo) * k / h.bins).to(dtype)
    on = edges[torch.randint(0, h.bins + 1, (n,), generator=gen)]
    away = torch.where(torch.rand(n, generator=gen) < 0.5, -float("inf"), float("inf")).to(dtype)
    near = torch.nextafter(on, away)  # one step of dtype itself (a float32 step would round back to the edge)
    spread = (torch.randn(n, generator=gen, dtype=torch.float64) * (h.hi - h.lo) / 3).to(dtype)
    pick = torch.randint(0, 4, (n,), generator=gen)
    x = torch.where(pick == 0, on, torch.where(pick == 1, near, torch.where(pick == 2, spread, torch.zeros_like(on))))
    x[:3] = torch.tensor([float("nan"), h.lo, h.hi], dtype=torch.float64).to(dtype)
    return x


# Each case its own range, so that its device table is new to the process when the test starts.
TABLE_CASES = [(torch.float64, 64, -4.0), (torch.float64, 1000, -4.25), (torch.float32, 1000, -4.5),
               (torch.bfloat16, 2048, -4.75), (torch.float32, 8192, -5.0)]


@pytest.mark.parametrize("first", ["in_capture", "eager"])
@pytest.mark.parametrize("dtype,bins,lo", TABLE_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_device_threshold_tables_in_graphs_and_streams(dtype, bins, lo, first):
    """Note [capture-safe tables] (csrc/cuda/device_tables.cuh): float64 inputs and histograms of more than 512 bins
    read their exact thresholds from a device table. Whether a range's table is first uploaded inside a capture or
    cached eagerly before it, every replay, every later eager call on the capture's stream and on another stream,
    and stats_multi_into count exactly what torch.histc on float64 counts."""
    lo = lo - (1 / 1024 if first == "eager" else 0.125)  # a range no other test uses (a fresh table)
    h = hookstats.Histogram.range(bins, lo, -lo)
    gen = torch.Generator().manual_seed(bins)
    n = 3 * 4096 + 7
    x = _edge_data(n, h, dtype, gen).cuda()
    y = _edge_data(1000, h, dtype, gen).cuda()
    out = hookstats.stats_buffer(2, device="cuda")
    hist = hookstats.histogram_buffer(2, h, dtype, device="cuda")

    def step():
        hookstats.stats_into(x, out, 0, hist=hist, histogram=h)
        hookstats.stats_multi_into([y], out, [1], hist=hist, histogram=h)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    if first == "eager":
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        assert torch.equal(hist[0].cpu(), reference.histogram_of(x.cpu(), h))
        assert torch.equal(hist[1].cpu(), reference.histogram_of(y.cpu(), h))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        step()
    for k in range(3):
        x.copy_(_edge_data(n, h, dtype, gen))
        y.copy_(_edge_data(1000, h, dtype, gen))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(hist[0].cpu(), reference.histogram_of(x.cpu(), h)), f"replay {k}"
        assert torch.equal(hist[1].cpu(), reference.histogram_of(y.cpu(), h)), f"replay {k}, stats_multi_into"
    for stream in (s, torch.cuda.Stream()):
        x.copy_(_edge_data(n, h, dtype, gen))
        with torch.cuda.stream(stream):
            got = hookstats.histogram(x, bins, range=(lo, -lo))
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), reference.histogram_of(x.cpu(), h))


def test_device_threshold_tables_past_the_cache():
    """More ranges than the table cache holds (64 entries, least recently used evicted in stream order): every
    histogram still counts exactly, the evicted ranges again when they come back."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(20000, generator=gen, dtype=torch.float64)
    x[::7] = 0.0
    xs = x.cuda()
    for rnd in range(2):
        for k in range(80):
            lo = -1.0 - k / 64
            got = hookstats.histogram(xs, 600 + k, range=(lo, -lo))
            want = reference.histogram_of(x, hookstats.Histogram.range(600 + k, lo, -lo))
            assert torch.equal(got.cpu(), want), f"round {rnd}, range {k}"
            f32 = hookstats.histogram(xs.float(), 600 + k, range=(lo, -lo))
            assert torch.equal(f32.cpu(), reference.histogram_of(x.float(), hookstats.Histogram.range(600 + k, lo, -lo)))
