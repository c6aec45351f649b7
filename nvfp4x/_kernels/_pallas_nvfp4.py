"""The NVFP4 quantiser (1x16 blocks along the last axis) as one Pallas kernel for GPUs.

Two passes over the input, the memory floor of a quantiser whose tensor scale depends
on the whole tensor: the tensor amax (an XLA reduction over the bits of `|x|`, ignoring
NaN: `_numerics._nvfp4.amax_of_bits`), then one kernel that reads each tile of `x` once
and writes, per tile, only what its caller asks for, with no intermediate array in
memory: the packed codes (two per byte, element `2i` in the low nibble) and the E4M3
block scales (as their bits) for `to_nvfp4`; the block-scaled values `e2m1 * scale_b` in
bfloat16 (exact there) alone for the GEMM operand path; the dequantised values in the
input's dtype alone for `fake_quantize`.

Tile shapes and Triton's `num_warps`/`num_stages` are a `Tiling`, looked up per block
layout and input dtype in one table, `TILINGS` (`benchmarks/bench_gpu.py --only
kernel_sweep` times the candidates on a GPU and prints the best).

Same bits as the reference (`nvfp4x._numerics._nvfp4`): the per-block and per-element
steps are the reference's, through `nvfp4x._numerics._ieee` where they lower on every
backend and through `_exact` where the reference uses an operation Triton lacks (see
there). A block scale's inverse is not computed per block: it is looked up in a table
of the reference's inverses of all 128 E4M3 scales (`_exact.inverse_table`, made in
XLA once per call), which takes the long division out of the kernel. Runs on the CPU with
`interpret=True`, which the tests use.

What the interpreter does not show, and the kernel must not rely on (both seen on an
H200, jax 0.11, where the interpreter was bit for bit the reference):

- Pallas Triton reads and writes a tile (`ref[...]`) at the flat offsets
  `row * stride + col` with no bounds check. A tile that overhangs the array's last
  column reads the next row's first elements and writes over them (another program's,
  or its own, results); one that overhangs the last row reads and writes past the
  buffer's end (other arrays). The interpreter pads instead, and drops what lands
  outside. So a tile that overhangs is read and written with explicit masks (`_load`,
  `_store`; the fill read outside is 0, and whole blocks are outside or inside, so it
  never meets a block of the array); tiles that fit are read and written plainly.
- Triton lowers `-x` as `0 - x`, which turns `-0.0` into `+0.0`: signs are set on the
  bits (`_exact.decode`), never by negation.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float

from .._numerics._constants import BLOCK, GOLDEN_RATIO_32, ROW_BLOCK, TILE
from .._numerics._e2m1 import _fmix32
from .._numerics._ieee import abs_bits, from_bits, mul_normal
from .._numerics._nvfp4 import Block, Rounding
from . import _exact
from ._exact import E4M3_CODES as _E4M3_CODES

#: The block layouts the kernel takes and what a call writes (`_exact`'s).
BLOCKS_2D, OUTPUTS = _exact.BLOCKS_2D, _exact.OUTPUTS
#: Slots of the float32 parameter vector (a power of two).
_NPARAMS = 8


class Tiling(NamedTuple):
    """How the kernel tiles an array: a tile has at most `cols` columns and `elements`
    elements (powers of two, as Triton's blocks are; at least one block: the rows are
    raised to 16 for 16x16 and 16x1 blocks), and its program runs on `num_warps` warps,
    `num_stages` pipeline stages (Triton)."""

    cols: int = 256
    elements: int = 4096
    num_warps: int = 4
    num_stages: int = 1


#: The tiling of each case, by `(block, input dtype name)` (others: `Tiling()`): the one
#: table to edit after a sweep on a GPU (`benchmarks/bench_gpu.py --only kernel_sweep`).
TILINGS: dict[tuple[Block, str], Tiling] = {
    (ROW_BLOCK, "float32"): Tiling(),
    (ROW_BLOCK, "bfloat16"): Tiling(),
    (TILE, "float32"): Tiling(),
    (TILE, "bfloat16"): Tiling(),
    ((BLOCK, 1), "float32"): Tiling(),
    ((BLOCK, 1), "bfloat16"): Tiling(),
}

#: The tilings a sweep on a GPU tries (`benchmarks/bench_gpu.py --only kernel_sweep`; each
#: lowers for CUDA in `tests/test_kernels.py`): today's default first, smaller tiles
#: (fewer registers per thread), more warps.
CANDIDATES: tuple[Tiling, ...] = (
    Tiling(),
    Tiling(128, 2048, 4),
    Tiling(128, 1024, 4),
    Tiling(256, 2048, 8),
    Tiling(64, 1024, 2),
    Tiling(512, 4096, 8),
)


def tiling_for(block: Block, dtype) -> Tiling:
    """The `TILINGS` entry for `block` and an input of `dtype`."""
    return TILINGS.get((block, jnp.dtype(dtype).name), Tiling())


def _tile(rows: int, cols: int, block: Block, tiling: Tiling) -> tuple[int, int]:
    """Tile shape, at most `tiling.cols` columns and `tiling.elements` elements: powers
    of two (as Triton's blocks are), whole blocks."""
    tc = max(2 * BLOCK, min(tiling.cols, pl.next_power_of_2(cols)))
    tr = max(block[0], min(tiling.elements // tc, pl.next_power_of_2(rows)))
    return tr, tc


def _views(tr: int, cols: int, block: Block):
    """`(view, block_max, per_element)` of a `(tr, cols)` tile in blocks `block`: the
    shape that puts each block on its own axes, the max over them (to the block grid),
    and the broadcast of a block-grid array back against the view. No axis of size 1
    (16x1 blocks are `(tr / 16, 16, cols)`, 1x16 `(tr, cols / 16, 16)`)."""
    if block == ROW_BLOCK:
        return (tr, cols // BLOCK, BLOCK), lambda b: jnp.max(b, axis=2), lambda g: g[:, :, None]
    if block == TILE:  # (one reduction over both axes: Pallas puts a layout change
        # between its two Triton reductions, which JAX says their correctness needs)
        view = (tr // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        return view, lambda b: jnp.max(b, axis=(1, 3)), lambda g: g[:, None, :, None]
    return (tr // BLOCK, BLOCK, cols), lambda b: jnp.max(b, axis=1), lambda g: g[:, None, :]


def _inside(tile: tuple[int, int], shape: tuple[int, int]) -> Array | None:
    """Which elements of this program's `tile` of an array of `shape` lie in the array,
    or `None` where the tiles fit the array exactly (no mask needed)."""
    (tr, tc), (rows, cols) = tile, shape
    if rows % tr == 0 and cols % tc == 0:
        return None
    row = pl.program_id(0) * tr + jax.lax.broadcasted_iota(jnp.int32, tile, 0)
    col = pl.program_id(1) * tc + jax.lax.broadcasted_iota(jnp.int32, tile, 1)
    return (row < rows) & (col < cols)


def _load(ref, shape: tuple[int, int]) -> Array:
    """This program's tile of the array `ref` (of `shape`), 0 where the tile overhangs
    it (never read there: Triton would read the next row, or past the buffer)."""
    mask = _inside(ref.shape, shape)
    if mask is None:
        return ref[...]
    return pltriton.load(ref, mask=mask, other=jnp.zeros(ref.shape, ref.dtype))


def _store(ref, value: Array, shape: tuple[int, int]) -> None:
    """Write this program's tile of the array `ref` (of `shape`), nothing where the
    tile overhangs it (Triton would write over the next row, or past the buffer)."""
    value = value.astype(ref.dtype)
    mask = _inside(ref.shape, shape)
    if mask is None:
        ref[...] = value
    else:
        pltriton.store(ref, value, mask=mask)


def _kernel(
    params_ref,
    seed_ref,
    inv_ref,
    x_ref,
    *out_refs,
    block: Block,
    rounding: Rounding,
    output: str,
    rows: int,
    cols: int,
):
    """One tile of the `(rows, cols)` array: block maxima, block scales and their
    inverses (looked up in `inv_ref`, see `_exact.inverse_table`), codes, and the one output
    asked for (`OUTPUTS`)."""
    tr, tc = x_ref.shape
    br, bc = block
    view, block_max, per_element = _views(tr, tc, block)
    x = _load(x_ref, (rows, cols)).astype(jnp.float32)
    c, c_sub, s_dec, tiny = (params_ref[i] for i in range(4))
    # Block maxima over the bits of |x| (NaN above inf, subnormals exact).
    bamax = from_bits(block_max(abs_bits(x).reshape(view)))
    # The reference's `_block_scales_exact`, block by block.
    scale_b, scale_bits = _exact.block_scale(bamax, c, c_sub)  # bits 0..126, 127 NaN
    inv_b, inv_sub = inv_ref[scale_bits], inv_ref[scale_bits + _E4M3_CODES]
    v = mul_normal(x.reshape(view), per_element(inv_b), per_element(inv_sub))
    if rounding == "nearest":
        codes = _exact.encode_nearest(v)
    else:
        codes = _stochastic_codes(v, seed_ref, tr, tc, cols)
    if output == "codes":
        codes_ref, scales_ref = out_refs
        _store(scales_ref, scale_bits, (rows // br, cols // bc))
        lo, hi = jax.lax.unstack(codes.reshape(tr, tc // 2, 2), axis=2)
        _store(codes_ref, lo | (hi << 4), (rows, cols // 2))
    else:
        q = _exact.decode(codes) * per_element(scale_b)  # exact
        if output == "dequantized":
            q = _exact.mul_exact(q, s_dec, tiny != 0.0)
        _store(out_refs[0], q.reshape(tr, tc), (rows, cols))


def _stochastic_codes(v, seed_ref, tr: int, tc: int, cols: int):
    """The codes of `_e2m1.encode(_e2m1.round_stochastic(v, _e2m1.uniform(key, shape)))`
    (`seed_ref` holds `jax.random.bits(key, (2,), uint32)`): the thresholds hash each
    element's flat index in the padded array, as `uniform` does, so the bits do not
    depend on the tiling."""
    shape = (tr, tc)
    row = pl.program_id(0) * tr + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    col = pl.program_id(1) * tc + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    index = row.astype(jnp.uint32) * jnp.uint32(cols) + col.astype(jnp.uint32)
    h = _fmix32(index * jnp.uint32(GOLDEN_RATIO_32) + seed_ref[0])
    h = _fmix32(h ^ seed_ref[1])
    u = ((h >> 16).astype(jnp.float32) + 0.5) * (1.0 / 65536.0)
    return _exact.encode_stochastic(v, u.reshape(v.shape))


def quantize_2d(
    x: Float[Array, "rows cols"],
    amax: Float[Array, ""] | None = None,
    seed: Array | None = None,
    *,
    block: Block = ROW_BLOCK,
    rounding: Rounding = "nearest",
    output: str = "codes",
    interpret: bool = False,
    tiling: Tiling | None = None,
) -> tuple[Array, Array | None, Float[Array, ""]]:
    """Quantise a 2-D array whose blocked axes are multiples of 16 (padded), in blocks
    `(1, 16)`, `(16, 16)` or `(16, 1)` (16 rows of one column: an operand quantised
    along its leading axis, wgrad's tokens).

    **Arguments:** `amax` the tensor amax (default: `max(|x|)` ignoring NaN); `seed`
    `jax.random.bits(key, (2,), uint32)` for stochastic rounding; `output` what to write
    (`OUTPUTS`); `tiling` the tile shape and Triton parameters (default:
    `tiling_for(block, x.dtype)`).

    **Returns:** `(out, scale_bits, s_dec)`, the tensor decode scale `s_dec` last. With
    `output="codes"`: `out` the packed codes `(rows, cols / 2)` (pairs along the rows),
    `scale_bits` the E4M3 block scales' bit patterns on the block grid
    `(rows / br, cols / bc)`. With `"values"`: `out` the bfloat16 block-scaled values
    `e2m1 * scale_b`; with `"dequantized"`, the dequantised values
    `(e2m1 * scale_b) * s_dec` in `x`'s dtype, as `fake_quantize` gives them; then
    `scale_bits` is `None` (not written).
    """
    tiling = tiling or tiling_for(block, x.dtype)  # (looked up here: `_quantize_2d` caches)
    return _quantize_2d(
        x,
        amax,
        seed,
        block=block,
        rounding=rounding,
        output=output,
        interpret=interpret,
        tiling=tiling,
    )


@functools.partial(jax.jit, static_argnames=("block", "rounding", "output", "interpret", "tiling"))
def _quantize_2d(x, amax, seed, *, block, rounding, output, interpret, tiling: Tiling):
    """`quantize_2d` with its tiling given (jitted: one trace per case)."""
    rows, cols = x.shape
    br, bc = block
    s_dec, head, inverses = _exact.tensor_parameters(x, amax, block, output)
    params = jnp.zeros((_NPARAMS,), jnp.float32).at[:4].set(head)
    if seed is None:
        seed = jnp.zeros((2,), jnp.uint32)
    seeds = jnp.zeros((_NPARAMS,), jnp.uint32).at[:2].set(seed)
    tr, tc = _tile(rows, cols, block, tiling)
    grid = (pl.cdiv(rows, tr), pl.cdiv(cols, tc))
    whole = pl.BlockSpec((_NPARAMS,), lambda i, j: (0,))
    if output == "codes":
        out_shape = [
            jax.ShapeDtypeStruct((rows, cols // 2), jnp.uint8),
            jax.ShapeDtypeStruct((rows // br, cols // bc), jnp.uint8),
        ]
        out_specs = [
            pl.BlockSpec((tr, tc // 2), lambda i, j: (i, j)),
            pl.BlockSpec((tr // br, tc // bc), lambda i, j: (i, j)),
        ]
    else:
        dtype = x.dtype if output == "dequantized" else jnp.bfloat16
        out_shape = [jax.ShapeDtypeStruct((rows, cols), dtype)]
        out_specs = [pl.BlockSpec((tr, tc), lambda i, j: (i, j))]
    kernel = functools.partial(
        _kernel, block=block, rounding=rounding, output=output, rows=rows, cols=cols
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[
            whole,
            whole,
            pl.BlockSpec((2 * _E4M3_CODES,), lambda i, j: (0,)),
            pl.BlockSpec((tr, tc), lambda i, j: (i, j)),
        ],
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages
        ),
        name="nvfp4_quantize_2d",
    )(params, seeds, inverses, x)
    return outs[0], outs[1] if output == "codes" else None, s_dec
