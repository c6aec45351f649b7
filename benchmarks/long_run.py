"""Does the error accumulate? The long-horizon study: 10,000 steps per variant.

Trains a small Llama-style byte LM (the `examples/train_lm.py` model, sized so that one
variant's 10,000 steps take well under an hour on 2 CPU cores) under float32, bf16, FP8
and the NVFP4 recipe, with the same seed and batches and a warmup-stable-decay learning
rate, and measures whether the gap to float32 grows with the number of steps:

    python benchmarks/long_run.py                         # every variant, 10,000 steps
    python benchmarks/long_run.py --only float32,nvfp4    # some variants
    python benchmarks/long_run.py --report                # tables and plot from the CSVs
    python benchmarks/long_run.py --smoke                 # a tiny run, to check it works

Each variant checkpoints every `--checkpoint-every` steps (model, optimiser state and the
losses so far, in one file written atomically with `eqx.tree_serialise_leaves`) and
resumes from its last checkpoint when started again: a killed run loses at most the
steps since then, and a resumed run equals an uninterrupted one bit for bit (the batches
depend on the step only; stochastic rounding is seeded by the weights).

Variants: `float32` (baseline), `bf16`, `fp8` (per-tensor current scaling, LM head
float32), `nvfp4` (the paper's policy: NVFP4 recipe, bf16 tail, LM head float32),
`nvfp4_then_bf16` (as nvfp4, every layer switched to bf16 for the last 10% of the steps
with `nvfp4x.requantize`, as the paper's App. D) and `nvfp4_unbiased` (as nvfp4, with the
block scales of stochastically rounded operands rounded up, when the installed nvfp4x has
that option).

Outputs in `--out` (default `benchmarks/results/long_run`): `<variant>/losses.csv`
(step, train loss, learning rate), `<variant>/val.csv` (step, validation loss),
`summary.md` (per variant: gap to float32 in the stable and decay phases, the slope of the
gap over the stable phase with its standard error) and `gap.png` (moving-average gap to
float32 over steps, log-scaled step axis).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax

import nvfp4x

ROOT = pathlib.Path(__file__).resolve().parent.parent
R = nvfp4x.recipes


sys.path.insert(0, str(ROOT / "examples"))  # the main example's package, examples/nvfp4_lm
import nvfp4_lm as lm  # noqa: E402

#: The study's model: 3 blocks, d_model 96, 64-byte contexts, 16 per step.
STUDY = lm.Config(
    d_model=96,
    n_layers=3,
    n_heads=3,
    seq=64,
    batch=16,
    steps=10_000,
    lr=3e-3,
    warmup=200,
    data_bytes=4_000_000,
    eval_seqs=256,
)
SMOKE = dataclasses.replace(
    lm.SMOKE, d_model=32, n_layers=2, n_heads=2, seq=16, batch=2, steps=12, warmup=2
)
DECAY_FRACTION = 0.2  # the last 20% of the steps: linear decay to 0
SWITCH_FRACTION = 0.9  # nvfp4_then_bf16: bf16 from 90% of the steps on


def _every_linear(recipe: nvfp4x.Recipe) -> Callable:
    def policy(path, _):
        return recipe if path != "lm_head" else None

    return policy


def _unbiased_training() -> nvfp4x.Recipe | None:
    try:
        return R.nvfp4_training(unbiased_sr=True)
    except TypeError:  # an nvfp4x without the option
        return None


@dataclasses.dataclass(frozen=True)
class Variant:
    """A study variant: the policy `quantize` gets (None: unquantised) and, optionally,
    the policy `requantize` switches to at `switch_fraction` of the steps."""

    description: str
    policy: Callable[[Any], Any] | None
    switch_to: Any = None
    switch_fraction: float = SWITCH_FRACTION


VARIANTS: dict[str, Variant] = {
    "float32": Variant("unquantised float32 (baseline)", None),
    "bf16": Variant("every Linear but the LM head in bf16", lambda cfg: _every_linear(R.bf16())),
    "fp8": Variant("FP8 current scaling, LM head float32", lambda cfg: _every_linear(R.fp8())),
    "nvfp4": Variant("NVFP4 recipe, paper policy", lm.paper_policy),
    "nvfp4_then_bf16": Variant(
        "as nvfp4; every quantised layer in bf16 for the last 10% of the steps",
        lm.paper_policy,
        switch_to=lambda path, _: None if path == "lm_head" else R.bf16(),
    ),
    "nvfp4_unbiased": Variant(
        "as nvfp4, SR block scales rounded up (unbiased)",
        lambda cfg: lm.paper_policy(cfg, training=_unbiased_training()),
    ),
}


def available(name: str) -> bool:
    return name != "nvfp4_unbiased" or _unbiased_training() is not None


def schedule(cfg) -> optax.Schedule:
    """Warmup-stable-decay: linear warmup to `cfg.lr`, constant, then a linear decay to 0
    over the last `DECAY_FRACTION` of the steps."""
    decay_start = int(cfg.steps * (1 - DECAY_FRACTION))
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, cfg.lr, cfg.warmup),
            optax.constant_schedule(cfg.lr),
            optax.linear_schedule(cfg.lr, 0.0, cfg.steps - decay_start),
        ],
        [cfg.warmup, decay_start],
    )


@functools.cache
def optimizer(cfg) -> optax.GradientTransformation:
    """Gradient clipping at 1, AdamW (decay on matrices only) on the WSD schedule (one
    object per configuration: the jitted step, which takes it as a static argument, is
    then compiled once per model structure, also when a run resumes)."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule(cfg), b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask),
    )


def switch_step(cfg, variant: Variant) -> int | None:
    return None if variant.switch_to is None else int(cfg.steps * variant.switch_fraction)


def initial_state(cfg, variant: Variant, step: int) -> tuple[Any, Any]:
    """`(model, opt_state)` as they are structured at `step` (after a precision switch
    the recipes, part of the tree structure, are the switched ones)."""
    model = lm.build_model(cfg, jax.random.key(cfg.seed))
    if variant.policy is not None:
        model = nvfp4x.quantize(model, variant.policy(cfg))
    opt_state = optimizer(cfg).init(eqx.filter(model, eqx.is_inexact_array))
    at = switch_step(cfg, variant)
    if at is not None and step >= at:
        model, opt_state = nvfp4x.requantize(model, variant.switch_to, state=opt_state)
    return model, opt_state


def _checkpoints(folder: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    found = []
    for p in folder.glob("ckpt_*.eqx"):
        try:
            found.append((int(p.stem.split("_")[1]), p))
        except (IndexError, ValueError):
            continue
    return sorted(found)


def save(folder: pathlib.Path, step: int, model, opt_state, losses, val) -> None:
    """One checkpoint file after `step` steps (written to a temporary name, then renamed:
    a kill never leaves a partial checkpoint); older ones are removed."""
    tmp = folder / f".ckpt_{step:06d}.tmp"
    with open(tmp, "wb") as f:
        eqx.tree_serialise_leaves(f, (model, opt_state, losses, val))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / f"ckpt_{step:06d}.eqx")
    for s, p in _checkpoints(folder):
        if s != step:
            p.unlink()


def load(folder: pathlib.Path, cfg, variant: Variant):
    """`(step, model, opt_state, losses, val)` from the last checkpoint, or from step 0.
    `losses[i]` is step i+1's training loss, `val[i]` the validation loss after i+1 steps
    (NaN where not measured)."""
    found = _checkpoints(folder)
    step = found[-1][0] if found else 0
    model, opt_state = initial_state(cfg, variant, step)
    losses = np.full(cfg.steps, np.nan, np.float32)
    val = np.full(cfg.steps, np.nan, np.float64)
    if found:
        with open(found[-1][1], "rb") as f:
            model, opt_state, losses, val = eqx.tree_deserialise_leaves(
                f, (model, opt_state, losses, val)
            )
    return step, model, opt_state, np.array(losses), np.array(val)


def run_variant(
    name: str,
    cfg,
    data,
    out: pathlib.Path,
    *,
    checkpoint_every: int,
    eval_every: int,
    stop_after: int | None = None,
    progress: bool = True,
) -> tuple[np.ndarray, Any]:
    """Train (or resume) one variant to `cfg.steps`; returns its per-step losses and
    the model.
    `stop_after`: stop once that many steps are done (simulates a killed run)."""
    from tqdm.auto import tqdm

    variant = VARIANTS[name]
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    if not _checkpoints(folder) and _complete(folder, cfg):
        # finished on another machine or session (its CSVs kept, its checkpoint not)
        return read_losses(folder), None
    step, model, opt_state, losses, val = load(folder, cfg, variant)
    if step >= cfg.steps:
        return losses, model
    optim = optimizer(cfg)
    sched = schedule(cfg)
    starts = lm.batch_starts(cfg, len(data.train))
    at = switch_step(cfg, variant)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = tqdm(range(step, end), desc=f"{name:>16}", disable=not progress, dynamic_ncols=True)
    for i in bar:
        if at is not None and i == at:
            model, opt_state = nvfp4x.requantize(model, variant.switch_to, state=opt_state)
        x, y = lm.windows(data.train, starts[i], cfg.seq)
        model, opt_state, loss = lm.train_step(model, opt_state, optim, x, y)
        losses[i] = float(loss)
        done = i + 1
        if done % eval_every == 0 or done == cfg.steps:
            val[i] = lm.evaluate(model, cfg, data.val)
        if done % checkpoint_every == 0 or done == end:
            save(folder, done, model, opt_state, losses, val)
            write_csvs(folder, losses[:done], val[:done], sched)
        bar.set_postfix(loss=f"{losses[i]:.3f}", refresh=False)
    return losses, model


def _complete(folder: pathlib.Path, cfg) -> bool:
    return (folder / "losses.csv").exists() and len(read_losses(folder)) >= cfg.steps


def write_csvs(folder: pathlib.Path, losses, val, sched) -> None:
    with open(folder / "losses.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "train_loss", "lr"])
        for i, loss in enumerate(losses):
            w.writerow([i + 1, f"{loss:.6f}", f"{float(sched(i)):.6g}"])
    with open(folder / "val.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "val_loss"])
        for i in np.flatnonzero(np.isfinite(val)):
            w.writerow([i + 1, f"{val[i]:.6f}"])


# --- the analysis ---


def read_losses(folder: pathlib.Path) -> np.ndarray:
    with open(folder / "losses.csv") as f:
        return np.array([float(r["train_loss"]) for r in csv.DictReader(f)])


def read_val(folder: pathlib.Path) -> dict[int, float]:
    with open(folder / "val.csv") as f:
        return {int(r["step"]): float(r["val_loss"]) for r in csv.DictReader(f)}


def moving_average(x: np.ndarray, window: int) -> np.ndarray:
    kernel = np.ones(window) / window
    return np.convolve(x, kernel, mode="valid")


def gap_slope(gap: np.ndarray, start: int, stop: int, block: int) -> tuple[float, float]:
    """Slope of the relative gap (per 1,000 steps) over steps `[start, stop)`, and its
    standard error: ordinary least squares on the means of consecutive `block`-step
    blocks (block means are close to independent; single steps are not)."""
    n = (stop - start) // block
    if n < 3:
        return float("nan"), float("nan")
    means = gap[start : start + n * block].reshape(n, block).mean(axis=1)
    t = (start + block * (np.arange(n) + 0.5)) / 1000.0
    tc = t - t.mean()
    slope = float(np.sum(tc * (means - means.mean())) / np.sum(tc**2))
    resid = means - means.mean() - slope * tc
    se = float(np.sqrt(np.sum(resid**2) / (n - 2) / np.sum(tc**2)))
    return slope, se


def summarise(cfg, out: pathlib.Path) -> tuple[str, dict]:
    """The study's table (markdown) and figures from the CSVs in `out`."""
    base = read_losses(out / "float32")
    base_val = read_val(out / "float32")
    stable = (cfg.warmup + cfg.steps // 50, int(cfg.steps * (1 - DECAY_FRACTION)))
    block = max(10, (stable[1] - stable[0]) // 20)
    last = max(1, cfg.steps // 20)
    rows, figures = [], {}
    for name in VARIANTS:
        folder = out / name
        if name == "float32" or not (folder / "losses.csv").exists():
            continue
        losses = read_losses(folder)
        n = min(len(losses), len(base))
        gap = (losses[:n] - base[:n]) / base[:n]
        slope, se = gap_slope(gap, stable[0], min(stable[1], n), block)
        part = gap[stable[0] : min(stable[1], n)]
        stable_gap = float(np.mean(part)) if part.size else float("nan")
        decay_gap = float(np.mean(gap[n - last : n])) if n == cfg.steps else float("nan")
        val = read_val(folder)
        final = max(s for s in val if s in base_val) if val else None
        val_gap = (val[final] - base_val[final]) / base_val[final] if final else float("nan")
        figures[name] = {
            "steps": n,
            "stable_gap": stable_gap,
            "slope_per_1k": slope,
            "slope_se": se,
            "decay_gap": decay_gap,
            "val_gap": val_gap,
            "val_step": final,
        }
        rows.append(
            f"| {name} | {n} | {100 * stable_gap:+.2f}% | {100 * slope:+.3f} ± {100 * se:.3f} "
            f"| {100 * decay_gap:+.2f}% | {100 * val_gap:+.2f}% (step {final}) |"
        )
    header = (
        f"Gap to float32 (relative train loss) of each variant; stable phase = steps "
        f"{stable[0]}-{stable[1]}, slope in percentage points per 1,000 steps (OLS on "
        f"{block}-step block means, ± one standard error), decay = the last {last} steps.\n\n"
        "| variant | steps | stable-phase gap | slope (pp / 1k steps) | decay gap | "
        "validation gap |\n|---|---|---|---|---|---|\n"
    )
    return header + "\n".join(rows) + "\n", figures


def plot(cfg, out: pathlib.Path) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = read_losses(out / "float32")
    window = max(5, cfg.steps // 100)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in VARIANTS:
        folder = out / name
        if name == "float32" or not (folder / "losses.csv").exists():
            continue
        losses = read_losses(folder)
        n = min(len(losses), len(base))
        gap = moving_average((losses[:n] - base[:n]) / base[:n], window)
        steps = np.arange(window, n + 1)
        ax.plot(steps, 100 * gap, label=name, lw=1.2)
    ax.axhline(0, color="k", lw=0.6)
    ax.axvline(int(cfg.steps * (1 - DECAY_FRACTION)), color="grey", lw=0.6, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("step (log scale)")
    ax.set_ylabel(f"train-loss gap to float32, % ({window}-step moving average)")
    ax.legend()
    fig.tight_layout()
    path = out / "gap.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--only", default=None, help="comma-separated variants")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_run"))
    parser.add_argument("--checkpoint-every", type=int, default=500)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--report", action="store_true", help="only summarise the CSVs")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    cfg = SMOKE if args.smoke else STUDY
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps, warmup=min(cfg.warmup, args.steps // 10))
    names = list(VARIANTS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    names = [n for n in names if available(n)]
    if "float32" not in names:
        names = ["float32", *names]  # the baseline every gap is measured against
    out = pathlib.Path(args.out)
    if not args.report:
        data = lm.load_data(cfg)
        every = 4 if args.smoke else args.checkpoint_every
        evals = 4 if args.smoke else args.eval_every
        for name in names:
            t = time.perf_counter()
            run_variant(
                name,
                cfg,
                data,
                out,
                checkpoint_every=every,
                eval_every=evals,
                stop_after=args.stop_after,
                progress=not args.quiet,
            )
            print(f"{name}: {time.perf_counter() - t:.0f} s")
    if args.stop_after is not None:
        return {}
    table, figures = summarise(cfg, out)
    (out / "summary.md").write_text(table)
    plot(cfg, out)
    print(table)
    return figures


if __name__ == "__main__":
    main()
