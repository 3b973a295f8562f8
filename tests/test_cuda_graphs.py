"""The Monitor's hook path under CUDA graph capture: no allocation and no host sync inside a hook, so a training
step with a Monitor attached can be captured, and each replay rewrites the captured records' rows with the new
statistics. Runs on the GPU machine (scripts/gpu_check.sh); skipped without CUDA."""
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


@pytest.mark.parametrize("histogram", [None, "exp", (16, (-2.0, 2.0))])
def test_monitor_step_is_capturable_and_replays_update_the_rows(histogram):
    m = _model()
    mon = hookstats.Monitor(m, kinds=("forward", "backward_pre"), histogram=histogram, slots=64)
    static_x = torch.randn(16, 32, device="cuda")
    outs = {}

    def keep(name):
        def hook(mod, args, out):
            outs[name] = out.detach()
        return hook

    # Warm up on a side stream (the usual recipe), so buffers exist before capture; then empty them.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            m.zero_grad(set_to_none=False)
            m(static_x).square().sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    mon.flush()
    n_before = len(mon.records())
    handles = [mod.register_forward_hook(keep(name)) for name, mod in m.named_modules() if name]
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.cuda.graph(graph):  # raises on a host sync during capture
        m.zero_grad(set_to_none=False)
        m(static_x).square().sum().backward()
    for h in handles:
        h.remove()
    # Replay with new data: the captured kernels rewrite the same rows, so the pending records now hold the new
    # statistics.
    new_x = torch.randn(16, 32, device="cuda") * 3
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    recs = mon.records()[n_before:]
    fwd = {r["module"]: r for r in recs if r["kind"] == "forward"}
    with torch.no_grad():
        expect_hidden = m[1](m[0](new_x))
        expect = {"0": m[0](new_x), "1": expect_hidden, "2": m[2](expect_hidden)}
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
    assert any(r["kind"] == "backward_pre" for r in recs)
    mon.detach()


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
@pytest.mark.parametrize("histogram", ["exp", (16, (-2.0, 2.0))])
def test_stats_into_hist_row_is_written_on_every_replay(histogram):
    """Note [histogram rows] (csrc/core/bindings.h): a captured stats_into leaves, after each replay, the histogram
    of that replay's input in its row, as it does the statistics; with accumulate=True the replays' counts add up."""
    h = hookstats._ops.as_histogram(histogram)
    x = torch.randn(4097, device="cuda")
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
        x.copy_(torch.randn(4097, device="cuda") * k)
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
