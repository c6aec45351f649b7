"""Inference benchmark (issue 4): a frozen NVFP4 model against the same model in bf16.

Model: `--layers` residual MLP blocks `x + fc2(gelu(fc1(x)))` with `fc1: d -> 4d` and
`fc2: 4d -> d` (the MLP half of a transformer), `2 * 4 * d^2 * layers` weights: the
defaults (12 blocks, d = 1024) give 100.7M parameters (`--layers 6`: 50.3M).

Reported:
- weight bytes: bf16 (the same Equinox model with weights cast to bfloat16) vs frozen
  NVFP4 (`nvfp4x.freeze(nvfp4x.quantize(model, nvfp4_weight_only))`), and the ratio;
- checkpoint file sizes: `eqx.tree_serialise_leaves` of the bf16 model vs `nvfp4x.save`
  (and `eqx.tree_serialise_leaves`) of the frozen model, written to a temporary
  directory that is deleted afterwards;
- peak temporary bytes of the jitted forward (`memory_analysis().temp_size_in_bytes`),
  frozen W4A16 vs bf16, next to the bytes of all layers' weights dequantised to bf16
  (what a forward that decodes every layer up front would hold), and the same for the
  blocks stacked and run with `jax.lax.scan`;
- forward latency (jitted, model passed as an argument, warm-up then the median of
  `--repeats` runs) of frozen W4A16 vs bf16 on the same `--tokens` inputs. On this CPU
  the frozen forward pays for decoding every weight on each call; the latency target
  belongs to GPUs, where reading the weights is the bottleneck.

- forward latency at 1 token (issue 17): frozen W4A16 (`nvfp4_weight_only`) and W4A4
  (`nvfp4_inference`) against the float32 model and the bf16 one, jitted, model passed
  as an argument, median of `--repeats` runs each: float32 and the frozen models
  interleaved call by call, then float32 and bf16 (see `one_token` for why the slow
  bf16 call is kept apart) (`latency_1tok_*` and the ratios `*_vs_f32`, `*_vs_bf16`).
  At a few tokens a CPU runs the frozen GEMM as a loop that decodes the packed codes
  chunk by chunk (`chunked_dot`): only the 4.5-bit weights are read.

Run: `python benchmarks/bench_inference.py [--layers 12] [--d 1024] [--repeats 10]`
(`--quick`: 2 blocks of d=512). `main(argv)` returns the numbers as a dict.
"""

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

import nvfp4x


class Block(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, d: int, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(d, 4 * d, key=k1)
        self.fc2 = eqx.nn.Linear(4 * d, d, key=k2)

    def __call__(self, x: Float[Array, " d"]) -> Float[Array, " d"]:
        h = jax.nn.gelu(self.fc1(x))
        return x + self.fc2(h).astype(x.dtype)


class ResidualMLP(eqx.Module):
    blocks: list[Block]

    def __init__(self, layers: int, d: int, key: PRNGKeyArray):
        self.blocks = [Block(d, k) for k in jax.random.split(key, layers)]

    def __call__(self, x: Float[Array, " d"]) -> Float[Array, " d"]:
        for block in self.blocks:
            x = block(x)
        return x


def stacked(model: ResidualMLP) -> Block:
    """The blocks of `model` stacked along a new leading axis (one `Block` whose arrays
    have a leading `layers` axis), to run with `jax.lax.scan`."""
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *model.blocks)


def scan_forward(stack: Block, x: Float[Array, "tokens d"]) -> Float[Array, "tokens d"]:
    params, static = eqx.partition(stack, eqx.is_array)

    def body(h, p):
        return jax.vmap(eqx.combine(p, static))(h), None

    return jax.lax.scan(body, x, params)[0]


def to_bf16(model: Any) -> Any:
    """The same model with every floating-point array in bfloat16."""

    def cast(v):
        if eqx.is_array(v) and jnp.issubdtype(v.dtype, jnp.floating):
            return v.astype(jnp.bfloat16)
        return v

    return jax.tree_util.tree_map(cast, model)


def linear_layers(model: Any) -> list:
    kinds = eqx.nn.Linear | nvfp4x.FrozenLinear
    leaves = jax.tree_util.tree_leaves(model, is_leaf=lambda v: isinstance(v, kinds))
    return [v for v in leaves if isinstance(v, kinds)]


def weight_bytes(model: Any) -> int:
    return sum(
        int(leaf.nbytes)
        for layer in linear_layers(model)
        for leaf in jax.tree_util.tree_leaves(layer.weight)
    )


def forward(model: Any, x: Float[Array, "tokens d"]) -> Float[Array, "tokens d"]:
    return jax.vmap(model)(x)


def temp_bytes(model: Any, x: Array, fwd=forward) -> int | None:
    params, static = eqx.partition(model, eqx.is_array)
    fn = jax.jit(lambda p, x: fwd(eqx.combine(p, static), x))
    analysis = fn.lower(params, x).compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def latency(model: Any, x: Array, repeats: int) -> float:
    """Median seconds of a jitted forward (after one warm-up call that compiles)."""
    fn = eqx.filter_jit(forward)
    fn(model, x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(model, x).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_latency(cases: dict[str, tuple[Any, Array]], repeats: int) -> dict[str, float]:
    """Median seconds of each jitted forward, the cases called in turn (one warm-up call
    each first), so that a slow patch of the machine falls on every case alike."""
    fn = eqx.filter_jit(forward)
    for model, x in cases.values():
        fn(model, x).block_until_ready()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, (model, x) in cases.items():
            start = time.perf_counter()
            fn(model, x).block_until_ready()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def one_token(model: Any, bf16: Any, d: int, repeats: int) -> dict:
    """Forward latency at 1 token: frozen W4A16 and W4A4 against float32 and bf16.

    Two interleaved groups, each against float32: the frozen models, then bf16. On a CPU
    without bfloat16 instructions the bf16 forward takes ~10x the float32 one, and a
    frozen forward timed right after it ran 2-3x slower than in steady state (its many
    small loop steps after a long call); decoding calls one model again and again, so
    the frozen models are not timed behind it. The ratios against bf16 go through the
    float32 time of each group."""
    w4a16 = nvfp4x.freeze(nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_weight_only()))
    w4a4 = nvfp4x.freeze(nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_inference()))
    x = jax.random.normal(jax.random.key(2), (1, d), jnp.float32)
    frozen = interleaved_latency(
        {"f32": (model, x), "w4a16": (w4a16, x), "w4a4": (w4a4, x)}, repeats
    )
    plain = interleaved_latency(
        {"f32": (model, x), "bf16": (bf16, x.astype(jnp.bfloat16))}, repeats
    )
    t = {**frozen, "bf16": plain["bf16"]}
    out = {f"latency_1tok_s_{name}": v for name, v in t.items()}
    bf16_vs_f32 = plain["bf16"] / plain["f32"]
    for name in ("w4a16", "w4a4"):
        out[f"latency_1tok_{name}_vs_f32"] = t[name] / t["f32"]
        out[f"latency_1tok_{name}_vs_bf16"] = t[name] / t["f32"] / bf16_vs_f32
    return out


def run(layers: int = 12, d: int = 1024, repeats: int = 10, tokens: int = 64) -> dict:
    """Run the benchmark, print a table and return the numbers."""
    model = ResidualMLP(layers, d, jax.random.key(0))
    params = sum(layer.weight.size for layer in linear_layers(model))
    bf16 = to_bf16(model)
    frozen = nvfp4x.freeze(nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_weight_only()))
    jax.block_until_ready(frozen)
    first = one_token(model, bf16, d, repeats)
    del model  # the float32 master weights are not needed any more

    x = jax.random.normal(jax.random.key(1), (tokens, d), jnp.float32)
    out: dict = {"layers": layers, "d": d, "parameters": int(params), "tokens": tokens}

    out["weight_bytes_bf16"] = weight_bytes(bf16)
    out["weight_bytes_frozen"] = weight_bytes(frozen)
    out["weight_bytes_ratio"] = out["weight_bytes_bf16"] / out["weight_bytes_frozen"]

    with tempfile.TemporaryDirectory() as tmp:
        eqx.tree_serialise_leaves(os.path.join(tmp, "bf16.eqx"), bf16)
        eqx.tree_serialise_leaves(os.path.join(tmp, "frozen.eqx"), frozen)
        nvfp4x.save(os.path.join(tmp, "frozen.nvfp4x"), frozen)
        sizes = {f: os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp)}
    out["file_bytes_bf16"] = sizes["bf16.eqx"]
    out["file_bytes_frozen_eqx"] = sizes["frozen.eqx"]
    out["file_bytes_frozen_nvfp4x"] = sizes["frozen.nvfp4x"]
    out["file_bytes_ratio"] = sizes["bf16.eqx"] / sizes["frozen.nvfp4x"]

    out["dequantised_bf16_all_layers"] = 2 * int(params)
    out["temp_bytes_bf16"] = temp_bytes(bf16, x.astype(jnp.bfloat16))
    out["temp_bytes_frozen"] = temp_bytes(frozen, x)
    # The same frozen blocks stacked and run with `lax.scan`: one block decoded per step.
    try:
        out["temp_bytes_frozen_scan"] = temp_bytes(stacked(frozen), x, scan_forward)
    except ValueError:  # frozen weights keep their layer path (static): blocks differ
        out["temp_bytes_frozen_scan"] = None
    out["temp_bytes_bf16_scan"] = temp_bytes(stacked(bf16), x.astype(jnp.bfloat16), scan_forward)
    if out["temp_bytes_bf16"] and out["temp_bytes_frozen"] is not None:
        out["temp_bytes_ratio"] = out["temp_bytes_frozen"] / out["temp_bytes_bf16"]

    out["latency_s_bf16"] = latency(bf16, x.astype(jnp.bfloat16), repeats)
    out["latency_s_frozen"] = latency(frozen, x, repeats)
    out["latency_ratio"] = out["latency_s_frozen"] / out["latency_s_bf16"]
    out.update(first)
    out["device"] = jax.devices()[0].device_kind

    def mib(n):
        return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"

    print(f"{layers} blocks, d={d}: {params / 1e6:.1f}M weights, {tokens} tokens, {out['device']}")
    rows = [
        (
            "weight bytes",
            out["weight_bytes_bf16"],
            out["weight_bytes_frozen"],
            f"{out['weight_bytes_ratio']:.3f}x smaller",
        ),
        (
            "checkpoint file",
            out["file_bytes_bf16"],
            out["file_bytes_frozen_nvfp4x"],
            f"{out['file_bytes_ratio']:.3f}x smaller",
        ),
        (
            "peak temp (jit fwd)",
            out["temp_bytes_bf16"],
            out["temp_bytes_frozen"],
            f"frozen/bf16 {out.get('temp_bytes_ratio', float('nan')):.3f}",
        ),
    ]
    print(f"{'':22}{'bf16':>14}{'frozen W4A16':>16}")
    for label, a, b, note in rows:
        print(f"{label:22}{mib(a):>14}{mib(b):>16}   {note}")
    print(
        f"{'peak temp (scan fwd)':22}{mib(out['temp_bytes_bf16_scan']):>14}"
        f"{mib(out['temp_bytes_frozen_scan']):>16}   blocks stacked, run with lax.scan"
    )
    print(f"{'(all layers deq. bf16)':22}{mib(out['dequantised_bf16_all_layers']):>14}")
    print(
        f"{'forward latency':22}{out['latency_s_bf16'] * 1e3:>11.1f} ms"
        f"{out['latency_s_frozen'] * 1e3:>13.1f} ms   frozen/bf16 {out['latency_ratio']:.2f}x"
        " (CPU; the latency target is for GPUs)"
    )
    ms = lambda name: out[f"latency_1tok_s_{name}"] * 1e3
    print(
        f"{'1-token latency':22}f32 {ms('f32'):.1f} ms, bf16 {ms('bf16'):.1f} ms, "
        f"W4A16 {ms('w4a16'):.1f} ms ({out['latency_1tok_w4a16_vs_f32']:.2f}x f32), "
        f"W4A4 {ms('w4a4'):.1f} ms ({out['latency_1tok_w4a4_vs_f32']:.2f}x f32)"
    )
    return out


def main(argv: list[str] | None = None) -> dict:
    """Parse `argv` (the command line by default), run, and return the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="residual MLP blocks")
    parser.add_argument("--d", type=int, default=1024, help="model width (hidden = 4d)")
    parser.add_argument("--repeats", type=int, default=10, help="timed forward calls")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per forward")
    parser.add_argument(
        "--quick", action="store_true", help="2 blocks of d=512, 3 repeats (a smoke run)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        return run(layers=2, d=512, repeats=3, tokens=args.tokens)
    return run(args.layers, args.d, args.repeats, args.tokens)


if __name__ == "__main__":
    main()
