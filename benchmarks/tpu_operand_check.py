"""The 16x1 GEMM operand kernel (`nvfp4x._kernels._tpu_operand`) on a TPU (issue 37):
compiles, bits, speed against `_tpu_quantize`'s kernel and the memory floor.

```
python benchmarks/tpu_operand_check.py --out PATH [--repeats N] [--size N]
python benchmarks/tpu_operand_check.py --smoke     # small, interpreted, on a CPU
```

Each case quantises an `N x N` array (8192: the training benchmark's largest wgrad
operands) in 16x1 and in 1x16 blocks to bfloat16 block values with the tensor amax given, by
`_tpu_quantize.tiled(..., output="values")` ("quantize_2d", that module's own kernel) and by
`_tpu_operand.operand` ("operand"), compares their bits, and times both (medians of
`--repeats`, interleaved) against the floor: the input read once and the bfloat16
values written once, at the copy bandwidth measured first. The `rht` cases compare the
transform's kernel followed by `quantize_2d` with `operand(..., rht=True)`, whose floor
is the same one read and one write, and time `rht_stats` (the read before it). Then the
operand kernel with the transform over tile rows, its groups unrolled and looped (`looped`):
compile seconds, bits, time.
"""

import functools
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks.tpu_quantize_check import same_bits, square_check, test_array, timed
from nvfp4x._kernels import _tpu_operand, _tpu_quantize, _tpu_rht
from nvfp4x._numerics._nvfp4 import amax_of_bits

SEED = jnp.asarray([0x1234, 0xABCD], jnp.uint32)


def main(argv: list[str] | None = None) -> int:
    a, n, interpret, report, bw = square_check(__doc__, argv, smoke_n=256)
    report.line(f"copy bandwidth (x + 1, float32): {bw / 1e9:.0f} GB/s")
    report.line("")
    report.line("| case | same bits | quantize_2d ms | x floor | operand ms | x floor | ratio |")
    report.line("|---|---|---|---|---|---|---|")
    ok = True
    for block in ((16, 1), (1, 16)):
        for dtype in (jnp.float32, jnp.bfloat16):
            for rounding in ("nearest", "stochastic"):
                for rht in (False, True) if dtype == jnp.float32 and block == (16, 1) else (False,):
                    kind = f"{jnp.dtype(dtype).name} {rounding}{' rht' if rht else ''}"
                    name = f"{block[0]}x{block[1]} {kind}"
                    try:
                        ok &= case(
                            report, name, n, dtype, rounding, rht, bw, a.repeats, interpret, block
                        )
                    except Exception:  # noqa: BLE001
                        ok = False
                        report.line(f"| {name} | error | | | | | |")
                        traceback.print_exc()
    report.line("")
    report.line("| operand kernel, float32 nearest, RHT | compile s | same bits | ms | x floor |")
    report.line("|---|---|---|---|---|")
    x = jax.random.normal(jax.random.key(3), (n, n), jnp.float32)
    amax = _tpu_operand.rht_stats(x, interpret=interpret)[1]
    kw = dict(rht=True, interpret=interpret)
    want = jax.jit(functools.partial(_tpu_operand.operand, **kw))(x, amax)[0]
    floor = (x.nbytes + x.size * 2) / bw
    fns, compiles = {}, {}
    for looped in (True, False):
        for rows in (256, 512, 1024, 2048) if not a.smoke else (128, 256):
            f = functools.partial(_tpu_operand.operand, rows=rows, looped=looped, **kw)
            try:
                t = time.perf_counter()
                compiled = jax.jit(f).lower(x, amax).compile()
                compiles[(rows, looped)] = time.perf_counter() - t
                same = same_bits(want, compiled(x, amax)[0])
                ok &= same
                fns[(rows, looped, same)] = functools.partial(compiled, x, amax)
            except Exception:  # noqa: BLE001
                ok = False
                report.line(f"| {rows}-row tiles, looped {looped} | error | | | |")
                traceback.print_exc()
    for (rows, looped, same), t in timed(fns, a.repeats).items():
        c = compiles[(rows, looped)]
        name = f"{rows}-row tiles, {'looped' if looped else 'unrolled'}"
        report.line(f"| {name} | {c:.1f} | {same} | {t * 1e3:.3f} | {t / floor:.2f}x |")
    report.line("")
    report.line(f"all cases compiled and bit for bit: {ok}")
    return 0 if ok else 1


def case(report, name, n, dtype, rounding, rht, bw, repeats, interpret, block) -> bool:
    x = test_array((n, n), dtype, seed=1)
    seed = SEED if rounding == "stochastic" else None
    if rht:
        x = jax.random.normal(jax.random.key(3), (n, n), jnp.float32)  # (no special columns)
        y = jax.jit(functools.partial(_tpu_rht.transform, interpret=interpret))(x)
        amax = amax_of_bits(y)
    else:
        amax = amax_of_bits(x.astype(jnp.float32))

    def old(x, amax, seed):
        y = _tpu_rht.transform(x, interpret=interpret) if rht else x
        kw = dict(block=block, rounding=rounding, output="values", interpret=interpret)
        return _tpu_quantize.tiled(
            y, amax, seed, tiling=_tpu_quantize.tiling_for(block, y.dtype), **kw
        )[0]

    def new(x, amax, seed):
        kw = dict(block=block, rounding=rounding, rht=rht, interpret=interpret)
        return _tpu_operand.operand(x, amax, seed, **kw)[0]

    f_old, f_new = jax.jit(old), jax.jit(new)
    same = same_bits(f_old(x, amax, seed), f_new(x, amax, seed))
    fns = {"old": lambda: f_old(x, amax, seed), "new": lambda: f_new(x, amax, seed)}
    if rht:  # the one read before: no special column, and the transform's amax
        f_stats = jax.jit(functools.partial(_tpu_operand.rht_stats, interpret=interpret))
        special, stats_amax = f_stats(x)
        same &= not bool(special) and same_bits(stats_amax, amax)
        fns["stats"] = lambda: f_stats(x)
    t = timed(fns, repeats)
    floor = (x.nbytes + x.size * 2) / bw
    if rht:
        name += f" (rht_stats {t['stats'] * 1e3:.3f} ms = {t['stats'] * bw / x.nbytes:.2f}x a read)"
    report.line(
        f"| {name} | {same} | {t['old'] * 1e3:.3f} | {t['old'] / floor:.2f}x | "
        f"{t['new'] * 1e3:.3f} | {t['new'] / floor:.2f}x | {t['new'] / t['old']:.2f}x |"
    )
    return same


if __name__ == "__main__":
    sys.exit(main())
