#!/usr/bin/python3
"""Charts of dattn benchmark results.

    plot.py [-o OUTDIR] [--title T] FILE.json [FILE.json ...]

Reads the JSON that `dattn-run WORKLOAD ... --json FILE` writes, an object
{"config": {...}, "rows": [...], ...}, merges the rows of every file and writes PNG charts
into OUTDIR (default: the current directory):

  prefill_time.png    prefill time_ms against seq (log2 x, log y), one line per series
  prefill_tflops.png  prefill tflops_per_rank against seq, one line per series
  decode_latency.png  decode time_ms (mean step latency) against the context length (seq)
  bytes_per_rank.png  sent_mb_per_rank against seq, one subplot per workload present

Row keys read (every row must have them; other keys are ignored):
  workload, strategy, layout       strings; layout "" means none
  seq, ranks                       positive integers
  time_ms, tflops_per_rank, sent_mb_per_rank   numbers or null

A series is (workload, strategy, layout, ranks). Its label names only what differs between
the series of a chart ("ring/zigzag, 4 ranks"); what they share goes into the chart's title.
A row whose value for a chart is null (or not finite) is left out of that chart. When several
rows give the same (series, seq), the last one read wins and a note says so.

Only charts with at least one point are written; one line is printed per chart written. A file
that is missing, is not JSON, has no rows or has a row without one of the keys above is an
error (exit status 1, the message names the file). Needs matplotlib (Agg backend, no display).
"""

import argparse
import json
import math
import os
import sys

STRING_KEYS = ("workload", "strategy", "layout")
INT_KEYS = ("seq", "ranks")
NUMBER_KEYS = ("time_ms", "tflops_per_rank", "sent_mb_per_rank")
REQUIRED_KEYS = STRING_KEYS + INT_KEYS + NUMBER_KEYS


class InputError(Exception):
    """A problem with one of the input files; the message names the file."""


# ---------------------------------------------------------------- reading


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_row(path, index, row):
    """Raises InputError unless row has every required key with a value of the right type."""
    where = f"{path}: row {index}"
    if not isinstance(row, dict):
        raise InputError(f"{where} is not an object")
    missing = [key for key in REQUIRED_KEYS if key not in row]
    if missing:
        raise InputError(f"{where} lacks the key(s) {', '.join(missing)}")
    for key in STRING_KEYS:
        if not isinstance(row[key], str):
            raise InputError(f"{where}: {key} is {row[key]!r}, not a string")
    for key in INT_KEYS:
        value = row[key]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InputError(f"{where}: {key} is {value!r}, not a positive integer")
    for key in NUMBER_KEYS:
        if row[key] is not None and not is_number(row[key]):
            raise InputError(f"{where}: {key} is {row[key]!r}, not a number or null")


def read_rows(path):
    """The rows of one benchmark JSON file, checked; raises InputError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise InputError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or "rows" not in data:
        raise InputError(f'{path}: no "rows" (expected an object {{"config": ..., "rows": [...]}})')
    rows = data["rows"]
    if not isinstance(rows, list):
        raise InputError(f'{path}: "rows" is not a list')
    if not rows:
        raise InputError(f'{path}: "rows" is empty')
    for index, row in enumerate(rows):
        check_row(path, index, row)
    return rows


def series_key(row):
    return (row["workload"], row["strategy"], row["layout"], row["ranks"])


def merge_rows(paths):
    """The rows of all files, one per (series, seq): the last read wins.

    Returns (rows, notes): rows in reading order, notes one line per duplicated point.
    """
    points = {}  # (series, seq) -> (row, path); dicts keep the order of first insertion
    notes = []
    for path in paths:
        for row in read_rows(path):
            key = (series_key(row), row["seq"])
            if key in points:
                notes.append(f"{describe_series(key[0])}, seq {key[1]}: duplicated in "
                             f"{points[key][1]} and {path}; keeping the last ({path})")
            points[key] = (row, path)
    return [row for row, _ in points.values()], notes


# ---------------------------------------------------------------- series and labels


def describe_series(key, show=(True, True, True, True)):
    """Readable text for a series key, with the parts whose show flag is set.

    ("prefill", "ring", "zigzag", 4) -> "prefill ring/zigzag, 4 ranks"
    """
    workload, strategy, layout, ranks = key
    name = strategy if show[1] else ""
    if show[2] and layout:
        name = f"{name}/{layout}" if name else layout
    if show[0]:
        name = f"{workload} {name}".strip()
    if show[3]:
        count = f"{ranks} rank" + ("" if ranks == 1 else "s")
        name = f"{name}, {count}" if name else count
    return name


def series_labels(keys):
    """Labels for the series of one chart (or subplot), which all have the same workload.

    Returns ({key: label}, common): the labels name the strategy and the parts that differ
    between the keys; common describes the layout and ranks all keys share ("" if none).
    """
    differs = [len({key[i] for key in keys}) > 1 for i in range(4)]
    differs[0], differs[1] = False, True  # the chart's title names the workload
    labels = {key: describe_series(key, differs) or key[0] for key in keys}
    shared = [False] + [not d for d in differs[1:]]
    common = describe_series(keys[0], shared) if keys and any(shared) else ""
    return labels, common


def series_points(rows, workload, value_key):
    """{series key: [(seq, value), ...] sorted by seq} for one workload and one row key.

    Rows whose value is null or not finite are left out.
    """
    series = {}
    for row in rows:
        value = row[value_key]
        if row["workload"] != workload or value is None or not math.isfinite(value):
            continue
        series.setdefault(series_key(row), []).append((row["seq"], value))
    return {key: sorted(points) for key, points in sorted(series.items())}


def series_styles(rows):
    """{series key: (palette, colour index, marker)} over all charts, so that a series looks
    the same in every chart. The markers differ too, so that lines on top of each other (equal
    bytes, say) still show both series."""
    keys = sorted({series_key(row) for row in rows})
    palette, colours = ("tab10", 10) if len(keys) <= 10 else ("tab20", 20)
    markers = "osD^vPX<>*"
    return {key: (palette, index % colours, markers[index % len(markers)])
            for index, key in enumerate(keys)}


# ---------------------------------------------------------------- drawing


def load_pyplot():
    """matplotlib.pyplot with the Agg backend, or exits with a message."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError as e:
        sys.exit(f"plot.py: error: matplotlib is needed ({e}); on Debian/Ubuntu: "
                 f"apt-get install python3-matplotlib, then run /usr/bin/python3 {sys.argv[0]}")
    return plt, ticker


def tokens(n):
    """Short text for a token count: 512, 4K, 1.5K, 1M."""
    for size, suffix in ((1 << 20, "M"), (1 << 10, "K")):
        if n >= size:
            return f"{n / size:g}{suffix}"
    return f"{n:g}"


def log_y_axis(ax, ticker, ys):
    """A log y axis labelled with plain numbers, also at 2x and 5x when it spans < 3 decades."""
    ax.set_yscale("log")
    plain = ticker.FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_formatter(plain)
    if max(ys) / min(ys) < 1000:
        ax.yaxis.set_minor_locator(ticker.LogLocator(base=10, subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(plain)
        ax.grid(True, which="minor", axis="y", alpha=0.15)
    else:
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def draw_series(ax, mpl, series, labels, styles, axis_labels, log_y):
    """Draws one line per series on ax over a log2 seq axis.

    axis_labels = (x label, y label). With log_y the y axis is logarithmic when all values
    are > 0; otherwise it is linear from 0 (or below, for negative values).
    """
    plt, ticker = mpl
    for key, points in series.items():
        palette, index, marker = styles[key]
        xs = [x for x, _ in points]
        ys = [y for _, y in points]
        ax.plot(xs, ys, marker=marker, markersize=7, markerfacecolor="none", label=labels[key],
                color=plt.get_cmap(palette)(index))
    ax.set_xscale("log", base=2)
    seqs = sorted({x for points in series.values() for x, _ in points})
    if len(seqs) <= 12:
        ax.set_xticks(seqs)
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: tokens(x)))
    ys = [y for points in series.values() for _, y in points]
    if log_y and min(ys) > 0:
        log_y_axis(ax, ticker, ys)
    else:
        ax.set_ylim(bottom=min(0, min(ys)))
    ax.set_xlabel(axis_labels[0])
    ax.set_ylabel(axis_labels[1])
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize="small")


def chart_title(text, common):
    """The title of one chart or subplot: text and the series parts shared by all lines."""
    return f"{text} ({common})" if common else text


def save(fig, mpl, outdir, title, name, counts):
    """Writes fig as OUTDIR/name with --title above it; counts = (series, points)."""
    path = os.path.join(outdir, name)
    if title:
        fig.suptitle(title, fontweight="bold")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    mpl[0].close(fig)
    print(f"wrote {path} ({counts[0]} series, {counts[1]} points)")


def line_chart(mpl, rows, styles, outdir, title, chart):
    """Writes one single-axes line chart, chart = (file name, workload, row key, title text,
    (x label, y label), log y); returns False (writing nothing) when no row has a value for it.
    """
    name, workload, value_key, text, axis_labels, log_y = chart
    series = series_points(rows, workload, value_key)
    if not series:
        return False
    labels, common = series_labels(list(series))
    fig, ax = mpl[0].subplots(figsize=(8, 5))
    draw_series(ax, mpl, series, labels, styles, axis_labels, log_y)
    ax.set_title(chart_title(text, common))
    save(fig, mpl, outdir, title, name, (len(series), sum(len(p) for p in series.values())))
    return True


def bytes_chart(mpl, rows, styles, outdir, title):
    """Writes bytes_per_rank.png: sent MB per rank against seq, one subplot per workload."""
    workloads = sorted({row["workload"] for row in rows})
    per_workload = [(w, series_points(rows, w, "sent_mb_per_rank")) for w in workloads]
    per_workload = [(w, s) for w, s in per_workload if s]
    if not per_workload:
        return False
    cols = min(2, len(per_workload))
    nrows = math.ceil(len(per_workload) / cols)
    fig, axes = mpl[0].subplots(nrows, cols, figsize=(7 * cols, 4.5 * nrows), squeeze=False)
    for ax, (workload, series) in zip(axes.flat, per_workload):
        labels, common = series_labels(list(series))
        xlabel = "context (tokens)" if workload == "decode" else "sequence length (tokens)"
        draw_series(ax, mpl, series, labels, styles, (xlabel, "sent per rank (MB)"), True)
        ax.set_title(chart_title(f"{workload.capitalize()}: bytes sent per rank", common))
    for ax in list(axes.flat)[len(per_workload):]:
        ax.set_visible(False)
    series_count = sum(len(s) for _, s in per_workload)
    point_count = sum(len(p) for _, s in per_workload for p in s.values())
    save(fig, mpl, outdir, title, "bytes_per_rank.png", (series_count, point_count))
    return True


LINE_CHARTS = (
    ("prefill_time.png", "prefill", "time_ms", "Prefill: time per forward",
     ("sequence length (tokens)", "time (ms)"), True),
    ("prefill_tflops.png", "prefill", "tflops_per_rank", "Prefill: throughput",
     ("sequence length (tokens)", "TFLOP/s per rank"), False),
    ("decode_latency.png", "decode", "time_ms", "Decode: step latency",
     ("context (tokens)", "mean step latency (ms)"), True),
)


# ---------------------------------------------------------------- main


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="plot.py",
        description="Write PNG charts of dattn benchmark JSON files (dattn-run ... --json FILE).")
    parser.add_argument("files", nargs="+", metavar="FILE.json", help="benchmark results")
    parser.add_argument("-o", "--outdir", default=".", help="folder for the PNGs (default: .)")
    parser.add_argument("--title", default="", help="a heading above every chart")
    return parser.parse_args(argv)


def main(argv):
    args = parse_args(argv)
    try:
        rows, notes = merge_rows(args.files)
    except InputError as e:
        print(f"plot.py: error: {e}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"plot.py: note: {note}", file=sys.stderr)
    mpl = load_pyplot()
    try:
        os.makedirs(args.outdir, exist_ok=True)
    except OSError as e:
        print(f"plot.py: error: cannot make the folder {args.outdir} ({e.strerror})",
              file=sys.stderr)
        return 1
    styles = series_styles(rows)
    written = 0
    for chart in LINE_CHARTS:
        written += line_chart(mpl, rows, styles, args.outdir, args.title, chart)
    written += bytes_chart(mpl, rows, styles, args.outdir, args.title)
    if not written:
        print("plot.py: error: no row has a value to plot", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
