"""PNG plots of run.py's results: throughput over the sweeps, worker memory over an epoch.

matplotlib (``pip install 'fastdata[bench]'``) is imported on first use,
with the Agg backend; without it no plot is drawn and the run says so.
"""

import os
import statistics

_MARKERS = {"folder": "o", "hdf5-raw": "s", "arrow-raw": "^", "hdf5-jpeg": "D", "arrow-jpeg": "v"}
_COLORS = {"folder": "tab:gray", "hdf5-raw": "tab:blue", "arrow-raw": "tab:orange", "hdf5-jpeg": "tab:green",
           "arrow-jpeg": "tab:red"}


def draw(results, out_dir):
    """Draw every plot the results allow; return ``(paths written, note or None)``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "no plots: matplotlib is not installed (pip install 'fastdata[bench]')"
    sections, written = results["sections"], []
    sweeps = sections.get("sweeps") or {}
    for name in ("num_workers", "batch_size", "prefetch_factor"):
        points = (sweeps.get("sweeps") or {}).get(name)
        if points:
            written.append(_sweep_plot(plt, name, points, os.path.join(out_dir, f"throughput_vs_{name}.png")))
    memory = sections.get("memory") or {}
    if memory.get("rows"):
        written.append(_memory_plot(plt, memory, os.path.join(out_dir, "worker_memory_over_epoch.png")))
    return written, None


def _sweep_plot(plt, name, points, path):
    """samples/s against ``name``, one line per format (and per num_workers where that varies too)."""
    groups = {}
    for p in points:
        label = p["format"] if name == "num_workers" else f"{p['format']}, {p['num_workers']} workers"
        groups.setdefault(label, []).append((p[name], p["samples_per_s"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, series in groups.items():
        series.sort()
        fmt = label.split(",")[0]
        dashed = name != "num_workers" and not label.endswith(" 0 workers")  # with workers: dashed
        ax.plot([x for x, _ in series], [y for _, y in series], marker=_MARKERS.get(fmt, "o"),
                color=_COLORS.get(fmt), linestyle="--" if dashed else "-", label=label)
    ax.set_xscale("symlog" if name == "num_workers" else "log", base=2)
    ax.set_yscale("log")
    values = sorted({p[name] for p in points})
    ax.set_xticks(values, [str(v) for v in values])
    ax.set_xlabel(name)
    ax.set_ylabel("samples/s (log)")
    ax.set_title(f"Throughput vs {name} (64x64, shuffled)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _memory_plot(plt, memory, path):
    """Mean per-worker growth (private dirty, and USS) over the epoch; one panel per start method."""
    methods = sorted({row["start_method"] for row in memory["rows"]})
    fig, axes = plt.subplots(2, len(methods), figsize=(6 * len(methods), 8), squeeze=False)
    for column, method in enumerate(methods):
        for row in (r for r in memory["rows"] if r["start_method"] == method):
            starts = [w["start"] for w in row["workers"]]
            for line, key in enumerate(("private_dirty", "uss")):
                xs = [0.0] + [reading["fraction"] for reading in row["readings"]] + [1.0]
                ys = [0.0] + [_mean_growth(reading["workers"], starts, key) for reading in row["readings"]]
                ys.append(_mean_growth([w["end"] for w in row["workers"]], starts, key))
                axes[line][column].plot(xs, ys, label=row["method"])
        axes[0][column].axhline(memory.get("bar_mb", 2.0), color="black", linestyle=":", linewidth=1,
                                label="bar for packed datasets")
        for line, key in enumerate(("private dirty", "USS")):
            ax = axes[line][column]
            ax.set_title(f"{method}: per-worker {key} growth")
            ax.set_xlabel("fraction of the epoch")
            ax.set_ylabel("MB (mean over workers)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"Worker memory over one epoch of {memory['num_samples']:,} samples")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mean_growth(readings, starts, key):
    if len(readings) != len(starts):
        return float("nan")
    return statistics.mean(r[key] - s[key] for r, s in zip(readings, starts)) / 1e6
