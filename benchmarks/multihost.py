"""NVFP4 training on JAX's multi-process runtime, on one machine.

`launch` starts one Python process per simulated host (`jax.distributed` over the
loopback interface, gloo collectives, each process with its own share of host CPU
devices) and bounds the whole group by a timeout; `initialize` is the worker side. The
rest is the training run that the tests (`tests/multidevice/test_multiprocess.py`) and
`benchmarks/bench_sharding.py` compare between 2 processes x 4 devices and 1 process x 8
devices:

    python -m benchmarks.multihost --processes 2 --out /tmp/mh     # the workers' results
    python -m benchmarks.multihost --processes 1 --out /tmp/mh1

A stack of residual MLP blocks (`lax.scan` over `eqx.filter_vmap`-made layers) under
`nvfp4x.recipes.nvfp4_training()` (16x16 weight tiles, stochastic rounding, RHT) trains
for a few steps with data parallelism over the `data` mesh axis (which spans the
processes) and FSDP over `fsdp`, on automatic and on explicit mesh axes, next to the same
float32 model. Each worker also quantises arrays sharded over both processes, freezes the
trained model sharded 8 ways and saves the sharded training state with Orbax, every
process writing its own shards.
"""

import argparse
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV_PROCESS_ID = "NVFP4X_PROCESS_ID"
ENV_NUM_PROCESSES = "NVFP4X_NUM_PROCESSES"
ENV_COORDINATOR = "NVFP4X_COORDINATOR"
DEVICES = 8  # devices in every run, over all its processes
D, H, LAYERS, TOKENS = 128, 256, 2, 256
STEPS = int(os.environ.get("MH_STEPS", "3"))


# --- the launcher side (no JAX import) ---


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    """One finished process: exit status, output (stdout and stderr), and when it ended
    (seconds after the group started)."""

    returncode: int
    output: str
    ended: float


def launch(
    argv: list[str], processes: int, *, timeout: float, env: dict | None = None
) -> list[Result]:
    """Run `python *argv` as `processes` JAX processes of one distributed run on this
    machine, each with `8 // processes` host CPU devices, and wait for all of them.

    Each process finds its rank, the process count and the coordinator's address in the
    environment (`initialize` reads them). Every process runs in its own session; if the
    group is not done within `timeout` seconds (or the caller is interrupted), every
    process still alive is killed and `TimeoutError` raised, with their output."""
    port = free_port()
    base = dict(os.environ if env is None else env)
    flags = base.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    base["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES // processes}"
    base[ENV_NUM_PROCESSES] = str(processes)
    base[ENV_COORDINATOR] = f"127.0.0.1:{port}"
    base["PYTHONUNBUFFERED"] = "1"
    start = time.monotonic()
    procs, logs = [], []
    try:
        for i in range(processes):
            out = tempfile.TemporaryFile("w+")  # noqa: SIM115 - read after the process ends
            logs.append(out)
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv],
                    cwd=ROOT,
                    env={**base, ENV_PROCESS_ID: str(i)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        ended = [None] * processes
        while any(e is None for e in ended):
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise TimeoutError(
                    f"{processes} processes still running after {timeout:.0f} s:\n" + _tails(logs)
                )
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    results = []
    for p, log, t in zip(procs, logs, ended, strict=True):
        log.seek(0)
        text = log.read()
        log.close()
        results.append(Result(p.returncode, text, t))
    return results


def _tails(logs) -> str:
    parts = []
    for i, log in enumerate(logs):
        log.seek(0)
        parts.append(f"--- process {i} ---\n{log.read()[-3000:]}")
    return "\n".join(parts)


# --- the worker side ---


def initialize(heartbeat_timeout: int = 10) -> None:
    """Join the distributed run `launch` started (no-op in a single process): gloo
    collectives over the loopback interface. A process whose peer dies exits with an
    error after `heartbeat_timeout` seconds instead of waiting in a collective."""
    import jax

    n = int(os.environ.get(ENV_NUM_PROCESSES, "1"))
    if n == 1:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=os.environ[ENV_COORDINATOR],
        num_processes=n,
        process_id=int(os.environ[ENV_PROCESS_ID]),
        initialization_timeout=120,
        heartbeat_timeout_seconds=heartbeat_timeout,
    )


def make_mesh(axis_type: str):
    import jax
    from jax.sharding import AxisType

    kind = AxisType.Explicit if axis_type == "explicit" else AxisType.Auto
    return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(kind, kind))


def _modules():
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    class Block(eqx.Module):
        norm: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.norm = eqx.nn.LayerNorm(D)
            self.up = eqx.nn.Linear(D, H, key=k1)
            self.down = eqx.nn.Linear(H, D, key=k2)

        def __call__(self, x):
            return x + self.down(jax.nn.gelu(self.up(self.norm(x))))

    class Stack(eqx.Module):
        """Blocks stacked along a leading axis, run by `lax.scan`."""

        blocks: Block
        head: eqx.nn.Linear

        def __init__(self, key):
            kb, kh = jax.random.split(key)
            self.blocks = eqx.filter_vmap(Block)(jax.random.split(kb, LAYERS))
            self.head = eqx.nn.Linear(D, D, key=kh)

        def __call__(self, x):
            dynamic, static = eqx.partition(self.blocks, eqx.is_array)

            def body(h, layer):
                return eqx.combine(layer, static)(h), None

            h, _ = jax.lax.scan(body, x, dynamic)
            return self.head(h)

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    return Stack, loss


def model(quantised: bool):
    """The stack of blocks, quantised with `nvfp4_training()` or float32."""
    import jax

    import nvfp4x

    stack, _ = _modules()
    m = stack(jax.random.key(0))
    return nvfp4x.quantize(m, nvfp4x.recipes.nvfp4_training()) if quantised else m


def weight_spec(path: str, leaf, axes="fsdp"):
    """FSDP: every weight matrix sharded along its rows over `axes` (stacked ones along
    their second axis); biases and norms replicated."""
    from jax.sharding import PartitionSpec as P

    if "weight" not in path or leaf.ndim < 2 or path.endswith("norm.weight"):
        return P()
    return P(*(None,) * (leaf.ndim - 2), axes)


def place(tree, mesh, spec_fn):
    """Every array of `tree` on `mesh` per `spec_fn(path, leaf)`, from the same host values in
    every process (`jax.make_array_from_callback`: each process fills its own shards)."""
    import equinox as eqx
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    def put(path, leaf):
        if not eqx.is_array(leaf):
            return leaf
        host = np.asarray(leaf)
        sharding = NamedSharding(mesh, spec_fn(jax.tree_util.keystr(path), leaf))
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree_util.tree_map_with_path(put, tree)


def batches():
    """The same global batches in every process: (x, y) per step, from a fixed key."""
    import jax
    import numpy as np

    key = jax.random.key(7)
    target = jax.random.normal(jax.random.key(8), (D, D)) / D**0.5
    out = []
    for i in range(STEPS):
        x = jax.random.normal(jax.random.fold_in(key, i), (TOKENS, D))
        out.append((np.asarray(x), np.asarray(x @ target)))
    return out


def gathered(tree):
    """Every array of `tree` as one host numpy array, identical in every process."""
    import equinox as eqx
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    arrays = [a for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]
    if jax.process_count() == 1:
        return [np.asarray(a) for a in arrays]
    return [np.asarray(a) for a in multihost_utils.process_allgather(arrays, tiled=True)]


@dataclass
class Training:
    """A training setup: the step (`step(params, opt_state, x, y)`, under the mesh), the
    jitted step to lower, the initial state, and `place_batch(x, y)` (host arrays to the
    mesh, batch over both axes)."""

    step: Any
    jitted: Any
    params: Any
    opt_state: Any
    place_batch: Any
    mesh: Any


def optimizer():
    """SGD with momentum. (Adam's first steps turn last-bit differences of gradients near
    zero into differences of a whole learning rate, `g / (|g| + eps)` for `|g| ~ eps`, in
    the float32 model too, which would hide what the process count itself changes.)"""
    import optax

    return optax.sgd(0.05, momentum=0.9)


def training(axis_type: str, quantised: bool) -> Training:
    """Data parallel (`data`, across the processes) + FSDP (`fsdp`) training of
    `model(quantised)`. Under explicit axes the loss gathers the weights before use
    (`jax.sharding.reshard(w, P())`), as explicit-axes FSDP code does; under automatic
    axes XLA places the gathers."""
    import equinox as eqx
    import jax
    from jax.sharding import PartitionSpec as P

    _, loss_fn = _modules()
    mesh = make_mesh(axis_type)

    def loss(m, x, y):
        if axis_type == "explicit":
            m = jax.tree.map(lambda a: jax.sharding.reshard(a, P()) if eqx.is_array(a) else a, m)
        return loss_fn(m, x, y)

    optim = optimizer()
    params = place(model(quantised), mesh, weight_spec)
    # The momentum sharded as its weights: the step's outputs then have its inputs'
    # shardings, and the second step runs the first step's program.
    opt_state = place(optim.init(eqx.filter(params, eqx.is_array)), mesh, weight_spec)

    @eqx.filter_jit
    def jitted(m, opt_state, x, y):
        value, grads = eqx.filter_value_and_grad(loss)(m, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(m, eqx.is_array))
        return eqx.apply_updates(m, updates), opt_state, value, grads

    def step(*args):
        with jax_mesh(mesh, axis_type):
            return jitted(*args)

    def place_batch(x, y):
        return place((x, y), mesh, lambda *_: P(("data", "fsdp")))

    return Training(step, jitted, params, opt_state, place_batch, mesh)


def train(axis_type: str, quantised: bool, *, measure: bool = False) -> dict:
    """`STEPS` steps of `training(axis_type, quantised)`: the losses, the first step's
    gradients, the final weights and optimiser state (host arrays, identical in every
    process), the final state itself, the mean time of the steps after the first
    (compilation excluded) and, if `measure`, the bytes the step's non-scalar collectives
    move (compiling the step once more)."""
    from benchmarks.collectives import collective_bytes

    t = training(axis_type, quantised)
    params, opt_state = t.params, t.opt_state
    losses, first_grads, times, moved = [], None, [], None
    for x, y in batches():
        start = time.perf_counter()
        params, opt_state, value, grads = t.step(params, opt_state, *t.place_batch(x, y))
        losses.append(float(value))
        times.append(time.perf_counter() - start)
        if first_grads is None:
            first_grads = gathered(grads)
        if measure and moved is None:
            with jax_mesh(t.mesh, axis_type):
                compiled = t.jitted.lower(params, opt_state, *t.place_batch(x, y)).compile()
            moved = collective_bytes(compiled.compiled.as_text())
    return {
        "losses": losses,
        "grads": first_grads,
        "weights": gathered(params),
        "opt_state": gathered(opt_state),
        "step_seconds": sum(times[1:]) / max(len(times) - 1, 1),
        "collective_bytes": moved,
        "params": params,
        "state": opt_state,
    }


def jax_mesh(mesh, axis_type: str):
    import jax

    return jax.set_mesh(mesh) if axis_type == "explicit" else contextlib.nullcontext()


def spread_input():
    """A (64, 128) input whose only large value lies in the rows of the last process's
    shard (rows sharded over `data`, which spans the processes)."""
    import numpy as np

    x = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    x[60, 5] = 3.0e4
    return x


def quantised_codes(mesh) -> dict:
    """`to_nvfp4` of `spread_input()` sharded over both mesh axes, with 1x16 blocks and
    16x16 tiles: codes, block scales and tensor scale, gathered."""
    import jax
    from jax.sharding import PartitionSpec as P

    import nvfp4x

    x = place(spread_input(), mesh, lambda *_: P("data", "fsdp"))
    out = {}
    for block in [(1, 16), (16, 16)]:
        q = jax.jit(lambda a, b=block: nvfp4x.to_nvfp4(a, block=b))(x)
        codes, scales, ts = gathered([q.codes, q.scale_bits, q.tensor_scale])
        tag = f"{block[0]}x{block[1]}"
        out[f"codes_{tag}"], out[f"scales_{tag}"], out[f"tensor_scale_{tag}"] = codes, scales, ts
    return out


def with_weights(weights: list) -> Any:
    """The quantised model holding `weights` (host arrays, in leaf order)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    params, static = eqx.partition(model(True), eqx.is_array)
    leaves = [jnp.asarray(w) for w in weights]
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(params), leaves), static)


def frozen_codes(weights: list, mesh) -> tuple[dict, dict]:
    """Freeze the quantised model holding `weights` with every weight matrix sharded 8
    ways (rows over both mesh axes): the packed leaves (gathered) and, per leaf, its
    partition spec, the bytes of the distinct shards this process holds, and its bytes."""
    import equinox as eqx
    import jax

    import nvfp4x

    def eight(path, leaf):
        return weight_spec(path, leaf, ("data", "fsdp"))

    frozen = nvfp4x.freeze(place(with_weights(weights), mesh, eight))
    leaves = jax.tree.leaves(eqx.filter(frozen, eqx.is_array))
    held = []
    for a in leaves:
        shards = {str(s.index): s.data.nbytes for s in a.addressable_shards}
        held.append([str(a.sharding.spec), sum(shards.values()), a.nbytes])
    return {f"frozen_{i}": v for i, v in enumerate(gathered(leaves))}, held


def save_checkpoint(path: str, params, opt_state) -> None:
    """The sharded training state as step 0 of `nvfp4x.TrainingCheckpointer(path)`
    (Orbax), each process writing its own shards."""
    import equinox as eqx

    import nvfp4x

    state = {"model": eqx.filter(params, eqx.is_array), "opt_state": opt_state}
    with nvfp4x.TrainingCheckpointer(path, async_save=False) as ckpt:
        ckpt.save(0, state)


def run_all(
    out: pathlib.Path | None = None, *, measure: bool = False, training_only: bool = False
) -> tuple[dict, dict]:
    """Everything the tests compare, in this run (one process or all of them): the
    training runs (`{axis}_{nvfp4|f32}_{losses|grads_i|weights_i|opt_i}`), the codes of
    `quantised_codes`, the frozen leaves of the explicit-axes run's final weights, and
    `info` (per-leaf held bytes, step times, collective bytes). With `out`, the sharded
    state of the explicit-axes NVFP4 run is saved there with Orbax (`out/checkpoint`).
    `training_only`: the training runs alone (a reference run)."""
    import numpy as np

    results, info = {}, {"timings": {}, "collective_bytes": {}}
    for axis_type in ("auto", "explicit"):
        for quantised in (True, False):
            tag = f"{axis_type}_{'nvfp4' if quantised else 'f32'}"
            r = train(axis_type, quantised, measure=measure)
            results[f"{tag}_losses"] = np.asarray(r["losses"])
            for name, key in (("grads", "grads"), ("weights", "weights"), ("opt", "opt_state")):
                for i, a in enumerate(r[key]):
                    results[f"{tag}_{name}_{i}"] = a
            info["timings"][tag] = r["step_seconds"]
            info["collective_bytes"][tag] = r["collective_bytes"]
            if quantised and axis_type == "explicit":
                last = r
    if training_only:
        return results, info
    results.update(quantised_codes(make_mesh("auto")))
    frozen, info["held"] = frozen_codes(last["weights"], make_mesh("explicit"))
    results.update(frozen)
    if out is not None:
        save_checkpoint(str(out / "checkpoint"), last["params"], last["state"])
    return results, info


def worker(out: pathlib.Path, die_after: int | None, heartbeat: int, measure: bool) -> None:
    initialize(heartbeat)
    import jax
    import numpy as np

    rank = jax.process_index()
    if die_after is not None:  # the failure test: the last process dies mid-run
        _die(die_after, rank)
        return
    results, info = run_all(out, measure=measure)
    (out / f"info_{rank}.json").write_text(json.dumps(info))
    if rank == 0:
        np.savez(out / "results.npz", **results)
    print(f"process {rank} of {jax.process_count()}: done", flush=True)


def _die(die_after: int, rank: int) -> None:
    """Train; the last process exits at step `die_after`, right after dispatching it
    (its peers are then inside that step's collectives)."""
    import jax

    t = training("explicit", False)
    params, opt_state = t.params, t.opt_state
    x, y = batches()[0]
    for i in range(die_after + 1000):
        params, opt_state, value, _ = t.step(params, opt_state, *t.place_batch(x, y))
        if i == die_after and rank == jax.process_count() - 1:
            print(f"process {rank}: exiting in step {i}", flush=True)
            os._exit(17)
        print(f"process {rank}: step {i} loss {float(value):.5f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--die-after", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--heartbeat", type=int, default=10)
    parser.add_argument("--measure", action="store_true", help="also collective bytes")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(out, args.die_after, args.heartbeat, args.measure)
        return
    argv = ["-m", "benchmarks.multihost", "--worker", "--out", str(out)]
    argv += ["--heartbeat", str(args.heartbeat)] + (["--measure"] if args.measure else [])
    for r in launch(argv, args.processes, timeout=args.timeout):
        print(r.output[-2000:])
        if r.returncode:
            raise SystemExit(r.returncode)


if __name__ == "__main__":
    main()
