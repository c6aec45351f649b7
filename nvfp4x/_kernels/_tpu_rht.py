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

Only the product: the caller (`_hadamard.rht`) keeps its checks for big, tiny and
non-finite chunk columns and its scaled path for them (`_guarded`, in XLA), and uses this
where no column needs them. Tested bit for bit against `_plain` in the TPU interpreter
(`pltpu.InterpretParams()`) on the CPU, and lowered for a TPU there
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
    if rows % GROUP_ROWS or rows <= 0:
        raise ValueError(f"`rows` must be a positive multiple of {GROUP_ROWS}, got {rows}.")
    if x.dtype != jnp.float32 or not applies(x.shape):
        raise ValueError(
            f"the TPU Hadamard kernel takes float32 (rows, columns) arrays with rows a "
            f"multiple of {BLOCK} and at least {GROUP_ROWS}, and at least {LANES} columns; "
            f"got {x.dtype} {x.shape} (callers check `applies` first)."
        )
    call = functools.partial(_transform, interpret=interpret, rows=rows)
    return each_problem(call, x)  # (vmapped: one array after another)


def _transform(x, *, interpret, rows):
    """`transform` of one 2-D `x`, its arguments checked."""
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
        _kernel,
        out_shape=jax.ShapeDtypeStruct(xp.shape, jnp.float32),
        grid=(pl.cdiv(n + pad, rows), pl.cdiv(m, LANES)),
        in_specs=[spec],
        out_specs=spec,
        interpret=_INTERPRETERS[interpret],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        name="nvfp4x_rht_tpu",
    )(xp)
    return y[:n] if pad else y
