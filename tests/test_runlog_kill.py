"""A run that ends badly keeps its log (Note [what survives a terminated run], Note [compaction a kill cannot break]).

Each case runs a real training loop in a subprocess and ends it as a scheduler or a user would: SIGTERM (with the
default disposition, with the user's handler), Ctrl-C (SIGINT: KeyboardInterrupt), or SIGKILL at a named point of
the Parquet writer's compaction or of a flush (HOOKSTATS_TEST_KILL_AT). Then the log is read by every reader
(read_log, pandas, pyarrow.dataset, DuckDB, Polars): each must see every record the run made, once.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")
ds = pytest.importorskip("pyarrow.dataset")

from hookstats.runlog import ParquetWriter, read_jsonl, read_log, read_run  # noqa: E402
from hookstats.runlog.parquet import log_paths  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The run: a 3-layer MLP, forward + grad records every step, a scalar, flush_every=FLUSH. It writes, before each
# step's hooks run, the number of records so far to RUN_DIR/progress (so the parent knows what the run had), and
# after STOP_AT steps waits for the parent's signal, mid-step (between the forward and the backward).
_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    from torch import nn
    import hookstats
    from hookstats.runlog import JSONLWriter, ParquetWriter

    run_dir, mode, steps, flush_every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if mode == "no-exchange":
        import hookstats.runlog.durable as durable
        durable.EXCHANGE = False
    if mode == "user-handler":
        def handler(signum, frame):
            open(os.path.join(run_dir, "user-handler-ran"), "w").close()
            sys.exit(3)
        signal.signal(signal.SIGTERM, handler)
    class Slow:  # an exporter that takes its time while `on`
        on = False

        def write_block(self, block, scalars):
            if self.on:
                time.sleep(0.5)

    slow = Slow()
    models = [nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(2 if mode == "two" else 1)]
    mons = []
    for i, model in enumerate(models):
        ex = [ParquetWriter(os.path.join(run_dir, "log.parquet" if i == 0 else f"log{i}.parquet"))]
        if i == 0:
            ex += [JSONLWriter(os.path.join(run_dir, "log.jsonl")), slow]
        mons.append(hookstats.Monitor(model, kinds=("forward", "grad"), flush_every=flush_every, exporters=ex,
                                      export_queue=1 if mode == "in-submit" else 8))
    for step in range(steps):
        for model, mon in zip(models, mons):
            loss = model(torch.randn(4, 6)).square().sum()
            if step == steps - 1 and mode in ("wait", "user-handler", "two", "sigint", "in-drain", "in-submit"):
                if mode == "in-drain":  # the signal lands while the main thread waits for the export thread
                    slow.on = True
                    mon.flush()
                    print("waiting", flush=True)
                    mon.drain()
                    slow.on = False
                elif mode == "in-submit":  # ... or inside a flush, waiting for a place in a full export queue
                    slow.on = True
                    mon.flush()  # the export thread takes it and sleeps
                    model(torch.randn(4, 6))
                    mon.flush()  # queued (export_queue=1)
                    model(torch.randn(4, 6))
                    print("waiting", flush=True)
                    mon.flush()  # waits in submit() until the first is written
                    slow.on = False
                else:
                    print("waiting", flush=True)  # mid-step: the forward recorded, the backward not yet
                time.sleep(60)
            loss.backward()
            mon.log("loss", loss.detach())
            mon.step()
    for mon in mons:
        mon.flush()
    print("records", sum(len(m.records()) for m in mons), flush=True)
    for mon in mons:
        mon.detach()
    print("done", flush=True)
""")



def _per_step() -> tuple:
    """(forward records a step, grad records a step) of the script's model."""
    import torch
    from torch import nn

    import hookstats

    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    mon = hookstats.Monitor(model, kinds=("forward", "grad"))
    model(torch.randn(4, 6)).square().sum().backward()
    kinds = [r["kind"] for r in mon.records()]
    mon.detach()
    return kinds.count("forward"), kinds.count("grad")


def _run(run_dir, mode: str, steps: int, flush_every: int, kill_at: str = "", sig=None):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HOOKSTATS_TEST_KILL_AT", None)
    if kill_at:
        env["HOOKSTATS_TEST_KILL_AT"] = kill_at
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(run_dir), mode, str(steps), str(flush_every)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        if sig is not None:
            line = proc.stdout.readline()
            assert line.strip() == "waiting", line + proc.stderr.read()
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


def _readers():
    """name -> records dir -> seq column (numpy)"""
    out = {"read_log": lambda p: read_log(p).column("seq").to_numpy(),
           "pandas": lambda p: pd.read_parquet(p, columns=["seq"])["seq"].to_numpy(),
           "pyarrow.dataset": lambda p: ds.dataset(p).to_table(columns=["seq"]).column("seq").to_numpy()}
    try:
        import duckdb

        out["duckdb"] = lambda p: np.array([r[0] for r in duckdb.sql(f"select seq from '{p}/*.parquet'").fetchall()])
    except ImportError:
        pass
    try:
        import polars as pl

        out["polars"] = lambda p: pl.scan_parquet(p).select("seq").collect()["seq"].to_numpy()
    except ImportError:
        pass
    return out


def _check_once(path, n: int) -> None:
    """Every reader sees the records with seq 0..n-1, each once."""
    for name, read in _readers().items():
        seq = np.sort(read(str(path)))
        assert len(seq) == n and (seq == np.arange(n)).all(), f"{name}: {len(seq)} rows ({len(np.unique(seq))} " \
                                                               f"distinct), want {n}"


def _hidden(run_dir) -> list:
    return sorted(n for n in os.listdir(run_dir) if n.startswith("."))


# -- SIGKILL: at every point of the compaction, and mid-flush ------------------------------------------------------

@pytest.mark.parametrize("kill_at,mode", [
    ("compact-writing", "plain"),   # the compacted file half written (hidden, beside the dataset)
    ("compact-staged", "plain"),    # the staging directory complete, not swapped in
    ("compact-swapped", "plain"),   # swapped in; the old content (under the staging name) not removed
    ("compact-moved", "no-exchange"),    # no renameat2: the dataset moved away, the staging one not yet in place
    ("compact-renamed", "no-exchange"),  # no renameat2: in place, the old one not removed
])
def test_sigkill_during_compaction_keeps_every_record_once(tmp_path, kill_at, mode):
    steps, flush_every = 12, 3
    rc, out, err = _run(tmp_path, mode, steps, flush_every, kill_at=kill_at)
    assert rc == -signal.SIGKILL, (rc, out, err)
    n = int(out.split("records")[1].split()[0])  # flushed and written before detach: all of them are on disk
    path = tmp_path / "log.parquet"
    if kill_at == "compact-moved":  # the one window without renameat2: the dataset directory is missing
        assert not path.exists()
        assert read_log(path).num_rows == n and read_log(tmp_path).num_rows == n  # read_log finds the staged one
    else:
        _check_once(path, n)
    assert not any(n.endswith(".tmp") for n in os.listdir(path)) if path.exists() else True
    assert len(read_run(path).scalars) == steps
    # the next writer on the log (a resumed run) finishes or removes what the kill left: nothing hidden stays
    w = ParquetWriter(path)
    w.close()
    assert _hidden(tmp_path) == [], _hidden(tmp_path)
    _check_once(path, n)
    assert len(pd.read_parquet(log_paths(path).scalars)) == steps
    assert sorted(os.listdir(path))[-1].count("-") in (1, 2)


def test_sigkill_mid_flush_leaves_the_flushes_before_it(tmp_path):
    fwd, grad = _per_step()
    steps, flush_every = 12, 3
    rc, out, err = _run(tmp_path, "plain", steps, flush_every, kill_at="part-written:5")  # records or scalars
    assert rc == -signal.SIGKILL, (rc, out, err)
    path = tmp_path / "log.parquet"
    t = read_log(path)
    # scalars-1, records-1, scalars-2, records-2, then the kill at scalars-3: two flushes of 3 steps each
    assert t.num_rows == 2 * flush_every * (fwd + grad)
    _check_once(path, t.num_rows)
    assert [n for n in _hidden(tmp_path) if n.endswith(".tmp")]  # the cut file: hidden, outside the dataset
    ParquetWriter(path).close()
    assert _hidden(tmp_path) == []


# -- SIGTERM and Ctrl-C -----------------------------------------------------------------------------------------

def _check_complete(run_dir, steps: int, name="log.parquet", jsonl=True, last_forwards=1) -> None:
    """The log holds every record of steps 0..steps-2 and the forward records of the last (interrupted) step; it
    was closed (compacted into one file); the JSONL log beside it holds the same."""
    fwd, grad = _per_step()
    path = run_dir / name
    t = read_log(path)
    per_step = np.bincount(t.column("step").to_numpy(), minlength=steps)
    assert per_step[:steps - 1].tolist() == [fwd + grad] * (steps - 1), per_step
    assert per_step[steps - 1] == last_forwards * fwd, per_step
    _check_once(path, t.num_rows)
    assert len(os.listdir(path)) == 1 and os.listdir(path)[0].count("-") == 2  # closed: compacted
    assert _hidden(run_dir) == []
    if jsonl:
        log = read_jsonl(run_dir / "log.jsonl")
        assert len(log.records) == t.num_rows and log.bad_lines == 0


def test_sigterm_with_the_default_action_flushes_closes_and_still_terminates(tmp_path):
    steps = 71  # flush_every=50: before the fix the log ended at step 49
    rc, out, err = _run(tmp_path, "wait", steps, 50, sig=signal.SIGTERM)
    assert rc == -signal.SIGTERM, (rc, out, err)  # the signal's default action still happened
    _check_complete(tmp_path, steps)


@pytest.mark.parametrize("mode,forwards", [("in-drain", 1), ("in-submit", 3)])
def test_sigterm_inside_hookstats_code(tmp_path, mode, forwards):
    """Landing in drain(), the handler flushes at once; landing in a flush (waiting in submit() for the export
    queue), it waits until the flush returned (the signal is sent again a few ms later), so nothing is flushed
    twice or out of order."""
    steps = 31
    rc, out, err = _run(tmp_path, mode, steps, 10, sig=signal.SIGTERM)
    assert rc == -signal.SIGTERM and "Traceback" not in err, (rc, out, err)
    _check_complete(tmp_path, steps, last_forwards=forwards)
    seq = read_log(tmp_path / "log.parquet").column("seq").to_numpy()
    assert (np.diff(seq) == 1).all()  # in flush order


def test_sigterm_chains_to_the_users_handler(tmp_path):
    steps = 71
    rc, out, err = _run(tmp_path, "user-handler", steps, 50, sig=signal.SIGTERM)
    assert rc == 3, (rc, out, err)  # the user's handler ran (sys.exit(3)) after the flush
    assert (tmp_path / "user-handler-ran").exists()
    _check_complete(tmp_path, steps)


def test_sigterm_saves_every_monitor(tmp_path):
    steps = 23
    rc, out, err = _run(tmp_path, "two", steps, 10, sig=signal.SIGTERM)
    assert rc == -signal.SIGTERM, (rc, out, err)
    fwd, grad = _per_step()
    _check_complete(tmp_path, steps)
    t = read_log(tmp_path / "log1.parquet")  # the second Monitor stopped before its last step's forward
    per_step = np.bincount(t.column("step").to_numpy(), minlength=steps)
    assert per_step[:steps - 1].tolist() == [fwd + grad] * (steps - 1) and per_step[steps - 1] == 0


def test_keyboard_interrupt_flushes_and_closes(tmp_path):
    steps = 71
    rc, out, err = _run(tmp_path, "sigint", steps, 50, sig=signal.SIGINT)
    assert rc != 0 and "KeyboardInterrupt" in err, (rc, out, err)
    _check_complete(tmp_path, steps)


# -- where the handler is installed ------------------------------------------------------------------------------

def test_sigterm_handler_installed_on_the_main_thread_only_and_restored():
    import threading

    import torch

    import hookstats

    from hookstats.monitor import lifecycle

    class Sink:
        def write_block(self, block, scalars):
            pass

    before = signal.getsignal(signal.SIGTERM)
    a = hookstats.Monitor(torch.nn.Linear(2, 2), exporters=[Sink()])
    b = hookstats.Monitor(torch.nn.Linear(2, 2), exporters=[Sink()])
    assert signal.getsignal(signal.SIGTERM) is lifecycle._on_sigterm
    a.detach()
    assert signal.getsignal(signal.SIGTERM) is lifecycle._on_sigterm  # b still attached
    b.detach()
    assert signal.getsignal(signal.SIGTERM) is before
    # made on another thread: nothing installed (signal.signal works only on the main thread), nothing raised
    made = []
    t = threading.Thread(target=lambda: made.append(hookstats.Monitor(torch.nn.Linear(2, 2), exporters=[Sink()])))
    t.start()
    t.join()
    assert made and signal.getsignal(signal.SIGTERM) is before
    made[0].detach()
    # an ignored SIGTERM stays ignored
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        c = hookstats.Monitor(torch.nn.Linear(2, 2), exporters=[Sink()])
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        c.detach()
    finally:
        signal.signal(signal.SIGTERM, before)
