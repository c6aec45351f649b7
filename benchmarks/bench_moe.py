"""The NVFP4 grouped GEMM (`lax.ragged_dot` on quantised experts) against the float one.

For tokens `(T, d)` sorted over `E` experts (uneven group sizes, one empty group), one
expert layer `(E, d, hidden)` is run forward and backward (`jax.value_and_grad` of a
loss with respect to the input and the experts, jitted): float32 `lax.ragged_dot`
against `nvfp4x`'s grouped GEMM (`nvfp4_training()`: fprop, dgrad and wgrad per expert,
stochastic rounding, RHT), timed interleaved in one process (medians).

    python benchmarks/bench_moe.py [--tokens 1024 --d 256 --hidden 512 --experts 8]

Measured on a 2-core CPU (XLA:CPU, float32 GEMM operands; `--tokens 512 --d 128
--hidden 256 --experts 8 --repeats 5`): float32 29.9 ms, NVFP4 20.4 ms, ratio 0.68x
(the quantised step is faster here; why was not profiled). A CPU ratio says little about
a GPU's grouped GEMM.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import nvfp4x


def _median_seconds(fns, repeats: int) -> list[float]:
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[i].append(time.perf_counter() - start)
    return [float(np.median(t)) for t in times]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="a small size (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.d, args.hidden, args.experts, args.repeats = 256, 64, 128, 4, 3

    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (args.tokens, args.d), jnp.float32)
    w = jax.random.normal(kw, (args.experts, args.d, args.hidden), jnp.float32)
    share = np.random.default_rng(0).dirichlet(np.ones(args.experts))
    sizes = np.floor(share * args.tokens).astype(np.int32)
    sizes[1] = 0  # an empty expert
    sizes[-1] += args.tokens - sizes.sum()
    sizes = jnp.asarray(sizes)
    recipe = nvfp4x.recipes.nvfp4_training()

    def float_loss(x, w):
        return jnp.mean(lax.ragged_dot(x, w, sizes) ** 2)

    qw = nvfp4x.quantize(_Experts(w), recipe)  # its call runs the grouped GEMM

    def nvfp4_loss(x, q):
        return jnp.mean(q(x, sizes) ** 2)

    f32 = jax.jit(jax.value_and_grad(float_loss, argnums=(0, 1)))
    q4 = eqx.filter_jit(eqx.filter_value_and_grad(lambda q, x: nvfp4_loss(x, q)))
    jax.block_until_ready((f32(x, w), q4(qw, x)))  # compile
    t_f32, t_q4 = _median_seconds([lambda: f32(x, w), lambda: q4(qw, x)], args.repeats)
    ratio = t_q4 / t_f32
    print(
        f"tokens={args.tokens} d={args.d} hidden={args.hidden} experts={args.experts} "
        f"({jax.devices()[0].platform}), fwd+bwd: float32 ragged_dot {1e3 * t_f32:.2f} ms, "
        f"NVFP4 grouped GEMM {1e3 * t_q4:.2f} ms, ratio {ratio:.2f}x"
    )
    return {"float32_ms": 1e3 * t_f32, "nvfp4_ms": 1e3 * t_q4, "ratio": ratio}


class _Experts(eqx.Module):
    """An expert layer as haliax's `MoELinear` holds it: one `(experts, in, out)` weight."""

    weight: jax.Array

    def __call__(self, x, group_sizes):
        return lax.ragged_dot(x, self.weight, group_sizes)


if __name__ == "__main__":
    main()
