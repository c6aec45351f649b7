"""Quickstart: train an `eqx.nn.MLP` under the NVFP4 training recipe.

```bash
python examples/quickstart.py           # 300 steps, a few seconds after compilation
python examples/quickstart.py --smoke   # 20 steps
```

1. Build any Equinox model (here an `eqx.nn.MLP`).
2. `nvfp4x.quantize(model, recipe)` swaps its `eqx.nn.Linear` layers for
   `nvfp4x.QuantizedLinear`, whose three GEMMs (fprop, dgrad, wgrad) run in NVFP4.
3. Train with `eqx.filter_value_and_grad` and optax exactly as before: the master
   weights stay float32 and are what the optimiser steps.
4. `nvfp4x.dequantize` gives the plain model back, with the trained weights.
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PRNGKeyArray

import nvfp4x


def make_data(
    key: PRNGKeyArray, n: int, d_in: int = 32, d_out: int = 8
) -> tuple[Float[Array, "n d_in"], Float[Array, "n d_out"]]:
    """A regression problem: `y = sin(x @ A)` for a fixed random teacher `A`."""
    kx, ka = jax.random.split(key)
    x = jax.random.normal(kx, (n, d_in))
    a = jax.random.normal(ka, (d_in, d_out)) / jnp.sqrt(d_in)
    return x, jnp.sin(2.0 * x @ a)


def loss_fn(
    model: eqx.Module, x: Float[Array, "n d_in"], y: Float[Array, "n d_out"]
) -> Float[Array, ""]:
    # eqx.nn.MLP acts on one example; vmap it over the batch as usual. A QuantizedLinear
    # gives the same bits vmapped or called on the whole batch (its scales cover the call).
    pred = jax.vmap(model)(x)
    return jnp.mean((pred - y) ** 2)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description="Train an eqx.nn.MLP in NVFP4.")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--smoke", action="store_true", help="20 steps")
    args = parser.parse_args(argv)
    steps = 20 if args.smoke else args.steps

    kmodel, kdata = jax.random.split(jax.random.key(0))
    model = eqx.nn.MLP(in_size=32, out_size=8, width_size=128, depth=2, key=kmodel)

    # Every eqx.nn.Linear under NVIDIA's training recipe: W in 16x16 blocks, x and dy in
    # 1x16 blocks, dy stochastically rounded, Hadamard transform in wgrad.
    qmodel = nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_training())
    print(nvfp4x.summary(qmodel))

    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(eqx.filter(qmodel, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    x, y = make_data(kdata, 4096)
    xb, yb = x.reshape(-1, 256, 32), y.reshape(-1, 256, 8)
    for i in range(steps):
        j = i % xb.shape[0]
        qmodel, opt_state, loss = step(qmodel, opt_state, xb[j], yb[j])
        if i % max(1, steps // 10) == 0 or i == steps - 1:
            print(f"step {i:4d}  loss {float(loss):.4f}")

    # No keys were passed: each step's stochastic rounding is still fresh, seeded by a
    # checksum of each layer's weight, which the optimiser changes every step. Pass `key=`
    # to a QuantizedLinear to mix in your own PRNG stream (e.g. one key per microbatch).

    trained = nvfp4x.dequantize(qmodel)  # a plain eqx.nn.MLP again, trained master weights
    assert all(isinstance(layer, eqx.nn.Linear) for layer in trained.layers)
    q_loss = float(eqx.filter_jit(loss_fn)(qmodel, x, y))
    f_loss = float(eqx.filter_jit(loss_fn)(trained, x, y))
    print(f"loss with the NVFP4 forward: {q_loss:.5f}; dequantised (float32) forward: {f_loss:.5f}")
    return q_loss


if __name__ == "__main__":
    main()
