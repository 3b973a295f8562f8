"""The GPU machine's scripts, checked where CI runs (no GPU): a session lent a GPU has 15 minutes of device time in
all, so a stale check in scripts/gpu_smoke.py (one expected histogram rows to add up across plain stats_into calls,
the rule before issue 14's written rows, and would have failed its first GPU run) must fail here first.

- gpu_smoke.py --device cpu: every smoke check, CPU against CPU (the script's own self-test mode).
- gpu_bench.py's by-distribution section on small tensors with a host timer: its reference checks (64 and 1,024
  bins against the float64 rule, norms against float64) and its report lines, on every dtype it measures.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")


def test_gpu_smoke_self_test_passes_on_cpu():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, SCRIPTS, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_smoke.py"), "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "0 failed" in r.stdout


def test_gpu_bench_distribution_section_runs_on_small_cpu_tensors(monkeypatch):
    sys.path.insert(0, SCRIPTS)
    try:
        import gpu_bench
    finally:
        sys.path.remove(SCRIPTS)
    make = gpu_bench.make_distribution
    # past 2^20 values, so that the section's 2^20-value reference slice is a slice
    monkeypatch.setattr(gpu_bench, "make_distribution", lambda name, n, dev, dtype: make(name, 2**20 + 4099, dev, dtype))

    def host_time(fn, reps=20):
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    monkeypatch.setattr(gpu_bench, "cuda_time", host_time)
    lines = gpu_bench.distribution_section("cpu")
    text = "\n".join(lines)
    for dtype in ("float32", "bfloat16", "float64"):
        assert f"### {dtype}" in text
    assert text.count("(target >= 75%)") == 3 and text.count("(target <= 1.3x)") == 3


def test_gpu_bench_reports_a_failed_section_and_keeps_the_others(tmp_path, monkeypatch):
    """Every section runs in run_section: one failed assertion becomes a FAILED line, and main() still runs and saves
    the sections after it (the clip and Monitor results survive a failed bandwidth check), then exits non-zero."""
    sys.path.insert(0, SCRIPTS)
    try:
        import gpu_bench
    finally:
        sys.path.remove(SCRIPTS)

    def broken(dev):
        assert 1 + 1 == 3, "a stale check"

    out, ok = gpu_bench.run_section("Bandwidth", broken, "cpu")
    assert not ok and len(out) == 2
    assert "## Bandwidth: FAILED: AssertionError: a stale check" in out[1] and "broken" in out[1]
    assert gpu_bench.run_section("Fine", lambda dev: ["", "fine"], "cpu") == (["", "fine"], True)
    ran = []
    for name in ("bandwidth_section", "clip_section", "monitor_section", "where_section", "distribution_section"):
        monkeypatch.setattr(gpu_bench, name, broken if name == "bandwidth_section" else
                            (lambda n: lambda dev: ran.append(n) or ["", f"## {n} ok"])(name))
    monkeypatch.setattr(gpu_bench.torch.cuda, "get_device_name", lambda dev=None: "test device")
    out_md = tmp_path / "bench.md"
    monkeypatch.setattr(sys, "argv", ["gpu_bench.py", "--out", str(out_md)])
    try:
        gpu_bench.main()
        raise AssertionError("main() should exit non-zero after a failed section")
    except SystemExit as e:
        assert "1 gpu_bench section(s) failed" in str(e)
    assert ran == ["clip_section", "monitor_section", "where_section", "distribution_section"]
    text = out_md.read_text()
    assert "## Bandwidth: FAILED" in text and "## monitor_section ok" in text and "## distribution_section ok" in text
