"""The GEMM of a frozen NVFP4 weight, `x @ W.T`, as one Pallas kernel for GPUs.

A frozen layer's forward (`_frozen.py`) multiplies its activations by a weight held
packed: E2M1 codes two per byte (`_numerics._pack`'s nibble order), E4M3 block scales
(1x16 blocks or 16x16 tiles) and a float32 tensor scale. The reference decodes the
weight into a bfloat16 array and calls a dot: at a few tokens the decoded weight, written
and read again, costs 4.4x the packed bytes. Here each program reads its tiles of the
packed codes and scales, decodes them in registers to the block values
`e2m1 * scale_b` (exact in bfloat16 and float32, as `NVFP4Array.operand()` gives them)
and multiplies them on the tensor cores with float32 accumulation; no decoded weight is
written. The tensor scales are applied by the caller, as `scaled_dot` applies them.

Operands (`operand`), by the activations' dtype (for either GEMM dtype of
`scaled_dot`: its products are exact in both):

- `"bfloat16"`: bfloat16 activations (a W4A4 layer's quantised values, or a W4A16
  layer's bfloat16 input) against the bfloat16 block values: one `pltriton.dot`.
- `"float32"`: float32 or float16 activations (a W4A16 layer's). The
  activations are split exactly into three bfloat16 parts (`_split3`; 24 significant
  bits in three of 8), each multiplied exactly against the block values (6 significant
  bits at most) and accumulated in float32: three bfloat16 dots instead of one float32
  dot, which Triton runs without the tensor cores.

Equal to the reference (`scaled_dot` on `operand()`) up to float32 summation order:
the products are exact, only the order and grouping of the float32 sums differ
(bounded in `tests/test_frozen_kernel.py` by `4 k 2^-24 (|x| @ |W|.T)`); NaN and
infinities land where the reference's do. The signs of zero sums may differ.

Tiles (`Tiles`): a program computes `tokens x features` outputs, looping over the
contraction in steps of `depth` elements. Triton's dot needs every dimension >= 16, so
one to 16 tokens run as 16 (the work of a GEMV is reading the weight, not the
multiply). The defaults per token count (`DEFAULT_TILES`) are guesses until a GPU run
of `benchmarks/bench_gpu.py --only frozen_sweep` picks them.

As `_pallas_nvfp4`: a tile that overhangs an array is read and written only through
masks (Triton reads such a tile at its flat offsets, over the next row or past the
buffer); steps and programs that fit use plain reads. Runs on the CPU with
`interpret=True` (the tests).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, UInt8

from .._numerics._constants import BLOCK, ROW_BLOCK, TILE
from .._numerics._pack import NIBBLE_SCALE, decode_e4m3

#: The weight block layouts the kernel takes.
WEIGHT_BLOCKS = (ROW_BLOCK, TILE)
#: The operand dtypes of its dot (see the module docstring).
OPERANDS = ("bfloat16", "float32")


class Tiles(NamedTuple):
    """A program's tile: `tokens x features` outputs, `depth` contraction elements per
    step (powers of two; `tokens, features >= 16`, `depth >= 32`), Triton's warps and
    pipeline stages."""

    tokens: int
    features: int
    depth: int
    warps: int = 4
    stages: int = 3


#: Tiles by token count: `(most tokens, tiles)`, the first that fits; `None`: any.
DEFAULT_TILES: tuple[tuple[int | None, Tiles], ...] = (
    (16, Tiles(16, 32, 256, 4, 4)),
    (64, Tiles(64, 64, 128, 4, 3)),
    (None, Tiles(128, 128, 64, 8, 3)),
)


#: The tiles `benchmarks/bench_gpu.py --only frozen_sweep` times: at up to 16 tokens
#: (GEMV-like: memory-bound, many programs and bytes in flight), then at 4096 tokens
#: (compute-bound: large tiles, so that each decoded weight tile feeds more tokens).
SWEEP_TILES: tuple[Tiles, ...] = (
    Tiles(16, 16, 256, 4, 4),
    Tiles(16, 32, 128, 4, 4),
    Tiles(16, 32, 256, 4, 4),
    Tiles(16, 32, 512, 4, 3),
    Tiles(16, 64, 128, 4, 4),
    Tiles(16, 64, 256, 8, 3),
    Tiles(16, 128, 128, 8, 3),
    Tiles(128, 128, 64, 8, 3),
    Tiles(128, 128, 64, 4, 4),
    Tiles(128, 256, 64, 8, 3),
    Tiles(256, 128, 64, 8, 3),
    Tiles(128, 128, 128, 8, 3),
    Tiles(64, 128, 64, 4, 4),
)


def default_tiles(tokens: int) -> Tiles:
    """The default tiles for `tokens` rows of activations."""
    for most, tiles in DEFAULT_TILES:
        if most is None or tokens <= most:
            return tiles
    raise AssertionError("the last entry of DEFAULT_TILES takes any token count")


def check_tiles(tiles: Tiles, block: tuple[int, int]) -> None:
    """Raise for tiles Triton cannot run (non powers of two, dots under 16)."""
    pow2 = lambda v: v > 0 and v & (v - 1) == 0
    bm, bn, bk = tiles.tokens, tiles.features, tiles.depth
    if not all(map(pow2, (bm, bn, bk, tiles.warps))) or bm < 16 or bn < 16 or bk < 32:
        raise ValueError(
            f"`tiles` {tiles} are not powers of two with tokens and features >= 16 and "
            "depth >= 32 (Triton's blocks and dots); pick such tiles."
        )
    if bn % block[0]:
        raise ValueError(f"`tiles.features` ({bn}) must be a multiple of the block {block}.")


def check_packed(
    codes: Array | jax.ShapeDtypeStruct,
    scale_bits: Array | jax.ShapeDtypeStruct,
    *,
    block: tuple[int, int],
    n: int,
    k: int,
    operand: str,
) -> None:
    """Raise unless `block` and `operand` are ones the frozen GEMM kernels take and `codes`
    and `scale_bits` are the packed layout of a `block` NVFP4 weight `(n, k)`: codes
    `(rows, k_pad / 2)` (`rows`: `n`, or `n` padded to 16 for 16x16 tiles), scale bits
    `(rows / block[0], k_pad / 16)`."""
    kp = -(-k // BLOCK) * BLOCK
    rows = n if block == ROW_BLOCK else -(-n // BLOCK) * BLOCK
    if block not in WEIGHT_BLOCKS or operand not in OPERANDS:
        raise ValueError(
            f"`frozen_matmul` takes blocks {WEIGHT_BLOCKS} and operands {OPERANDS}, got "
            f"`block={block}`, `operand={operand!r}`."
        )
    srows = rows // block[0]
    if codes.shape != (rows, kp // 2) or scale_bits.shape != (srows, kp // BLOCK):
        raise ValueError(
            f"`codes` {codes.shape} and `scale_bits` {scale_bits.shape} are not the packed "
            f"layout of a {block} NVFP4 weight ({n}, {k}): expected {(rows, kp // 2)} and "
            f"{(srows, kp // BLOCK)}."
        )


def _split3(x: Float[Array, "*s"]) -> tuple[Array, Array, Array]:
    """Three bfloat16 arrays whose float32 sum is exactly `x` (finite `x`; for inf and
    NaN the first part is `x`'s class and the others 0): its top 8 significant bits
    (truncated, so never rounded up to inf), the next 8, the last 8."""

    def top(v):
        bits = lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0xFFFF0000)
        return lax.bitcast_convert_type(bits, jnp.float32)

    finite = jnp.abs(x) <= jnp.float32(jnp.finfo(jnp.float32).max)
    hi = jnp.where(finite, top(x), x)  # (inf and NaN as they are)
    r1 = jnp.where(finite, x - hi, 0.0)  # exact: the low 16 bits
    mid = top(r1)
    lo = r1 - mid  # exact, at most 8 significant bits
    return hi.astype(jnp.bfloat16), mid.astype(jnp.bfloat16), lo.astype(jnp.bfloat16)


def _decode(codes: Array, scale_bits: Array, block: tuple[int, int]) -> Float[Array, "n k"]:
    """The float32 block values `e2m1 * scale_b` of a tile of packed codes `(bn, bk/2)`
    and its E4M3 scale bits (`(bn, bk/16)`, or `(bn/16, bk/16)` for 16x16 tiles), in
    registers: E2M1 codes as float16 bit patterns (`_pack.nibble_values`: the value times
    `2^-14`), times the block scale times `2^14` (exact; no subnormal on the way)."""
    bn, half = codes.shape
    b = codes.astype(jnp.int32)
    lo = ((b << 9) & 0x0E00) | ((b << 12) & 0x8000)
    hi = ((b << 5) & 0x0E00) | ((b << 8) & 0x8000)
    as_f32 = lambda bits: lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(
        jnp.float32
    )
    s = decode_e4m3(scale_bits) * jnp.float32(1 / NIBBLE_SCALE)
    if block == ROW_BLOCK:
        s = jnp.broadcast_to(s[:, :, None], (bn, half // 8, 8))
    else:
        s = jnp.broadcast_to(s[:, None, :, None], (bn // BLOCK, BLOCK, half // 8, 8))
    s = s.reshape(bn, half)
    return jnp.stack([as_f32(lo) * s, as_f32(hi) * s], axis=-1).reshape(bn, 2 * half)


def _dot(x: Array, w: Float[Array, "n k"], operand: str) -> Float[Array, "m n"]:
    """`x @ w.T` in float32 from exact bfloat16 products (see the module docstring)."""
    wb = w.astype(jnp.bfloat16)  # exact: block values
    if operand == "bfloat16":
        return pltriton.dot(x.astype(jnp.bfloat16), wb, trans_b=True)
    hi, mid, lo = _split3(x.astype(jnp.float32))
    out = pltriton.dot(hi, wb, trans_b=True)
    out += pltriton.dot(mid, wb, trans_b=True)
    return out + pltriton.dot(lo, wb, trans_b=True)


def _mask(*parts: Array | None, shape: tuple[int, int]) -> Array | None:
    """The conjunction of the masks in `parts` (None: no condition), broadcast to `shape`,
    or None if there is none."""
    live = [p for p in parts if p is not None]
    if not live:
        return None
    out = live[0]
    for p in live[1:]:
        out = out & p
    return jnp.broadcast_to(out, shape)


def _load(ref, mask: Array | None) -> Array:
    if mask is None:
        return ref[...]
    return pltriton.load(ref, mask=mask, other=jnp.zeros(ref.shape, ref.dtype))


def _kernel(x_ref, codes_ref, scales_ref, out_ref, *, m, k, block, operand, tiles):
    bm, bn, bk = tiles.tokens, tiles.features, tiles.depth
    br = block[0]
    n0, m0 = pl.program_id(0) * bn, pl.program_id(1) * bm
    rows, width = codes_ref.shape
    srows, swidth = scales_ref.shape
    n = out_ref.shape[1]
    iota = lambda shape, axis: lax.broadcasted_iota(jnp.int32, shape, axis)
    # Which rows of the tiles lie in the arrays (None where every program's do).
    tok_in = None if m % bm == 0 else m0 + iota((bm, 1), 0) < m
    row_in = None if rows % bn == 0 else n0 + iota((bn, 1), 0) < rows
    srow_in = None if srows % (bn // br) == 0 else n0 // br + iota((bn // br, 1), 0) < srows

    def step(s, acc, tail: bool):
        k0 = s * bk
        # The last step of a contraction that is not a multiple of `depth`: its columns
        # past the arrays' ends are masked (read as 0).
        col = lambda size, per, end: (k0 // per + iota((1, size), 1) < end) if tail else None
        xs = x_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)]
        xt = _load(xs, _mask(tok_in, col(bk, 1, k), shape=(bm, bk)))
        cs = codes_ref.at[pl.ds(n0, bn), pl.ds(k0 // 2, bk // 2)]
        c = _load(cs, _mask(row_in, col(bk // 2, 2, width), shape=(bn, bk // 2)))
        ss = scales_ref.at[pl.ds(n0 // br, bn // br), pl.ds(k0 // BLOCK, bk // BLOCK)]
        sb = _load(ss, _mask(srow_in, col(bk // BLOCK, BLOCK, swidth), shape=ss.shape))
        w = _decode(c, sb, block)
        if tail and k % BLOCK:  # a padded block's scale (NaN for a NaN block) stays out
            w = jnp.where(k0 + iota((1, bk), 1) < k, w, 0.0)
        return acc + _dot(xt, w, operand)

    acc = jnp.zeros((bm, bn), jnp.float32)
    if k // bk:  # (not traced otherwise: its plain reads would be larger than the arrays)
        acc = lax.fori_loop(0, k // bk, functools.partial(step, tail=False), acc)
    if k % bk:  # (a traced step index: a static slice past an array's end is refused)
        acc = step(k // bk + 0 * pl.program_id(0), acc, tail=True)
    out = out_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)]
    col_in = None if n % bn == 0 else n0 + iota((1, bn), 1) < n
    mask = _mask(tok_in, col_in, shape=(bm, bn))
    if mask is None:
        out[...] = acc
    else:
        pltriton.store(out, acc, mask=mask)


@functools.partial(jax.jit, static_argnames=("block", "n", "operand", "tiles", "interpret"))
def frozen_matmul(
    x: Float[Array, "m k"],
    codes: UInt8[Array, "rows k2"],
    scale_bits: UInt8[Array, "srows k16"],
    *,
    block: tuple[int, int],
    n: int,
    operand: str,
    tiles: Tiles | None = None,
    interpret: bool = False,
) -> Float[Array, "m n"]:
    """`x @ W.T` in float32 for the NVFP4 weight `W` `(n, k)` held as `codes` and
    `scale_bits` (an `NVFP4Array`'s fields, padded layout), without its tensor scale.

    **Arguments:**

    - `x`: the activations `(m, k)`, bfloat16, float16 or float32.
    - `codes`, `scale_bits`: the packed codes `(n or n padded to 16, k_pad / 2)` and the
      E4M3 scales' bits (`(n, k_pad / 16)` for 1x16 blocks, `(n_pad / 16, k_pad / 16)`
      for 16x16 tiles).
    - `block`: `(1, 16)` or `(16, 16)`; `n`: the weight's rows.
    - `operand`: `"bfloat16"` or `"float32"` (see the module docstring).
    - `tiles`: a `Tiles`, by default `default_tiles(m)`.
    - `interpret`: run in Pallas's interpreter (a CPU).

    **Returns:** `(m, n)` float32, `scaled_dot`'s product before its scales, up to
    float32 summation order.
    """
    m, k = x.shape
    block = (block[0], block[1])
    check_packed(codes, scale_bits, block=block, n=n, k=k, operand=operand)
    tiles = default_tiles(m) if tiles is None else tiles
    check_tiles(tiles, block)
    kernel = functools.partial(_kernel, m=m, k=k, block=block, operand=operand, tiles=tiles)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(pl.cdiv(n, tiles.features), pl.cdiv(m, tiles.tokens)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages),
        name="nvfp4_frozen_matmul",
    )(x, codes, scale_bits)
