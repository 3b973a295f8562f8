"""File operations of the Parquet log that a kill cannot leave half done (Note [compaction a kill cannot break]).

Note [compaction a kill cannot break]
A records (or scalars) dataset is a directory D that readers list as it is (pandas, pyarrow.dataset, DuckDB and
Polars read every file in it). Compaction replaces many per-flush files by one, and no set of renames and removals
inside D does that atomically: a kill between them leaves both (rows counted twice) or neither. So the new content
is built beside D and swapped in whole:
  1. the compacted file is streamed (a row group at a time) into a hidden temporary file beside D and fsynced;
  2. a hidden staging directory .D.staged-PID gets it, and a hard link (a copy where links fail) of every file of D
     it does not replace; it is fsynced;
  3. Linux: renameat2(RENAME_EXCHANGE) swaps D and the staging directory in one atomic step (D is never missing,
     never mixed), and the old content, now under the staging name, is removed. Elsewhere: D is renamed to
     .D.old-PID, then the staging directory to D, then the old one removed: between those two renames D is missing
     (a reader of D finds no log; read_log and the next writer take the staging directory);
  4. the parent directory is fsynced.
Whatever the kill point, D holds either the old content or the new one, and every leftover is hidden (a name
beginning with "."): a temporary file, a staging or old directory. `resolve(D)` says which directory holds the log
(D, or the staging directory in the one window of step 3's fallback), and `repair(D)` (the next writer, at open)
finishes or removes what a dead process left. HOOKSTATS_TEST_KILL_AT=<point> kills the process with SIGKILL at a
named point ("name:N": its N-th passage; tests/test_runlog_kill.py).
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
from typing import Optional

_KILL_ENV = "HOOKSTATS_TEST_KILL_AT"
EXCHANGE = True  # use renameat2(RENAME_EXCHANGE) where the OS has it (tests turn it off to exercise the fallback)


_hits: dict = {}


def kill_point(name: str) -> None:
    """Test hook: SIGKILL this process here when HOOKSTATS_TEST_KILL_AT names this point ("name", or "name:N" for
    its N-th passage)."""
    want = os.environ.get(_KILL_ENV)
    if not want or not want.startswith(name):
        return
    point, _, nth = want.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


_renameat2 = None


def _exchange(a: str, b: str) -> bool:
    """Atomically swaps two directories (Linux renameat2 RENAME_EXCHANGE); False where the OS or filesystem cannot."""
    global _renameat2
    if not EXCHANGE or not hasattr(os, "sched_getaffinity"):  # Linux only
        return False
    if _renameat2 is None:
        try:
            f = ctypes.CDLL(None, use_errno=True).renameat2
            f.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            f.restype = ctypes.c_int
            _renameat2 = f
        except (AttributeError, OSError):
            _renameat2 = False
    if not _renameat2:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return _renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _hidden(d: str, what: str, pid: Optional[int] = None) -> str:
    parent, name = os.path.split(os.path.normpath(d))
    return os.path.join(parent, f".{name}.{what}-{os.getpid() if pid is None else pid}")


def _leftovers(d: str) -> dict:
    """{"staged": [(pid, path)], "old": [...]} beside directory d."""
    parent, name = os.path.split(os.path.normpath(d))
    pat = re.compile(r"^\." + re.escape(name) + r"\.(staged|old)-(\d+)$")
    out: dict = {"staged": [], "old": []}
    try:
        names = os.listdir(parent or ".")
    except OSError:
        return out
    for n in names:
        m = pat.match(n)
        if m:
            out[m.group(1)].append((int(m.group(2)), os.path.join(parent, n)))
    return out


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve(d: str) -> Optional[str]:
    """The directory that holds dataset d now: d itself, or, after a kill between the fallback swap's two renames,
    its complete staging directory; None when there is neither."""
    if os.path.isdir(d):
        return d
    left = _leftovers(d)
    if left["old"] and left["staged"]:  # step 3's fallback: D moved away only once the staging was complete
        return sorted(left["staged"])[-1][1]
    if left["old"]:
        return sorted(left["old"])[-1][1]
    return None


def repair(d: str, tmp_prefix: str) -> None:
    """Finishes what a killed writer left of a swap, and removes its hidden leftovers (its temporary files, staging
    and old directories). Leftovers of a live process are left alone."""
    held = resolve(d)
    if held is not None and held != d:
        os.rename(held, d)
        fsync_dir(os.path.dirname(d) or ".")
    for pid, p in _leftovers(d)["staged"] + _leftovers(d)["old"]:
        if not _alive(pid):
            shutil.rmtree(p, ignore_errors=True)
    parent, prefix = os.path.split(tmp_prefix)
    try:
        names = os.listdir(parent or ".")
    except OSError:
        return
    for n in names:
        if n.startswith(prefix):
            m = re.match(r"(\d+)-", n[len(prefix):])
            if m and not _alive(int(m.group(1))):
                try:
                    os.remove(os.path.join(parent, n))
                except OSError:
                    pass


def swap_in(d: str, new_file: str, new_name: str, replaced: set, fsync: bool = True) -> None:
    """Makes directory d hold new_file (as new_name) instead of the files named in `replaced`, in one step that a
    kill cannot leave half done (Note [compaction a kill cannot break])."""
    staged = _hidden(d, "staged")
    shutil.rmtree(staged, ignore_errors=True)
    os.mkdir(staged)
    try:
        for n in sorted(os.listdir(d)):
            if n in replaced:
                continue
            src, dst = os.path.join(d, n), os.path.join(staged, n)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
        os.replace(new_file, os.path.join(staged, new_name))
    except BaseException:  # d untouched: the staging directory goes, the error is the caller's
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if fsync:
        fsync_dir(staged)
    kill_point("compact-staged")
    parent = os.path.dirname(d) or "."
    if _exchange(staged, d):
        if fsync:
            fsync_dir(parent)
        kill_point("compact-swapped")
        shutil.rmtree(staged, ignore_errors=True)
    else:
        old = _hidden(d, "old")
        os.rename(d, old)
        kill_point("compact-moved")
        os.rename(staged, d)
        if fsync:
            fsync_dir(parent)
        kill_point("compact-renamed")
        shutil.rmtree(old, ignore_errors=True)


__all__ = ["kill_point", "fsync_dir", "fsync_file", "resolve", "repair", "swap_in"]
