"""The Monitor's hook path under CUDA graph capture: no allocation and no host sync inside a hook, so a training
step with a Monitor attached can be captured, and each replay rewrites the captured records' rows with the new
statistics. Runs on the GPU machine (scripts/gpu_check.sh); skipped without CUDA."""
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
