"""The Hadamard transform's product (`_numerics._hadamard._plain`) as a Pallas kernel for
TPUs (Mosaic).

`_plain` is the 16-point fast Walsh-Hadamard transform of each chunk of 16 rows, written
in XLA's elementwise operations on reshapes such as `(chunks, 4, 4, 1, columns)`. On a
TPU those reshapes put factors of 1 and 4 into the (8, 128) tiles' sublane dimension:
XLA writes the first pass's parts in `T(1, 128)` tiles, one sublane in 8 used, and a
transform of an 8192x8192 float32 operand took ~10 ms, ~9x one read and one write of it
at the copy bandwidth (TPU v5e, 2026-12-06, the training step's profile in
`benchmarks/results/tpu_v5e.md`).

Here each tile of `rows x 128` is in VMEM once, and the transform is worked on 8 chunks
at a time (unrolled, so that every index is static): row `j` of each of 8 consecutive
chunks is one strided load (sublane stride 16) into one vector register, the 16 such
registers go through the four butterfly stages
(`a + b`, `a - b` over rows `j` and `j + h`, `h = 1, 2, 4, 8`) and the signs, and are
stored back the same way. The same float32 operations in the same order as `_plain`
(times 1/4 first, then the stages, then the signs), so the same bits; the tile's last
dimension is 128 lanes because Mosaic's strided loads and stores take only memrefs of
that width.

`transform` is the product only: the caller (`_hadamard.rht`) keeps its checks for big,
tiny and non-finite chunk columns, and uses it where no column needs them.
`transform_scaled` is the other branch, `_hadamard.rht_scaled` (`_guarded`: every chunk
column scaled into range by its largest magnitude and back, results near float32's
maximum computed again): in XLA that branch is inlined at every call site of a training
step and took ~11 s of a TPU's compile time. Same tiles and the same 16 registers of a
group of 8 chunks, and on them `_guarded`'s operations (`scaled_butterflies`): the chunk
columns' largest `abs_bits` (the elementwise maximum of the 16 registers), the scalings
of `_hadamard.scaled_into_range` and `scaled_back` (whose `tiny_up` and `tiny_down` read and
build subnormals from bits, so a TPU's flushing of subnormals does not touch them),
`butterflies` between, and `_accurate_chunk`'s TwoSum butterflies (`_sum_of_sums`, in
its order) computed for every group and selected where a result is near the maximum
(`_accurate` computes them only there: the same bits). Its groups run in a `fori_loop`
(one group's code, compiled much faster than unrolled; speed matters little on this
rarely taken path). On a TPU v5e (2026-12-07, alone in a jit, compiled) it compiled in
0.2-0.8 s against 1.5-2.9 s for XLA's `rht_scaled`, gave its bits (on these tests' data
up to 8192x8192) and took 1.2 ms against 11.4 ms on 8192x8192.

Both are tested bit for bit against the XLA code (`_plain`, `rht_scaled`) in the TPU
interpreter (`pltpu.InterpretParams()`) on the CPU, and lowered for a TPU there
(`tests/test_tpu_rht.py`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float

from .._numerics._constants import BLOCK, RHT_SIGNS
from .._numerics._hadamard import (
    _sum_of_sums,
    near_maximum,
    range_masks,
    scaled_back,
    scaled_into_range,
)
from .._numerics._ieee import abs_bits
from ._batching import each_problem

#: Lanes of a tile (Mosaic's strided loads need memrefs exactly this wide).
LANES = 128
#: Rows of a tile at most (a multiple of `GROUP_ROWS`): 1 MiB of float32 in, 1 MiB out.
ROWS = 2048
#: Rows worked on at a time: 8 chunks of 16, one vector register per row of a chunk.
GROUP_ROWS = 8 * BLOCK
#: `transform`'s `interpret` values: what `pallas_call` is given for each.
_INTERPRETERS = {False: False, True: pltpu.InterpretParams(), "plain": True}


def applies(shape: tuple[int, ...]) -> bool:
    """Whether the kernel takes a `(rows, columns)` array: rows a multiple of 16 (whole
    chunks) and at least `GROUP_ROWS`, columns at least one tile of lanes (narrower arrays
    run `_plain`: too small to matter)."""
    rows_ok = len(shape) == 2 and shape[0] % BLOCK == 0 and shape[0] >= GROUP_ROWS
    return rows_ok and shape[1] >= LANES


def butterflies(rows: list[Array]) -> list[Array]:
    """`_plain`'s operations on the 16 rows of a group of chunks (`rows[j]`: row `j` of
    each chunk, any shape), in its order: times 1/4, the four butterfly stages (`a + b`,
    `a - b` over rows `j` and `j + h`, `h = 1, 2, 4, 8`), times the signs. Also the
    prologue of `_tpu_operand`'s kernel."""
    rows = [r * np.float32(0.25) for r in rows]
    half = 1
    while half < BLOCK:  # `_plain`'s stages: rows j and j + half of each chunk
        staged = list(rows)
        for j in range(BLOCK):
            if not j & half:
                staged[j] = rows[j] + rows[j + half]
                staged[j + half] = rows[j] - rows[j + half]
        rows, half = staged, 2 * half
    return [r * np.float32(s) for r, s in zip(rows, RHT_SIGNS, strict=True)]


def _kernel(x_ref, o_ref):
    """One tile, `GROUP_ROWS` rows at a time (unrolled: every load and store has static
    indices), row `j` of 8 chunks one `(8, 128)` value."""
    for base in range(0, x_ref.shape[0], GROUP_ROWS):
        rows = butterflies([x_ref[pl.ds(base + j, 8, stride=BLOCK), :] for j in range(BLOCK)])
        for j in range(BLOCK):
            o_ref[pl.ds(base + j, 8, stride=BLOCK), :] = rows[j]


def _scaled_kernel(x_ref, o_ref):
    """One tile, `GROUP_ROWS` rows at a time in a `fori_loop` (dynamic row offsets, one
    group's code), row `j` of 8 chunks one `(8, 128)` value, transformed by
    `scaled_butterflies`."""

    def one(g, carry):
        base = pl.multiple_of(g * GROUP_ROWS, GROUP_ROWS)
        rows = [x_ref[pl.ds(base + j, 8, stride=BLOCK), :] for j in range(BLOCK)]
        for j, r in enumerate(scaled_butterflies(rows)):
            o_ref[pl.ds(base + j, 8, stride=BLOCK), :] = r
        return carry

    jax.lax.fori_loop(0, x_ref.shape[0] // GROUP_ROWS, one, 0)


def scaled_butterflies(rows: list[Array]) -> list[Array]:
    """`_hadamard._guarded`'s operations on the 16 rows of a group of chunks (`rows[j]`:
    row `j` of each chunk, any shape; the chunk columns are the elements): each column
    scaled into range by its largest `abs_bits` (`_hadamard.range_masks` and
    `scaled_into_range`: big ones, from 2^124 or non-finite, down by 2^-4; tiny ones,
    below 2^-100 or zero, up by 2^64), `butterflies`, the results of big columns near
    float32's maximum (`near_maximum`) taken from `accurate_butterflies` instead, and
    scaled back (`scaled_back`): `_hadamard`'s own steps, row by row."""
    masks = range_masks(functools.reduce(jnp.maximum, [abs_bits(r) for r in rows]))
    chunk = [scaled_into_range(r, masks) for r in rows]
    out = []
    for y, exact in zip(butterflies(chunk), accurate_butterflies(chunk), strict=True):
        out.append(scaled_back(jnp.where(near_maximum(y, masks), exact, y), masks))
    return out


def accurate_butterflies(rows: list[Array]) -> list[Array]:
    """`_hadamard._accurate_chunk`'s transform of the 16 rows of a group of chunks (as
    `butterflies`' `rows`; scaled into range already), everywhere: each butterfly stage's
    `a + b` and `a - b` (rows `j` and `j + h`, `h = 1, 2, 4, 8`) as unevaluated sums
    `hi + lo` by `_sum_of_sums`, in its order, then `hi` times the signs over 4."""
    hi, lo = list(rows), [jnp.zeros_like(r) for r in rows]
    half = 1
    while half < BLOCK:
        hi2, lo2 = list(hi), list(lo)
        for j in range(BLOCK):
            if not j & half:
                k = j + half
                hi2[j], lo2[j] = _sum_of_sums(hi[j], lo[j], hi[k], lo[k])
                hi2[k], lo2[k] = _sum_of_sums(hi[j], lo[j], -hi[k], -lo[k])
        hi, lo, half = hi2, lo2, 2 * half
    signs = np.asarray(RHT_SIGNS, np.float32) / 4
    return [h * s for h, s in zip(hi, signs, strict=True)]


def _check(x: Array, rows: int) -> None:
    """The `ValueError`s of `transform` and `transform_scaled` for what they do not take."""
    if rows % GROUP_ROWS or rows <= 0:
        raise ValueError(f"`rows` must be a positive multiple of {GROUP_ROWS}, got {rows}.")
    if x.dtype != jnp.float32 or not applies(x.shape):
        raise ValueError(
            f"the TPU Hadamard kernel takes float32 (rows, columns) arrays with rows a "
            f"multiple of {BLOCK} and at least {GROUP_ROWS}, and at least {LANES} columns; "
            f"got {x.dtype} {x.shape} (callers check `applies` first)."
        )


@functools.partial(jax.jit, static_argnames=("interpret", "rows"))
def transform(
    x: Float[Array, "n m"], *, interpret: bool | str = False, rows: int = ROWS
) -> Float[Array, "n m"]:
    """`H` times each chunk of 16 rows of the float32 `x` (`applies(x.shape)`): the bits of
    `_hadamard._plain(x.reshape(-1, 16, m)).reshape(n, m)`. `interpret`: `True` runs the
    kernel in Pallas's TPU interpreter (any backend: tests); `"plain"` in its generic
    interpreter, which also runs inside nvfp4x's primitives (their lowering has no token
    for the TPU interpreter's ordered callbacks). `rows`: a tile's rows at most (a
    multiple of `GROUP_ROWS`; `benchmarks/bench_accel.py` times a few on a TPU)."""
    _check(x, rows)
    call = functools.partial(_tiled, _kernel, "nvfp4x_rht_tpu", interpret=interpret, rows=rows)
    return each_problem(call, x)  # (vmapped: one array after another)


@functools.partial(jax.jit, static_argnames=("interpret", "rows"))
def transform_scaled(
    x: Float[Array, "n m"], *, interpret: bool | str = False, rows: int = ROWS
) -> Float[Array, "n m"]:
    """`_hadamard.rht_scaled(x)` bit for bit, for a float32 `x` that `applies(x.shape)`:
    `H` times each chunk of 16 rows, every chunk column scaled into range and back
    (`_guarded`: big, non-finite and tiny columns too, subnormal results included;
    the other columns as `transform` gives them). The kernel `scaled_butterflies` of
    each group of 8 chunks, its groups in a loop. `interpret` and `rows` as
    `transform`'s."""
    _check(x, rows)
    call = functools.partial(
        _tiled, _scaled_kernel, "nvfp4x_rht_scaled_tpu", interpret=interpret, rows=rows
    )
    return each_problem(call, x)  # (vmapped: one array after another)


def _tiled(kernel, name, x, *, interpret, rows):
    """The `pallas_call` of `kernel` (`name`) on one 2-D `x` in tiles of `rows x 128`,
    its arguments checked."""
    n, m = x.shape
    # An array shorter than a tile is padded to whole groups (zero chunks, cut off again);
    # a longer one is not copied: its last tile may overhang it (by whole chunks, as the
    # rows are whole chunks: their results are dropped; lanes: the columns are
    # independent).
    pad = -n % GROUP_ROWS if n < rows else 0
    xp = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
    rows = min(rows, n + pad)
    spec = pl.BlockSpec((rows, LANES), lambda i, j: (i, j))
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(xp.shape, jnp.float32),
        grid=(pl.cdiv(n + pad, rows), pl.cdiv(m, LANES)),
        in_specs=[spec],
        out_specs=spec,
        interpret=_INTERPRETERS[interpret],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        name=name,
    )(xp)
    return y[:n] if pad else y
