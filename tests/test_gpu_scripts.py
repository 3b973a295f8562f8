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


# -- scripts/gpu_check.sh, dry runs -------------------------------------------------------------------------------
# The script runs as it is, with PYTHON set to a fake interpreter: each stage's command (the preflight's probes, the
# build, smoke, pytest, gpu_bench, gpu_large_models) is answered from FAKE_<stage>="rc:seconds" and logged in order,
# so the stage order, caps, budget and report are checked in seconds, without a GPU or a CUDA build.
FAKE_PYTHON = r'''#!/usr/bin/env bash
echo "$*" >> "$FAKE_CALLS"
act() {  # act STAGE: sleep and exit as FAKE_<STAGE> says (rc:seconds, default 0:0)
  local v="FAKE_$1"; local s=${!v:-0:0}
  echo "fake $1: $*"
  sleep "${s#*:}"
  exit "${s%%:*}"
}
live() {  # a pytest stage: its outcomes to the live log at once (a cut run's too), then act
  local v="FAKE_$1"; local s=${!v:-0:0}
  echo "PASSED tests/fake_$1.py::test_a" >> "$HOOKSTATS_LIVE_LOG"
  [[ ${s%%:*} == 1 ]] && printf 'FAILED tests/fake_%s.py::test_b\n    AssertionError: fake\n' "$1" >> "$HOOKSTATS_LIVE_LOG"
  act "$1"
}
bench() {  # bench STAGE ARGS...: a gpu_bench run, its table to --out first
  local name=$1 prev= a; shift
  for a in "$@"; do [[ $prev == --out ]] && echo "## fake table $name" > "$a"; prev=$a; done
  act "$name"
}
case "$*" in
  *"gpu_preflight.py --built"*)
    if [[ -n ${FAKE_IMPORT_ERROR:-} ]]; then echo "import: FAILED: $FAKE_IMPORT_ERROR"; exit 1; fi
    echo "import: ok (fake)"; echo "cuda_kernels_built: ${FAKE_KERNELS:-True}";;
  *gpu_preflight.py*)
    echo "python: fake"; echo "torch: 2.11.0+cu130, CUDA 13.0"; echo "cuda: ${FAKE_CUDA:-True}"
    echo "module xdist: ${FAKE_XDIST:-3.8.0}"; echo "missing: ${FAKE_MISSING:-none}";;
  *"setup.py build_ext --inplace"*) act build;;
  *gpu_smoke.py*) echo "| fake_smoke_check | PASS | 0.0 | |" >> "${@: -1}"; act smoke;;
  *"-m pytest"*--ignore=*) live tests;;
  *"-m pytest"*test_cuda_graphs.py*) live graphs;;
  *"gpu_bench.py --sections bandwidth"*) bench bandwidth "$@";;
  *"gpu_bench.py --sections monitor"*) bench monitor "$@";;
  *"gpu_bench.py --sections clip,where,distribution"*) bench extra "$@";;
  *gpu_large_models.py*) bench large "$@";;
  *) echo "fake python: unexpected call: $*"; exit 99;;
esac
'''
STAGE_NAMES = ["preflight", "build", "smoke", "graphs", "bandwidth", "monitor", "tests", "extra", "large"]


def run_gpu_check(tmp_path, **env_over):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_")}
    env.update(PYTHON=str(fake), OUT=str(out), FAKE_CALLS=str(tmp_path / "calls"))
    env.update({k: str(v) for k, v in env_over.items()})
    t = time.time()
    r = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_check.sh")], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=env)
    report = (out / "report.md").read_text()
    calls = (tmp_path / "calls").read_text().splitlines()
    summary = {}
    for line in report.split("## Summary")[1].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0] in STAGE_NAMES:
            summary[cells[0]] = cells[1]
    return r, report, calls, summary, out, time.time() - t


def test_gpu_check_runs_every_stage_in_order_and_reports_each(tmp_path):
    r, report, calls, summary, out, _ = run_gpu_check(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert list(summary) == STAGE_NAMES and set(summary.values()) == {"ok"}, summary
    order = ["gpu_preflight.py", "setup.py build_ext", "gpu_preflight.py --built", "gpu_smoke.py", "test_cuda_graphs",
             "--sections bandwidth", "--sections monitor", "--ignore=", "--sections clip,where,distribution",
             "gpu_large_models.py --quick"]
    assert len(calls) == len(order) and all(want in got for want, got in zip(order, calls)), calls
    graphs, rest = calls[4], calls[7]
    for f in ("tests/test_cuda_graphs.py", "tests/test_cuda_streams.py", "tests/test_cuda_smem.py"):
        assert f in graphs and f"--ignore={f}" in rest
    assert "-m cuda and not slow" in graphs and "-n 8" in graphs and "-p pytest_live" in rest
    for title in ("## fake table bandwidth", "## fake table monitor", "## fake table extra", "## fake table large",
                  "| fake_smoke_check | PASS |", "- torch: 2.11.0+cu130", "- import: ok (fake)"):
        assert title in report, title
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(p.is_file() for p in out.iterdir()), files  # what the device tool returns
    assert {"report.md", "build.log", "smoke.log", "graphs.log", "bench.log", "tests.log", "tests_live.log"} >= set(files)
    assert "fake graphs" in (out / "graphs.log").read_text() and "fake tests" in (out / "tests.log").read_text()


def test_gpu_check_a_cut_or_failed_stage_keeps_the_others(tmp_path):
    """The smoke fails and the graph tests outlive their cap: both say so (the cut stage with the outcomes it logged
    before its cap), every later stage still runs, and the exit status is 1 for the failure alone."""
    r, report, calls, summary, _, secs = run_gpu_check(tmp_path, FAKE_smoke="1:0", FAKE_graphs="0:60",
                                                       GRAPHS_CAP_S=2)
    assert r.returncode == 1, r.stdout[-3000:]
    assert summary["smoke"] == "failed (rc 1)" and summary["graphs"] == "cut at its 2 s cap"
    assert all(summary[s] == "ok" for s in ("build", "bandwidth", "monitor", "tests", "extra", "large")), summary
    graphs_part = report.split("## 3.")[1].split("## 4.")[0]
    assert "- 1 passed, 0 failed" in graphs_part
    assert secs < 30
    (tmp_path / "b").mkdir()
    r, report, _, summary, _, _ = run_gpu_check(tmp_path / "b", FAKE_graphs="0:60", GRAPHS_CAP_S=2)
    assert r.returncode == 0 and summary["graphs"] == "cut at its 2 s cap", summary  # a cut alone fails nothing


def test_gpu_check_failed_tests_are_listed_in_the_report(tmp_path):
    r, report, _, summary, _, _ = run_gpu_check(tmp_path, FAKE_tests="1:0")
    assert r.returncode == 1 and summary["tests"] == "failed (rc 1)"
    part = report.split("## 6.")[1]
    assert "- 1 passed, 1 failed" in part and "FAILED tests/fake_tests.py::test_b" in part and "AssertionError" in part


def test_gpu_check_stops_stages_when_the_budget_is_spent(tmp_path):
    r, report, calls, summary, _, _ = run_gpu_check(tmp_path, FAKE_build="0:3", BUDGET_S=5, MIN_STAGE_S=3)
    assert r.returncode == 0
    assert summary["build"] == "ok"
    assert all(summary[s] == "not run (budget spent)" for s in STAGE_NAMES[2:]), summary
    assert not any("pytest" in c or "gpu_smoke" in c for c in calls)


def test_gpu_check_reports_a_missing_import_as_what_it_is(tmp_path):
    """Issue 33: with numpy missing, the build's import check said "no CUDA kernels in this build"."""
    err = "ModuleNotFoundError: No module named 'numpy'"
    r, report, _, summary, _, _ = run_gpu_check(tmp_path, FAKE_MISSING="numpy", FAKE_IMPORT_ERROR=err)
    assert r.returncode == 1
    assert summary["preflight"] == "failed (missing: numpy)"
    assert summary["build"] == f"failed (built, but {err})"
    assert all(summary[s] == "not run (import hookstats failed)" for s in STAGE_NAMES[2:]), summary
    assert "no CUDA kernels" not in report


def test_gpu_check_without_a_gpu_builds_and_skips_the_gpu_stages(tmp_path):
    r, report, _, summary, _, _ = run_gpu_check(tmp_path, FAKE_CUDA="False")
    assert r.returncode == 0 and summary["build"] == "ok"
    assert all(summary[s] == "skipped (no GPU)" for s in STAGE_NAMES[2:]), summary
    (tmp_path / "k").mkdir()
    r, _, _, summary, _, _ = run_gpu_check(tmp_path / "k", FAKE_KERNELS="False")
    assert r.returncode == 1 and summary["build"].startswith("failed (a GPU, but no CUDA kernels")


def test_gpu_preflight_probes_this_machine():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_preflight.py")], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env)
    import torch

    assert r.returncode == 0, r.stdout + r.stderr
    assert f"torch: {torch.__version__}" in r.stdout and f"cuda: {torch.cuda.is_available()}" in r.stdout
    assert "module numpy: " in r.stdout and "\nmissing: " in r.stdout
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_preflight.py"), "--built"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env=env)
    import hookstats

    assert r.returncode == 0 and "import: ok" in r.stdout
    assert f"cuda_kernels_built: {hookstats.cuda_kernels_built()}" in r.stdout


def test_gpu_preflight_reports_a_missing_numpy(tmp_path):
    """numpy made unimportable (a package of that name that raises as a missing one would): both probes name it."""
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_preflight.py")], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env)
    assert "module numpy: MISSING (ModuleNotFoundError: No module named 'numpy')" in r.stdout, r.stdout + r.stderr
    assert "\nmissing: numpy" in r.stdout
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_preflight.py"), "--built"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 1
    assert "import: FAILED: ModuleNotFoundError: No module named 'numpy'" in r.stdout, r.stdout + r.stderr


def test_gpu_bench_runs_the_sections_asked_for_in_that_order(tmp_path, monkeypatch):
    sys.path.insert(0, SCRIPTS)
    try:
        import gpu_bench
    finally:
        sys.path.remove(SCRIPTS)
    ran = []
    for name, (_, fn) in gpu_bench.SECTIONS.items():
        monkeypatch.setattr(gpu_bench, fn, (lambda n: lambda dev: ran.append(n) or ["", f"## {n} ok"])(name))
    monkeypatch.setattr(gpu_bench.torch.cuda, "get_device_name", lambda dev=None: "test device")
    out_md = tmp_path / "bench.md"
    monkeypatch.setattr(sys, "argv", ["gpu_bench.py", "--out", str(out_md), "--sections", "monitor,bandwidth"])
    gpu_bench.main()
    assert ran == ["monitor", "bandwidth"]
    assert out_md.read_text().index("## monitor ok") < out_md.read_text().index("## bandwidth ok")
    monkeypatch.setattr(sys, "argv", ["gpu_bench.py", "--out", str(out_md), "--sections", "bandwith"])
    try:
        gpu_bench.main()
        raise AssertionError("an unknown section must be refused")
    except SystemExit as e:
        assert e.code == 2
