"""Convergence study: does NVFP4 training match the float32 baseline on our model?

Trains the `examples/train_lm.py` transformer under several precision policies, with the
same seed and batches, and compares their loss curves:

    python benchmarks/convergence.py              # the default study
    python benchmarks/convergence.py --smoke      # a tiny run, to check it works
    python benchmarks/convergence.py --only float32,nvfp4

Writes `losses.csv` (per-step training loss of every variant), `convergence.png` (the
curves and each one's relative gap to the float32 baseline) and `results.md` (the table)
to `--out`, and prints the table: final loss, relative gap, validation loss, the first
step at which a variant reached the baseline's final loss, and wall time per step.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import pathlib
import sys
import time
from collections.abc import Callable

import jax
import numpy as np

import nvfp4x

ROOT = pathlib.Path(__file__).resolve().parent.parent


sys.path.insert(0, str(ROOT / "examples"))  # the main example's package, examples/nvfp4_lm
import nvfp4_lm as lm  # noqa: E402

R = nvfp4x.recipes


def _all_linear(recipe: nvfp4x.Recipe, *, head: bool = False) -> Callable:
    """Every Linear under `recipe` (the LM head too if `head`)."""

    def policy(path, _):
        return recipe if (head or path != "lm_head") else None

    return policy


#: name -> (description, policy builder from the model's Config; None = unquantised)
VARIANTS: dict[str, tuple[str, Callable | None]] = {
    "float32": ("unquantised float32 (baseline)", None),
    "bf16": ("every Linear bf16 (LM head too)", lambda cfg: _all_linear(R.bf16(), head=True)),
    "fp8": ("FP8 current scaling, LM head float32", lambda cfg: _all_linear(R.fp8())),
    "mxfp8": ("MXFP8, LM head float32", lambda cfg: _all_linear(R.mxfp8())),
    "nvfp4": ("NVFP4 recipe, paper policy (bf16 tail, LM head float32)", lm.paper_policy),
    "nvfp4_no_rht": (
        "as nvfp4, without the Hadamard transform",
        lambda cfg: lm.paper_policy(cfg, training=R.nvfp4_training(rht=False)),
    ),
    "nvfp4_no_sr": (
        "as nvfp4, gradients rounded to nearest",
        lambda cfg: lm.paper_policy(cfg, training=R.nvfp4_training(stochastic_rounding=False)),
    ),
    "nvfp4_1x16_w": (
        "as nvfp4, 1x16 weight blocks",
        lambda cfg: lm.paper_policy(cfg, training=R.nvfp4_training(weight_block=(1, 16))),
    ),
    "nvfp4_all": (
        "every Linear NVFP4 (no bf16 tail, LM head too)",
        lambda cfg: _all_linear(R.nvfp4_training(), head=True),
    ),
}


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    description: str
    final_loss: float
    gap: float
    val_loss: float
    steps_to_baseline: int | None
    seconds_per_step: float


def steps_to_reach(losses: np.ndarray, target: float, window: int) -> int | None:
    """First step at which the running mean (over `window` steps) is at or below `target`
    (to float32 precision: the baseline reaches its own final loss at its last step)."""
    if len(losses) < window:
        return None
    running = np.convolve(losses, np.ones(window) / window, mode="valid")
    hit = np.nonzero(running <= target * (1 + 1e-6))[0]
    return int(hit[0] + window) if len(hit) else None


def run(cfg, data, names: list[str], progress: bool) -> dict[str, lm.TrainResult]:
    key = jax.random.key(cfg.seed)
    results = {}
    for name in names:
        _, make_policy = VARIANTS[name]
        model = lm.build_model(cfg, key)
        if make_policy is not None:
            model = nvfp4x.quantize(model, make_policy(cfg))
        results[name] = lm.train(model, cfg, data, label=name, progress=progress)
    return results


def table(cfg, results: dict[str, lm.TrainResult]) -> list[Row]:
    base = results["float32"]
    window = max(1, min(20, cfg.steps // 10))
    rows = []
    for name, r in results.items():
        rows.append(
            Row(
                name=name,
                description=VARIANTS[name][0],
                final_loss=r.final_train_loss,
                gap=r.final_train_loss / base.final_train_loss - 1.0,
                val_loss=r.val_loss,
                steps_to_baseline=steps_to_reach(r.losses, base.final_train_loss, window),
                seconds_per_step=r.seconds / max(cfg.steps - 1, 1),
            )
        )
    return rows


def markdown(rows: list[Row], cfg) -> str:
    lines = [
        f"{cfg.n_layers} blocks, d_model {cfg.d_model}, {cfg.steps} steps of "
        f"{cfg.batch}x{cfg.seq} bytes; final loss = mean of the last "
        f"{max(1, min(20, cfg.steps // 10))} steps; seed {cfg.seed}.",
        "",
        "| variant | final train loss | gap vs float32 | val loss | steps to baseline's final "
        "loss | s/step | what |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        reach = "-" if r.steps_to_baseline is None else str(r.steps_to_baseline)
        lines.append(
            f"| {r.name} | {r.final_loss:.4f} | {100 * r.gap:+.2f}% | {r.val_loss:.4f} | "
            f"{reach} | {r.seconds_per_step:.3f} | {r.description} |"
        )
    return "\n".join(lines)


def write(out: pathlib.Path, cfg, results, rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    names = list(results)
    with open(out / "losses.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *names])
        for step in range(cfg.steps):
            w.writerow([step, *(f"{results[n].losses[step]:.6f}" for n in names)])
    (out / "results.md").write_text(markdown(rows, cfg) + "\n")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    smooth = max(1, cfg.steps // 50)
    kernel = np.ones(smooth) / smooth
    base = np.convolve(results["float32"].losses, kernel, mode="valid")
    for n in names:
        curve = np.convolve(results[n].losses, kernel, mode="valid")
        steps = np.arange(len(curve)) + smooth - 1
        ax1.plot(steps, curve, label=n, lw=1.2)
        ax2.plot(steps, 100 * (curve / base - 1), label=n, lw=1.2)
    ax1.set_ylabel("training loss (nats/byte)")
    ax1.legend(fontsize=8)
    ax2.axhline(0, color="k", lw=0.5)
    ax2.set_ylabel("gap to float32 (%)")
    ax2.set_xlabel("step")
    fig.suptitle("nvfp4x convergence study (train_lm, byte-level)")
    fig.tight_layout()
    fig.savefig(out / "convergence.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny config, few steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--only", default=None, help="comma-separated variant names")
    parser.add_argument("--data", default=None, help="a text file (default: Python's stdlib)")
    parser.add_argument("--out", default="out/convergence")
    parser.add_argument("--seed", type=int, default=None, help="weights and batch order")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    cfg = lm.SMOKE if args.smoke else lm.Config()
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    if args.seed is not None:
        cfg = dataclasses.replace(cfg, seed=args.seed)
    names = list(VARIANTS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if "float32" not in names:
        names.insert(0, "float32")
    data = lm.load_data(cfg, args.data)
    t0 = time.perf_counter()
    results = run(cfg, data, names, progress=not args.no_progress)
    rows = table(cfg, results)
    write(pathlib.Path(args.out), cfg, results, rows)
    print(markdown(rows, cfg))
    print(f"total {time.perf_counter() - t0:.0f} s; outputs in {args.out}")
    return {r.name: dataclasses.asdict(r) for r in rows}


if __name__ == "__main__":
    main()
