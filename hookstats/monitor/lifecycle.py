"""A Monitor's life around the process's: its records at SIGTERM, Ctrl-C and interpreter exit, and closing its
exporters at detach() whatever one of them raises.

Note [what survives a terminated run]
Every Monitor with exporters is registered here from its construction to its detach() (weakly: a dropped Monitor
is not kept alive).
- SIGTERM (what a scheduler sends before it kills): the first Monitor made on the main thread installs one handler
  for all of them, chained to the handler it found (signal.signal works only on the main thread: a Monitor made on
  another thread installs nothing; a handler found that Python did not install, or SIG_IGN, is left alone). At the
  signal, each Monitor flushes (what it recorded so far, the step in progress included) and waits for its export
  thread; then the previous handler runs. Where that is the default action (the process ends), the Monitors are
  first detached (their exporters closed: the Parquet log compacted), and the signal is sent again with the default
  disposition, so the process ends as SIGTERM ends it (exit status -15). A Python handler (a framework's) is called
  with the Monitors still attached: if it returns, training goes on recording; if it exits (SystemExit), the exit
  below closes them. The handler is not re-entered into hookstats' own code: a signal that arrives while the main
  thread is inside it is sent again a few ms later (for up to ~5 s; a wait in drain() is no obstacle). A forked child (a DataLoader worker) never
  writes through its parent's Monitors. The last detach() puts the previous handler back when ours is still the
  one installed.
- KeyboardInterrupt, SystemExit, an uncaught error, the end of the script: at interpreter exit every Monitor still
  registered is detached (flushed, drained, exporters closed); errors go to stderr. A Monitor with a process group is
  not flushed there (a flush is a collective the other ranks may not reach): what it handed over is written and
  its exporters closed.
- SIGKILL: nothing runs. What the exporters wrote survives (each log is written to survive a kill); what the export
  thread had not yet written, and the records since the last flush, are lost: at most flush_every steps plus
  export_queue flushes (docs/guide/run-log.md).
`close_exporters` closes the export thread and every exporter, each whatever the others raise, and returns the
errors, which detach() raises once (ExportError) after its hooks are gone.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import traceback
import weakref
from typing import Optional

from .export_thread import ExportError, ExportThread

_LIVE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # owner -> its save function (unbound)
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the hookstats package
_RETRY_S, _RETRIES = 0.005, 1000  # up to ~5 s (a scheduler's grace period is ~30 s)


class _State:
    installed = False
    prev = None  # the SIGTERM handler found at install
    pid = 0  # the process that installed it (a forked child must not write through its parent's Monitors)
    tries = 0
    resend = None  # the pending threading.Timer that sends the signal again


_S = _State()


def register(mon, save) -> None:
    """A Monitor with exporters, from its construction on: `save(close)`, a method of mon, runs at SIGTERM
    (close=False: everything recorded handed to the exporters and written) and at interpreter exit (close=True:
    the Monitor detached too). mon is held weakly."""
    _LIVE[mon] = save.__func__
    _install()


def unregister(mon) -> None:
    _LIVE.pop(mon, None)
    if not len(_LIVE):
        _uninstall()


def _install() -> None:
    if _S.installed or threading.current_thread() is not threading.main_thread():
        return
    prev = signal.getsignal(signal.SIGTERM)
    if prev is None or prev == signal.SIG_IGN:  # a handler Python did not install, or the signal ignored: left alone
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    _S.installed, _S.prev, _S.pid = True, prev, os.getpid()


def _uninstall() -> None:
    if not _S.installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, _S.prev)
        _S.installed, _S.prev = False, None
    # else: a handler installed after ours may chain to it; ours stays in that chain, forwarding to the one it found


_DRAIN = ExportThread.drain.__code__  # waiting for the export thread: nothing half done, safe to flush from here


def _in_hookstats(frame) -> bool:
    """Whether the main thread was interrupted inside hookstats code (other than a wait in drain())."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PKG):
            return frame.f_code is not _DRAIN
        frame = frame.f_back
    return False


def _report(what: str, mon, ex: BaseException) -> None:
    print(f"hookstats.Monitor: {what} failed ({type(ex).__name__}: {ex}); the records it had may not all have reached "
          "its exporters", file=sys.stderr)
    traceback.print_exception(type(ex), ex, ex.__traceback__, file=sys.stderr)


def _save(mon, save, close: bool) -> None:
    """save(mon, close), its errors reported on stderr; with close, mon is forgotten whatever it raised."""
    try:
        save(mon, close)
    except BaseException as ex:  # noqa: BLE001 -- nothing to raise to: the process is ending
        _report("saving its records at exit" if close else "saving its records at SIGTERM", mon, ex)
    finally:
        if close:
            _LIVE.pop(mon, None)


def _resend(signum) -> None:
    _S.resend = None
    os.kill(os.getpid(), signum)


def _on_sigterm(signum, frame) -> None:
    prev = _S.prev
    if os.getpid() == _S.pid:
        if _S.resend is not None:  # a resend is pending (this signal arrived meanwhile): that one will do it
            return
        if _in_hookstats(frame) and _S.tries < _RETRIES:  # not re-entered mid-flush: the signal comes again shortly
            _S.tries += 1
            _S.resend = threading.Timer(_RETRY_S, _resend, (signum,))
            _S.resend.daemon = True
            _S.resend.start()
            return
        _S.tries = 0
        ends = not callable(prev)  # SIG_DFL: the process ends after this handler
        for mon, save in list(_LIVE.items()):
            _save(mon, save, close=ends)
    if callable(prev):
        prev(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # never swallowed: the default action, as if we had not been here
    os.kill(os.getpid(), signum)


@atexit.register
def _at_exit() -> None:  # registered after export_thread's: runs before it (atexit runs last-registered first)
    if _S.pid and os.getpid() != _S.pid:
        return
    for mon, save in list(_LIVE.items()):
        _save(mon, save, close=True)


def close_exporters(thread, exporters, end_info: Optional[dict] = None) -> list:
    """Stops the export thread (after it wrote what it had), hands `end_info` (what the run learned by its end, from
    the features' run_end_info()) to every exporter that has an end(info) method, and closes every exporter, each
    whatever the others raise; returns [(exporter, error)] of the end() / close() calls that failed."""
    errors = []
    if thread is not None:
        try:
            thread.close()
        except BaseException as ex:  # noqa: BLE001 -- raised once, after the rest is closed
            errors.append((thread, ex))
    for e in exporters:
        end = getattr(e, "end", None) if end_info else None
        if end is not None:
            try:
                end(end_info)
            except BaseException as ex:  # noqa: BLE001
                errors.append((e, ex))
        close = getattr(e, "close", None)
        if close is None:
            continue
        try:
            close()
        except BaseException as ex:  # noqa: BLE001
            errors.append((e, ex))
    return errors


def raise_detach_errors(thread, close_errors: list) -> None:
    """Raises, once, the exporters' errors left at detach(): those of the export thread's writes (first) and of the
    close() calls. A KeyboardInterrupt / SystemExit raised in a close() is raised as it is."""
    errs = (thread.take_errors() if thread is not None else []) + [(e, ex, "in close()") for e, ex in close_errors]
    if not errs:
        return
    e, ex, what = errs[0]
    if not isinstance(ex, Exception):
        raise ex
    more = f" ({len(errs) - 1} more exporter error(s))" if len(errs) > 1 else ""
    where = "on the export thread" if what == "write" else what
    raise ExportError(f"hookstats.Monitor: exporter {type(e).__name__} failed {where}: {type(ex).__name__}: "
                      f"{ex}{more}. The Monitor is detached: its hooks are removed and every other exporter closed"
                      ) from ex


__all__ = ["register", "unregister", "close_exporters", "raise_detach_errors"]
