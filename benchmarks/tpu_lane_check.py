"""Where the TPU quantiser's time goes for 1x16 blocks (issue 37): the same tiles and
chunks as `_tpu_quantize.tiled`'s, with one piece of its work at a time.

```
python benchmarks/tpu_lane_check.py --out PATH [--repeats N] [--size N] [--tiled]
python benchmarks/tpu_lane_check.py --smoke     # small, interpreted, on a CPU (1x16 only)
```

Each case maps an `N x N` float32 array to bfloat16 in tiles of 2048 x 512, chunks of
128 x 512 (`_tpu_quantize.TILINGS`' float32 tiling), and is timed as the median of
`--repeats` rounds of 10 calls inside one jitted loop (no dispatch in the time),
against the floor (the input read once, the bfloat16 output written once, at the copy
bandwidth):

The first five cases (`--tiled` leaves them out) came out at ~0.13 ms a call on a TPU v5e
(2026-12-08), past the chip's bandwidth: their kernels are not what they time there (not
understood yet); the library's cases gave the times of the step's profile.

- `copy`: the cast alone (the pipeline, the loads and the stores);
- `transpose f32 there and back`: each chunk transposed and transposed back, then cast
  (the two transposes a 1x16 chunk takes now, `x.T` and `q.T`);
- `transpose, cast, transpose back`: the second transpose of bfloat16 values;
- `lane-group max by rolls`: each 16 lanes' maximum in every lane of the group
  (`_tpu_quantize._lane_group_max`, no transpose), times `x`;
- `sublane max, transposed`: the transposed chunk's block maxima by the sublane
  reduction and broadcast back (what 1x16 blocks do now before the block steps);
- the library's `tiled` values for 1x16 and 16x1 blocks (the same arithmetic, with and
  without the transposes), to the nearest and stochastically, and 16x16; and some of
  them traced with one of the kernel's choices changed (`PATCHES`, for this timing
  only, their bits compared with the library's): `no conds` (the scalar `lax.cond` on
  the tensor's tininess in each chunk's `_block_steps` replaced by its usual branch, and
  the magnitudes the plain product: what a chunk costs without a branch), `no block
  cond` (the first alone), `unroll 2` (two chunks an iteration of the loop down a
  tile's rows). (The magnitudes before the twenty-fifth session, the plain product in
  a `lax.cond` of their own, were a patch too while they were compared on the chip:
  `benchmarks/results/tpu_v5e.md`, tree def0d12.)
"""

import contextlib
import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from benchmarks.tpu_quantize_check import same_bits, square_check, timed
from nvfp4x._kernels import _tpu_quantize
from nvfp4x._numerics._constants import BLOCK
from nvfp4x._numerics._ieee import abs_bits, from_bits

ROWS, COLS, CHUNK_ROWS = 2048, 512, 128
#: Calls per timed round, inside one jitted loop.
CALLS = 10
_FORI = jax.lax.fori_loop  # (the timing loop's, not patched)


_BLOCK_STEPS, _MAGNITUDES = _tpu_quantize._block_steps, _tpu_quantize.magnitudes


def _normal_steps(bamax_bits, params_ref, table_ref, tiny_tensor=None):
    """`_tpu_quantize._block_steps` with its `normal` branch only (no `lax.cond`)."""
    return _BLOCK_STEPS(bamax_bits, params_ref, table_ref, False)


def _plain_magnitudes(ab, inv, inv_sub, expand, *, plain=False):
    """The plain product `|x| * inv_b` (exact outside tiny tensors)."""
    return _MAGNITUDES(ab, inv, inv_sub, expand, plain=True)


def _unrolled(lower, upper, body, init, **kw):
    return _FORI(lower, upper, body, init, unroll=2)


#: Changes traced into the kernel for a case (`(module, attribute, value)`).
PATCHES = {
    "no conds": [
        (_tpu_quantize, "_block_steps", _normal_steps),
        (_tpu_quantize, "magnitudes", _plain_magnitudes),
    ],
    "no block cond": [(_tpu_quantize, "_block_steps", _normal_steps)],
    "unroll 2": [(jax.lax, "fori_loop", _unrolled)],
}


@contextlib.contextmanager
def patched(name: str | None):
    """`PATCHES[name]` in place while a case is traced."""
    changes = PATCHES.get(name, []) if name else []
    old = [getattr(m, a) for m, a, _ in changes]
    for m, a, v in changes:
        setattr(m, a, v)
    try:
        yield
    finally:
        for (m, a, _), v in zip(changes, old, strict=True):
            setattr(m, a, v)


def per_chunk(chunk_fn, x, *, interpret):
    """`chunk_fn` on each `CHUNK_ROWS x COLS` chunk of `x`'s tiles, into bfloat16."""
    n, m = x.shape
    tr, tc = min(ROWS, n), min(COLS, m)

    def kernel(x_ref, o_ref):
        def body(k, carry):
            r0 = pl.multiple_of(k * CHUNK_ROWS, CHUNK_ROWS)
            rows = pl.ds(r0, CHUNK_ROWS)
            o_ref[rows, :] = chunk_fn(x_ref[rows, :]).astype(jnp.bfloat16)
            return carry

        jax.lax.fori_loop(0, tr // CHUNK_ROWS, body, 0)

    spec = pl.BlockSpec((tr, tc), lambda i, j: (i, j))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, m), jnp.bfloat16),
        grid=(pl.cdiv(n, tr), pl.cdiv(m, tc)),
        in_specs=[spec],
        out_specs=spec,
        interpret=pltpu.InterpretParams() if interpret else False,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        name="lane_check",
    )(x)


def there_and_back(x):
    return x.T.T


def cast_between(x):
    return x.T.astype(jnp.bfloat16).T


def rolls(x):
    return x * from_bits(_tpu_quantize._lane_group_max(abs_bits(x)))


def sublane_max(x):
    t = x.T
    n, m = t.shape
    bmax = jnp.max(abs_bits(t).reshape(n // BLOCK, BLOCK, m), axis=1)
    return (t * from_bits(_tpu_quantize._expand(bmax))).T


def repeated(fn, calls: int = CALLS):
    """`fn(x)` `calls` times in one jitted loop (each call's input passes an
    optimisation barrier with the loop counter, so that XLA hoists or shares no call:
    with a select on the counter instead, it hoisted the first run's kernels)."""

    def run(x):
        def body(i, acc):
            xi, _ = jax.lax.optimization_barrier((x, i))  # (no copy: XLA cannot see through)
            return acc + fn(xi)[0, 0].astype(jnp.float32)

        return _FORI(0, calls, body, jnp.float32(0))

    return jax.jit(run)


def main(argv: list[str] | None = None) -> int:
    tiled_only = "--tiled" in (argv := list(sys.argv[1:] if argv is None else argv))
    a, n, interpret, report, bw = square_check(
        __doc__, [v for v in argv if v != "--tiled"], smoke_n=256
    )
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    amax = jnp.max(jnp.abs(x))
    seed = jnp.asarray([0x1234, 0xABCD], jnp.uint32)
    floor = (x.nbytes + x.size * 2) / bw
    report.line(f"copy bandwidth {bw / 1e9:.0f} GB/s; floor {floor * 1e3:.3f} ms a call")
    chunked = {
        "copy": lambda x: x,
        "transpose f32 there and back": there_and_back,
        "transpose, cast, transpose back": cast_between,
        "lane-group max by rolls": rolls,
        "sublane max, transposed": sublane_max,
    }
    cases = {k: functools.partial(per_chunk, f, interpret=interpret) for k, f in chunked.items()}
    if tiled_only:
        cases = {"copy": cases["copy"]}
    tiled = _tpu_quantize.tiled.__wrapped__  # (traced anew in each case: its patches)
    variants = {}  # case: (its patch, the library's case it is compared with)
    # (interpreted, `--smoke`: one kernel and its patches, to check that the script runs)
    for block in ((1, 16),) if interpret else ((1, 16), (16, 1), (16, 16)):
        for rounding in ("nearest",) if interpret else ("nearest", "stochastic"):
            if block == (16, 16) and rounding == "stochastic":
                continue
            sd = seed if rounding == "stochastic" else None
            name = f"tiled {block[0]}x{block[1]} {rounding}"
            fn = functools.partial(
                lambda x, block, rounding, sd: tiled(
                    x,
                    amax,
                    sd,
                    block=block,
                    rounding=rounding,
                    output="values",
                    interpret=interpret,
                    tiling=_tpu_quantize.Tiling(ROWS, COLS, COLS),
                )[0],
                block=block,
                rounding=rounding,
                sd=sd,
            )
            cases[name] = fn
            if block != (16, 1):
                for patch in PATCHES:
                    cases[f"{name}, {patch}"] = fn
                    variants[f"{name}, {patch}"] = (patch, name)
    report.line("\n| case | ms a call | x floor | x copy |")
    report.line("|---|---|---|---|")
    # (the cast cases' bits against the input's cast: the kernels do what they say; the
    # patched cases' against the library's)
    ok = same_bits(cases["copy"](x), x.astype(jnp.bfloat16))
    for k in set(cases) & {"transpose, cast, transpose back", "transpose f32 there and back"}:
        ok &= same_bits(cases[k](x), x.astype(jnp.bfloat16))
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
    copy = times["copy"] / calls
    for k, t in times.items():
        t /= calls
        report.line(f"| {k} | {t * 1e3:.3f} | {t / floor:.2f}x | {t / copy:.2f}x |")
    report.line(f"\nthe copy's and the patched kernels' bits as they should be: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
