"""Whether a writer may continue an existing log: the same run resumed (a framework's resume from a checkpoint) or
refused before training starts.

Note [one run per log]
A log holds one run. A writer opening a log that already holds records continues it only when the new run's header
(Monitor.run_info()) says it is the same run: the same histogram spec, statistics fields, kinds, modules and
features (what decides the columns and what they mean), and the same stats_dtype (a Parquet log's column types), and
the new run does not start again at step 0 (a resume starts at the step of its checkpoint: start_step). What may
differ: the versions, `every`, `histogram_every`, the time and what the old run reported at its end ("end"). Anything else is refused with a ValueError that says
which field differs and what to do, raised by the writer's begin() (so by the Monitor's constructor, before a step
runs). The header of every writer that continued the log is kept beside the first (JSONL: one "run" line each;
Parquet: log.run.json's "resumed" list).
"""
from __future__ import annotations

import json
from typing import Optional

MAY_DIFFER = frozenset({"hookstats", "torch", "time", "every", "histogram_every", "start_step", "stats_dtype",
                        "resumed", "end"})  # end: what the previous run reported at its detach()


def plain(info: dict) -> dict:
    """info as JSON holds it (tuples as lists; a dtype, a device, anything else as its str)."""
    return json.loads(json.dumps(info, default=str))


def check_resume(writer: str, path: str, old: dict, new: dict, has_records: bool) -> None:
    """Raises ValueError when the run `new` may not continue the log at `path` whose header is `old`."""
    if not old and not has_records:
        return
    what = ("write this run to a new path, or remove the old log first; to resume the run the log holds, use the "
            "options it was written with and its checkpoint's step as start_step")
    if old:
        a, b = plain(old), plain(new)
        diff = [k for k in sorted(set(a) | set(b)) if k not in MAY_DIFFER and a.get(k) != b.get(k)]
        if diff:
            k = diff[0]
            more = f" (and {', '.join(diff[1:])})" if len(diff) > 1 else ""
            raise ValueError(f"hookstats.{writer}: {path!r} holds another run: its {k} is {a.get(k)!r}, this run's is "
                             f"{b.get(k)!r}{more}. A log holds one run: {what}")
    if has_records and new.get("start_step", None) == 0:
        raise ValueError(f"hookstats.{writer}: {path!r} already holds a run's records, and this run starts at step 0: "
                         f"its steps would mix with the old ones. {what}")


def check_stats_dtype(writer: str, path: str, asked: Optional[str], found: Optional[str]) -> str:
    """The stats_dtype a writer uses: the one asked for, or the log's when continuing one (float64 for a new log);
    a different one than the log's is refused (its columns would not merge)."""
    if found is None:
        return asked or "float64"
    if asked is not None and asked != found:
        raise ValueError(f"hookstats.{writer}: {path!r} holds {found} statistics and this writer was asked for "
                         f"{asked}: the columns of one log have one type. Continue it with stats_dtype={found!r} (or "
                         "leave stats_dtype unset), or write this run to a new path")
    return found


__all__ = ["check_resume", "check_stats_dtype", "MAY_DIFFER", "plain"]
