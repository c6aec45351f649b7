"""One jitted optax (adam) training step of a stack of MLP blocks, NVFP4 vs float32.

Each block is `x + W2 · gelu(W1 · x)` with `d=512`, hidden `2048`, on `2048` tokens; the
layers are called per token through `jax.vmap`, as Equinox models are. The same model is
timed unquantised (plain `eqx.nn.Linear`, float32) and quantised with
`nvfp4x.recipes.nvfp4_training()` (fast GEMMs on bfloat16 operands), with the reference
float32 GEMMs (`fast=False`) and with the `bf16` recipe, all in this process.

Target on CPU: the NVFP4 step at most 1.5x the float32 step. Also reported: the same
ratio for an unjitted (eager) `jax.grad` of one block, and the telemetry overhead.

    python benchmarks/bench_training.py --repeats 5
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import nvfp4x


class Block(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, d: int, hidden: int, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(d, hidden, key=k1)
        self.fc2 = eqx.nn.Linear(hidden, d, key=k2)

    def __call__(self, x):
        return x + self.fc2(jax.nn.gelu(self.fc1(x)))


class Stack(eqx.Module):
    blocks: list

    def __init__(self, d: int, hidden: int, n_blocks: int, key):
        self.blocks = [Block(d, hidden, k) for k in jax.random.split(key, n_blocks)]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def make_step(optimizer):
    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    @eqx.filter_jit
    def step(model, state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss

    return step


class Runner:
    """A model, its adam state and its jitted step; `__call__` times one step."""

    def __init__(self, model, x, y):
        self.optimizer = optax.adam(1e-4)
        self.state = self.optimizer.init(eqx.filter(model, eqx.is_array))
        self.step = make_step(self.optimizer)
        self.model, self.x, self.y = model, x, y
        for _ in range(2):  # compile, then warm up
            self()

    def __call__(self) -> float:
        t0 = time.perf_counter()
        self.model, self.state, loss = self.step(self.model, self.state, self.x, self.y)
        jax.block_until_ready((self.model, loss))
        return time.perf_counter() - t0


def eager_grad_ratio(model, x, y, recipe, repeats: int) -> float:
    """Median time of an unjitted `eqx.filter_grad` of the loss, quantised / float32, on
    the first block and a quarter of the tokens (op-by-op dispatch: how quick experiments
    and debugging run)."""
    block, tokens = model.blocks[0], x.shape[0] // 4
    x, y = x[:tokens], y[:tokens]
    grad = eqx.filter_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))
    medians = []
    for m in (block, nvfp4x.quantize(block, recipe)):
        jax.block_until_ready(grad(m))  # compile every op once
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(grad(m))
            ts.append(time.perf_counter() - t0)
        medians.append(statistics.median(ts))
    return medians[1] / medians[0]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="time only these variants (and float32), e.g. `--only nvfp4_training "
        "nvfp4_training+telemetry` for the telemetry overhead; skips the eager ratio",
    )
    args = parser.parse_args(argv)

    kx, ky, km = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (args.tokens, args.d), jnp.float32)
    y = jax.random.normal(ky, (args.tokens, args.d), jnp.float32)
    model = Stack(args.d, args.hidden, args.blocks, km)

    training = nvfp4x.recipes.nvfp4_training()
    variants = {
        "float32": model,
        "nvfp4_training": nvfp4x.quantize(model, training),
        "nvfp4_training_reference": nvfp4x.quantize(model, training, fast=False),
        # the same, with every layer's quantisation statistics computed in the step
        "nvfp4_training+telemetry": nvfp4x.telemetry.enable(nvfp4x.quantize(model, training)),
        "bf16": nvfp4x.quantize(model, nvfp4x.recipes.bf16()),
    }
    if args.only is not None:
        variants = {k: v for k, v in variants.items() if k == "float32" or k in args.only}
    print(
        f"{args.blocks} blocks, d={args.d}, hidden={args.hidden}, tokens={args.tokens}, "
        f"median of {args.repeats} steps, {jax.devices()[0].platform}"
    )
    runners = {name: Runner(m, x, y) for name, m in variants.items()}
    # Interleave the variants so that a load change on a shared machine hits all alike.
    samples = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            samples[name].append(run())
    times = {name: statistics.median(ts) for name, ts in samples.items()}
    base = times["float32"]
    result = {}
    for name, t in times.items():
        ratio = t / base
        result[name] = {"seconds": t, "ratio_vs_float32": ratio}
        print(f"{name:26s} {t * 1e3:9.1f} ms   {ratio:5.2f}x float32")
    if args.only is None:
        eager = eager_grad_ratio(model, x, y, training, args.repeats)
        result["eager_grad_ratio_vs_float32"] = eager
        print(f"eager (unjitted) jax.grad, nvfp4_training / float32: {eager:.2f}x")
    if "nvfp4_training+telemetry" in times and "nvfp4_training" in times:
        overhead = times["nvfp4_training+telemetry"] / times["nvfp4_training"]
        result["telemetry_overhead"] = overhead
        print(f"telemetry overhead: {overhead:.2f}x the nvfp4_training step (target <= 1.15x)")
    if "nvfp4_training" in result:
        ok = result["nvfp4_training"]["ratio_vs_float32"] <= 1.5
        print(f"target nvfp4_training <= 1.5x float32: {'met' if ok else 'NOT met'}")
    return result


if __name__ == "__main__":
    main()
