"""Time `nvfp4x.to_nvfp4` against JAX's own NVFP4 quantiser and a plain read of the input.

```
python benchmarks/bench_format.py [--size 4096] [--repeats 20]
```

Three jitted functions on the same float32 `size x size` array, in one process:

- `nvfp4x.to_nvfp4(x)`: the whole cast, tensor amax and packing included (1x16 blocks,
  round to nearest);
- JAX's quantiser, `jax._src.cudnn.scaled_matmul_stablehlo.quantize`, in its `nvfp4` mode
  (block 16, E2M1 data, E4M3 scales, global scale 1.0). It does less work: no tensor
  amax (the user supplies the global scale), no packing, no non-finite handling;
- a plain read, `jnp.max(jnp.abs(x))`: the floor any cast must pay to see its input;
- `nvfp4x.to_nvfp4` on the same values in bfloat16 (a training step's usual operand
  dtype), which must be no slower than on float32 input (it reads half the bytes);
- the floor of a two-pass quantiser on this backend: the block-maxima pass alone
  (`block_absmax` and the tensor max over it, which the codes depend on) and the
  cheapest element pass that writes a byte per element (`(x > 0).astype(uint8)`).

Each is compiled and warmed up first; the figure is the median over `--repeats` runs of
one call followed by `block_until_ready` on every output leaf. Printed ratios: the
throughput of `to_nvfp4` over JAX's quantiser (target: >= 3x) and the time of `to_nvfp4`
relative to the plain read. `main(argv)` returns the figures as a dict, for
`benchmarks/run_all.py`.
"""

import argparse
import dataclasses
import inspect
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4x
from nvfp4x._numerics._constants import ROW_BLOCK
from nvfp4x._numerics._nvfp4 import block_absmax

#: Arguments `benchmarks/run_all.py --quick` passes: small, to check that it runs.
QUICK_ARGV = ["--size", "1024", "--repeats", "5"]
WARMUP = 3


def median_seconds(fn, x, repeats: int) -> float:
    """Median wall time of `fn(x)` until every output leaf is ready, after warm-up."""
    for _ in range(WARMUP):  # the first call compiles
        jax.block_until_ready(fn(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def jax_nvfp4_quantizer():
    """JAX's nvfp4 quantiser, jitted, with its config built from the dataclass's fields.

    `quantize(x, config)` (read with `inspect`) asserts `config.scale_type ==
    float8_e4m3fn` and `config.global_scale.dtype == float32` in `nvfp4` mode, divides `x`
    by the global scale, clips the block scales `amax / 6` to 448, casts them to E4M3
    behind an optimisation barrier and casts `x / scale` to `data_type`.
    """
    from jax._src.cudnn import scaled_matmul_stablehlo as sms

    source = inspect.getsource(sms.quantize)
    assert 'config.mode == "nvfp4"' in source, "JAX's quantize no longer has an nvfp4 mode"
    wanted = {
        "mode": "nvfp4",
        "block_size": 16,
        "data_type": jnp.float4_e2m1fn,
        "scale_type": jnp.float8_e4m3fn,
        "global_scale": jnp.asarray(1.0, jnp.float32),
        "infer_only": False,
    }
    fields = {f.name for f in dataclasses.fields(sms.BlockScaleConfig)}
    missing = fields - set(wanted)
    if missing:
        raise RuntimeError(f"BlockScaleConfig has fields this script does not know: {missing}")
    config = sms.BlockScaleConfig(**{k: v for k, v in wanted.items() if k in fields})
    return jax.jit(lambda x: sms.quantize(x, config))


def block_maxima_pass(x):
    """The first pass of `to_nvfp4`: the 1x16 block maxima and the tensor max over them."""
    bamax = block_absmax(x, ROW_BLOCK)
    return bamax, jnp.max(bamax)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="the array is size x size")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs (median taken)")
    args = parser.parse_args(argv)
    if args.size <= 0 or args.size % 16:
        parser.error("--size must be a positive multiple of 16 (JAX's quantiser needs it)")

    x = jax.random.normal(jax.random.key(0), (args.size, args.size), jnp.float32)
    x = jax.block_until_ready(x)
    ours = jax.jit(nvfp4x.to_nvfp4)
    theirs = jax_nvfp4_quantizer()
    read = jax.jit(lambda x: jnp.max(jnp.abs(x)))

    t_ours = median_seconds(ours, x, args.repeats)
    t_theirs = median_seconds(theirs, x, args.repeats)
    t_read = median_seconds(read, x, args.repeats)
    x_bf16 = jax.block_until_ready(x.astype(jnp.bfloat16))
    t_bf16 = median_seconds(ours, x_bf16, args.repeats)
    t_blocks = median_seconds(jax.jit(block_maxima_pass), x, args.repeats)
    t_bytes = median_seconds(jax.jit(lambda x: (x > 0).astype(jnp.uint8)), x, args.repeats)

    q = ours(x)
    gbytes = x.size * x.dtype.itemsize / 1e9
    results = {
        "device": f"{jax.default_backend()} ({jax.devices()[0].device_kind})",
        "size": f"{args.size}x{args.size} float32",
        "repeats": args.repeats,
        "to_nvfp4 ms": 1e3 * t_ours,
        "jax quantize ms": 1e3 * t_theirs,
        "plain read ms": 1e3 * t_read,
        "to_nvfp4 input GB/s": gbytes / t_ours,
        "speedup vs jax quantize": t_theirs / t_ours,
        "time vs plain read": t_ours / t_read,
        "to_nvfp4 bfloat16 ms": 1e3 * t_bf16,
        "bfloat16 input vs float32 input": t_bf16 / t_ours,
        "block-maxima pass ms": 1e3 * t_blocks,
        "byte-per-element pass ms": 1e3 * t_bytes,
        "two-pass floor vs plain read": (t_blocks + t_bytes) / t_read,
        "bits per element": 8 * q.nbytes / x.size,
        "finite": bool(np.isfinite(np.asarray(q.tensor_scale)).all()),
    }
    width = max(len(k) for k in results)
    for k, v in results.items():
        print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    target = "meets" if results["speedup vs jax quantize"] >= 3 else "misses"
    print(
        f"to_nvfp4 is {results['speedup vs jax quantize']:.2f}x JAX's quantiser "
        f"({target} the >= 3x target) and takes {results['time vs plain read']:.2f}x "
        "a plain read of its input; on bfloat16 input it takes "
        f"{results['bfloat16 input vs float32 input']:.2f}x its float32 time. The floor of "
        "two passes (block maxima, then one byte written per element) is "
        f"{results['two-pass floor vs plain read']:.2f}x the plain read."
    )
    return results


if __name__ == "__main__":
    main()
