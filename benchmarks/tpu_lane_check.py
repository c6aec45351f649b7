"""Where the TPU quantiser's time goes (issue 37): its kernels, each also traced with
one of its choices changed.

```
python benchmarks/tpu_lane_check.py --out PATH [--repeats N] [--size N]
python benchmarks/tpu_lane_check.py --smoke     # small, interpreted, on a CPU (1x16 only)
```

Each case maps an `N x N` float32 array to bfloat16 block values
(`_tpu_quantize.tiled`, tiles of 2048 x 512, chunks of 128 x 512: the float32
`TILINGS`) and is timed as the median of `--repeats` rounds of 10 calls inside one
jitted loop (no dispatch in the time), against the floor (the input read once, the
bfloat16 output written once, at the copy bandwidth): 1x16 and 16x1 blocks (the same
arithmetic, with and without the transposes), to the nearest and stochastically, and
16x16; the 1x16 and 16x16 ones also in other forms (`PATCHES`, their bits compared with
the library's): `branched once` (`Tiling.branch_once`: no branch in the chunk loop, the
plain product), `unroll 2` (`Tiling.unroll`), and `no block cond`, for this timing only
(`_block_steps`' scalar `lax.cond` on the tensor's tininess replaced by its usual
branch, the magnitudes' exact steps kept). (On the chip, trees a377d83 and def0d12 in
`benchmarks/results/tpu_v5e.md`, the first two were patches too, "no conds" and "unroll
2", with the magnitudes before the twenty-fifth session, the plain product in a
`lax.cond` of their own; and chunk kernels of a copy, transposes and a lane-group
maximum, whose times there were past the chip's bandwidth, not understood, and were
removed. Those runs took `--tiled`, which is still taken and does nothing.)
"""

import contextlib
import functools
import sys

import jax
import jax.numpy as jnp

from benchmarks.tpu_quantize_check import same_bits, square_check, timed
from nvfp4x._kernels import _tpu_quantize

ROWS, COLS = 2048, 512
#: Calls per timed round, inside one jitted loop.
CALLS = 10


def _normal_steps(
    bamax_bits, params_ref, table_ref, tiny_tensor=None, *, _steps=_tpu_quantize._block_steps
):
    """`_tpu_quantize._block_steps` with its `normal` branch only (no `lax.cond`)."""
    return _steps(bamax_bits, params_ref, table_ref, False)


#: The forms timed beside the library's: `(changes to its tiling, changes traced into
#: the kernel as `(module, attribute, value)`)`.
PATCHES = {
    "branched once": ({"branch_once": True}, []),
    "no block cond": ({}, [(_tpu_quantize, "_block_steps", _normal_steps)]),
    "unroll 2": ({"unroll": 2}, []),
}


@contextlib.contextmanager
def patched(name: str | None):
    """`PATCHES[name]`'s changes to the kernel in place while a case is traced."""
    changes = PATCHES[name][1] if name else []
    old = [getattr(m, a) for m, a, _ in changes]
    for m, a, v in changes:
        setattr(m, a, v)
    try:
        yield
    finally:
        for (m, a, _), v in zip(changes, old, strict=True):
            setattr(m, a, v)


def repeated(fn, calls: int = CALLS):
    """`fn(x)` `calls` times in one jitted loop (each call's input passes an
    optimisation barrier with the loop counter, so that XLA hoists or shares no call:
    with a select on the counter instead, it hoisted the first run's kernels)."""

    def run(x):
        def body(i, acc):
            xi, _ = jax.lax.optimization_barrier((x, i))  # (no copy: XLA cannot see through)
            return acc + fn(xi)[0, 0].astype(jnp.float32)

        return jax.lax.fori_loop(0, calls, body, jnp.float32(0))

    return jax.jit(run)


def main(argv: list[str] | None = None) -> int:
    argv = [v for v in (sys.argv[1:] if argv is None else argv) if v != "--tiled"]
    a, n, interpret, report, bw = square_check(__doc__, argv, smoke_n=256)
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    amax = jnp.max(jnp.abs(x))
    seed = jnp.asarray([0x1234, 0xABCD], jnp.uint32)
    floor = (x.nbytes + x.size * 2) / bw
    report.line(f"copy bandwidth {bw / 1e9:.0f} GB/s; floor {floor * 1e3:.3f} ms a call")
    cases = {}
    tiled = _tpu_quantize.tiled.__wrapped__  # (traced anew in each case: its patches)
    variants = {}  # case: (its patch, the library's case it is compared with)
    # (interpreted, `--smoke`: one kernel and its patches, to check that the script runs)
    for block in ((1, 16),) if interpret else ((1, 16), (16, 1), (16, 16)):
        for rounding in ("nearest",) if interpret else ("nearest", "stochastic"):
            if block == (16, 16) and rounding == "stochastic":
                continue
            sd = seed if rounding == "stochastic" else None
            name = f"tiled {block[0]}x{block[1]} {rounding}"
            kw = dict(block=block, rounding=rounding, output="values", interpret=interpret)

            def case(x, sd=sd, kw=kw, **changes):
                tiling = _tpu_quantize.Tiling(ROWS, COLS, COLS)._replace(**changes)
                return tiled(x, amax, sd, tiling=tiling, **kw)[0]

            cases[name] = case
            if block != (16, 1):
                for patch, (changes, _) in PATCHES.items():
                    cases[f"{name}, {patch}"] = functools.partial(case, **changes)
                    variants[f"{name}, {patch}"] = (patch, name)
    report.line("\n| case | ms a call | x floor |")
    report.line("|---|---|---|")
    ok = True  # (the patched cases' bits are the library's)
    fns, calls = {}, 1 if interpret else CALLS  # (interpreted: each call is slow)
    for k, f in cases.items():
        patch, base = variants.get(k, (None, None))
        with patched(patch):
            fns[k] = repeated(f, calls)
            jax.block_until_ready(fns[k](x))
            if base is not None:
                same = same_bits(jax.jit(lambda x, f=f: f(x))(x), jax.jit(cases[base])(x))
                ok &= same
                if not same:
                    report.line(f"{k}: NOT the bits of {base}")
    times = timed({k: functools.partial(f, x) for k, f in fns.items()}, a.repeats)
    for k, t in times.items():
        t /= calls
        report.line(f"| {k} | {t * 1e3:.3f} | {t / floor:.2f}x |")
    report.line(f"\nthe patched kernels' bits are the library's: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
