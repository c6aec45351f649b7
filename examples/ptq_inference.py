"""Post-training quantisation for inference: a float32 model -> frozen NVFP4 weights.

```bash
python examples/ptq_inference.py                  # 400 training steps, then quantise
python examples/ptq_inference.py --smoke          # a few seconds
python examples/ptq_inference.py --out out/ptq    # where the checkpoints go (default)
```

1. Train a small `eqx.nn.MLP` briefly in float32 (any trained float model will do).
2. `nvfp4x.quantize(model, recipe)` with an inference recipe:
   `nvfp4_inference` (W4A4: weights and activations in NVFP4) or
   `nvfp4_weight_only` (W4A16: NVFP4 weights, activations in their own dtype).
3. `nvfp4x.freeze` packs each weight into an `nvfp4x.NVFP4Array` (4-bit codes, an E4M3
   scale per 16 weights, one float32 tensor scale: 4.5 bits per weight) and drops the
   float32 master copy. The frozen forward gives the same bits as the quantised one.
4. `nvfp4x.save` writes a checkpoint that records every layer's recipe and array shapes;
   `nvfp4x.load` reads it into a skeleton (built with `eqx.filter_eval_shape`, so no
   weights are materialised) and refuses a file that does not match.
"""

import argparse
import dataclasses
import os
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, PRNGKeyArray

import nvfp4x


@dataclasses.dataclass(frozen=True)
class Config:
    d_in: int = 64
    d_out: int = 16
    width: int = 256
    depth: int = 3
    steps: int = 400
    batch: int = 256
    n_train: int = 8192
    n_test: int = 1024


SMOKE = Config(width=64, depth=2, steps=30, n_train=1024, n_test=256)

RECIPES = {
    "nvfp4_inference": nvfp4x.recipes.nvfp4_inference,  # W4A4
    "nvfp4_weight_only": nvfp4x.recipes.nvfp4_weight_only,  # W4A16
}


def build_model(cfg: Config, key: PRNGKeyArray) -> eqx.nn.MLP:
    return eqx.nn.MLP(cfg.d_in, cfg.d_out, cfg.width, cfg.depth, activation=jax.nn.gelu, key=key)


def make_data(
    key: PRNGKeyArray, n: int, cfg: Config
) -> tuple[Float[Array, "n d_in"], Float[Array, "n d_out"]]:
    """A regression problem: `y = sin(2 x @ A)` for a fixed random teacher `A` (the same
    for every `key`, which only draws the inputs)."""
    x = jax.random.normal(key, (n, cfg.d_in))
    a = jax.random.normal(jax.random.key(1234), (cfg.d_in, cfg.d_out)) / np.sqrt(cfg.d_in)
    return x, jnp.sin(2.0 * x @ a)


def predict(model: Any, x: Float[Array, "n d_in"]) -> Float[Array, "n d_out"]:
    return jax.vmap(model)(x)


def mse(model: Any, x: Float[Array, "n d_in"], y: Float[Array, "n d_out"]) -> Float[Array, ""]:
    return jnp.mean((predict(model, x) - y) ** 2)


def train(cfg: Config, key: PRNGKeyArray) -> eqx.nn.MLP:
    """A few hundred Adam steps in float32."""
    kmodel, kdata = jax.random.split(key)
    model = build_model(cfg, kmodel)
    x, y = make_data(kdata, cfg.n_train, cfg)
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, xb, yb):
        loss, grads = eqx.filter_value_and_grad(mse)(model, xb, yb)
        updates, opt_state = optimizer.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    nbatches = cfg.n_train // cfg.batch
    for i in range(cfg.steps):
        j = (i % nbatches) * cfg.batch
        model, opt_state, loss = step(model, opt_state, x[j : j + cfg.batch], y[j : j + cfg.batch])
        if i % max(1, cfg.steps // 4) == 0 or i == cfg.steps - 1:
            print(f"float32 training step {i:4d}  loss {float(loss):.4f}")
    return model


def weight_bytes(model: Any) -> int:
    """Bytes of the arrays holding the linear layers' weights (packed ones once frozen)."""
    kinds = eqx.nn.Linear | nvfp4x.QuantizedLinear | nvfp4x.FrozenLinear
    layers = jax.tree_util.tree_leaves(model, is_leaf=lambda v: isinstance(v, kinds))
    return sum(
        int(leaf.nbytes)
        for layer in layers
        if isinstance(layer, kinds)
        for leaf in jax.tree_util.tree_leaves(layer.weight)
    )


def to_bf16(model: Any) -> Any:
    """The same model with every floating-point array in bfloat16 (the baseline)."""

    def cast(v):
        if eqx.is_array(v) and jnp.issubdtype(v.dtype, jnp.floating):
            return v.astype(jnp.bfloat16)
        return v

    return jax.tree_util.tree_map(cast, model)


def rel_err(got: Array, want: Array) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Quantise a float32 MLP to frozen NVFP4.")
    parser.add_argument("--steps", type=int, default=None, help="float32 training steps")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 30 steps")
    parser.add_argument("--out", default=os.path.join("out", "ptq"), help="checkpoint folder")
    args = parser.parse_args(argv)
    cfg = SMOKE if args.smoke else Config()
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    os.makedirs(args.out, exist_ok=True)

    kmodel, ktest = jax.random.split(jax.random.key(0))
    model = train(cfg, kmodel)
    x, y = make_data(ktest, cfg.n_test, cfg)
    want = predict(model, x)

    bf16 = to_bf16(model)
    bf16_path = os.path.join(args.out, "bf16.eqx")
    eqx.tree_serialise_leaves(bf16_path, bf16)
    bf16_file = os.path.getsize(bf16_path)
    rows = [
        (
            "float32",
            0.0,
            float(mse(model, x, y)),
            weight_bytes(model),
            weight_bytes(bf16) / weight_bytes(model),
            "-",
            "-",
        ),
        (
            "bf16",
            rel_err(predict(bf16, x.astype(jnp.bfloat16)), want),
            float(mse(bf16, x.astype(jnp.bfloat16), y.astype(jnp.bfloat16))),
            weight_bytes(bf16),
            1.0,
            f"{bf16_file:,}",
            "-",
        ),
    ]
    results: dict = {"bf16_weight_bytes": weight_bytes(bf16), "bf16_file_bytes": bf16_file}

    for name, recipe_fn in RECIPES.items():
        recipe = recipe_fn()
        qmodel = nvfp4x.quantize(model, recipe)
        frozen = nvfp4x.freeze(qmodel)
        got = predict(frozen, x)
        same = bool(np.array_equal(np.asarray(got), np.asarray(predict(qmodel, x))))

        path = os.path.join(args.out, f"{name}.nvfp4x")
        nvfp4x.save(path, frozen)

        # The skeleton: the same architecture and recipe, built abstractly (no weights).
        def skeleton(recipe=recipe):
            return nvfp4x.freeze(nvfp4x.quantize(build_model(cfg, jax.random.key(1)), recipe))

        loaded = nvfp4x.load(path, eqx.filter_eval_shape(skeleton))
        round_trip = bool(np.array_equal(np.asarray(predict(loaded, x)), np.asarray(got)))

        nbytes = weight_bytes(frozen)
        results[name] = {
            "rel_err_vs_float32": rel_err(got, want),
            "test_mse": float(mse(frozen, x, y)),
            "weight_bytes": nbytes,
            "bytes_ratio_vs_bf16": weight_bytes(bf16) / nbytes,
            "file_bytes": os.path.getsize(path),
            "file_ratio_vs_bf16": bf16_file / os.path.getsize(path),
            "frozen_equals_quantized": same,
            "checkpoint_round_trip": round_trip,
        }
        r = results[name]
        rows.append(
            (
                f"{name} (frozen)",
                r["rel_err_vs_float32"],
                r["test_mse"],
                nbytes,
                r["bytes_ratio_vs_bf16"],
                f"{r['file_bytes']:,}",
                "ok" if round_trip and same else "MISMATCH",
            )
        )

    print()
    print(nvfp4x.summary(frozen))
    print()
    head = (
        "model",
        "rel err vs f32",
        "test MSE",
        "weight bytes",
        "bf16/this",
        "file bytes",
        "load+bits",
    )
    print(
        f"{head[0]:28}{head[1]:>15}{head[2]:>11}{head[3]:>14}{head[4]:>11}{head[5]:>13}"
        f"{head[6]:>11}"
    )
    for label, err, loss, nb, ratio, fb, ok in rows:
        print(f"{label:28}{err:>15.4f}{loss:>11.4f}{nb:>14,}{ratio:>11.2f}{fb:>13}{ok:>11}")
    print(f"\ncheckpoints in {args.out}/")
    for name in RECIPES:
        if not (
            results[name]["checkpoint_round_trip"] and results[name]["frozen_equals_quantized"]
        ):
            raise SystemExit(f"{name}: the frozen or reloaded model's outputs changed")
    return results


if __name__ == "__main__":
    main()
