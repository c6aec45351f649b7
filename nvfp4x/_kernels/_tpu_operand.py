"""The NVFP4 GEMM operand of 16x1 blocks (16 rows of a column: wgrad's operands, blocked
along the tokens) as a Pallas kernel for TPUs (Mosaic), optionally after the random
Hadamard transform of the same 16 rows; also of 1x16 blocks and of 16x16 tiles (a
weight's), which `_tpu_quantize.OPERAND_KERNEL_BLOCKS` does not route here by default.

`_tpu_quantize`'s kernel holds chunks of `128 x 512` elements (64 vector registers per
value) and reduces each block of 16 rows with a sublane reduction: every step of its
element work is a pass over VMEM, and it ran at 3.5-4.6x the memory floor on a TPU v5e
(`benchmarks/results/tpu_v5e.md`; chunks of 128 columns, 16 registers, were no
faster). Here a tile is `rows x
128` (one lane tile wide: Mosaic's strided loads take only memrefs that wide) and is
worked on 128 rows (8 blocks) at a time: row `j` of each of the 8 blocks is one strided
load (sublane stride 16) into one `(8, 128)` vector register, so that

- a block's maximum is the elementwise maximum of 16 registers (no sublane reduction),
  and the per-block steps (`_tpu_quantize._block_steps`: the reference's block scale
  and its inverse) run once on one register for 8 x 128 blocks;
- the element steps run on 16 registers, and the E2M1 rounding is float32 arithmetic
  instead of seven comparisons (`_tpu_quantize._nearest`, shared with that kernel's
  block values): to the nearest (ties to even) by `(a + c) - c` with `c` the power of
  two whose unit in the last place is the E2M1 step at `a` (0.5 below 2, 1 below 4, 2
  above), saturated at 6; stochastically by `_exact.encode_stochastic`'s steps
  (`_tpu_quantize._stochastic`), its thresholds hashed from each element's index in
  the caller's array (`_tpu_quantize._uniform`); the magnitudes are
  `_tpu_quantize.magnitudes`' (the exact steps, with no branch);
- with `rht=True` the 16 registers first go through the 16-point transform's butterfly
  stages (`_tpu_rht.butterflies`: `_hadamard._plain`'s operations in its order, so its
  bits), so that the transformed operand is never written to memory.

The values (`e2m1 * scale_b`, exact in float32) are stored back the same strided way
into a float32 scratch, then converted to the bfloat16 output one group at a time; a
bfloat16 input is converted to a float32 scratch first (strided loads of packed
bfloat16 rows are not what Mosaic takes). The tensor amax comes from the caller (an XLA
reduction, or `rht_stats` here for the transformed operand).

Same bits as the reference (`_numerics._nvfp4`'s quantiser, and `_hadamard.rht` before
it with `rht=True`), tested in the TPU interpreter on the CPU (`tests/test_tpu_operand.py`)
and lowered for a TPU there; the same tests run the compiled kernel on a TPU.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float

from .._numerics._constants import BLOCK, TILE
from .._numerics._hadamard import special_columns
from .._numerics._ieee import INF_BITS, abs_bits, from_bits
from . import _tpu_quantize
from ._batching import each_problem, fusible
from ._tpu_quantize import (
    _block_steps,
    _lane_group_max,
    _nearest,
    _signed,
    _stochastic,
    _uniform,
    kernel_parameters,
    magnitudes,
    once_a_tile,
)
from ._tpu_rht import _INTERPRETERS, butterflies, scaled_butterflies

#: Lanes of a tile (Mosaic's strided loads need memrefs exactly this wide).
LANES = 128
#: Rows worked on at a time: 8 blocks of 16, one vector register per row of a block.
GROUP_ROWS = 8 * BLOCK
#: Rows of a tile at most (a multiple of `GROUP_ROWS`). 2048: on a TPU v5e (2026-12-06,
#: 8192x8192 float32 with the transform, `benchmarks/tpu_operand_check.py`) 1.73 ms
#: looped against 1.89 ms at 1024 rows, 2.01 at 512, 2.30 at 256.
ROWS = 2048
#: Whether the kernel's groups run in a loop by default (`_kernel`'s `looped`): on a TPU
#: v5e (same check) as fast as unrolled (1.730 against 1.745 ms at 2048 rows) and
#: compiled in 0.6 s against 4.2 s.
LOOPED = True
#: `(rows, looped)` by default for 1x16 blocks, whose groups transpose through a scratch:
#: on a TPU v5e (8192x8192 float32, nearest) 1.99 ms unrolled in 1024-row tiles, 2.87 ms
#: looped in 2048-row tiles (`benchmarks/tpu_operand_check.py`, 2026-12-06).
ACROSS_DEFAULTS = (1024, False)


def applies(shape: tuple[int, ...], dtype, block: tuple[int, int] = (BLOCK, 1)) -> bool:
    """Whether the kernel takes a `(rows, columns)` array in `block`s (16x1, 1x16 or
    16x16): each blocked axis a multiple of 16 (whole blocks), at least one lane tile of
    columns, float32 or bfloat16."""
    if len(shape) != 2 or tuple(block) not in ((BLOCK, 1), (1, BLOCK), TILE) or 0 in shape:
        return False
    whole = all(n % b == 0 for n, b in zip(shape, block, strict=True))
    dtypes = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    return whole and shape[1] >= LANES and jnp.dtype(dtype) in dtypes


def _check_rows(rows: int) -> None:
    if rows % GROUP_ROWS or rows <= 0:
        raise ValueError(f"`rows` must be a positive multiple of {GROUP_ROWS}, got {rows}.")


def _each_group(tr: int, looped: bool, one, carry):
    """`carry = one(base, carry)` for each group of a `tr`-row tile (`base` its first row):
    in a `fori_loop` with `looped` (one group's code, its row offset dynamic: less for
    Mosaic to compile), else unrolled (static offsets). The final `carry`."""
    if looped:
        body = lambda g, c: one(pl.multiple_of(g * GROUP_ROWS, GROUP_ROWS), c)  # noqa: E731
        return jax.lax.fori_loop(0, tr // GROUP_ROWS, body, carry)
    for base in range(0, tr, GROUP_ROWS):
        carry = one(base, carry)
    return carry


def _group(
    rows: list[Array],
    index,
    refs,
    *,
    rounding: str,
    cols: int,
    tile: bool = False,
    tiny: bool | None = None,
) -> list[Array]:
    """The values (float32) of the 8 x 128 blocks of one group: `rows[j]` element `j` of
    each block (`(8, 128)`), `index(j)` the caller's `(row, column)` of `rows[j]`'s
    elements (int32 arrays; stochastic rounding hashes them). With `tile`, each 16 lanes
    of a sublane are one 16x16 block (8 x 8 of them): the maxima of its 16 columns
    reduced across the lanes (`_tpu_quantize._lane_group_max`, on one register). `tiny`:
    whether the tensor is tiny, where the caller branched on it (`branch_once`)."""
    params_ref, seed_ref, table_ref = refs
    ab = [abs_bits(r) for r in rows]
    bmax = functools.reduce(jnp.maximum, ab)  # (NaN above inf)
    if tile:
        bmax = _lane_group_max(bmax)
    scale_b, _, inv, inv_sub = _block_steps(bmax, params_ref, table_ref, tiny)
    # (a NaN block's values are NaN whatever the magnitudes and signs: `x`'s sign)
    out = []
    mags = magnitudes(ab, inv, inv_sub, lambda a: a, plain=tiny is False)
    for j, (r, a) in enumerate(zip(rows, mags, strict=True)):
        if rounding == "nearest":
            mag = _nearest(a)
        else:
            row, col = index(j)
            mag = _stochastic(a, _uniform(seed_ref, row, col, cols))
        negative = jax.lax.bitcast_convert_type(r, jnp.int32) < 0
        out.append(_signed(mag, negative) * scale_b)  # exact
    return out


def _kernel(
    params_ref,
    seed_ref,
    table_ref,
    x_ref,
    o_ref,
    *scratch,
    across,
    rounding,
    rht,
    cols,
    looped,
    tile=False,
    branch_once=False,
):
    """One tile `rows x 128`, a group of 128 rows at a time (`_each_group`: unrolled, or
    with `looped`, the default `LOOPED`, in a loop; with `branch_once`, two loops, the
    tensor's tininess branched on once a tile, `_tpu_quantize.once_a_tile`: a group loop
    with no branch and the plain product `|x| * inv_b`, and a looped one for a tiny
    tensor). 16x1 blocks: row `j` of the group's
    8 blocks of each lane one strided load; 16x16 blocks (`tile`) the same, the blocks'
    maxima then reduced across each 16 lanes. 1x16 blocks (`across`): the group's
    `128 x 128` square transposed into a scratch first (the XLU's work), so that its
    blocks lie down the sublanes there, and the values transposed back."""
    tr = x_ref.shape[0]
    r_tile, c_tile = pl.program_id(0) * tr, pl.program_id(1) * LANES
    sublane = jax.lax.broadcasted_iota(jnp.int32, (8, LANES), 0)
    lane = jax.lax.broadcasted_iota(jnp.int32, (8, LANES), 1)
    refs = (params_ref, seed_ref, table_ref)
    src, dst = x_ref, scratch[0]
    if not across and x_ref.dtype != jnp.float32:  # (widened into a float32 scratch)
        src = scratch[1]
        src[...] = x_ref[...].astype(jnp.float32)

    def one(base, carry, tiny=None):
        group = pl.ds(base, GROUP_ROWS)
        if across:  # (rows of the square are the caller's columns, lanes its rows)
            square = scratch[1]
            square[...] = x_ref[group, :].astype(jnp.float32).T
            rows = [square[pl.ds(j, 8, stride=BLOCK), :] for j in range(BLOCK)]
            at = 0
        else:
            rows = [src[pl.ds(base + j, 8, stride=BLOCK), :] for j in range(BLOCK)]
            at = base

        def index(j):
            """The caller's `(row, column)` of `rows[j]`'s elements."""
            if across:
                return r_tile + base + lane, c_tile + sublane * BLOCK + j
            return r_tile + base + sublane * BLOCK + j, c_tile + lane

        if rht == "scaled":
            rows = scaled_butterflies(rows)
        elif rht:
            rows = butterflies(rows)
        values = _group(rows, index, refs, rounding=rounding, cols=cols, tile=tile, tiny=tiny)
        for j, v in enumerate(values):
            dst[pl.ds(at + j, 8, stride=BLOCK), :] = v
        out = dst[pl.ds(at, GROUP_ROWS), :]
        o_ref[group, :] = (out.T if across else out).astype(o_ref.dtype)
        return carry

    if branch_once:  # (a tiny tensor's groups looped: the least code)
        once_a_tile(
            params_ref,
            lambda tiny: _each_group(tr, tiny or looped, functools.partial(one, tiny=tiny), 0),
        )
    else:
        _each_group(tr, looped, one, 0)


@functools.partial(
    jax.jit,
    static_argnames=("block", "rounding", "rht", "interpret", "rows", "looped", "branch_once"),
)
def operand(
    x: Float[Array, "n m"],
    amax: Float[Array, ""] | None,
    seed: Array | None = None,
    *,
    block: tuple[int, int] = (BLOCK, 1),
    rounding: str = "nearest",
    rht: bool | str = False,
    interpret: bool | str = False,
    rows: int | None = None,
    looped: bool | None = None,
    parameters: tuple[Array, Array, Array, Array] | None = None,
    branch_once: bool | None = None,
) -> tuple[Array, Float[Array, ""]]:
    """The bfloat16 block values `e2m1 * scale_b` of `x` (`applies(x.shape, x.dtype,
    block)`) quantised in `block`s (16x1: 16 rows of a column; 1x16: 16 columns of a
    row; 16x16 tiles) with the tensor amax `amax` (the tensor's own, or of its transform with
    `rht=True`; `None`: `x`'s own), and `s_dec`: the results of `_tpu_quantize.tiled(x,
    amax, seed, block=block, output="values")`, bit for bit, after the product of
    `_hadamard.rht(x, axis=0)` with `rht=True` (16x1 blocks of a float32 `x` only; the
    caller checks that no chunk column needs `_hadamard`'s scaling: `rht_stats`), or
    with `rht="scaled"` after `_hadamard.rht_scaled(x)` (every chunk column scaled into
    range and back, `_tpu_rht.scaled_butterflies`: the path for columns that need it,
    `amax` then `rht_stats(x, scaled=True)`'s). `seed`: two uint32 words for
    `rounding="stochastic"`. `interpret` as `_tpu_rht.transform`'s; `rows`: a tile's
    rows at most (a multiple of `GROUP_ROWS`); `looped`: the kernel's groups in a loop
    rather than unrolled (`_kernel`); `None`: `ROWS` and `LOOPED` for 16x1 and 16x16
    blocks, `ACROSS_DEFAULTS` for 1x16. `parameters`: what the kernel reads from SMEM, made
    already (`_tpu_quantize.kernel_parameters_many`'s: a `cond` whose branches run this
    kernel in two ways makes them once), in place of `amax` (then `None`).
    `branch_once`: the tensor's tininess branched on once a tile (`_kernel`; `None`:
    `_tpu_quantize.BRANCH_ONCE`)."""
    across, tile = tuple(block) == (1, BLOCK), tuple(block) == TILE
    default_rows, default_looped = ACROSS_DEFAULTS if across else (ROWS, LOOPED)
    rows = default_rows if rows is None else rows
    looped = default_looped if looped is None else looped
    _check_rows(rows)
    if rht not in (False, True, "scaled"):
        raise ValueError(f"`rht` must be False, True or 'scaled', got {rht!r}.")
    # (`rht=True` takes float32 only: `_kernels.rht_operand` widens a bfloat16 operand
    # first, `_hadamard.padded_rows`. Read as it is by the kernels instead, on a TPU v5e
    # (2026-12-07), the mixed-bf16 training step gained 1.25 ms of 40 but its temporaries
    # rose from 718 to 1,358 MiB.)
    column_blocks = tuple(block) == (BLOCK, 1)
    if not applies(x.shape, x.dtype, block) or (
        rht and (x.dtype != jnp.float32 or not column_blocks)
    ):
        raise ValueError(
            f"the TPU operand kernel takes float32 or bfloat16 (rows, columns) arrays in "
            f"16x1 blocks (rows a multiple of {BLOCK}), 1x16 blocks (columns a multiple "
            f"of {BLOCK}) or 16x16 blocks (both), with at least {LANES} columns (16x1 "
            f"blocks of float32 with `rht=True`); got {x.dtype} {x.shape} in {block} "
            f"blocks (callers check `applies` first)."
        )
    if rounding not in ("nearest", "stochastic") or (rounding == "stochastic") != (
        seed is not None
    ):
        raise ValueError(f"`rounding={rounding!r}` with a seed exactly when stochastic.")
    if parameters is not None and amax is not None:
        raise ValueError("`operand` takes `amax` or `parameters`, not both.")
    kw = dict(across=across, tile=tile, rounding=rounding, rht=rht, rows=rows, looped=looped)
    branch_once = _tpu_quantize.BRANCH_ONCE if branch_once is None else branch_once
    call = functools.partial(
        _operand, block=tuple(block), interpret=interpret, branch_once=branch_once, **kw
    )
    # vmapped (grouped or stacked problems): one array after another, as the quantiser
    if parameters is None:
        return each_problem(call, x, amax, seed)
    return each_problem(lambda x, *p: call(x, None, None, parameters=p), x, *parameters)


def _operand(
    x,
    amax,
    seed,
    *,
    block,
    across,
    tile,
    rounding,
    rht,
    interpret,
    rows,
    looped,
    branch_once=False,
    parameters=None,
):
    """`operand` of one 2-D `x`, its arguments checked."""
    n, m = x.shape
    if parameters is None:
        parameters = kernel_parameters(x, amax, seed, block, "values", interpret)
    s_dec, params, seeds, table = parameters
    # An array shorter than a tile is padded to whole groups (zero blocks, cut off
    # again); a longer one is not copied: its last tile may overhang it by whole blocks
    # or by rows and lanes of blocks that are all beyond it, whose results are dropped.
    pad = -n % GROUP_ROWS if n < rows else 0
    xp = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
    tr = min(rows, n + pad)
    spec = pl.BlockSpec((tr, LANES), lambda i, j: (i, j))
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    if across:
        scratch = [pltpu.VMEM((GROUP_ROWS, LANES), jnp.float32)] * 2
    else:
        scratch = [pltpu.VMEM((tr, LANES), jnp.float32)]
        if x.dtype != jnp.float32:
            scratch.append(pltpu.VMEM((tr, LANES), jnp.float32))
    kw = dict(across=across, tile=tile, rounding=rounding, rht=rht, cols=m, looped=looped)
    kernel = functools.partial(_kernel, branch_once=branch_once, **kw)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(xp.shape, jnp.bfloat16),
        grid=(pl.cdiv(n + pad, tr), pl.cdiv(m, LANES)),
        in_specs=[smem, smem, smem, spec],
        out_specs=spec,
        scratch_shapes=scratch,
        interpret=_INTERPRETERS[interpret],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"),
            allow_input_fusion=fusible(False, False, False, True),
        ),
        name="nvfp4x_operand_scaled_tpu" if rht == "scaled" else "nvfp4x_operand_tpu",
    )(params, seeds, table, xp)
    return (y[:n] if pad else y), s_dec


def _stats_kernel(x_ref, o_ref, *, n, m, looped, scaled=False):
    """One tile `rows x 128` of `rht_stats`: `o_ref` `(2, 8, 128)` int32, the largest
    `_hadamard.special_columns` flag of the tile's chunk columns and the largest
    absolute-value bits of their transform (rows and lanes beyond the array, which an
    overhanging tile holds as garbage, masked); its groups by `_each_group`. With
    `scaled`, of the scaled transform (`_tpu_rht.scaled_butterflies`), NaN results
    taken as zero (`amax_of_bits`'s rule: they may occur there)."""
    tr = x_ref.shape[0]
    r_tile = pl.program_id(0) * tr
    col = pl.program_id(1) * LANES + jax.lax.broadcasted_iota(jnp.int32, (8, LANES), 1)
    sub_row = jax.lax.broadcasted_iota(jnp.int32, (8, LANES), 0) * BLOCK

    def one(base, carry):
        flag, top = carry
        rows = [x_ref[pl.ds(base + j, 8, stride=BLOCK), :] for j in range(BLOCK)]
        inside = (r_tile + base + sub_row < n) & (col < m)
        xmax = _max_abs_bits(rows)
        flag = jnp.maximum(flag, (inside & special_columns(xmax)).astype(jnp.int32))
        if scaled:
            bits = [abs_bits(r) for r in scaled_butterflies(rows)]
            most = functools.reduce(jnp.maximum, [jnp.where(b > INF_BITS, 0, b) for b in bits])
        else:
            most = _max_abs_bits(butterflies(rows))
        top = jnp.maximum(top, jnp.where(inside, most, 0))
        return flag, top

    o_ref[0], o_ref[1] = _each_group(tr, looped, one, (jnp.zeros((8, LANES), jnp.int32),) * 2)


def _max_abs_bits(rows: list[Array]) -> Array:
    """The largest absolute-value bits (int32) of the rows, element by element."""
    return functools.reduce(jnp.maximum, [abs_bits(r) for r in rows])


@functools.partial(jax.jit, static_argnames=("interpret", "rows", "looped", "scaled"))
def rht_stats(
    x: Float[Array, "n m"],
    *,
    interpret: bool | str = False,
    rows: int = ROWS,
    looped: bool = LOOPED,
    scaled: bool = False,
) -> tuple[Array, Float[Array, ""]]:
    """`(special, amax)` of the float32 `x` (`applies(x.shape, x.dtype)`) in one read:
    whether any chunk column of 16 rows needs `_hadamard.rht`'s scaled path
    (`_hadamard.special_columns`: big, non-finite, or tiny but nonzero), and the tensor
    amax of `_hadamard.rht(x, axis=0)` (`amax_of_bits` of it), valid where `special` is
    false (then every result is finite and the transform is `_plain`'s, whose bits the
    kernel computes). `operand(x, amax, ..., rht=True)` then quantises it. With
    `scaled`, the amax is `amax_of_bits(_hadamard.rht_scaled(x))`'s (any columns, NaN
    results ignored), for `operand(..., rht="scaled")`. `rows` and `looped` as
    `operand`'s."""
    _check_rows(rows)
    if x.dtype != jnp.float32 or not applies(x.shape, x.dtype):
        raise ValueError(
            f"`rht_stats` takes float32 (rows, columns) arrays with rows a multiple of "
            f"{BLOCK} and at least {LANES} columns; got {x.dtype} {x.shape}."
        )
    kw = dict(interpret=interpret, rows=rows, looped=looped, scaled=scaled)
    call = functools.partial(_rht_stats, **kw)
    return each_problem(call, x)  # (vmapped: one array after another)


def _rht_stats(x, *, interpret, rows, looped, scaled):
    """`rht_stats` of one 2-D `x`, its arguments checked."""
    n, m = x.shape
    tr = min(rows, -(-n // GROUP_ROWS) * GROUP_ROWS)
    kernel = functools.partial(_stats_kernel, n=n, m=m, looped=looped, scaled=scaled)
    name = "nvfp4x_rht_scaled_stats_tpu" if scaled else "nvfp4x_rht_stats_tpu"
    stats = stats_call(kernel, x, (tr, LANES), interpret, name)
    return jnp.max(stats[0]) > 0, from_bits(jnp.max(stats[1]))


def stats_call(kernel, x: Array, tile: tuple[int, int], interpret, name: str) -> Array:
    """The `pallas_call` of a statistics kernel over `x` in `tile`s: each tile writes two
    `(8, tile width)` int32 results (`rht_stats`' flag and amax bits), gathered as `(2,
    8 * row tiles, width of the tiles)` (also `benchmarks/tpu_read_check.py`'s variants)."""
    n, m = x.shape
    tr, tw = tile
    grid = (pl.cdiv(n, tr), pl.cdiv(m, tw))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((2, grid[0] * 8, grid[1] * tw), jnp.int32),
        grid=grid,
        in_specs=[pl.BlockSpec((tr, tw), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((2, 8, tw), lambda i, j: (0, i, j)),
        interpret=_INTERPRETERS[interpret],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), allow_input_fusion=fusible(True)
        ),
        name=name,
    )(x)
