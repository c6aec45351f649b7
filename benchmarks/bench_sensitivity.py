"""`nvfp4x.sensitivity` on the `examples/train_lm.py` transformer: the vmapped sweep
(one compiled `lax.map` over single-layer variants) against the reference loop (one
compiled pass per layer), wall time of a whole call including compilation, in the same
process, and the largest difference between their figures.

    python benchmarks/bench_sensitivity.py                  # 4 blocks: 29 Linear layers
    python benchmarks/bench_sensitivity.py --layers 2 --d 64  # quick

`--trained` answers a different question: which layers of the `train_lm` model, trained
in float32 with its default configuration, are most sensitive to NVFP4 (measured on
validation windows, vmapped sweep only), and which policy `suggest_policy` proposes.
"""

import argparse
import pathlib
import sys
import time

import jax
import numpy as np

import nvfp4x

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))  # the main example's package, examples/nvfp4_lm
import nvfp4_lm as lm  # noqa: E402

QUICK_ARGV = ["--layers", "1", "--d", "64", "--seq", "32", "--batch", "4"]


def _loss(model, batch):
    return lm.loss_fn(model, *batch)


def _timed(fn):
    jax.clear_caches()  # each variant pays its own compilations
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--d", type=int, default=128, help="model width")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--per-pass", type=int, default=8, help="layers_per_pass of the sweep")
    parser.add_argument(
        "--trained", action="store_true", help="rank the layers of the trained train_lm model"
    )
    args = parser.parse_args(argv)
    if args.trained:
        return trained(args.per_pass)

    cfg = lm.Config(
        d_model=args.d,
        n_layers=args.layers,
        n_heads=2,
        seq=args.seq,
        batch=args.batch,
        steps=2,
        warmup=1,
    )
    model = lm.build_model(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, 256)
    batch = (tokens[:, :-1], tokens[:, 1:])

    recipe = nvfp4x.recipes.nvfp4_training()
    per_pass = args.per_pass
    swept, t_sweep = _timed(
        lambda: nvfp4x.sensitivity(model, _loss, batch, recipe=recipe, layers_per_pass=per_pass)
    )
    looped, t_loop = _timed(
        lambda: nvfp4x.sensitivity(model, _loss, batch, recipe=recipe, layers_per_pass=None)
    )
    by_path = {r.path: r for r in looped.rows}
    scale = max(abs(r.loss_delta) for r in looped.rows)
    loss_diff = max(abs(r.loss_delta - by_path[r.path].loss_delta) for r in swept.rows)
    grad_diff = max(
        abs(r.grad_error - by_path[r.path].grad_error) / by_path[r.path].grad_error
        for r in swept.rows
    )
    same_order = [r.path for r in swept.rows] == [r.path for r in looped.rows]
    n = len(swept.rows)
    print(
        f"{n} Linear layers, d={args.d}, {args.layers} blocks, batch {args.batch}x{args.seq}, "
        f"{jax.devices()[0].platform}"
    )
    print(f"  loop (one compiled pass per layer): {t_loop:8.1f} s")
    print(f"  vmapped sweep ({args.per_pass} layers per pass): {t_sweep:8.1f} s")
    print(f"  loop / sweep: {t_loop / t_sweep:.2f}x")
    print(f"  max |loss delta difference| / max |loss delta|: {loss_diff / scale:.2e}")
    print(f"  max relative grad-error difference: {grad_diff:.2e}; same ranking: {same_order}")
    print(swept)
    return {
        "layers": n,
        "loop_seconds": t_loop,
        "sweep_seconds": t_sweep,
        "loop_over_sweep": t_loop / t_sweep,
        "loss_delta_rel_diff": loss_diff / scale,
        "grad_error_rel_diff": grad_diff,
        "same_ranking": same_order,
        "most_sensitive": [r.path for r in swept.rows[:3]],
    }


def trained(per_pass: int) -> dict:
    """Train `train_lm`'s default model in float32, then rank its layers."""
    cfg = lm.Config()
    data = lm.load_data(cfg)
    result = lm.train(lm.build_model(cfg, jax.random.key(cfg.seed)), cfg, data, label="float32")
    starts = np.linspace(0, len(data.val) - cfg.seq - 1, 4 * cfg.batch).astype(np.int64)
    batch = lm.windows(data.val, starts, cfg.seq)

    t0 = time.perf_counter()
    report = nvfp4x.sensitivity(result.model, _loss, batch, layers_per_pass=per_pass)
    seconds = time.perf_counter() - t0
    print(f"float32 model after {cfg.steps} steps: val loss {result.val_loss:.4f}")
    print(report)
    policy = report.suggest_policy(keep_fraction=0.15)
    print(f"suggest_policy(keep_fraction=0.15): {policy}")
    print(f"sensitivity of {len(report.rows)} layers: {seconds:.1f} s (compilation included)")
    return {
        "layers": len(report.rows),
        "seconds": seconds,
        "ranking": [r.path for r in report.rows],
        "loss_delta": [r.loss_delta for r in report.rows],
        "grad_error": [r.grad_error for r in report.rows],
    }


if __name__ == "__main__":
    main()
