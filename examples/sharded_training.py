"""Train a quantised MLP on a data x model mesh of 8 (host CPU) devices.

    python examples/sharded_training.py            # 8 simulated devices
    python examples/sharded_training.py --smoke

Prints the mesh, the sharding of one packed NVFP4 weight, and the loss per step. The
sharded run gives the numbers a single device gives: every tensor amax is global (XLA
all-reduces it), and 16-element blocks stay inside a shard.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from jaxtyping import Array, Float, PyTree  # noqa: E402

import nvfp4x  # noqa: E402


def shard_params(model: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
    """Megatron-style tensor parallelism on the `model` axis: the first layer of each MLP
    column-parallel (output features sharded), the second row-parallel (inputs sharded)."""

    def put(path, leaf):
        if not eqx.is_array(leaf):
            return leaf
        name = jax.tree_util.keystr(path)
        if "layers[0]" in name:
            spec = P("model")
        elif leaf.ndim == 2:
            spec = P(None, "model")
        else:
            spec = P()
        return jax.device_put(leaf, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(put, model)


def loss_fn(model: PyTree, x: Float[Array, "b d"], y: Float[Array, "b d"]) -> Float[Array, ""]:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None, help="unused; accepted for uniformity")
    args = parser.parse_args(argv)
    steps, d, hidden, batch = (3, 64, 128, 64) if args.smoke else (args.steps, 256, 1024, 256)

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    print("mesh:", dict(mesh.shape))
    key_model, key_data = jax.random.split(jax.random.key(0))
    model = eqx.nn.MLP(d, d, hidden, 1, key=key_model)
    qmodel = shard_params(nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_training()), mesh)

    master = qmodel.layers[0].weight.array  # the quantised layer's master weight
    packed = nvfp4x.to_nvfp4(master, block=(16, 16))
    placed = nvfp4x.shard_packed(packed, master.sharding)
    print("packed layers[0] weight:", placed)
    print("  codes :", placed.codes.shape, placed.codes.sharding.spec)
    print("  scales:", placed.scales.shape, placed.scales.sharding.spec)

    target = jax.random.normal(key_data, (d, d)) / d**0.5
    data_sharding = NamedSharding(mesh, P("data"))
    optim = optax.adam(1e-3)
    opt_state = optim.init(eqx.filter(qmodel, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state, x):
        y = x @ target
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for i in range(steps):
        x = jax.random.normal(jax.random.fold_in(key_data, i), (batch, d))
        x = jax.device_put(x, data_sharding)
        qmodel, opt_state, loss = step(qmodel, opt_state, x)
        losses.append(float(loss))
        print(f"step {i:3d}  loss {losses[-1]:.5f}")
    return losses


if __name__ == "__main__":
    main()
