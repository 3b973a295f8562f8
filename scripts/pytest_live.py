"""pytest plugin for scripts/gpu_check.sh (`-p pytest_live` with scripts/ on PYTHONPATH): appends each test's outcome
to the file named by $HOOKSTATS_LIVE_LOG the moment it is known (a failure with the last lines of its report), so a
run cut by its time cap still says what ran, what failed and why. With pytest-xdist only the controller writes."""
from __future__ import annotations

import os

_PATH = os.environ.get("HOOKSTATS_LIVE_LOG")
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")


def _write(line: str) -> None:
    if _PATH and not _WORKER:
        with open(_PATH, "a") as f:
            f.write(line.rstrip("\n") + "\n")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        outcome = report.outcome
        if report.when != "call" and outcome == "failed":
            outcome = "error"
        if report.when == "teardown" and outcome == "skipped":
            return
        _write(f"{outcome.upper()} {report.nodeid}")
        if outcome in ("failed", "error"):
            text = str(report.longrepr) if report.longrepr is not None else ""
            tail = [ln for ln in text.splitlines() if ln.strip()][-6:]
            for ln in tail:
                _write(f"    {ln[:300]}")


def pytest_sessionfinish(session, exitstatus):
    _write(f"SESSION {session.testscollected} collected, exit status {int(exitstatus)}")
