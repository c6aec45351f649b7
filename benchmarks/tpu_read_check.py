"""Where a read-only TPU kernel's time goes (issue 37): `rht_stats` against reads of the
same array in other shapes of tile and load.

```
python benchmarks/tpu_read_check.py --out PATH [--repeats N] [--size N]
python benchmarks/tpu_read_check.py --smoke     # small, interpreted, on a CPU
```

`_tpu_operand.rht_stats` reads an `N x N` float32 array once (wgrad's operand, for the
special-column check and the transform's amax) and took 1.24 ms at 8192 on a TPU v5e,
~4x one read at the copy bandwidth. Each case here reads the same array and writes a few
bytes, timed (medians of `--repeats`, interleaved) against that read:

- `xla max`: XLA's `max(|x|)`;
- `max WxH contiguous`: a Pallas kernel whose tiles are `rows x width` and whose loads
  are `(8, width)` rows in order (the DMA and the load alone);
- `max 2048x128 strided`: the tiles and the 16 strided loads (sublane stride 16) of
  `rht_stats`, with a maximum and no transform;
- `rht_stats`: the library's;
- `rht_stats contiguous WxH`: the same two results from contiguous `(8, width)` loads,
  each chunk of 16 rows two of them, the transform's stages 1, 2 and 4 by sublane
  rotations (`pltpu.roll`) and stage 8 between the two; its results compared with
  `rht_stats`'s, bit for bit;
- `quantize_2d 1x16 values` (fprop's and dgrad's operand, the Mosaic quantiser), the
  same then `rht_stats` (what a step pays now for such an operand and wgrad's RHT
  statistics of it), and `quantize 1x16 + stats`: both from one read
  (`_tpu_quantize.quantize_with_stats`, for the design that carries the statistics from
  fprop and dgrad to wgrad), its values, tensor scale and statistics compared with the
  two apart, bit for bit.
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from benchmarks.tpu_quantize_check import square_check, timed
from nvfp4x._kernels import _tpu_operand, _tpu_quantize
from nvfp4x._numerics._constants import BLOCK
from nvfp4x._numerics._ieee import abs_bits, from_bits


def max_contiguous(x, *, tile, interpret):
    """max |x| bits, `(8, width)` loads in order."""

    def kernel(x_ref, o_ref):
        tr, tw = x_ref.shape

        def body(r, top):
            return jnp.maximum(top, abs_bits(x_ref[pl.ds(pl.multiple_of(r * 8, 8), 8), :]))

        top = jax.lax.fori_loop(0, tr // 8, body, jnp.zeros((8, tw), jnp.int32), unroll=8)
        o_ref[0], o_ref[1] = top, top

    return jnp.max(_tpu_operand.stats_call(kernel, x, tile, interpret, "read_check"))


def max_strided(x, *, interpret):
    """max |x| bits by `rht_stats`'s 16 strided loads per 128 rows."""

    def kernel(x_ref, o_ref):
        tr = x_ref.shape[0]

        def body(g, top):
            base = pl.multiple_of(g * 128, 128)
            rows = [x_ref[pl.ds(base + j, 8, stride=BLOCK), :] for j in range(BLOCK)]
            return jnp.maximum(top, functools.reduce(jnp.maximum, [abs_bits(r) for r in rows]))

        top = jax.lax.fori_loop(0, tr // 128, body, jnp.zeros((8, 128), jnp.int32))
        o_ref[0], o_ref[1] = top, top

    return jnp.max(_tpu_operand.stats_call(kernel, x, (2048, 128), interpret, "read_check"))


def stats_contiguous(x, *, tile, interpret, unroll=4):
    """`rht_stats(x)` from contiguous loads, `_tpu_quantize.rht_chunk_stats` on each
    chunk of 16 rows: `(special, amax)`."""
    n, m = x.shape

    def kernel(x_ref, o_ref):
        tr, tw = x_ref.shape
        r_tile = pl.program_id(0) * tr
        col = pl.program_id(1) * tw + jax.lax.broadcasted_iota(jnp.int32, (BLOCK, tw), 1)

        def body(c, carry):
            base = pl.multiple_of(c * BLOCK, BLOCK)
            inside = (col < m) & (r_tile + base < n)
            rows = jnp.where(inside, x_ref[pl.ds(base, BLOCK), :], np.float32(0.0))
            parts = _tpu_quantize.rht_chunk_stats(rows)
            return tuple(jnp.maximum(old, new) for old, new in zip(carry, parts, strict=True))

        zeros = jnp.zeros((8, tw), jnp.int32)
        flag, top = jax.lax.fori_loop(0, tr // BLOCK, body, (zeros, zeros), unroll=unroll)
        o_ref[0], o_ref[1] = flag, top

    stats = _tpu_operand.stats_call(kernel, x, tile, interpret, "read_check")
    return jnp.max(stats[0]) > 0, from_bits(jnp.max(stats[1]))


def main(argv: list[str] | None = None) -> int:
    a, n, interpret, report, bw = square_check(__doc__, argv, smoke_n=512)
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)  # (no special column)
    read_s = x.nbytes / (bw / 2)
    report.line(f"copy bandwidth {bw / 1e9:.0f} GB/s; one read of x: {read_s * 1e3:.3f} ms")
    small = (256, 128) if a.smoke else None
    cases = {
        "xla max": jax.jit(lambda x: jnp.max(abs_bits(x))),
        "rht_stats": functools.partial(_tpu_operand.rht_stats, interpret=interpret),
        "max 2048x128 strided": jax.jit(functools.partial(max_strided, interpret=interpret)),
    }
    for tile in [small] if a.smoke else [(2048, 128), (512, 512), (256, 1024), (512, 2048)]:
        t = f"{tile[0]}x{tile[1]}"
        cases[f"max {t} contiguous"] = jax.jit(
            functools.partial(max_contiguous, tile=tile, interpret=interpret)
        )
    for tile in [small] if a.smoke else [(2048, 128), (512, 512), (256, 1024), (512, 1024)]:
        t = f"{tile[0]}x{tile[1]}"
        cases[f"rht_stats contiguous {t}"] = jax.jit(
            functools.partial(stats_contiguous, tile=tile, interpret=interpret)
        )
    amax = jnp.max(jnp.abs(x))
    quantize = functools.partial(
        _tpu_quantize.quantize_2d, block=(1, BLOCK), output="values", interpret=interpret
    )
    cases["quantize_2d 1x16 values"] = jax.jit(lambda x: quantize(x, amax))
    cases["quantize_2d 1x16 values, then rht_stats"] = jax.jit(
        lambda x: (quantize(x, amax), _tpu_operand.rht_stats(x, interpret=interpret))
    )
    cases["quantize 1x16 + stats"] = jax.jit(
        lambda x: _tpu_quantize.quantize_with_stats(x, amax, interpret=interpret)
    )
    want = jax.device_get(_tpu_operand.rht_stats(x, interpret=interpret))
    # a second array with a special column (a tiny nonzero chunk column)
    x2 = x.at[32:48, 5].set(1e-35)
    want2 = jax.device_get(_tpu_operand.rht_stats(x2, interpret=interpret))
    fns = {}
    report.line("")
    report.line("| case | ms | x one read | result as rht_stats's |")
    report.line("|---|---|---|---|")
    for name, f in cases.items():
        try:
            got = jax.device_get(f(x))
            same = ""
            if name == "quantize 1x16 + stats":
                values, _, s_dec, stats = got
                ref_values, _, ref_s = jax.device_get(quantize(x, amax))
                ok = np.asarray(values).tobytes() == np.asarray(ref_values).tobytes()
                ok &= np.asarray(s_dec).tobytes() == np.asarray(ref_s).tobytes()
                ok &= all(
                    np.asarray(g).tobytes() == np.asarray(w).tobytes()
                    for g, w in zip(stats, want, strict=True)
                )
                same = "yes (values, s_dec, stats)" if ok else "NO"
            elif name.startswith("rht_stats "):
                got2 = jax.device_get(f(x2))
                ok = all(
                    np.asarray(g).tobytes() == np.asarray(w).tobytes()
                    for g, w in zip((*got, *got2), (*want, *want2), strict=True)
                )
                same = "yes" if ok else f"NO: {got} {got2} against {want} {want2}"
            fns[name] = (functools.partial(f, x), same)
        except Exception as e:  # noqa: BLE001 (a case that fails to compile is a row)
            report.line(f"| {name} | failed: {type(e).__name__}: {str(e)[:300]} | | |")
    times = timed({k: v[0] for k, v in fns.items()}, a.repeats)
    for name, (_, same) in fns.items():
        t = times[name]
        report.line(f"| {name} | {t * 1e3:.3f} | {t / read_s:.2f} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
