"""A Monitor's flush against rows written on other streams than the current one (Note [flush across streams] in
hookstats/monitor/recorder.py): records made under `torch.cuda.stream(s)` (forward hooks, and backward hooks, which
autograd runs on the forward ops' stream), graph replays on a side stream and scalars logged there, each queued
behind a long GPU sleep on that stream, then flushed with no `wait_stream`: the flush must read every row after its
kernel ran, and its NaN reset must not erase the next step's rows. Issue 33: the flush waited only for the current
stream, so it read NaN rows here. Runs on the GPU machine (scripts/gpu_check.sh); skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

import hookstats
from hookstats import reference

from _testing import cuda_ready

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA GPU and the CUDA kernels")]

SLEEP_CYCLES = 100_000_000  # ~50 ms of one SM at ~2 GHz: far longer than the flush takes to enqueue its copy


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()


def _expected(m, x):
    with torch.no_grad():
        h0 = m[0](x)
        h1 = m[1](h0)
        out = m[2](h1)
        return {"": out, "0": h0, "1": h1, "2": out}  # "": the model itself


def _check_forward(recs, m, x):
    fwd = {r["module"]: r for r in recs if r["kind"] == "forward"}
    assert sorted(fwd) == ["", "0", "1", "2"]
    for name, t in _expected(m, x).items():
        ref = reference.stats(t).to_dict()
        got = fwd[name]["stats"]
        assert got["numel"] == ref["numel"] and got["nan_count"] == 0, name
        for key in ("sum", "l2", "min", "max"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6 * (1 + ref["l1"])), (name, key)


def test_records_on_side_streams_are_flushed_without_wait_stream():
    """Three steps, each on its own side stream behind a sleep, each flushed at once from the default stream: every
    flush holds its step's forward rows and grad_output rows (the last layer's is all ones: loss = out.sum())."""
    m = _model()
    mon = hookstats.Monitor(m, kinds=("forward", "backward_pre"), histogram=(16, (-2.0, 2.0)))
    for i in range(3):
        s = torch.cuda.Stream()
        x = torch.randn(16, 32, device="cuda") * (i + 1)
        s.wait_stream(torch.cuda.current_stream())  # x is ready on s (the input's order, not the flush's)
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP_CYCLES)
            m(x).sum().backward()
        mon.step()
        recs = mon.flush()  # no torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()  # for the references only
        assert {r["step"] for r in recs} == {i}
        _check_forward(recs, m, x)
        last = [r for r in recs if r["kind"] == "backward_pre" and r["module"] == "2"]
        assert len(last) == 1
        st = last[0]["stats"]
        assert st["numel"] == 16 * 8 and st["min"] == 1.0 and st["max"] == 1.0 and st["nan_count"] == 0
        assert sum(last[0]["histogram"]) == 16 * 8
        m.zero_grad()
    mon.detach()


def test_graph_replays_on_a_side_stream_are_flushed_without_wait_stream():
    """Ring rows written by replays of a captured forward launched on a side stream (behind a sleep)."""
    m = _model()
    mon = hookstats.Monitor(m, kinds=("forward",), slots=8)
    static_x = torch.randn(16, 32, device="cuda")
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(2):
            m(static_x)
            mon.step()
    torch.cuda.current_stream().wait_stream(warm)
    mon.flush()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        m(static_x)
    mon.step()
    datas = {}

    def replay_behind_a_sleep(stream, x):
        static_x.copy_(x)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            graph.replay()
        datas[mon.current_step] = x

    s = torch.cuda.Stream()
    for i in range(3):
        replay_behind_a_sleep(s, torch.randn(16, 32, device="cuda") * (i + 2))
        # the next step's number (a fill on the current stream, Note [monitor graph replays]) and the next copy_
        # into static_x wait for this replay
        torch.cuda.current_stream().wait_stream(s)
        mon.step()
    replay_behind_a_sleep(torch.cuda.Stream(), torch.randn(16, 32, device="cuda") * 7)
    recs = mon.flush()  # the last replay is still queued behind its sleep: the flush reads its ring count too
    torch.cuda.synchronize()
    assert sorted({r["step"] for r in recs}) == sorted(datas)
    for st, x in datas.items():
        _check_forward([r for r in recs if r["step"] == st], m, x)
    mon.detach()


def test_a_scalar_logged_on_a_side_stream_is_flushed_without_wait_stream():
    m = _model()
    mon = hookstats.Monitor(m, kinds=("forward",))
    x = torch.randn(16, 32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        loss = m(x).square().mean()
        mon.log("loss", loss)
    mon.step()
    recs = mon.flush()
    scalars = mon.scalars()
    torch.cuda.synchronize()
    _check_forward(recs, m, x)
    assert [v["tag"] for v in scalars] == ["loss"]
    assert scalars[0]["value"] == pytest.approx(float(loss.detach()), rel=1e-6)
    mon.detach()
