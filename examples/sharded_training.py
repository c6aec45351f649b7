"""Train a quantised MLP on a data x model mesh of 8 (host CPU) devices, in one process or
in several, as on several hosts.

    python examples/sharded_training.py                  # 1 process, 8 simulated devices
    python examples/sharded_training.py --processes 2    # 2 processes x 4 devices
    python examples/sharded_training.py --smoke

Prints the mesh, the sharding of one packed NVFP4 weight, and the loss per step. The
sharded run gives the numbers a single device gives: every tensor amax is global (XLA
all-reduces it), and 16-element blocks stay inside a shard. With `--processes 2` the
script starts two copies of itself on this machine, joined by `jax.distributed` over the
loopback interface (gloo collectives), and prints process 0's output: the loss curve of
the one-process run. On a real cluster, run the same script once per host with
`--coordinator HOST:PORT --num-processes N --process-id I`, or with `--distributed`
under SLURM (where `jax.distributed.initialize()` finds all three itself): nvfp4x needs
nothing else.
"""

import os

_PROCESSES = int(os.environ.get("NVFP4X_EXAMPLE_PROCESSES", "1"))
# 8 CPU devices in all (a process's share of them), added to any XLA flags already set.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    _count = f"--xla_force_host_platform_device_count={8 // _PROCESSES}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_count}".strip()

import argparse  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from jaxtyping import Array, Float, PyTree  # noqa: E402

import nvfp4x  # noqa: E402


def to_mesh(value, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value every process holds: each process fills its own
    devices' shards (`jax.device_put` of a host array works on one process only)."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


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
        return to_mesh(leaf, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(put, model)


def loss_fn(model: PyTree, x: Float[Array, "b d"], y: Float[Array, "b d"]) -> Float[Array, ""]:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def launch(processes: int, argv: list[str], timeout: float) -> list[float]:
    """Run this script as `processes` JAX processes on this machine; print process 0's
    output and return its losses. Every process is killed if one fails or time runs out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["NVFP4X_EXAMPLE_PROCESSES"] = str(processes)
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--coordinator", f"127.0.0.1:{port}"]
    cmd += ["--num-processes", str(processes)]
    procs = [
        subprocess.Popen(
            [*cmd, "--process-id", str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    failed = [i for i, p in enumerate(procs) if p.returncode]
    if failed:
        raise SystemExit(f"process {failed[0]} failed:\n{outputs[failed[0]][-4000:]}")
    lines = [line for line in outputs[0].splitlines() if not line.startswith("[Gloo]")]
    print("\n".join(lines))
    return [float(line.split()[-1]) for line in lines if line.startswith("step ")]


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--processes", type=int, default=1, help="start N local processes")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0 (multi-host)")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="jax.distributed.initialize() with the cluster's own settings (SLURM, ...)",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds, with --processes")
    parser.add_argument("--out", default=None, help="unused; accepted for uniformity")
    args = parser.parse_args(argv)
    if args.processes > 1 and args.coordinator is None:
        forward = ["--steps", str(args.steps)] + (["--smoke"] if args.smoke else [])
        return launch(args.processes, forward, args.timeout)
    if args.coordinator is not None or args.distributed:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    steps, d, hidden, batch = (3, 64, 128, 64) if args.smoke else (args.steps, 256, 1024, 256)

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    print(f"mesh: {dict(mesh.shape)} over {jax.process_count()} process(es)")
    key_model, key_data = jax.random.split(jax.random.key(0))
    model = eqx.nn.MLP(d, d, hidden, 1, key=key_model)
    qmodel = shard_params(nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_training()), mesh)

    master = qmodel.layers[0].weight.array  # the quantised layer's master weight
    packed = jax.jit(lambda w: nvfp4x.to_nvfp4(w, block=(16, 16)))(master)
    print("packed layers[0] weight:", packed)
    print("  codes :", packed.codes.shape, packed.codes.sharding.spec)
    print("  scales:", packed.scales.shape, packed.scales.sharding.spec)

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
        x = to_mesh(jax.random.normal(jax.random.fold_in(key_data, i), (batch, d)), data_sharding)
        qmodel, opt_state, loss = step(qmodel, opt_state, x)
        losses.append(float(loss))
        print(f"step {i:3d}  loss {losses[-1]:.7f}")
    return losses


if __name__ == "__main__":
    main()
