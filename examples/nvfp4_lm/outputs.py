"""The run's outputs: loss curves and telemetry, as CSV files and plots."""

import csv
import os

import numpy as np

from .training import TrainResult


def write_outputs(
    out: str, baseline: TrainResult, quant: TrainResult, *, title: str = ""
) -> tuple[str, str]:
    """Write `losses.csv` (step, baseline, nvfp4) and `loss_curves.png` (both curves, and
    the relative gap between them) to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    csv_path = os.path.join(out, "losses.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "baseline", "nvfp4"])
        for i, (a, b) in enumerate(zip(baseline.losses, quant.losses, strict=True)):
            writer.writerow([i + 1, f"{a:.6f}", f"{b:.6f}"])

    steps = np.arange(1, len(baseline.losses) + 1)
    k = max(1, len(steps) // 25)  # moving average over ~4% of the run
    smooth = lambda v: np.convolve(v, np.ones(k) / k, mode="valid")
    fig, (ax, gap_ax) = plt.subplots(
        2, 1, figsize=(7, 5.6), dpi=120, sharex=True, gridspec_kw=dict(height_ratios=[2.2, 1])
    )
    for res, color, name in ((baseline, "C0", "float32 baseline"), (quant, "C3", "NVFP4 recipe")):
        ax.plot(steps, res.losses, color=color, alpha=0.2, lw=0.8)
        ax.plot(steps[k - 1 :], smooth(res.losses), color=color, lw=1.6, label=name)
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title(title or "float32 vs NVFP4 training", fontsize=10)
    lo = min(baseline.losses.min(), quant.losses.min())
    hi = np.percentile(np.concatenate([baseline.losses, quant.losses]), 95)
    ax.set_ylim(lo - 0.05 * (hi - lo), hi)
    ax.grid(alpha=0.3)
    ax.legend()
    gap = 100 * (quant.losses - baseline.losses) / baseline.losses
    gap_ax.axhline(0, color="0.5", lw=0.8)
    gap_ax.plot(steps, gap, color="C3", alpha=0.2, lw=0.8)
    gap_ax.plot(steps[k - 1 :], smooth(gap), color="C3", lw=1.6)
    gap_ax.set_ylabel("gap (%)")
    gap_ax.set_xlabel(f"step (thick lines: moving average over {k} steps)")
    gap_ax.grid(alpha=0.3)
    fig.tight_layout()
    png_path = os.path.join(out, "loss_curves.png")
    fig.savefig(png_path)
    plt.close(fig)
    return csv_path, png_path


def write_telemetry(out: str, records: list) -> tuple[str, str]:
    """Write `telemetry.csv` (step, layer, operand, statistics) and `telemetry.png` (each
    statistic per operand over steps, averaged over the quantised layers) to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nvfp4x._telemetry import OPERANDS, STATS

    os.makedirs(out, exist_ok=True)
    csv_path = os.path.join(out, "telemetry.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "layer", "operand", *STATS])
        for step, table in enumerate(records, start=1):
            for layer, ops in table.items():
                for op in OPERANDS:
                    writer.writerow([step, layer, op, *(f"{float(ops[op][s]):.6g}" for s in STATS)])
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), dpi=120, sharex=True)
    steps = np.arange(1, len(records) + 1)
    for ax, stat in zip(axes.ravel(), STATS, strict=True):
        for op in OPERANDS:
            series = [np.mean([float(t[layer][op][stat]) for layer in t]) for t in records]
            ax.plot(steps, series, label=op, lw=1.2)
        ax.set_title(stat, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0, 0].set_yscale("log")
    axes[0, 0].legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle("NVFP4 operand statistics, mean over quantised layers", fontsize=10)
    fig.tight_layout()
    png_path = os.path.join(out, "telemetry.png")
    fig.savefig(png_path)
    plt.close(fig)
    return csv_path, png_path
