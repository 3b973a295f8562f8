"""Markdown report of a hookstats benchmark run (pytest-benchmark JSON), stdlib only.

    python -m pytest benchmarks --benchmark-only --benchmark-json=bench.json
    python benchmarks/report.py bench.json [--markdown out.md]

Two sets of tables, one table per device and dtype in each: hookstats.stats (`summarize`, `format_table`) and
the histograms (`summarize_hist`, `format_hist_table`). Times are medians. GB/s counts one read of the input (the bytes the fused op
must move); the roof is the same run's `x.sum()` on CPU and `y.copy_(x)` on CUDA, whose GB/s counts read +
write. On CUDA, times come from CUDA events around back-to-back launches when the run recorded them
(extra_info["cuda_event_s"]), else from the host clock with a synchronize per call.
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


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json_path", help="pytest-benchmark JSON (--benchmark-json=PATH)")
    parser.add_argument("--markdown", metavar="OUT", help="also write the report to this file")
    args = parser.parse_args(argv)
    text = format_table(summarize(args.json_path)) + "\n" + format_hist_table(summarize_hist(args.json_path))
    sys.stdout.write(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
