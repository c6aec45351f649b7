"""The NVFP4 quantiser (1x16, 16x16 and 16x1 blocks) as one Pallas kernel for TPUs (Mosaic).

The same two passes as the GPU kernel (`_pallas_nvfp4`): the tensor amax, an XLA
reduction over the bits of `|x|` (skipped where the caller gives `amax`), then one
kernel that reads each tile of `x` into VMEM once and writes only what its caller asks
for: the packed codes (two per byte, element `2i` in the low nibble) and the E4M3 block
scales' bits (`to_nvfp4`); the bfloat16 block values `e2m1 * scale_b` (the GEMM
operand); or the dequantised values in the input's dtype (`fake_quantize`).

How it fits a TPU's (8, 128) vector tiles, with no 16-wide trailing axis anywhere:

- A tile of `Tiling.rows x Tiling.cols` is DMA'd into VMEM by the grid's pipeline and
  worked on in chunks of `128 x Tiling.chunk` (a `fori_loop` down the rows, the chunks
  along the columns unrolled, or with `Tiling.looped` in the loop too), so that the
  element steps' temporaries stay small. The tiles of `TILINGS` are one chunk wide:
  Mosaic compiles one chunk's code (its compile grew with the chunks unrolled).
- Blocks lie along the sublanes: 16 consecutive rows of a chunk reduce with a sublane
  reduction (`(n/16, 16, m)`, max over the 16). 16x1 blocks are already so; a 1x16
  chunk is transposed first (the XLU's work), so its blocks of 16 columns become 16
  rows; a 16x16 tile reduces its 16 rows, then its 16 lanes by a butterfly of
  `pltpu.roll`s within lane groups of 16 (on the reduced array: 1/16 of the elements).
- Every per-block step runs once per block on the reduced array (`_block_steps`): the
  reference's block scale and E4M3 bits (`_exact.block_scale`), and the inverse
  `inv_b = min(1 / (scale_b * s_dec), FLT_MAX)` without a division: where the tensor
  scale is not tiny (`s_dec >= 2^-64`), every product and quotient is normal, so
  `inv_b` is the reference's inverse of `scale_b`'s significand (one of 8, made once
  per tensor by `prologue`, a kernel of the reference's own arithmetic,
  `_exact.inverse_entries`) shifted by its exponent;
  for a tiny tensor the kernel takes another branch that selects among all 128
  entries of that table. The results are broadcast back down the sublanes.
- Per element: the scaled magnitude (`mul_normal`'s two products, so a subnormal `x`
  is read exactly although the TPU flushes subnormals in arithmetic), the E2M1 code
  by the seven midpoint comparisons (`_e2m1.encode_nearest`'s) or stochastically
  (`_exact.encode_stochastic`, thresholds hashed from each element's flat index in
  the caller's array, as `_e2m1.uniform` does), the sign from `x`'s bits. The block
  values (the GEMM operand, `fake_quantize`) skip the codes (`Tiling.arithmetic`, the
  default): the E2M1 value itself by float arithmetic (`_nearest`: `(a + c) - c`
  with `ulp(c)` the E2M1 step at `a`; `_stochastic`), times the block scale (0.89x
  the comparisons' time for 1x16 blocks on a TPU v5e, and the training step 1.64x
  mixed bf16 against 1.70x), the magnitudes `magnitudes`' exact steps with no branch,
  or, with `Tiling.branch_once`, the plain product `|x| * inv_b` in a chunk loop for
  tensors that are not tiny, taken once a tile (`magnitudes` says why no subnormal can
  count then).
- Two codes per byte along a row: each 256 codes of a row (or, transposed, of a
  column) are packed into 128 bytes by a matmul with a constant 0/1/16 matrix on the
  MXU (`_pairs`): codes and bytes are integers below 256, exact in bfloat16 with
  float32 accumulation; a 1x16 chunk's bytes are transposed back.

The scales are written in the layout the kernel holds them in, and one small XLA op
puts them in the format's layout: a 1x16 array's scales are written transposed
(`(cols / 16, rows)`, then `.T`), a 16x16 array's once per column (`(rows / 16,
cols)`, then every 16th column); both move 1/16 of a byte per element, about 1 bit per
element on top of the 4.5 the format writes. Arrays with fewer rows or columns than a
tile, or columns not a multiple of 256 below a tile's width, are padded to the
kernel's granules first (an XLA copy; the tiles of larger arrays may overhang them,
which the pipeline masks).

Same bits as the reference (`nvfp4x._numerics._nvfp4`), tested in interpret mode on the
CPU (`pltpu.InterpretParams()`, which simulates the TPU's semantics); the same tests run
the compiled kernel on a TPU. Tile shapes are one table, `TILINGS`;
`benchmarks/tpu_quantize_check.py` times `CANDIDATES` on a TPU and prints the best.

`quantize_with_stats` (1x16 blocks) also gives, from the same read, the random Hadamard
transform's statistics of the rows that wgrad needs (`_tpu_operand.rht_stats`' results):
one pass over an activation instead of two, once its GEMM carries them to wgrad (not yet:
the GEMMs call `rht_stats`). On a TPU v5e (2026-12-07, `benchmarks/tpu_read_check.py`,
8192x8192 float32) it took 2.24 ms against 2.41 ms for the quantiser then `rht_stats`
(the quantiser alone 1.95 ms), the same bits: ~0.8 ms a 2-block training step to gain.
"""

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float

from .._numerics._constants import BLOCK, FLT_MAX, GOLDEN_RATIO_32, ROW_BLOCK, TILE
from .._numerics._e2m1 import _fmix32
from .._numerics._hadamard import special_columns
from .._numerics._ieee import (
    INF_BITS,
    MIN_NORMAL_BITS,
    abs_bits,
    from_bits,
    ldexp_normal,
    scale_down_149,
)
from .._numerics._nvfp4 import Block, Rounding, tensor_scale_values
from . import _exact
from ._batching import ONE_PASS as _ONE_PASS, each_problem, fusible
from ._tpu_rht import _INTERPRETERS

#: The block layouts the kernel takes and what a call writes (`_exact`'s).
BLOCKS_2D, OUTPUTS = _exact.BLOCKS_2D, _exact.OUTPUTS
#: Rows of a chunk: the lanes of a transposed 1x16 chunk, 8 sublanes of block maxima.
CHUNK_ROWS = 128
#: Lanes of a vector register.
LANES = 128
#: Codes packed per matmul (into half as many bytes: one MXU tile wide).
PAIR_GROUP = 256
#: Slots of the float32 parameter vector: `c, c_sub, s_dec, tiny`, then the inverses
#: of the 8 E4M3 significands `1 + k/8` (see `_block_steps`).
_NPARAMS = 16
#: The table slot of the E4M3 scale `1.0` (exponent field 7, mantissa 0).
_ONE = 7 << 3


class Tiling(NamedTuple):
    """How the kernel tiles an array: tiles of `rows x cols` (the pipeline's blocks in
    VMEM), worked on in chunks of `CHUNK_ROWS x chunk` (`chunk` a multiple of 256, or
    of 128 where the output is not the packed codes, which pack 256 at a time).
    `rows` a multiple of 512 and `cols` of 512 (the int8 scale blocks' tiles), `cols`
    a multiple of `chunk`; an array smaller than a tile gets one tile of its size.
    `looped`: every chunk of a tile in one loop (its column offset dynamic: one
    chunk's code for Mosaic to compile) instead of the chunks along a row unrolled.
    `arithmetic`: the block values (`output="values"` or `"dequantized"`) rounded by
    float arithmetic (`_nearest`, `_stochastic`: the E2M1 value itself, as
    `_tpu_operand`'s kernel does) instead of codes by comparisons, then decoded; the
    same bits (the codes output takes the comparisons either way). On a TPU v5e
    (2026-12-07, 8192x8192, `benchmarks/tpu_quantize_check.py --values-sweep`) the
    arithmetic took 0.89x the comparisons' time for 1x16 blocks (float32 and bfloat16,
    both roundings) and 0.95x for 16x16 (2048x8192).
    `branch_once` (with `arithmetic`, for the block values): the tensor's tininess
    (`s_dec < 2^-64`) branched on once a tile, not in each chunk (`_block_steps`' and, in
    a tiny tensor, `magnitudes`' exact steps): the usual chunk loop with no branch and
    the plain product `|x| * inv_b`, and a second loop for a tiny tensor in chunks of
    128 columns (more code for Mosaic to compile). On a TPU v5e (2026-12-08,
    `benchmarks/tpu_lane_check.py --tiled`, 8192x8192 float32) a chunk loop without
    the branches took 0.85-0.91x the time in two runs (1x16 to the nearest and SR,
    16x16). The cost is code: each loop holds its own copy of the element steps, and the
    2-block training step's lowering for a TPU took 4.5 s against 2.8 s on a 2-core
    CPU with it on in both kernels (11.4 against 7.1 s under `tpu_compile_check.py
    --only lowering`'s profiler, `NVFP4X_TPU_BRANCH_ONCE=1`); not yet
    timed in the training step nor compiled as this loop pair.
    `unroll`: the chunk loop's iterations unrolled by that many (Mosaic schedules two
    chunks together): on the same run, 0.91x the time for 1x16 blocks (both roundings)
    and 1.11x for 16x16."""

    rows: int = 512
    cols: int = 1024
    chunk: int = 256
    looped: bool = False
    arithmetic: bool = True
    branch_once: bool = False
    unroll: int = 1


#: Whether both TPU quantisers branch on the tensor's tininess once a tile (`once_a_tile`:
#: `tiling_for`'s tilings with `Tiling.branch_once`, and `_tpu_operand.operand`'s default)
#: rather than in each chunk: off until the chip has compiled and timed it in the training
#: step; the environment variable `NVFP4X_TPU_BRANCH_ONCE=1` turns it on from the start
#: (to run the tests with it there). Read when a kernel is traced (clear JAX's caches
#: after changing it).
BRANCH_ONCE = os.environ.get("NVFP4X_TPU_BRANCH_ONCE", "0") == "1"

#: The tiling of each case, by `(block, input dtype name)` (others: `Tiling()`): the one
#: table to edit after a sweep on a TPU (`benchmarks/tpu_quantize_check.py --sweep`).
TILINGS: dict[tuple[Block, str], Tiling] = {
    # Tiles one chunk wide (2048 x 512, chunks of 128 x 512: no chunks unrolled along a
    # row): on a TPU v5e (2026-12-07, 4096x8192, `benchmarks/tpu_compile_check.py --only
    # tilings`) each kernel compiled in 0.8-1.2 s and lowered in ~0.6 s, against 1.4-3.4 s
    # and 2.0-2.4 s for the 4-chunk-wide tiles of the sweep before, at 0.99-1.08x their
    # time (16x16 float32: 0.90x).
    (ROW_BLOCK, "float32"): Tiling(2048, 512, 512),
    (ROW_BLOCK, "bfloat16"): Tiling(2048, 512, 512),
    (TILE, "float32"): Tiling(2048, 512, 512),
    (TILE, "bfloat16"): Tiling(2048, 512, 512),
    ((BLOCK, 1), "float32"): Tiling(),
    ((BLOCK, 1), "bfloat16"): Tiling(1024, 1024, 256),  # 4.24 ms (2026-12-05)
}

#: The tilings a sweep on a TPU tries (each lowers for TPU in `tests/test_tpu_kernels.py`).
CANDIDATES: tuple[Tiling, ...] = (
    Tiling(),
    Tiling(512, 2048),
    Tiling(1024, 1024),
    Tiling(512, 1024, 512),
    Tiling(1024, 2048, 512),
    Tiling(512, 512),
    Tiling(2048, 512, 512),
    Tiling(4096, 512, 512),
    Tiling(1024, 512, 512),
)


def tiling_for(block: Block, dtype) -> Tiling:
    """The `TILINGS` entry for `block` and an input of `dtype` (with `branch_once` where
    `BRANCH_ONCE` is on)."""
    tiling = TILINGS.get((block, jnp.dtype(dtype).name), Tiling())
    return tiling._replace(branch_once=True) if BRANCH_ONCE else tiling


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _tile(
    rows: int, cols: int, tiling: Tiling, codes: bool = True
) -> tuple[int, int, int, int, int]:
    """`(padded rows, padded cols, tile rows, tile cols, chunk)` for a `(rows, cols)`
    array: an axis shorter than a tile is padded to the kernel's granule (128 rows, 256
    columns) and gets one tile; a longer one keeps its length (its last tile may
    overhang it). `codes`: the output is the packed codes (chunks of 256 at least)."""
    granule = PAIR_GROUP if codes else LANES
    if tiling.rows % 512 or tiling.cols % 512 or tiling.chunk % granule:
        raise ValueError(
            f"`{tiling}`: rows and cols multiples of 512, chunk of {granule} (of 256 for "
            f"the packed codes, of 128 for the block values)."
        )
    if tiling.cols % tiling.chunk:
        raise ValueError(f"`{tiling}`: cols must be a multiple of chunk.")
    if tiling.unroll < 1:
        raise ValueError(f"`{tiling}`: unroll must be at least 1 (1: the loop as it is).")
    rp, tr = (rows, tiling.rows) if rows >= tiling.rows else (_round_up(rows, CHUNK_ROWS),) * 2
    cp, tc = (cols, tiling.cols) if cols >= tiling.cols else (_round_up(cols, PAIR_GROUP),) * 2
    chunk = tiling.chunk if tc % tiling.chunk == 0 else PAIR_GROUP
    return rp, cp, tr, tc, chunk


def _expand(g: Array) -> Array:
    """A block-grid array `(n / 16, m)` broadcast down the sublanes to `(n, m)`."""
    n16, m = g.shape
    return jnp.broadcast_to(g[:, None, :], (n16, BLOCK, m)).reshape(n16 * BLOCK, m)


def _lane_group_max(a: Array) -> Array:
    """The max of each group of 16 lanes of the int32 array `a`, in every lane of its
    group: a butterfly over lane distances 8, 4, 2, 1, each lane taking the max with
    its partner `lane ^ d` (which of the two rolls brings the partner is found by
    rolling the lane index too, so the direction of `roll` does not matter)."""
    m = a.shape[1]
    lane = jax.lax.broadcasted_iota(jnp.int32, a.shape, 1)
    for d in (8, 4, 2, 1):
        fwd = pltpu.roll(a, d, 1)
        from_fwd = pltpu.roll(lane, d, 1) == (lane ^ d)
        a = jnp.maximum(a, jnp.where(from_fwd, fwd, pltpu.roll(a, m - d, 1)))
    return a


def _sublane_max(v: Array) -> Array:
    """Every sublane of `v` (`(8, m)`) holding the maximum of its column's 8, by rolls
    over sublane distances 4, 2, 1."""
    for d in (4, 2, 1):
        v = jnp.maximum(v, pltpu.roll(v, d, 0))
    return v


def rht_chunk_stats(x: Array) -> tuple[Array, Array]:
    """`_tpu_operand.rht_stats`' two results for the chunks of 16 rows of the float32
    `x` (`(16 k, m)`, in VMEM), each column of them element-wise: `(flag, amax bits)`,
    int32 `(8, m)`, the largest `_hadamard.special_columns` flag of its chunk columns and
    the largest absolute-value bits of their transform (every sublane holds its column's
    result). Each chunk is two `(8, m)` rows of registers in order (no strided loads):
    its column maximum by sublane rolls, and `_hadamard._plain`'s butterflies: times
    1/4, stages 1, 2 and 4 by rolls (`a + b` at row `j`, `a - b` at `j + h`, its
    operands in that order: the same bits), stage 8 between the two halves; the signs,
    which do not change a magnitude, are left out."""
    m = x.shape[1]
    sub = jax.lax.broadcasted_iota(jnp.int32, (8, m), 0)
    flag = top = jnp.zeros((8, m), jnp.int32)
    for g in range(0, x.shape[0], BLOCK):
        a, b = x[g : g + 8], x[g + 8 : g + BLOCK]
        amax = _sublane_max(jnp.maximum(abs_bits(a), abs_bits(b)))
        flag = jnp.maximum(flag, special_columns(amax).astype(jnp.int32))
        a, b = a * np.float32(0.25), b * np.float32(0.25)
        for h in (1, 2, 4):
            low = (sub & h) == 0
            a = jnp.where(low, a + pltpu.roll(a, 8 - h, 0), pltpu.roll(a, h, 0) - a)
            b = jnp.where(low, b + pltpu.roll(b, 8 - h, 0), pltpu.roll(b, h, 0) - b)
        top = jnp.maximum(top, jnp.maximum(abs_bits(a + b), abs_bits(a - b)))
    return flag, top


def _aligned(offset, multiple: int):
    """A static offset as it is; a dynamic one marked a multiple of `multiple` (so that
    Mosaic takes it as an aligned start)."""
    return offset if isinstance(offset, int) else pl.multiple_of(offset, multiple)


def _over(offset, d: int):
    """`offset // d` of a static or a dynamic (non-negative) offset (`lax.div`: `//`
    would lower a sign fix-up, which Mosaic lowers by asking for the device)."""
    return offset // d if isinstance(offset, int) else jax.lax.div(offset, d)


def _lookup(index: Array, table) -> Array:
    """`table[index]` for an int32 `index` array and a table of scalars (a power of two
    of them), by a tree of selects on the bits of `index` (TPUs have no vector
    gather from a table)."""
    level, bit = list(table), 0
    while len(level) > 1:
        take = ((index >> bit) & 1) == 1
        level = [jnp.where(take, hi, lo) for lo, hi in zip(level[::2], level[1::2], strict=True)]
        bit += 1
    return level[0]


def is_tiny(params_ref) -> Array:
    """Whether the tensor is tiny (`s_dec < 2^-64`: products may be subnormal), from the
    kernel parameters `kernel_parameters` made (a scalar bool)."""
    return params_ref[3] != 0.0


def once_a_tile(params_ref, run) -> None:
    """`run(tiny)` with `tiny` the tensor's tininess (`is_tiny`) as a Python bool: one
    branch a tile (`Tiling.branch_once`, `BRANCH_ONCE`) instead of a scalar `lax.cond`
    in each chunk, so that the usual loop has no branch; the rare tiny loop is its own
    code."""
    tiny = is_tiny(params_ref)

    @pl.when(tiny)
    def _():
        run(True)

    @pl.when(jnp.logical_not(tiny))
    def _():
        run(False)


def _block_steps(bamax_bits: Array, params_ref, table_ref, tiny_tensor: bool | None = None):
    """The per-block steps on the block maxima' bits: `(scale_b, bits, inv_b, inv_sub)`,
    the reference's `_block_scales_exact` (see the module docstring for the inverse).
    `tiny_tensor`: whether the tensor is tiny, where the caller knows it (`once_a_tile`);
    `None` branches here (a scalar `lax.cond` on `is_tiny`)."""
    c, c_sub = params_ref[0], params_ref[1]
    scale_b, bits = _exact.block_scale(from_bits(bamax_bits), c, c_sub)

    def tiny(scale_b, bits):  # `s_dec < 2^-64`: products may be subnormal; 128 entries
        return _lookup(bits, [table_ref[i] for i in range(_exact.E4M3_CODES)])

    def normal(scale_b, bits):  # `scale_b = (1 + k/8) 2^e`: `1 / (1 + k/8)`, times `2^-e`
        sb = jax.lax.bitcast_convert_type(scale_b, jnp.int32)
        k, e = (sb >> 20) & 7, (sb >> 23) - 127
        inv = ldexp_normal(_lookup(k, [params_ref[4 + i] for i in range(8)]), -e)
        return jnp.where(bits == 0, FLT_MAX, jnp.where(bits == 0x7F, jnp.nan, inv))

    if tiny_tensor is None:
        inv = jax.lax.cond(is_tiny(params_ref), tiny, normal, scale_b, bits)
    else:
        inv = (tiny if tiny_tensor else normal)(scale_b, bits)
    return scale_b, bits, inv, scale_down_149(inv)


def _pair_matrix(transposed: bool) -> np.ndarray:
    """The 0/1/16 matrix that packs 256 codes into 128 bytes: `byte i = code 2i + 16 *
    code 2i+1` (`(256, 128)`, codes along lanes; its transpose for codes down the
    sublanes)."""
    p = np.zeros((PAIR_GROUP, PAIR_GROUP // 2), np.float32)
    i = np.arange(PAIR_GROUP // 2)
    p[2 * i, i], p[2 * i + 1, i] = 1.0, 16.0
    return p.T if transposed else p


def _pairs(codes: Array, pair_ref, transposed: bool) -> list[Array]:
    """The packed bytes (as int32, `(rows, 128)` each) of each 256 codes along a row of
    `codes` (transposed: down a column of `codes`, the bytes transposed back)."""
    out = []
    c = codes.astype(jnp.float32).astype(jnp.bfloat16)  # 0..15: exact
    p = pair_ref[...]
    for g in range(codes.shape[0 if transposed else 1] // PAIR_GROUP):
        part = slice(g * PAIR_GROUP, (g + 1) * PAIR_GROUP)
        if transposed:
            b = jnp.dot(p, c[part, :], preferred_element_type=jnp.float32, precision=_ONE_PASS).T
        else:
            b = jnp.dot(c[:, part], p, preferred_element_type=jnp.float32, precision=_ONE_PASS)
        out.append(b.astype(jnp.int32))
    return out


def _uniform(seed_ref, row: Array, col: Array, cols: int) -> Array:
    """`_e2m1.uniform`'s samples at the elements `(row, col)` of an array with `cols`
    columns (the flat index hashed with the seed words, as there)."""
    index = row.astype(jnp.uint32) * jnp.uint32(cols) + col.astype(jnp.uint32)
    s0 = seed_ref[0].astype(jnp.uint32)
    s1 = seed_ref[1].astype(jnp.uint32)
    h = _fmix32(index * jnp.uint32(GOLDEN_RATIO_32) + s0)
    h = _fmix32(h ^ s1)
    return ((h >> 16).astype(jnp.int32).astype(jnp.float32) + 0.5) * (1.0 / 65536.0)


#: `c` of the nearest rounding, by the E2M1 step at `a`: `ulp(c) == step`.
_C_HALF, _C_ONE, _C_TWO = np.float32(2.0**22), np.float32(2.0**23), np.float32(2.0**24)


def _signed(mag: Array, sign: Array) -> Array:
    """`mag` (float32, `>= 0`) with its sign bit set where `sign`: `_exact.decode`'s
    sign, so that code 8 is `-0.0`."""
    bits = jax.lax.bitcast_convert_type(mag, jnp.int32)
    return from_bits(bits | jnp.where(sign, jnp.int32(-(2**31)), jnp.int32(0)))


def _nearest(a: Array) -> Array:
    """The E2M1 value nearest `a >= 0` (ties to even, saturating at 6): `_exact.
    encode_nearest`'s magnitude, decoded. A NaN `a` gives NaN or 6, which is not that
    (code 0): callers take it only where `a` is NaN in a NaN block, whose block scale,
    NaN, makes every value NaN whatever the magnitude and the sign."""
    c = jnp.where(a < 2.0, _C_HALF, jnp.where(a < 4.0, _C_ONE, _C_TWO))
    return jnp.minimum((a + c) - c, np.float32(6.0))


def _stochastic(a: Array, u: Array) -> Array:
    """`_exact.encode_stochastic(a, u)`'s magnitude, decoded (`a >= 0`; NaN as
    `_nearest`'s)."""
    a6 = jnp.minimum(a, np.float32(6.0))
    small, mid = a6 < 2.0, a6 < 4.0
    step = jnp.where(small, np.float32(0.5), jnp.where(mid, np.float32(1.0), np.float32(2.0)))
    inv = jnp.where(small, np.float32(2.0), jnp.where(mid, np.float32(1.0), np.float32(0.5)))
    lo = jnp.floor(a6 * inv) * step
    return jnp.where(u < (a6 - lo) * inv, lo + step, lo)


def magnitudes(
    ab: list[Array], inv: Array, inv_sub: Array, expand, *, plain: bool = False
) -> list[Array]:
    """The scaled magnitudes `mul_normal(|x|, inv_b, inv_sub)` of the absolute-value
    bits `ab` (a list of arrays; `inv` and `inv_sub` on their block grid, `expand`
    broadcasting them to an element of `ab`), for the block values: `exact_magnitude`'s
    steps, with no branch; with `plain`, the plain product `|x| * inv_b`, which the
    TPU's arithmetic computes as zero for a subnormal `x`, for a caller that knows the
    tensor is not tiny (`Tiling.branch_once`). Only in a tiny tensor
    (`s_dec < 2^-64`, so `s_enc` is at most about `2^64`) can a subnormal `x` count:
    elsewhere a zero block scale makes every value of its block zero, and a nonzero one
    needs a block maximum `bmax > 2^-10 * 6 / s_enc > 2^-72`, its inverse `inv_b = 1 /
    (scale_b * s_dec)` being at most about `12 / bmax` (a nonzero E4M3 scale is at least
    half its unrounded value `bmax * s_enc / 6`) or, where the scale clamps at 448,
    `s_enc / 448`: below `2^76` either way, so a subnormal `x` gives below `2^-126 * 2^76
    = 2^-50`, which rounds to zero to the nearest and stochastically (whose smallest
    threshold is `2^-17`) as zero does. Until the twenty-fifth session the plain product
    `|x| * inv_b` ran outside tiny tensors, in a scalar `lax.cond` on `params_ref[3]`
    in every chunk; on a TPU v5e (2026-12-08, `benchmarks/tpu_lane_check.py --tiled`,
    8192x8192 float32, the same bits) these exact steps with no branch took 0.97x its
    time (1x16 to the nearest 1.099 ms against 1.129, SR 1.490 against 1.544, 16x16
    1.340 against 1.367). A chunk loop with neither this branch nor `_block_steps`' took
    0.89x (0.973 ms): `Tiling.branch_once` is that, off by default until the training
    step times it."""
    inv_e = expand(inv)
    if plain:
        return [from_bits(b) * inv_e for b in ab]
    inv_sub_e = expand(inv_sub)
    return [exact_magnitude(b, inv_e, inv_sub_e) for b in ab]


def exact_magnitude(ab: Array, inv: Array, inv_sub: Array) -> Array:
    """`mul_normal(|x|, inv_b, inv_sub)` of the absolute-value bits `ab` (`inv` and
    `inv_sub` broadcast to them): a subnormal `x` is its 23-bit field times
    `inv_b * 2^-149`, so that it is read exactly although the TPU flushes subnormals in
    arithmetic."""
    return jnp.where(ab < MIN_NORMAL_BITS, ab.astype(jnp.float32) * inv_sub, from_bits(ab) * inv)


def _encode_nearest(a: Array) -> Array:
    """The E2M1 magnitude code (int32 0..7) of `a >= 0`, ties to even, saturating; NaN
    gives 0: the seven midpoint comparisons of `_e2m1.encode_nearest`."""
    mag = (a > 0.25).astype(jnp.int32)
    for t, ge in ((0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True)):
        mag = mag + ((a >= t) if ge else (a > t)).astype(jnp.int32)
    return mag + (a > 5.0).astype(jnp.int32)


def _chunk(
    x: Array,
    row: Array,
    col: Array,
    refs,
    *,
    block: Block,
    rounding: Rounding,
    output: str,
    cols: int,
    arithmetic: bool = False,
    tiny: bool | None = None,
):
    """The steps of one chunk `x` (float32, blocks of 16 down its sublanes: 1x16 chunks
    come transposed), `row` and `col` the caller's indices of its elements (`arithmetic`:
    `Tiling.arithmetic`; `tiny`: whether the tensor is tiny, where the caller branched
    on it, `Tiling.branch_once`). Returns `(codes or None, scale bits (n/16, m), values
    or None)`, values in float32."""
    params_ref, seed_ref, table_ref, pair_ref = refs
    n, m = x.shape
    xbits = jax.lax.bitcast_convert_type(x, jnp.int32)
    ab = xbits & 0x7FFFFFFF
    bmax = jnp.max(ab.reshape(n // BLOCK, BLOCK, m), axis=1)  # (NaN above inf)
    if block == TILE:
        bmax = _lane_group_max(bmax)
    scale_b, bits, inv, inv_sub = _block_steps(bmax, params_ref, table_ref, tiny)
    negative = xbits < 0
    if arithmetic and output != "codes":  # the E2M1 values themselves (`_tpu_operand`'s)
        # (a NaN block's values are NaN whatever the magnitudes and signs: `x`'s sign)
        (a,) = magnitudes([ab], inv, inv_sub, _expand, plain=tiny is False)
        if rounding == "nearest":
            mag = _nearest(a)
        else:
            mag = _stochastic(a, _uniform(seed_ref, row, col, cols))
        q = _signed(mag, negative) * _expand(scale_b)  # exact
        return None, bits, _dequantized(q, output, params_ref, tiny)
    a = exact_magnitude(ab, _expand(inv), _expand(inv_sub))  # (the codes need it exact)
    nan_block = _expand(bits == 0x7F)
    if rounding == "nearest":
        mag = _encode_nearest(a)
        # The reference's sign is `x * inv_b`'s: `x`'s, or in a NaN block that of the
        # NaN product (`+NaN`, or a NaN `x` itself).
        sign = negative & (~nan_block | (ab > INF_BITS))
    else:
        mag = _exact.encode_stochastic(a, _uniform(seed_ref, row, col, cols))
        sign = negative & ~nan_block  # (`round_stochastic` gives NaN code 0)
    codes = mag | jnp.where(sign, 8, 0)
    if output == "codes":
        return codes, bits, None
    q = _exact.decode(codes) * _expand(scale_b)  # exact
    return None, bits, _dequantized(q, output, params_ref)


def _dequantized(q: Array, output: str, params_ref, tiny: bool | None = None) -> Array:
    """The block values `q` (float32, exact), times `s_dec` for `output="dequantized"`
    (exactly, by `_exact.mul_exact`, where the tensor is tiny: `tiny` where the caller
    knows it, else a scalar `lax.cond`)."""
    if output != "dequantized":
        return q
    s_dec = params_ref[2]

    def exact(q):
        return _exact.mul_exact(q, s_dec, jnp.bool_(True))

    def plain(q):
        return q * s_dec

    if tiny is not None:
        return (exact if tiny else plain)(q)
    return jax.lax.cond(is_tiny(params_ref), exact, plain, q)


def _kernel(
    params_ref,
    seed_ref,
    table_ref,
    pair_ref,
    x_ref,
    *refs,
    block: Block,
    rounding: Rounding,
    output: str,
    cols: int,
    chunk: int,
    stats: bool = False,
    bounds: tuple[int, int] | None = None,
    looped: bool = False,
    arithmetic: bool = False,
    branch_once: bool = False,
    unroll: int = 1,
):
    """One tile: a loop down its rows, `CHUNK_ROWS` at a time, over its chunks of
    `chunk` columns; the tile's scale bits are gathered in an int32 scratch and written
    at the end. With `stats`, the last output `(2, 8, tile columns)` gathers the
    chunks' `rht_chunk_stats` too (the RHT's statistics of the same rows, from the same
    read); with `bounds` (the array's rows and columns, where a tile overhangs it) the
    elements beyond them, garbage, taken as zeros, as `_hadamard.padded_rows` pads.
    `looped`, `arithmetic`, `branch_once` and `unroll`: `Tiling`'s."""
    tr, tc = x_ref.shape
    transposed = block == ROW_BLOCK
    scratch = refs[-1]
    outs = refs[:-1]
    if stats:
        *outs, stats_ref = outs
        stats_ref[...] = jnp.zeros(stats_ref.shape, jnp.int32)
    r_tile, c_tile = pl.program_id(0) * tr, pl.program_id(1) * tc
    consts = (params_ref, seed_ref, table_ref, pair_ref)

    def one(k, r0, c0, width: int, tiny: bool | None):
        """The chunk of rows from `r0 = k * CHUNK_ROWS` and `width` columns from `c0`
        (static, or dynamic in the looped form)."""
        x = x_ref[pl.ds(r0, CHUNK_ROWS), pl.ds(c0, width)].astype(jnp.float32)
        if stats:
            lanes, inside = pl.ds(c0, width), x
            if bounds is not None:
                at = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) + r_tile + r0
                on = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) + c_tile + c0
                keep = (at < bounds[0]) & (on < bounds[1])
                inside = jnp.where(keep, x, np.float32(0.0))
            for i, part in enumerate(rht_chunk_stats(inside)):
                stats_ref[i, :, lanes] = jnp.maximum(stats_ref[i, :, lanes], part)
        shape = (width, CHUNK_ROWS) if transposed else (CHUNK_ROWS, width)
        ri, ci = (1, 0) if transposed else (0, 1)
        row = r_tile + r0 + jax.lax.broadcasted_iota(jnp.int32, shape, ri)
        col = c_tile + c0 + jax.lax.broadcasted_iota(jnp.int32, shape, ci)
        codes, bits, q = _chunk(
            x.T if transposed else x,
            row,
            col,
            consts,
            block=block,
            rounding=rounding,
            output=output,
            cols=cols,
            arithmetic=arithmetic,
            tiny=tiny,
        )
        rows = pl.ds(r0, CHUNK_ROWS)
        if codes is not None:
            if transposed:
                c16 = _aligned(_over(c0, BLOCK), width // BLOCK)
                scratch[k, pl.ds(c16, width // BLOCK), :] = bits
            else:
                r16 = pl.multiple_of(k * (CHUNK_ROWS // BLOCK), CHUNK_ROWS // BLOCK)
                scratch[pl.ds(r16, CHUNK_ROWS // BLOCK), pl.ds(c0, width)] = bits
            for g, b in enumerate(_pairs(codes, pair_ref, transposed)):
                c2 = _aligned(_over(c0, 2) + g * (PAIR_GROUP // 2), PAIR_GROUP // 2)
                outs[0][rows, pl.ds(c2, PAIR_GROUP // 2)] = b.astype(jnp.int8)
        else:
            assert q is not None
            out = outs[0]
            out[rows, pl.ds(c0, width)] = (q.T if transposed else q).astype(out.dtype)

    def chunks(width: int, looped: bool, tiny: bool | None, unroll: int) -> None:
        """Every chunk of the tile, `width` columns each."""
        per_row = tc // width
        if looped and per_row > 1:  # one chunk's code, its row and column offsets dynamic

            def each_chunk(i, carry):
                # (`lax.div` and `rem`: `i >= 0`; `//` and `%` would lower a sign fix-up)
                k, c = jax.lax.div(i, per_row), jax.lax.rem(i, per_row)
                r0 = pl.multiple_of(k * CHUNK_ROWS, CHUNK_ROWS)
                one(k, r0, pl.multiple_of(c * width, width), width, tiny)
                return carry

            jax.lax.fori_loop(0, (tr // CHUNK_ROWS) * per_row, each_chunk, 0, unroll=unroll)
        else:  # a loop down the rows, the chunks along them unrolled (static offsets)

            def body(k, carry):
                r0 = pl.multiple_of(k * CHUNK_ROWS, CHUNK_ROWS)
                for c0 in range(0, tc, width):
                    one(k, r0, c0, width, tiny)
                return carry

            jax.lax.fori_loop(0, tr // CHUNK_ROWS, body, 0, unroll=unroll)

    if branch_once and arithmetic and output != "codes":
        # (a tiny tensor's loop in chunks of 128 columns: a quarter of the code of 512-wide
        # chunks for Mosaic to compile)
        once_a_tile(
            params_ref,
            lambda tiny: (
                chunks(LANES, True, True, 1) if tiny else chunks(chunk, looped, False, unroll)
            ),
        )
    else:
        chunks(chunk, looped, None, unroll)
    if output == "codes":
        scales = outs[1]
        if transposed:
            for k in range(tr // CHUNK_ROWS):
                lanes = pl.ds(k * CHUNK_ROWS, CHUNK_ROWS)
                scales[:, lanes] = scratch[k].astype(jnp.int8)
        else:
            scales[...] = scratch[...].astype(jnp.int8)


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
    `(1, 16)`, `(16, 16)` or `(16, 1)`: `_pallas_nvfp4.quantize_2d`'s arguments and
    results, on a TPU (`interpret=True` runs it in the TPU interpreter,
    `pltpu.InterpretParams()`; `tiling` defaults to `tiling_for(block, x.dtype)`).

    **Returns:** `(out, scale_bits, s_dec)`: with `output="codes"`, the packed codes
    `(rows, cols / 2)` uint8 and the E4M3 scale bits on the block grid, uint8; with
    `"values"` the bfloat16 block values, with `"dequantized"` the dequantised values
    in `x`'s dtype, and `scale_bits` `None`.
    """
    tiling = tiling or tiling_for(block, x.dtype)
    call = functools.partial(
        _quantize_2d,
        block=block,
        rounding=rounding,
        output=output,
        interpret=interpret,
        tiling=tiling,
    )
    # vmapped (a stack of weights, a batch of operands): one array after another
    return each_problem(call, x, amax, seed)


def kernel_parameters(x, amax, seed, block, output: str, interpret: bool | str = False):
    """`(s_dec, params, seeds, table)`: what a quantiser kernel reads from SMEM for the
    padded 2-D `x` (`_exact.checked_amax`'s checks): the float32 parameter vector
    (`_NPARAMS` slots, see `_block_steps`), the seed words as int32 (zeros without a
    seed), and the inverse table (`_exact.inverse_table`), made by `prologue`'s kernel
    (`interpret` as there). Shared with `_tpu_operand`."""
    return kernel_parameters_many([x], [amax], [seed], block, output, interpret)[0]


def kernel_parameters_many(
    xs, amaxes, seeds, block, output: str, interpret: bool | str = False
) -> list[tuple]:
    """`[kernel_parameters(x, amax, seed, block, output, interpret) for ...]`: one
    `prologue` call (a grid step per tensor) for all."""
    amax = [_exact.checked_amax(x, a, block, output) for x, a in zip(xs, amaxes, strict=True)]
    made = prologue(jnp.stack(amax), interpret=interpret)
    out = []
    for i, seed in enumerate(seeds):
        params = made[i, _PARAMS_ROW, :_NPARAMS]
        seed = jnp.zeros((2,), jnp.uint32) if seed is None else seed
        words = jax.lax.bitcast_convert_type(seed.astype(jnp.uint32), jnp.int32)
        out.append((params[2], params, words, made[i, :_PARAMS_ROW].reshape(-1)))
    return out


#: The row of `prologue`'s result that holds the parameter vector (the rows above it:
#: the inverse table's two halves).
_PARAMS_ROW = 2


@functools.partial(jax.jit, static_argnames=("interpret",))
def prologue(amax: Float[Array, " k"], *, interpret: bool | str = False) -> Float[Array, "k 8 128"]:
    """The quantiser kernels' exact scalar prologue for `k` tensors, from their amaxes,
    as one Pallas kernel (a grid step each): `[k, 0]` and `[k, 1]` the inverse table's
    two halves (`_exact.inverse_table`), `[k, 2, :_NPARAMS]` the parameter vector
    (`_exact.head_values`, then the 8 significands' inverses), the same bits as
    `_exact.scale_parameters` (in XLA, that exact arithmetic is most of a quantisation's
    code: ~400 operations that XLA compiled in ~0.45 s at each call site on a TPU v5e,
    against ~0.03 s for this kernel's, 2026-12-07). The amax enters as its bits, so that
    a subnormal one is read exactly. `interpret` as `_tpu_rht.transform`'s."""
    k = amax.shape[0]
    bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32)
    spec = pl.BlockSpec((None, 8, LANES), lambda i: (i, 0, 0))
    return pl.pallas_call(
        _prologue_kernel,
        out_shape=jax.ShapeDtypeStruct((k, 8, LANES), jnp.float32),
        grid=(k,),
        in_specs=[spec],
        out_specs=spec,
        interpret=_INTERPRETERS[interpret],
        name="nvfp4x_prologue_tpu",
    )(jnp.broadcast_to(bits[:, None, None], (k, 8, LANES)))


def _prologue_kernel(bits_ref, out_ref):
    """`prologue`'s step for one tensor: its amax's bits fill `bits_ref` (8, 128); each
    lane computes the same scalars, and its own E4M3 code's inverse."""
    s_enc, s_dec = tensor_scale_values(from_bits(bits_ref[...]))
    lane = jax.lax.broadcasted_iota(jnp.int32, s_dec.shape, 1)
    row = jax.lax.broadcasted_iota(jnp.int32, s_dec.shape, 0)
    inv_b, inv_sub = _exact.inverse_entries(lane, s_dec)  # lane = code (128 of them)
    head = _exact.head_values(s_enc, s_dec)
    # lanes 4..11 of the parameter row: the inverses of the codes `_ONE + 0..7`
    ones, _ = _exact.inverse_entries(jnp.clip(lane + (_ONE - 4), 0, _exact.E4M3_CODES - 1), s_dec)
    params = jnp.where((lane >= 4) & (lane < 12), ones, 0.0)
    for i, value in enumerate(head):
        params = jnp.where(lane == i, value, params)
    out_ref[...] = jnp.where(row == 0, inv_b, jnp.where(row == 1, inv_sub, params))


#: The blocks whose GEMM operand path (`output="values"`) runs `_tpu_operand`'s kernel
#: (strided loads, one vector register per block row) where it takes the array, instead
#: of this module's: 16x1, where it took 0.75-0.85x this module's time on a TPU v5e
#: (8192x8192, 2026-12-06, `benchmarks/tpu_operand_check.py`); not 1x16, where its
#: transposes made it 1.02-1.08x (and the training step the same, 2026-12-07); 16x16
#: (a weight's) not yet timed there (`bench_accel.py`'s train section times it).
OPERAND_KERNEL_BLOCKS = ((BLOCK, 1),)


def _quantize_2d(x, amax, seed, *, block, rounding, output, interpret, tiling: Tiling):
    """`quantize_2d` with its tiling given: `_tpu_operand`'s kernel for the GEMM operand
    in `OPERAND_KERNEL_BLOCKS` where it takes the array, else `tiled`."""
    from . import _tpu_operand

    fits = block in OPERAND_KERNEL_BLOCKS and _tpu_operand.applies(x.shape, x.dtype, block)
    if output == "values" and fits:
        kw = dict(block=block, rounding=rounding, interpret=interpret)
        values, s_dec = _tpu_operand.operand(x, amax, seed, **kw)
        return values, None, s_dec
    kw = dict(block=block, rounding=rounding, output=output, interpret=interpret)
    return tiled(x, amax, seed, tiling=tiling, **kw)


def quantize_with_stats(
    x: Float[Array, "rows cols"],
    amax: Float[Array, ""] | None = None,
    seed: Array | None = None,
    *,
    rounding: Rounding = "nearest",
    output: str = "values",
    interpret: bool = False,
) -> tuple[Array, Array | None, Float[Array, ""], tuple[Array, Float[Array, ""]]]:
    """`quantize_2d(x, amax, seed, block=(1, 16), ...)`'s results and, from the same
    read of `x`, `_tpu_operand.rht_stats(x)`'s `(special, amax)` (its rows padded to
    whole chunks of 16 with zeros, as `_hadamard.padded_rows` pads them): one pass over
    an activation for its 1x16 GEMM operand (fprop's x, dgrad's dy) and wgrad's RHT
    statistics of it, bit for bit both apart. 1x16 blocks by this module's kernel
    (`tiled`), whatever the output."""
    tiling = tiling_for(ROW_BLOCK, x.dtype)
    kw = dict(rounding=rounding, output=output, interpret=interpret, tiling=tiling)
    return tiled(x, amax, seed, block=ROW_BLOCK, stats=True, **kw)


@functools.partial(
    jax.jit, static_argnames=("block", "rounding", "output", "interpret", "tiling", "stats")
)
def tiled(x, amax, seed, *, block, rounding, output, interpret, tiling: Tiling, stats=False):
    """`quantize_2d`'s results by this module's kernel, whatever the output (jitted: one
    trace per case); with `stats` (1x16 blocks) a fourth: `quantize_with_stats`'."""
    if stats and block != ROW_BLOCK:
        raise ValueError(f"`stats=True` takes 1x16 blocks, got {block}.")
    rows, cols = x.shape
    br, bc = block
    s_dec, params, seeds, table = kernel_parameters(x, amax, seed, block, output, interpret)
    transposed = block == ROW_BLOCK
    pairs = jnp.asarray(_pair_matrix(transposed), jnp.bfloat16)

    rp, cp, tr, tc, chunk = _tile(rows, cols, tiling, codes=output == "codes")
    xp = x if (rp, cp) == (rows, cols) else jnp.pad(x, ((0, rp - rows), (0, cp - cols)))
    grid = (pl.cdiv(rp, tr), pl.cdiv(cp, tc))
    tiles = lambda shape: pl.BlockSpec(shape, lambda i, j: (i, j))
    if output == "codes":
        if transposed:  # (the scales transposed: `(cols / 16, rows)`)
            scales = ((cp // BLOCK, rp), pl.BlockSpec((tc // BLOCK, tr), lambda i, j: (j, i)))
            scratch = pltpu.VMEM((tr // CHUNK_ROWS, tc // BLOCK, CHUNK_ROWS), jnp.int32)
        else:  # (16x16: once per column, `(rows / 16, cols)`)
            scales = ((rp // BLOCK, cp), tiles((tr // BLOCK, tc)))
            scratch = pltpu.VMEM((tr // BLOCK, tc), jnp.int32)
        out_shape = [
            jax.ShapeDtypeStruct((rp, cp // 2), jnp.int8),
            jax.ShapeDtypeStruct(scales[0], jnp.int8),
        ]
        out_specs = [tiles((tr, tc // 2)), scales[1]]
    else:
        dtype = x.dtype if output == "dequantized" else jnp.bfloat16
        out_shape = [jax.ShapeDtypeStruct((rp, cp), dtype)]
        out_specs = [tiles((tr, tc))]
        scratch = pltpu.VMEM((8, 128), jnp.int32)  # (unused)
    if stats:  # (the RHT's statistics: per tile, 8 sublanes of each column's)
        out_shape.append(jax.ShapeDtypeStruct((2, grid[0] * 8, cp), jnp.int32))
        out_specs.append(pl.BlockSpec((2, 8, tc), lambda i, j: (0, i, j)))
    # (the statistics mask an overhanging tile's garbage; padded or whole tiles need none)
    overhang = rp % tr or cp % tc
    kw = dict(stats=True, bounds=(rows, cols) if overhang else None) if stats else {}
    kernel = functools.partial(
        _kernel,
        block=block,
        rounding=rounding,
        output=output,
        cols=cols,
        chunk=chunk,
        looped=tiling.looped,
        arithmetic=tiling.arithmetic,
        branch_once=tiling.branch_once,
        unroll=tiling.unroll,
        **kw,
    )
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[
            smem,
            smem,
            smem,
            pl.BlockSpec(pairs.shape, lambda i, j: (0, 0)),
            tiles((tr, tc)),
        ],
        out_specs=out_specs,
        scratch_shapes=[scratch],
        interpret=pltpu.InterpretParams() if interpret else False,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"),
            vmem_limit_bytes=_vmem_limit(tr, tc, x.dtype, output),
            allow_input_fusion=fusible(False, False, False, False, True),
        ),
        name="nvfp4_quantize_tpu",
    )(params, seeds, table, pairs, xp)
    found = ()
    if stats:
        *outs, partial = outs
        found = ((jnp.max(partial[0]) > 0, from_bits(jnp.max(partial[1]))),)
    if output != "codes":
        out = outs[0]
        return (out if (rp, cp) == (rows, cols) else out[:rows, :cols]), None, s_dec, *found
    codes = jax.lax.bitcast_convert_type(outs[0], jnp.uint8)[:rows, : cols // 2]
    scale_bits = jax.lax.bitcast_convert_type(outs[1], jnp.uint8)
    if transposed:
        scale_bits = scale_bits.T
    elif block == TILE:
        scale_bits = scale_bits[:, ::BLOCK]
    return codes, scale_bits[: rows // br, : cols // bc], s_dec, *found


def _vmem_limit(tr: int, tc: int, dtype, output: str) -> int:
    """Scoped VMEM for a tile: double-buffered input and outputs, the scale scratch,
    and room for the chunks' temporaries (Mosaic's default is smaller than a v5e's
    128 MiB)."""
    size = tr * tc
    inp = 2 * size * jnp.dtype(dtype).itemsize
    out = 2 * size * (4 if output == "dequantized" else 2) if output != "codes" else size
    return int(inp + out + size // 4 + (32 << 20))
