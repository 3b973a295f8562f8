"""Markdown report of a hookstats benchmark run (pytest-benchmark JSON), stdlib only.

    python -m pytest benchmarks --benchmark-only --benchmark-json=bench.json
    python benchmarks/report.py bench.json [--markdown out.md]

Two sets of tables, one table per device and dtype in each: hookstats.stats (`summarize`, `format_table`) and
the histograms (`summarize_hist`, `format_hist_table`); then, when the file has any, the by-distribution tables
(`summarize_bydata`, `format_bydata_table`: every op on each of issue 14's distributions, slowest / fastest), the
clipping tables, per
device (`summarize_clip`, `format_clip_table`), and the hookstats.Monitor tables (`summarize_monitor`,
`format_monitor_table`: training-step time with no hooks, PyTorch hooks and a Monitor, and the cost of one hook
call; host clock, ratios to the no-hooks step). Times are medians. GB/s counts one read of the input (the bytes
the fused op must move; the clipping tables count what each op must move, see `summarize_clip`); the roof is
the same run's `x.sum()` on CPU and `y.copy_(x)` on CUDA, whose GB/s counts read + write. On CUDA, times come
from CUDA events around back-to-back launches when the run recorded them (extra_info["cuda_event_s"]), else
from the host clock with a synchronize per call.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

CASES = ("fused", "composite", "roof")


def _case_seconds(bench: dict) -> tuple[float, str]:
    extra = bench.get("extra_info", {})
    if extra.get("cuda_event_s") is not None:
        return float(extra["cuda_event_s"]), "cuda events"
    return float(bench["stats"]["median"]), "host clock"


def _new_row(extra: dict, **more) -> dict:
    """The fields a group row takes from its first benchmark's extra_info."""
    row = {
        "device": extra["device"],
        "dtype": extra["dtype"],
        "size_log2": int(extra["size_log2"]),
        "numel": int(extra["numel"]),
        "bytes": int(extra["bytes"]),
        "roof": extra.get("roof", "copy" if extra["device"] == "cuda" else "sum"),
        "timer": None,
    }
    row.update(more)
    return row


def summarize(json_path: str) -> list[dict]:
    """One dict per (device, dtype, size) group of a pytest-benchmark JSON file, sorted by device, dtype, size.

    Keys: device, dtype, size_log2, numel, bytes, timer, roof (the roof's name), and, None where a case
    did not run: fused_s, composite_s, roof_s, fused_gbps, roof_gbps (roof's own bytes: 2x for a copy),
    fused_over_roof (time ratio), speedup (composite time / fused time), copy_fraction (fused GB/s over copy
    GB/s, CUDA only), rounds and threads (torch threads) of the fused case.
    """
    with open(json_path) as f:
        data = json.load(f)
    groups: dict[tuple, dict] = {}
    for bench in data.get("benchmarks", []):
        extra = bench.get("extra_info", {})
        if extra.get("family", "stats") != "stats" or extra.get("case") not in CASES or "bytes" not in extra:
            continue  # another op family's benchmark (the histograms have a "roof" case too)
        key = (extra["device"], extra["dtype"], int(extra["size_log2"]))
        if key not in groups:
            groups[key] = _new_row(extra)
        row = groups[key]
        seconds, timer = _case_seconds(bench)
        row[f"{extra['case']}_s"] = seconds
        if extra["case"] == "fused":
            row["timer"] = timer
            row["rounds"] = bench["stats"].get("rounds")
            row["threads"] = extra.get("torch_threads")

    rows = []
    for key in sorted(groups, key=lambda k: (k[0] != "cpu", k[0], k[1] != "float32", k[1], k[2])):
        row = groups[key]
        for case in CASES:
            row.setdefault(f"{case}_s", None)
        row.setdefault("rounds", None)
        row.setdefault("threads", None)
        fused, comp, roof = row["fused_s"], row["composite_s"], row["roof_s"]
        roof_bytes = row["bytes"] * (2 if row["roof"] == "copy" else 1)
        row["fused_gbps"] = row["bytes"] / fused / 1e9 if fused else None
        row["roof_gbps"] = roof_bytes / roof / 1e9 if roof else None
        row["fused_over_roof"] = fused / roof if fused and roof else None
        row["speedup"] = comp / fused if fused and comp else None
        row["copy_fraction"] = (
            row["fused_gbps"] / row["roof_gbps"]
            if row["roof"] == "copy" and row["fused_gbps"] and row["roof_gbps"]
            else None
        )
        rows.append(row)
    return rows


def _fmt_us(seconds: Optional[float]) -> str:
    if seconds is None:
        return "–"
    us = seconds * 1e6
    return f"{us:,.0f}" if us >= 100 else f"{us:.1f}"


def _fmt_gbps(gbps: Optional[float]) -> str:
    if gbps is None:
        return "–"
    return f"{gbps:,.0f}" if gbps >= 100 else f"{gbps:.2f}"


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _roof_stalled(group: list[dict]) -> bool:
    """True when the roof takes about as long at 16x the size: a sign of stalled threads, not of bandwidth."""
    timed = sorted((r["size_log2"], r["roof_s"]) for r in group if r["roof_s"])
    return any(
        k1 - k0 >= 4 and t1 < 2 * t0 and t0 > 1e-3 for (k0, t0), (k1, t1) in zip(timed, timed[1:])
    )


def format_table(rows: list[dict]) -> str:
    """Markdown: a heading and a table per (device, dtype), in the order of `rows`."""
    out: list[str] = []
    tables: dict[tuple, list[dict]] = {}
    for row in rows:
        tables.setdefault((row["device"], row["dtype"]), []).append(row)
    for (device, dtype), group in tables.items():
        cuda = any(r["roof"] == "copy" for r in group)
        notes = sorted({r["timer"] for r in group if r["timer"]}) or ["no fused case"]
        if device == "cpu":
            threads = sorted({r["threads"] for r in group if r["threads"]})
            notes += [f"{t} torch thread{'s' if t > 1 else ''}" for t in threads]
        out.append(f"### hookstats.stats, {device}, {dtype} (median times; {', '.join(notes)})")
        out.append("")
        head = ["size", "fused µs", "fused GB/s", "roof GB/s", "fused / roof", "composite µs", "fused speedup"]
        if cuda:
            head.append("of copy BW")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join("---:" for _ in head) + "|")
        for r in group:
            cells = [
                f"2^{r['size_log2']}",
                _fmt_us(r["fused_s"]),
                _fmt_gbps(r["fused_gbps"]),
                _fmt_gbps(r["roof_gbps"]),
                _fmt(r["fused_over_roof"], ".2f", f"x {r['roof']}"),
                _fmt_us(r["composite_s"]),
                _fmt(r["speedup"], ".1f", "x"),
            ]
            if cuda:
                cells.append(_fmt(r["copy_fraction"], ".0%"))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        if _roof_stalled(group):
            out.append(
                "**Warning:** the roof's time does not grow with the size, so these times measure waiting, not "
                "work: with other load on the machine, each parallel region waits a scheduler tick for a "
                "busy core. Rerun on a quiet machine or with `HOOKSTATS_BENCH_THREADS=1`."
            )
            out.append("")
    if not out:
        return "No hookstats.stats benchmarks in this file.\n"
    out.append(
        "GB/s: input bytes / median time (the copy roof counts read + write). fused / roof: time ratio, "
        "lower is better. fused speedup: composite time / fused time. of copy BW (CUDA): fused GB/s / copy GB/s."
    )
    return "\n".join(out) + "\n"


HIST_CASES = ("hist", "stats_hist", "stats_exp", "histc", "torch_histogram", "roof")
# A PyTorch baseline that had to upcast (bf16 counts stop at 256) is recorded as "<case>_f32".
_HIST_CASE_ALIASES = {"histc_f32": "histc", "torch_histogram_f32": "torch_histogram"}


def summarize_hist(json_path: str) -> list[dict]:
    """One dict per (device, dtype, bins, size) histogram group of a pytest-benchmark JSON file, sorted by device,
    dtype, bins, size.

    Keys: device, dtype, bins, size_log2, numel, bytes, timer, roof (the roof's name), and, None where a case did
    not run: hist_s, stats_hist_s, stats_exp_s (timed in the 64-bin group; copied to the other bin counts of the
    same input), histc_s, torch_histogram_s, roof_s, histc_upcast / torch_histogram_upcast (True when the
    baseline timed `x.float()` + the op), hist_speedup (histc time / hist time), stats_hist_over_roof (time
    ratio), stats_hist_gbps, roof_gbps (roof's own bytes: 2x for a copy), copy_fraction (stats_hist GB/s over
    copy GB/s, CUDA only), rounds and threads (torch threads) of the stats_hist case.
    """
    with open(json_path) as f:
        data = json.load(f)
    groups: dict[tuple, dict] = {}
    for bench in data.get("benchmarks", []):
        extra = bench.get("extra_info", {})
        case = _HIST_CASE_ALIASES.get(extra.get("case"), extra.get("case"))
        if extra.get("family") != "hist" or case not in HIST_CASES or "bytes" not in extra:
            continue
        key = (extra["device"], extra["dtype"], int(extra["bins"]), int(extra["size_log2"]))
        if key not in groups:
            groups[key] = _new_row(extra, bins=int(extra["bins"]))
        row = groups[key]
        seconds, timer = _case_seconds(bench)
        row[f"{case}_s"] = seconds
        if case in _HIST_CASE_ALIASES.values():
            row[f"{case}_upcast"] = extra["case"] != case
        if case == "stats_hist":
            row["timer"] = timer
            row["rounds"] = bench["stats"].get("rounds")
            row["threads"] = extra.get("torch_threads")

    # The exponent histogram has no bins: it is timed in one group per input and shown in each.
    exp_times = {(k[0], k[1], k[3]): r["stats_exp_s"] for k, r in groups.items() if r.get("stats_exp_s")}
    rows = []
    for key in sorted(groups, key=lambda k: (k[0] != "cpu", k[0], k[1] != "float32", k[1], k[2], k[3])):
        row = groups[key]
        for case in HIST_CASES:
            row.setdefault(f"{case}_s", None)
        if row["stats_exp_s"] is None:
            row["stats_exp_s"] = exp_times.get((key[0], key[1], key[3]))
        for name in ("histc_upcast", "torch_histogram_upcast"):
            row.setdefault(name, False)
        row.setdefault("rounds", None)
        row.setdefault("threads", None)
        hist, both, histc, roof = row["hist_s"], row["stats_hist_s"], row["histc_s"], row["roof_s"]
        roof_bytes = row["bytes"] * (2 if row["roof"] == "copy" else 1)
        row["stats_hist_gbps"] = row["bytes"] / both / 1e9 if both else None
        row["roof_gbps"] = roof_bytes / roof / 1e9 if roof else None
        row["hist_speedup"] = histc / hist if hist and histc else None
        row["stats_hist_over_roof"] = both / roof if both and roof else None
        row["copy_fraction"] = (
            row["stats_hist_gbps"] / row["roof_gbps"]
            if row["roof"] == "copy" and row["stats_hist_gbps"] and row["roof_gbps"]
            else None
        )
        rows.append(row)
    return rows


# The targets, reported (never asserted): (device, bins, size_log2 or None for bytes, bytes, key,
# comparison, threshold, text).
HIST_TARGETS = (
    ("cpu", 64, 20, None, "hist_speedup", ">=", 20.0, "CPU, 64 bins, 2^20: hist >= 20x faster than torch.histc"),
    ("cpu", 64, 20, None, "stats_hist_over_roof", "<=", 3.0, "CPU, 64 bins, 2^20: stats + hist <= 3x x.sum()"),
    ("cuda", None, None, 256 * 2**20, "copy_fraction", ">=", 0.75,
     "CUDA, 256 MB: stats + hist >= 75% of copy bandwidth"),
)


def format_hist_targets(rows: list[dict]) -> list[str]:
    """Lines of markdown: each target of HIST_TARGETS against the matching rows, met or not, or not measured."""
    out = ["Targets (reported, not asserted):"]
    for device, bins, size_log2, nbytes, key, op, threshold, text in HIST_TARGETS:
        hits = [
            r for r in rows
            if r["device"] == device and (bins is None or r["bins"] == bins)
            and (size_log2 is None or r["size_log2"] == size_log2) and (nbytes is None or r["bytes"] == nbytes)
            and r[key] is not None
        ]
        if not hits:
            out.append(f"- {text}: not measured in this run")
            continue
        parts = []
        for r in hits:
            met = r[key] >= threshold if op == ">=" else r[key] <= threshold
            value = f"{r[key]:.0%}" if key == "copy_fraction" else f"{r[key]:.2f}x"
            label = r["dtype"] if bins is not None else f"{r['dtype']} {r['bins']}b"
            parts.append(f"{label} {value} ({'met' if met else 'NOT met'})")
        out.append(f"- {text}: " + "; ".join(parts))
    return out


def format_hist_table(rows: list[dict]) -> str:
    """Markdown: a heading and a histogram table per (device, dtype), in the order of `rows`, then the targets."""
    out: list[str] = []
    tables: dict[tuple, list[dict]] = {}
    for row in rows:
        tables.setdefault((row["device"], row["dtype"]), []).append(row)
    upcast_note = False
    for (device, dtype), group in tables.items():
        cuda = any(r["roof"] == "copy" for r in group)
        notes = sorted({r["timer"] for r in group if r["timer"]}) or ["no stats_hist case"]
        if device == "cpu":
            threads = sorted({r["threads"] for r in group if r["threads"]})
            notes += [f"{t} torch thread{'s' if t > 1 else ''}" for t in threads]
        out.append(f"### hookstats histograms, {device}, {dtype} (median times; {', '.join(notes)})")
        out.append("")
        head = ["size", "bins", "hist µs", "stats+hist µs", "stats+exp µs", "histc µs", "torch.histogram µs",
                "hist vs histc", "stats+hist / roof"]
        if cuda:
            head.append("of copy BW")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join("---:" for _ in head) + "|")
        for r in group:
            mark = {name: "†" if r[f"{name}_upcast"] else "" for name in ("histc", "torch_histogram")}
            upcast_note = upcast_note or any(mark.values())
            cells = [
                f"2^{r['size_log2']}",
                str(r["bins"]),
                _fmt_us(r["hist_s"]),
                _fmt_us(r["stats_hist_s"]),
                _fmt_us(r["stats_exp_s"]),
                _fmt_us(r["histc_s"]) + (mark["histc"] if r["histc_s"] else ""),
                _fmt_us(r["torch_histogram_s"]) + (mark["torch_histogram"] if r["torch_histogram_s"] else ""),
                _fmt(r["hist_speedup"], ".1f", "x"),
                _fmt(r["stats_hist_over_roof"], ".2f", f"x {r['roof']}"),
            ]
            if cuda:
                cells.append(_fmt(r["copy_fraction"], ".0%"))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        for bins in sorted({r["bins"] for r in group}):
            if _roof_stalled([r for r in group if r["bins"] == bins]):
                out.append(
                    f"**Warning ({bins} bins):** the roof's time does not grow with the size, so these times measure "
                    "waiting, not work: with other load on the machine, each parallel region waits a scheduler tick "
                    "for a busy core. Rerun on a quiet machine or with `HOOKSTATS_BENCH_THREADS=1`."
                )
                out.append("")
    if not out:
        return "No hookstats histogram benchmarks in this file.\n"
    out.append(
        "hist: hookstats.histogram (the stats_hist kernel, statistics dropped). stats+hist: hookstats.stats with a "
        "range histogram; stats+exp: with the exponent histogram (no bins; the same time in both bin rows). "
        "hist vs histc: histc time / hist time. stats+hist / roof: time ratio, lower is better. of copy BW (CUDA): "
        "stats+hist GB/s (one read) / copy GB/s (read + write)."
        + (" †: the PyTorch op timed on `x.float()` (upcast included): given bf16 it returns bf16 counts, which "
           "stop at 256." if upcast_note else "")
    )
    out.append("")
    out.extend(format_hist_targets(rows))
    return "\n".join(out) + "\n"


CLIP_CASES = ("hookstats", "torch", "torch_foreach", "torch_loop", "roof")
CLIP_SINGLE_OPS = ("clip_norm", "clip_value")  # one tensor, grouped by size
CLIP_LIST_OPS = ("clip_grad_norm", "total_norm")  # a list of grads, grouped by the number of tensors
_CLIP_OP_NAMES = {"clip_norm": "clip_norm_", "clip_value": "clip_value_", "clip_grad_norm": "clip_grad_norm_",
                  "total_norm": "get_total_norm"}


def summarize_clip(json_path: str) -> list[dict]:
    """One dict per clipping group (benchmarks/test_bench_clip.py) of a pytest-benchmark JSON file, sorted by
    device, op, dtype, then size or number of tensors.

    Keys: op (clip_norm, clip_value, clip_grad_norm, total_norm), device, dtype, size_log2 (single-tensor ops,
    else None), n_tensors (list ops, else None), numel, bytes (one read of the input), traffic_bytes (the bytes
    the op must move at least: 3x bytes for a norm clip, read then read + write; 1x for get_total_norm and
    clip_value_), timer, roof (the roof's name), and, None where a case did not run: hookstats_s, torch_s,
    torch_foreach_s, torch_loop_s, roof_s, speedup (PyTorch time / hookstats time, against `torch` for the
    single-tensor ops and `torch_foreach` for the list ops), speedup_loop (torch_loop time / hookstats time),
    hookstats_gbps (traffic_bytes / time), roof_gbps (roof's own bytes: 2x for a copy), of_roof (hookstats
    GB/s / roof GB/s), rounds and threads (torch threads) of the hookstats case.
    """
    with open(json_path) as f:
        data = json.load(f)
    groups: dict[tuple, dict] = {}
    for bench in data.get("benchmarks", []):
        extra = bench.get("extra_info", {})
        op = extra.get("op")
        if extra.get("family") != "clip" or op not in _CLIP_OP_NAMES or extra.get("case") not in CLIP_CASES:
            continue
        single = op in CLIP_SINGLE_OPS
        key = (extra["device"], op, extra["dtype"], int(extra["size_log2"] if single else extra["n_tensors"]))
        if key not in groups:
            groups[key] = {
                "op": op,
                "device": extra["device"],
                "dtype": extra["dtype"],
                "size_log2": int(extra["size_log2"]) if single else None,
                "n_tensors": None if single else int(extra["n_tensors"]),
                "numel": int(extra["numel"]),
                "bytes": int(extra["bytes"]),
                "traffic_bytes": int(extra.get("traffic_bytes", extra["bytes"])),
                "roof": extra.get("roof", "copy" if extra["device"] == "cuda" else "sum"),
                "timer": None,
            }
        row = groups[key]
        seconds, timer = _case_seconds(bench)
        row[f"{extra['case']}_s"] = seconds
        if extra["case"] == "hookstats":
            row["timer"] = timer
            row["rounds"] = bench["stats"].get("rounds")
            row["threads"] = extra.get("torch_threads")

    def order(k: tuple) -> tuple:
        device, op, dtype, size = k
        return (device != "cpu", device, list(_CLIP_OP_NAMES).index(op), dtype != "float32", dtype, size)

    rows = []
    for key in sorted(groups, key=order):
        row = groups[key]
        for case in CLIP_CASES:
            row.setdefault(f"{case}_s", None)
        row.setdefault("rounds", None)
        row.setdefault("threads", None)
        mine = row["hookstats_s"]
        base = row["torch_s"] if row["op"] in CLIP_SINGLE_OPS else row["torch_foreach_s"]
        loop, roof = row["torch_loop_s"], row["roof_s"]
        roof_bytes = row["bytes"] * (2 if row["roof"] == "copy" else 1)
        row["speedup"] = base / mine if mine and base else None
        row["speedup_loop"] = loop / mine if mine and loop else None
        row["hookstats_gbps"] = row["traffic_bytes"] / mine / 1e9 if mine else None
        row["roof_gbps"] = roof_bytes / roof / 1e9 if roof else None
        row["of_roof"] = (
            row["hookstats_gbps"] / row["roof_gbps"] if row["hookstats_gbps"] and row["roof_gbps"] else None
        )
        rows.append(row)
    return rows


# The targets, reported (never asserted): (op, least number of tensors, key, threshold, text). Each is
# checked on every device and dtype the run measured.
CLIP_TARGETS = (
    ("clip_grad_norm", 0, "speedup", 1.0, "clip_grad_norm_ not slower than foreach anywhere"),
    ("clip_grad_norm", 1000, "speedup", 2.0, "clip_grad_norm_ >= 2x faster than foreach at 1,000+ params"),
)


def format_clip_targets(rows: list[dict]) -> list[str]:
    """Lines of markdown: each target of CLIP_TARGETS against the matching rows (all met, or not), or not
    measured."""
    out = ["Targets (reported, not asserted):"]
    for op, least, key, threshold, text in CLIP_TARGETS:
        hits = [r for r in rows if r["op"] == op and r["n_tensors"] is not None and r["n_tensors"] >= least
                and r[key] is not None]
        if not hits:
            out.append(f"- {text}: not measured in this run")
            continue
        parts = []
        for r in hits:
            met = r[key] >= threshold
            label = f"{r['device']} {r['dtype']} {r['n_tensors']:,}p"
            parts.append(f"{label} {r[key]:.2f}x ({'met' if met else 'NOT met'})")
        verdict = "met" if all(r[key] >= threshold for r in hits) else "NOT met"
        out.append(f"- {text}: **{verdict}**: " + "; ".join(parts))
    return out


def format_clip_table(rows: list[dict]) -> str:
    """Markdown: per device a table of the single-tensor ops (clip_norm_, clip_value_) and one of the list ops
    (clip_grad_norm_, get_total_norm), in the order of `rows`, then the targets."""
    out: list[str] = []
    devices: dict[str, list[dict]] = {}
    for row in rows:
        devices.setdefault(row["device"], []).append(row)
    for device, group in devices.items():
        notes = sorted({r["timer"] for r in group if r["timer"]}) or ["no hookstats case"]
        if device == "cpu":
            threads = sorted({r["threads"] for r in group if r["threads"]})
            notes += [f"{t} torch thread{'s' if t > 1 else ''}" for t in threads]
        note = f"median times; {', '.join(notes)}"
        single = [r for r in group if r["op"] in CLIP_SINGLE_OPS]
        if single:
            out.append(f"### hookstats clipping, one tensor, {device} ({note})")
            out.append("")
            head = ["op", "dtype", "size", "hookstats µs", "torch µs", "speedup", "hookstats GB/s", "roof GB/s",
                    "of roof"]
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "|".join(":---" if i < 2 else "---:" for i in range(len(head))) + "|")
            for r in single:
                out.append("| " + " | ".join([
                    _CLIP_OP_NAMES[r["op"]],
                    r["dtype"],
                    f"2^{r['size_log2']}",
                    _fmt_us(r["hookstats_s"]),
                    _fmt_us(r["torch_s"]),
                    _fmt(r["speedup"], ".2f", "x"),
                    _fmt_gbps(r["hookstats_gbps"]),
                    _fmt_gbps(r["roof_gbps"]),
                    _fmt(r["of_roof"], ".0%"),
                ]) + " |")
            out.append("")
            for op in CLIP_SINGLE_OPS:
                for dtype in sorted({r["dtype"] for r in single if r["op"] == op}):
                    if _roof_stalled([r for r in single if r["op"] == op and r["dtype"] == dtype]):
                        out.append(
                            f"**Warning ({_CLIP_OP_NAMES[op]}, {dtype}):** the roof's time does not grow with the "
                            "size, so these times measure waiting, not work: with other load on the machine, each "
                            "parallel region waits a scheduler tick for a busy core. Rerun on a quiet machine or with "
                            "`HOOKSTATS_BENCH_THREADS=1`."
                        )
                        out.append("")
        lists = [r for r in group if r["op"] in CLIP_LIST_OPS]
        if lists:
            out.append(f"### hookstats clipping, parameter lists, {device} ({note})")
            out.append("")
            head = ["op", "dtype", "tensors", "elements", "hookstats µs", "foreach µs", "loop µs", "vs foreach",
                    "vs loop", "hookstats GB/s"]
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "|".join(":---" if i < 2 else "---:" for i in range(len(head))) + "|")
            for r in lists:
                out.append("| " + " | ".join([
                    _CLIP_OP_NAMES[r["op"]],
                    r["dtype"],
                    f"{r['n_tensors']:,}",
                    f"{r['numel'] / 1e6:.1f}M",
                    _fmt_us(r["hookstats_s"]),
                    _fmt_us(r["torch_foreach_s"]),
                    _fmt_us(r["torch_loop_s"]),
                    _fmt(r["speedup"], ".2f", "x"),
                    _fmt(r["speedup_loop"], ".2f", "x"),
                    _fmt_gbps(r["hookstats_gbps"]),
                ]) + " |")
            out.append("")
    if not out:
        return "No hookstats clipping benchmarks in this file.\n"
    out.append(
        "speedup / vs foreach / vs loop: the PyTorch way's time / hookstats' time (higher is better): "
        "`vector_norm` + `mul_` (clip_norm_), `((x < lo) | (x > hi)).sum()` + `clamp_` (clip_value_), "
        "torch.nn.utils with foreach=True / False (list ops). hookstats GB/s: the bytes the op must move at least "
        "/ median time: 3 passes for the norm clips (read, then read + write), 1 for get_total_norm and "
        "clip_value_ (which writes only the ~1.2% it clips). roof: `x.sum()` on CPU, `y.copy_(x)` on CUDA (read + "
        "write). of roof: hookstats GB/s / roof GB/s. The norm clips are timed on a max_norm schedule that "
        "scales by 0.9 every call, clip_value_ on an input restored before every call (test_bench_clip.py, "
        "Note [honest repeated clipping])."
    )
    out.append("")
    out.extend(format_clip_targets(rows))
    return "\n".join(out) + "\n"


MONITOR_STEP_CASES = ("none", "empty_hooks", "torch_hooks", "monitor_hist", "monitor", "none_after")
MONITOR_HOOK_CASES = ("none", "empty", "record", "record_hist", "torch_hooks")
MONITOR_MODELS = ("transformer", "deep1000")  # the order of the step tables; other models follow, by name
_MONITOR_CASE_NAMES = {
    "none": "no hooks",
    "none_after": "no hooks, again (timed last)",
    "empty_hooks": "empty hooks (PyTorch's hook machinery)",
    "torch_hooks": "PyTorch hooks (norm, aminmax, isnan, histc)",
    "monitor_hist": "hookstats.Monitor + 64-bin histogram",
    "monitor": "hookstats.Monitor, stats only",
    "empty": "empty Python hook",
    "record": "hookstats.record().forward",
    "record_hist": "hookstats.record(histogram=64 bins).forward",
}
# The targets, reported (never asserted): (model, case, largest step time / no-hooks step time, text).
MONITOR_TARGETS = (
    ("transformer", "monitor_hist", 1.10, "transformer step, Monitor with histogram <= 1.10x no hooks"),
    ("transformer", "monitor", 1.10, "transformer step, Monitor stats only <= 1.10x no hooks"),
)
MONITOR_TORCH_HOOKS_REPORTED = 2.99  # the issue author's measurement of the PyTorch-hooks case, transformer step
MONITOR_NOISY_IQR = 0.10  # a step case whose IQR passes 10% of its median ran on a busy machine


def summarize_monitor(json_path: str) -> dict[str, list[dict]]:
    """The Monitor benchmarks (benchmarks/test_bench_monitor.py) of a pytest-benchmark JSON file:
    {"steps": one dict per (device, model, case) of the training-step groups, "hooks": one dict per (device, case)
    of the tiny-hook group}, each sorted by device, then model (MONITOR_MODELS first), then case in the order of
    MONITOR_STEP_CASES / MONITOR_HOOK_CASES.

    steps keys: device, model, model_desc, case, modules, hook_calls, records_per_step, threads, rounds, step_s (the
    median step), iqr (of the step times, / step_s), and, None where not measured: flush_s (the median flush; the
    Monitor cases, Note [flush cost] in test_bench_monitor.py), flush_every, total_s (step_s + flush_s /
    flush_every), ratio (total_s / no hooks), overhead_per_record_s ((total_s - no hooks) / records_per_step),
    where "no hooks" is the mean step of the no-hooks cases, timed first and last so that they bracket the others
    (the baseline_s of every row), own_per_record_s ((total_s - empty hooks) / records_per_step: the case's cost beyond
    PyTorch's hook machinery, for the cases that compute something).
    hooks keys: device, case, threads, rounds, iterations, call_s (the median call: host clock, synchronized per
    call on CUDA), iqr, over_none_s (call_s - the no-hook case's).
    """
    with open(json_path) as f:
        data = json.load(f)
    steps: dict[tuple, dict] = {}
    hooks: dict[tuple, dict] = {}
    for bench in data.get("benchmarks", []):
        extra = bench.get("extra_info", {})
        if extra.get("family") != "monitor":
            continue
        case, stats = extra.get("case"), bench["stats"]
        median = float(stats["median"])
        common = {"device": extra["device"], "case": case, "threads": extra.get("torch_threads"),
                  "rounds": stats.get("rounds"), "iqr": float(stats["iqr"]) / median if median else None}
        if extra.get("bench") == "step" and case in MONITOR_STEP_CASES:
            flush_s, every = extra.get("flush_s"), extra.get("flush_every")
            steps[(extra["device"], extra["model"], case)] = dict(
                common, model=extra["model"], model_desc=extra.get("model_desc", extra["model"]),
                modules=extra.get("modules"), hook_calls=extra.get("hook_calls"),
                records_per_step=extra.get("records_per_step"), step_s=median,
                flush_s=float(flush_s) if flush_s is not None else None, flush_every=every if flush_s else None,
                total_s=median + float(flush_s) / every if flush_s is not None and every else median)
        elif extra.get("bench") == "hook" and case in MONITOR_HOOK_CASES:
            hooks[(extra["device"], case)] = dict(common, iterations=extra.get("iterations"), call_s=median)

    step_rows = []
    def order(k: tuple) -> tuple:
        device, model, case = k
        known = MONITOR_MODELS.index(model) if model in MONITOR_MODELS else len(MONITOR_MODELS)
        return (device != "cpu", device, known, model, MONITOR_STEP_CASES.index(case))

    for key in sorted(steps, key=order):
        row = steps[key]
        nones = [steps[(key[0], key[1], c)]["total_s"] for c in ("none", "none_after") if (key[0], key[1], c) in steps]
        base = row["baseline_s"] = sum(nones) / len(nones) if nones else None
        row["ratio"] = row["total_s"] / base if base else None
        records = row["records_per_step"]
        row["overhead_per_record_s"] = (
            (row["total_s"] - base) / records if base and records and not row["case"].startswith("none") else None
        )
        empty = steps.get((key[0], key[1], "empty_hooks"))
        row["own_per_record_s"] = (
            (row["total_s"] - empty["total_s"]) / records
            if empty and records and row["case"] not in ("none", "none_after", "empty_hooks") else None
        )
        step_rows.append(row)
    hook_rows = []
    for key in sorted(hooks, key=lambda k: (k[0] != "cpu", k[0], MONITOR_HOOK_CASES.index(k[1]))):
        row = hooks[key]
        none = hooks.get((key[0], "none"))
        row["over_none_s"] = row["call_s"] - none["call_s"] if none and row["case"] != "none" else None
        hook_rows.append(row)
    return {"steps": step_rows, "hooks": hook_rows}


def _fmt_us_signed(seconds: Optional[float]) -> str:
    """_fmt_us for a difference of two times, which noise can make negative."""
    if seconds is None:
        return "–"
    return ("-" if seconds < 0 else "") + _fmt_us(abs(seconds))


def _fmt_ms(seconds: Optional[float]) -> str:
    if seconds is None:
        return "–"
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.2f}"


def format_monitor_targets(rows: list[dict]) -> list[str]:
    """Lines of markdown: each target of MONITOR_TARGETS against the matching step rows (met or not, per device),
    or not measured; then the PyTorch-hooks ratio beside the issue's."""
    out = ["Targets (reported, not asserted):"]

    def noisy(r: dict) -> bool:  # the case or its no-hooks baseline ran on a busy machine
        base = [n for n in rows if (n["device"], n["model"]) == (r["device"], r["model"])
                and n["case"] in ("none", "none_after")]
        return any(x["iqr"] is not None and x["iqr"] > MONITOR_NOISY_IQR for x in [r] + base)

    for model, case, threshold, text in MONITOR_TARGETS:
        hits = [r for r in rows if r["model"] == model and r["case"] == case and r["ratio"] is not None]
        if not hits:
            out.append(f"- {text}: not measured in this run")
            continue
        parts = [f"{r['device']} {r['ratio']:.2f}x ({'met' if r['ratio'] <= threshold else 'NOT met'}"
                 + (", uncertain: busy machine" if noisy(r) else "") + ")" for r in hits]
        verdict = "met" if all(r["ratio"] <= threshold for r in hits) else "NOT met"
        if any(noisy(r) for r in hits):
            verdict += " (uncertain: rerun on a quiet machine)"
        out.append(f"- {text}: **{verdict}**: " + "; ".join(parts))
    ref = [r for r in rows if r["model"] == "transformer" and r["case"] == "torch_hooks" and r["ratio"] is not None]
    if ref:
        out.append(f"- for reference, PyTorch hooks on the transformer step: "
                   + "; ".join(f"{r['device']} {r['ratio']:.2f}x" for r in ref)
                   + f" (the issue author measured ~{MONITOR_TORCH_HOOKS_REPORTED:.2f}x)")
    return out


def format_monitor_table(summary: dict[str, list[dict]]) -> str:
    """Markdown: per device and model a table of the training-step cases (time, flush, ratio to no hooks, cost per
    record), per device a table of the tiny-hook cases, then the targets."""
    out: list[str] = []
    steps, hooks = summary.get("steps", []), summary.get("hooks", [])
    tables: dict[tuple, list[dict]] = {}
    for row in steps:
        tables.setdefault((row["device"], row["model"]), []).append(row)
    for (device, model), group in tables.items():
        first = group[0]
        notes = ["host clock"] + [f"{t} torch thread{'s' if t > 1 else ''}"
                                  for t in sorted({r["threads"] for r in group if r["threads"]}) if device == "cpu"]
        out.append(f"### hookstats.Monitor, one training step, {device}: {first['model_desc']} "
                   f"(median times; {', '.join(notes)})")
        out.append("")
        shape = [f"{first['modules']:,} modules" if first["modules"] else None,
                 f"{first['hook_calls']:,} hook calls" if first["hook_calls"] else None,
                 f"{first['records_per_step']:,} tensors recorded" if first["records_per_step"] else None]
        if any(shape):
            out.append("A step: " + ", ".join(s for s in shape if s) + ".")
            out.append("")
        every = sorted({r["flush_every"] for r in group if r["flush_every"]})
        flush_head = f"flush ms (every {every[0]})" if len(every) == 1 else "flush ms"
        head = ["case", "step ms", "IQR", flush_head, "step + flush share ms", "vs no hooks", "µs / tensor",
                "beyond empty hooks µs / tensor", "rounds"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join(":---" if i == 0 else "---:" for i in range(len(head))) + "|")
        for r in group:
            out.append("| " + " | ".join([
                _MONITOR_CASE_NAMES.get(r["case"], r["case"]),
                _fmt_ms(r["step_s"]),
                _fmt(r["iqr"], ".0%"),
                _fmt_ms(r["flush_s"]),
                _fmt_ms(r["total_s"]),
                _fmt(r["ratio"], ".2f", "x"),
                _fmt_us_signed(r["overhead_per_record_s"]),
                _fmt_us_signed(r["own_per_record_s"]),
                str(r["rounds"] or "–"),
            ]) + " |")
        out.append("")
        noisy = [r for r in group if r["iqr"] is not None and r["iqr"] > MONITOR_NOISY_IQR]
        if noisy:
            spread = ", ".join(f"{_MONITOR_CASE_NAMES.get(r['case'], r['case'])} {r['iqr']:.0%}" for r in noisy)
            out.append(
                f"**Warning:** step times spread by more than {MONITOR_NOISY_IQR:.0%} (IQR / median: {spread}), so "
                "these ratios are uncertain: a busy machine (with all cores in use, each parallel region of a step can "
                "wait a scheduler tick; rerun on a quiet machine), or in the hook-heavy cases Python's garbage "
                "collector (PyTorch's full backward hooks allocate autograd Functions in every module, every step)."
            )
            out.append("")
    devices: dict[str, list[dict]] = {}
    for row in hooks:
        devices.setdefault(row["device"], []).append(row)
    for device, group in devices.items():
        notes = ["host clock" + (", synchronized per call" if device == "cuda" else "")]
        notes += [f"{t} torch thread{'s' if t > 1 else ''}"
                  for t in sorted({r["threads"] for r in group if r["threads"]}) if device == "cpu"]
        out.append(f"### one hook call on a tiny tensor, {device}: Linear(4, 4) forward on a 1 x 4 input, one forward "
                   f"hook (median times; {', '.join(notes)})")
        out.append("")
        head = ["hook", "µs a forward", "IQR", "hook cost µs"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|:---|---:|---:|---:|")
        for r in group:
            out.append("| " + " | ".join([_MONITOR_CASE_NAMES.get(r["case"], r["case"]), _fmt_us(r["call_s"]),
                                          _fmt(r["iqr"], ".0%"), _fmt_us_signed(r["over_none_s"])]) + " |")
        out.append("")
    if not out:
        return "No hookstats.Monitor benchmarks in this file.\n"
    out.append(
        "step ms: median of single steps (forward, MSE loss, backward, SGD step). flush ms: the median `mon.flush()`, "
        "timed inside the step every N-th call (one host copy of the buffers plus the record dicts); step + flush "
        "share: step ms + flush ms / N, the time a Monitor step costs and the one its ratio uses. vs no hooks: that "
        "time / no hooks, where no hooks is the mean of the two no-hooks rows, timed first and last so that they "
        "bracket the other cases (the machine's speed drifts). µs / tensor: (that time - no hooks) / tensors recorded "
        "a step, i.e. the cost of one recorded tensor, hook call included; beyond empty hooks: the same against the "
        "empty-hooks case, i.e. leaving out what PyTorch's hook machinery costs by itself. IQR: interquartile range / "
        "median of the step (or call) times. hook cost: µs a forward - the no-hook forward's."
    )
    out.append("")
    out.extend(format_monitor_targets(steps))
    return "\n".join(out) + "\n"


COMPILE_CASES = ("eager", "eager_monitor", "compiled", "compiled_ca", "compiled_ca_monitor", "eager_after")
_COMPILE_CASE_NAMES = {
    "eager": "eager, no hooks",
    "eager_monitor": "eager + Monitor",
    "compiled": "torch.compile",
    "compiled_ca": "torch.compile + compiled autograd",
    "compiled_ca_monitor": "torch.compile + compiled autograd + Monitor",
    "eager_after": "eager, no hooks, again (timed last)",
}
# What each case's "vs its pair" ratio divides by: the Monitor's cost in the same execution mode.
_COMPILE_PAIRS = {"eager_monitor": "eager", "compiled_ca_monitor": "compiled_ca"}


def summarize_compile(json_path: str) -> list[dict]:
    """The torch.compile step benchmarks (benchmarks/test_bench_compile.py): one dict per (device, model, case),
    sorted by device, model, then COMPILE_CASES. Keys: device, model, model_desc, case, backend, threads, rounds,
    step_s (median), iqr (/ step_s), flush_s, flush_every, total_s (step_s + flush_s / flush_every), first_step_s
    (the compiling step), graphs, new_graphs_while_timed, graph_breaks, records_per_step, vs_eager (total_s / the
    mean of the two no-hooks eager cases), vs_pair (eager_monitor / eager baseline, compiled_ca_monitor /
    compiled_ca)."""
    with open(json_path) as f:
        data = json.load(f)
    rows: dict[tuple, dict] = {}
    for bench in data.get("benchmarks", []):
        extra = bench.get("extra_info", {})
        if extra.get("family") != "compile" or extra.get("case") not in COMPILE_CASES:
            continue
        median = float(bench["stats"]["median"])
        flush_s, every = extra.get("flush_s"), extra.get("flush_every")
        rows[(extra["device"], extra["model"], extra["case"])] = {
            "device": extra["device"], "model": extra["model"], "model_desc": extra.get("model_desc", extra["model"]),
            "case": extra["case"], "backend": extra.get("backend"), "threads": extra.get("torch_threads"),
            "rounds": bench["stats"].get("rounds"), "step_s": median,
            "iqr": float(bench["stats"]["iqr"]) / median if median else None,
            "flush_s": flush_s, "flush_every": every if flush_s is not None else None,
            "total_s": median + flush_s / every if flush_s is not None and every else median,
            "first_step_s": extra.get("first_step_s"), "graphs": extra.get("graphs"),
            "new_graphs_while_timed": extra.get("new_graphs_while_timed"), "graph_breaks": extra.get("graph_breaks"),
            "records_per_step": extra.get("records_per_step"),
        }
    out = []
    for key in sorted(rows, key=lambda k: (k[0] != "cpu", k[0], k[1], COMPILE_CASES.index(k[2]))):
        row = rows[key]
        base = [rows[(key[0], key[1], c)]["total_s"] for c in ("eager", "eager_after") if (key[0], key[1], c) in rows]
        base_s = sum(base) / len(base) if base else None
        row["vs_eager"] = row["total_s"] / base_s if base_s else None
        pair = _COMPILE_PAIRS.get(row["case"])
        pair_s = base_s if pair == "eager" else rows.get((key[0], key[1], pair), {}).get("total_s") if pair else None
        row["vs_pair"] = row["total_s"] / pair_s if pair_s else None
        out.append(row)
    return out


def format_compile_table(rows: list[dict]) -> str:
    """Markdown: per device and model, the training step eager and compiled, with and without a Monitor."""
    out: list[str] = []
    tables: dict[tuple, list[dict]] = {}
    for row in rows:
        tables.setdefault((row["device"], row["model"]), []).append(row)
    for (device, model), group in tables.items():
        backends = sorted({r["backend"] for r in group if r["backend"] and r["backend"] != "eager"})
        threads = sorted({r["threads"] for r in group if r["threads"]})
        notes = ["host clock", f"backend {', '.join(backends) or '–'}"]
        if device == "cpu" and threads:
            notes.append(", ".join(f"{t} torch thread{'s' if t > 1 else ''}" for t in threads))
        out.append(f"### torch.compile and hookstats.Monitor, one training step, {device}: {group[0]['model_desc']} "
                   f"(median times; {'; '.join(notes)})")
        out.append("")
        head = ["case", "step ms", "IQR", "step + flush share ms", "vs eager", "Monitor: vs same without",
                "first step s", "graphs", "new graphs while timed", "graph breaks", "rounds"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join(":---" if i == 0 else "---:" for i in range(len(head))) + "|")
        for r in group:
            out.append("| " + " | ".join([
                _COMPILE_CASE_NAMES.get(r["case"], r["case"]), _fmt_ms(r["step_s"]), _fmt(r["iqr"], ".0%"),
                _fmt_ms(r["total_s"]), _fmt(r["vs_eager"], ".2f", "x"), _fmt(r["vs_pair"], ".2f", "x"),
                _fmt(r["first_step_s"], ".1f"), str(r["graphs"] if r["graphs"] is not None else "–"),
                str(r["new_graphs_while_timed"] if r["new_graphs_while_timed"] is not None else "–"),
                str(r["graph_breaks"] if r["graph_breaks"] is not None else "–"), str(r["rounds"] or "–"),
            ]) + " |")
        out.append("")
    if not out:
        return "No torch.compile benchmarks in this file.\n"
    out.append("vs eager: step + flush share / the mean of the two eager no-hooks rows (timed first and last). Monitor: "
               "vs same without: the Monitor case / the same execution mode without hooks (eager, or torch.compile "
               "with compiled autograd): what the Monitor costs there. first step: the step that compiled (a few "
               "seconds eager). new graphs while timed: graphs compiled during the timed rounds (0: no recompiles).")
    return "\n".join(out) + "\n"


def summarize_dist(json_path: str) -> list[dict]:
    """The extra_info of the distributed clipping benchmarks (timed inside the ranks, benchmarks/
    test_bench_distributed.py)."""
    with open(json_path) as f:
        data = json.load(f)
    return [b.get("extra_info", {}) for b in data.get("benchmarks", [])
            if b.get("extra_info", {}).get("family") == "dist_clip"]


def format_dist_table(rows: list[dict]) -> str:
    lines = ["", "## Distributed clipping (FSDP2, DTensor grads; timed inside the ranks, slowest rank's median)", "",
             "| setup | op | hookstats | torch.nn.utils | speedup (per rank) |", "|---|---|---|---|---|"]
    for r in rows:
        setup = (f"{r.get('world_size')} {r.get('backend')} ranks, {r.get('device')}, {r.get('n_tensors')} "
                 f"{r.get('dtype')} tensors, {r.get('numel', 0) / 1e6:.2f}M values")
        for op, name in (("clip_grad_norm", "clip_grad_norm_"), ("total_norm", "get_total_norm")):
            if f"{op}_hookstats_s" not in r:
                continue
            per_rank = ", ".join(f"{x:.2f}x" for x in r.get(f"{op}_rank_speedup", []))
            lines.append(f"| {setup} | {name} | {_fmt_ms(r[f'{op}_hookstats_s'])} | {_fmt_ms(r[f'{op}_torch_s'])} | "
                         f"**{r[f'{op}_speedup']:.2f}x** ({per_rank}) |")
    return "\n".join(lines) + "\n"


def summarize_large(json_path: str) -> list[dict]:
    """The extra_info of the large-model benchmarks (benchmarks/test_bench_large_models.py): interleaved medians and
    ratios measured inside the benchmark."""
    with open(json_path) as f:
        data = json.load(f)
    return [b.get("extra_info", {}) for b in data.get("benchmarks", [])
            if b.get("extra_info", {}).get("family") == "large"]


LARGE_CASE_NAMES = {"none": "no hooks", "empty_hooks": "PyTorch's empty forward + full backward pre-hooks",
                    "monitor": "Monitor, default kinds", "monitor_grads": "+ grad (optimizer=)",
                    "monitor_exp": "+ exponent histogram"}


def format_large_table(rows: list[dict]) -> str:
    lines = ["", "## Monitor on large models (1 thread, interleaved; flush every 10 steps counted in)", ""]
    for r in rows:
        if r.get("bench") == "step":
            lines += [f"### {r['model']}: {r['modules']} modules, {r['records_per_step']} records a step (with grads)",
                      "", "| case | step ms (fastest period) | vs no hooks | median ratio | target |",
                      "|---|---:|---:|---:|---:|"]
            targets = r.get("targets", {})
            for case, name in LARGE_CASE_NAMES.items():
                if case not in r.get("ratios", {}):
                    continue
                ratio = r["ratios"][case]
                target = targets.get(case)
                mark = "" if target is None else (f"<= {target:.2f}x " + ("met" if ratio <= target else "**missed**"))
                med = r.get("median_ratios", {}).get(case)
                med_s = "" if med is None else f"{med:.2f}x"
                lines.append(f"| {name} | {r['step_s'][case] * 1e3:.2f} | {ratio:.2f}x | {med_s} | {mark} |")
            lines.append("")
        elif r.get("bench") == "host":
            t = r.get("targets", {})
            for key, label in (("record_host_s", "host time per recorded tensor (tiny tensor, kernel included)"),
                               ("flush_per_record_s", f"flush per record ({r.get('flush_records')} records)")):
                v, goal = r[key], t.get(key)
                verdict = "" if goal is None else f" (target <= {goal * 1e6:.2f} us: {'met' if v <= goal else 'missed'})"
                lines.append(f"- {label}: {v * 1e6:.2f} us{verdict}")
            if r.get("flush_exp_per_record_s") is not None:
                kept, dense = r.get("hist_kept_bytes", 0), r.get("hist_dense_bytes", 0)
                share = f", {kept / dense:.0%} of the dense rows" if dense else ""
                lines.append(f"- flush per record with exponent histograms ({r['flush_exp_records']} records, "
                             f"{r.get('flush_every')} steps): {r['flush_exp_per_record_s'] * 1e6:.2f} us; histogram rows "
                             f"kept: {kept / 1e6:.1f} MB{share}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# Every distribution (benchmarks/test_bench_stats.py test_stats_by_data, test_bench_hist.py test_hist_by_data)

BYDATA_OPS = ("sum", "stats", "norm", "hist", "exp_hist", "stats_hist", "histc", "bincount")
# op -> the slowest / fastest distribution ratio it should stay under (issue 14)
BYDATA_SPREAD = {"stats": 1.5, "norm": 1.5, "hist": 1.3, "exp_hist": 1.3}
# Distributions whose every non-NaN value is one value (or that are all NaN): the CPU kernel counts their chunks'
# histograms at once from the statistics (Note [cpu constant chunks] in csrc/cpu/stats_cpu.cpp). The interleaved
# groups say per row whether the data fell in one bin ("one_bin", "one_bin_exp": float16 flushes 1e-20 to zero, and
# the edge rule puts all of float32 randn * 1e-20 in one bin, counted 64 at a time), and the report uses that.
ONE_SLOT_DATA = ("zeros", "all_nan", "on_edge")


def summarize_bydata(json_path: str) -> dict:
    """{(device, dtype): {data: {op: seconds}}} of the by-distribution groups, in the run's order of data.
    The stats file's and the hist file's groups of one distribution are one row (both time `stats` or `sum`:
    the hist file's time wins, it runs beside the histograms)."""
    with open(json_path) as f:
        data = json.load(f)
    out: dict[tuple, dict] = {}
    for bench in data.get("benchmarks", []):
        extra = bench.get("extra_info", {})
        if extra.get("family") not in ("bydata", "bydata_hist"):
            continue
        case = extra.get("case", "")
        op = "histc" if case.startswith("histc") else case
        if op not in BYDATA_OPS:
            continue
        key = (extra["device"], extra["dtype"])
        row = out.setdefault(key, {}).setdefault(extra["data"], {})
        if op in row and extra["family"] == "bydata":
            continue
        row[op] = _case_seconds(bench)[0]
    return out


def bydata_targets(rows: dict, hist_op: str) -> str:
    """Issue 14's target lines for one device and dtype: {data: {op: µs}}, the range histogram's time under
    `hist_op` ("hist" in the by-distribution groups, "stats_hist" in the interleaved ones: the same kernel)."""
    spread = {(hist_op if op == "hist" else op): limit for op, limit in BYDATA_SPREAD.items()}
    lines = ["Targets (reported, not asserted):"]
    for op, limit in spread.items():
        ts = {n: r[op] for n, r in rows.items() if r.get(op)}
        if not ts:
            continue
        ratio = max(ts.values()) / min(ts.values())
        slow, fast = max(ts, key=ts.get), min(ts, key=ts.get)
        flag = "one_bin_exp" if op == "exp_hist" else "one_bin"
        one_slot = {n for n, r in rows.items() if r.get(flag, n in ONE_SLOT_DATA)}
        per_value = {n: t for n, t in ts.items() if n not in one_slot}
        if op in (hist_op, "exp_hist") and len(per_value) < len(ts) and per_value:
            # Note [cpu constant chunks]: one-bin data skips the per-value work, so it is the fastest by
            # design; the target is about slow cases: the per-value distributions among themselves, and the
            # one-bin ones no slower than the slowest of those.
            pv = max(per_value.values()) / min(per_value.values())
            pslow, pfast = max(per_value, key=per_value.get), min(per_value, key=per_value.get)
            one_slot_ok = max(t for n, t in ts.items() if n in one_slot) <= max(per_value.values())
            met = pv <= limit and one_slot_ok
            lines.append(f"- `{op}` slowest / fastest <= {limit}x: {pv:.2f}x over the distributions binned value "
                         f"by value ({pslow} / {pfast}); {ratio:.2f}x with the one-bin data "
                         f"({', '.join(n for n in ts if n in one_slot)}), counted a chunk at once and "
                         f"{'no slower than the slowest of them' if one_slot_ok else 'SLOWER than some of them'} "
                         f"({'met' if met else 'NOT met'})")
            continue
        lines.append(f"- `{op}` slowest / fastest <= {limit}x: {ratio:.2f}x ({slow} / {fast}, "
                     f"{'met' if ratio <= limit else 'NOT met'})")
    vs = [r["histc"] / r[hist_op] for r in rows.values() if r.get("histc") and r.get(hist_op)]
    if vs:
        lines.append(f"- `hist` >= 4x faster than `torch.histc` on every distribution: at least {min(vs):.1f}x "
                     f"({'met' if min(vs) >= 4 else 'NOT met'})")
    sh = [r["stats_hist"] / (r["stats"] + r["bincount"]) for r in rows.values()
          if r.get("stats_hist") and r.get("stats") and r.get("bincount")]
    if sh:
        lines.append(f"- `stats_hist` <= 1.5x (`stats` + `bincount`): at most {max(sh):.2f}x "
                     f"({'met' if max(sh) <= 1.5 else 'NOT met'})")
    return "\n".join(lines) + "\n"


def format_bydata_table(table: dict) -> str:
    """Markdown: per (device, dtype), µs of each op on each distribution, the slowest / fastest ratio per op, and
    the issue's targets: hist >= 4x faster than histc everywhere, stats_hist within 1.5x of stats + bincount."""
    out: list[str] = []
    for (device, dtype), rows in table.items():
        ops = [op for op in BYDATA_OPS if any(op in r for r in rows.values())]
        out.append(f"### By distribution, {device}, {dtype}, µs (median)\n")
        out.append("| data | " + " | ".join(f"`{op}`" for op in ops) + " |")
        out.append("|---|" + "---:|" * len(ops))
        for name, r in rows.items():
            out.append(f"| {name} | " + " | ".join(_fmt_us(r.get(op)) for op in ops) + " |")
        spread = []
        for op in ops:
            ts = [r[op] for r in rows.values() if r.get(op)]
            spread.append(f"{max(ts) / min(ts):.2f}x" if ts else "–")
        out.append("| **slowest / fastest** | " + " | ".join(spread) + " |")
        if "randn" in rows:  # NaN-laden data is cheaper than randn (counted only): the slow side, against randn
            vs_randn = []
            for op in ops:
                ts = [r[op] for r in rows.values() if r.get(op)]
                base = rows["randn"].get(op)
                vs_randn.append(f"{max(ts) / base:.2f}x" if ts and base else "–")
            out.append("| **slowest / randn** | " + " | ".join(vs_randn) + " |")
        out.append("")
        out.append(bydata_targets(rows, "hist"))
    return "\n".join(out)


def summarize_bydata_interleaved(json_path: str) -> dict:
    """{(device, dtype): {data: {op: µs}}} of the interleaved by-distribution groups (test_hist_by_data_interleaved)."""
    with open(json_path) as f:
        data = json.load(f)
    return {(b["extra_info"]["device"], b["extra_info"]["dtype"]): b["extra_info"]["rows"]
            for b in data.get("benchmarks", []) if b.get("extra_info", {}).get("family") == "bydata_interleaved"}


def format_bydata_interleaved(table: dict) -> str:
    """Markdown: the interleaved medians per distribution, and the issue's targets read from them."""
    ops = ("sum", "stats", "stats_hist", "exp_hist", "histc", "bincount")
    out: list[str] = []
    for (device, dtype), rows in table.items():
        out.append(f"### By distribution, interleaved call by call, {device}, {dtype}, µs (median)\n")
        out.append("| data | " + " | ".join(f"`{op}`" for op in ops) + " | `stats_hist` / (`stats` + `bincount`) |")
        out.append("|---|" + "---:|" * (len(ops) + 1))
        for name, r in rows.items():
            ratio = r["stats_hist"] / (r["stats"] + r["bincount"])
            out.append(f"| {name} | " + " | ".join(_fmt_us(r.get(op) * 1e-6 if r.get(op) else None) for op in ops)
                       + f" | {ratio:.2f}x |")
        out.append("")
        out.append(bydata_targets(rows, "stats_hist"))
    return "\n".join(out)


def summarize_export(json_path: str) -> list[dict]:
    """The extra_info of the exporter benchmarks (benchmarks/test_bench_export.py)."""
    with open(json_path) as f:
        data = json.load(f)
    return [b.get("extra_info", {}) for b in data.get("benchmarks", [])
            if b.get("extra_info", {}).get("family") == "export"]


EXPORT_NAMES = {"none": "no exporter (the flush alone)", "parquet": "ParquetWriter (float32)",
                "parquet64": "ParquetWriter (float64)", "jsonl": "JSONLWriter", "tensorboard": "TensorBoardWriter",
                "wandb": "WandbWriter (offline)"}


def format_export_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    r0 = rows[0]
    lines = ["", f"## Exporters off the training thread ({r0.get('records_per_step')} records a step, flush every "
                 f"{r0.get('flush_every')} steps, 1 thread)", "",
             "| writer | steps | records | training thread ms/step | flush | hand-over | queue-full waits | "
             "drain s | writer records/s | bytes/record | report s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {r["writer"]: r for r in rows}
    for name, label in EXPORT_NAMES.items():
        r = by.get(name)
        if r is None:
            continue
        exp = r.get("export_s")
        cells = [label, str(r["steps"]), f"{r['records']:,}", f"{r['step_thread_s'] * 1e3:.3f}",
                 f"{r.get('flush_s', 0) * 1e3:.3f}", "-" if exp is None or name == "none" else f"{exp * 1e3:.3f}",
                 f"{r['export_waits']} ({r.get('wait_s', 0) * 1e3:.3f} ms/step)",
                 f"{r['drain_s']:.2f}", f"{r['writer_rps']:,.0f}",
                 f"{r['bytes_per_record']:.1f}" if "bytes_per_record" in r else "-",
                 f"{r['report_s']:.2f}" if "report_s" in r else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    t = r0.get("targets", {})
    pq, js = by.get("parquet"), by.get("jsonl")
    lines.append("")
    if pq and pq.get("export_s") is not None:
        v, goal = pq["export_s"], t.get("export_s", 0.3e-3)
        lines.append(f"- Parquet: handing each flush to the export thread costs the training thread {v * 1e3:.3f} ms "
                     f"a step (target <= {goal * 1e3:.1f} ms: {'met' if v <= goal else 'missed'}); flush + hand-over "
                     f"{(v + pq['flush_s']) * 1e3:.3f} ms (the flush: issue #13's copy into a Block); queue-full "
                     f"waits {pq['export_waits']} ({pq.get('wait_s', 0) * 1e3:.3f} ms a step: the writer behind this "
                     f"hooks-only loop)")
    if pq and js and "bytes_per_record" in pq and "bytes_per_record" in js:
        ratio = pq["bytes_per_record"] / js["bytes_per_record"]
        goal = t.get("parquet_vs_jsonl_bytes", 0.2)
        lines.append(f"- Parquet / JSONL bytes per record: {ratio:.3f} (target <= {goal:.2f}: "
                     f"{'met' if ratio <= goal else 'missed'})")
    if pq and "report_s" in pq:
        goal = t.get("report_s", 10.0)
        lines.append(f"- report of the {pq['records']:,}-record Parquet run: {pq['report_s']:.2f} s (target <= "
                     f"{goal:.0f} s: {'met' if pq['report_s'] <= goal else 'missed'})")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json_path", help="pytest-benchmark JSON (--benchmark-json=PATH)")
    parser.add_argument("--markdown", metavar="OUT", help="also write the report to this file")
    args = parser.parse_args(argv)
    text = format_table(summarize(args.json_path)) + "\n" + format_hist_table(summarize_hist(args.json_path))
    clip_rows = summarize_clip(args.json_path)
    if clip_rows:  # files without clipping groups print exactly what they did before
        text += "\n" + format_clip_table(clip_rows)
    monitor = summarize_monitor(args.json_path)
    if monitor["steps"] or monitor["hooks"]:  # likewise for the Monitor groups
        text += "\n" + format_monitor_table(monitor)
    compile_rows = summarize_compile(args.json_path)
    if compile_rows:
        text += "\n" + format_compile_table(compile_rows)
    bydata = summarize_bydata(args.json_path)
    if bydata:  # files without the by-distribution groups print exactly what they did before
        text += "\n" + format_bydata_table(bydata)
    interleaved = summarize_bydata_interleaved(args.json_path)
    if interleaved:
        text += "\n" + format_bydata_interleaved(interleaved)
    dist_rows = summarize_dist(args.json_path)
    if dist_rows:
        text += format_dist_table(dist_rows)
    large_rows = summarize_large(args.json_path)
    if large_rows:
        text += format_large_table(large_rows)
    export_rows = summarize_export(args.json_path)
    if export_rows:
        text += format_export_table(export_rows)
    sys.stdout.write(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
