"""NVFP4 as a GEMM operand format: E2M1 elements, an E4M3 scale per 16 elements (along
the GEMM's contraction axis, or 16x16 tiles of a weight), a float32 tensor scale."""

import functools
from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float

from .. import _kernels
from .._array import NVFP4Array, to_nvfp4
from .._kernels import _native
from .._numerics import _e2m1
from .._numerics._constants import (
    BLOCK,
    BLOCK_BYTES,
    E2M1_MAX,
    NVFP4_BLOCKS,
    NVFP4_RANGE,
    ROW_BLOCK,
    TILE,
    is_tile,
)
from .._numerics._nvfp4 import (
    ROUNDINGS,
    SCALE_ROUNDINGS,
    Block,
    Rounding,
    ScaleRounding,
    expand,
    from_blocks,
    pad_to_blocks,
    quantize_blocks,
    scale_blocks,
    tensor_scales,
    to_blocks,
)
from .._numerics._pack import NIBBLE_SCALE, decode_e4m3, nibble_values
from ._dot import CHUNK, Pairs, apply_scales, chunk_steps, chunked_dot
from ._spec import Format, FormatSpec


def _layout(fmt: Format) -> tuple[Block, Rounding, ScaleRounding]:
    """An nvfp4 `Format`'s block and roundings, with the types `Format` checked them to
    have (it always has a block, its roundings are among `NVFP4Spec`'s)."""
    return (
        cast(Block, fmt.block),
        cast(Rounding, fmt.rounding),
        cast(ScaleRounding, fmt.scale_rounding),
    )


class NVFP4Spec(FormatSpec):
    name = "nvfp4"
    description = "FP4 E2M1 elements, E4M3 scale per 16 elements, float32 tensor scale"
    bits_per_element = 4 + 8 / BLOCK
    blocks = NVFP4_BLOCKS
    roundings = ROUNDINGS
    scale_roundings = SCALE_ROUNDINGS
    shared_tensor_scale = True
    quantizes_pieces = True
    native = _native.NVFP4
    sign_symmetric = True

    def layouts_agree(self, fmt: Format) -> bool:
        """16x16 tiles read the same either way; 1x16 blocks run along one axis."""
        return is_tile(fmt.block)

    def label(self, fmt: Format) -> str:
        block, rounding, scale_rounding = _layout(fmt)
        sr = ", SR" if rounding == "stochastic" else ""
        up = ", scale up" if scale_rounding == "up" else ""
        return f"nvfp4 {block[0]}x{block[1]}{sr}{up}"

    def quantize(
        self, a: Float[Array, "..."], fmt: Format, axis: int, key: jax.Array | None
    ) -> tuple[Array, Float[Array, ""]]:
        if (fast := _kernels.nvfp4_operand(a, *_layout(fmt), axis, key)) is not None:
            return fast  # the backend's kernel, where `_kernels` picks one
        q, sb, s_dec, blk, _, unblock = self._blocks(a, fmt, axis, key)
        return unblock(q * expand(sb, blk)).astype(jnp.bfloat16), s_dec

    def quantize_rht(
        self, a: Float[Array, "t n"], fmt: Format, key: jax.Array | None
    ) -> tuple[Array, Float[Array, ""]]:
        values, s_dec = super().quantize_rht(a, fmt, key)
        return values, jnp.asarray(s_dec, jnp.float32)

    def rht_kernel_request(
        self, a: Float[Array, "t n"], fmt: Format, key: jax.Array | None
    ) -> tuple | None:
        return (a, *_layout(fmt), key)

    def _blocks(self, a: Float[Array, "..."], fmt: Format, axis: int, key: jax.Array | None):
        """The quantiser's work in its block view: `(q, scale_b, s_dec, block, padded,
        unblock)`, `unblock` taking an array of the block view back to `a`'s layout.
        `quantize` and `quantize_saturated` share it."""
        block, rounding, scale_rounding = _layout(fmt)
        if is_tile(block):
            if a.ndim != 2:
                raise ValueError(
                    f"16x16 blocks need a 2-D operand (a weight), got shape {a.shape}."
                )
            blk = TILE

            def unblock(b):
                return from_blocks(b, TILE)[: a.shape[0], : a.shape[1]]

            xp = pad_to_blocks(a, TILE)
        elif a.ndim >= 2 and axis % a.ndim == a.ndim - 2:
            # Blocks down the columns (e.g. wgrad's token axis): no transpose needed.
            blk = (BLOCK, 1)

            def unblock(b):
                return from_blocks(b, blk)[..., : a.shape[-2], :]

            xp = pad_to_blocks(a, blk)
        else:
            blk = block
            moved = jnp.moveaxis(a, axis, -1)
            n = moved.shape[-1]

            def unblock(b):
                return jnp.moveaxis(from_blocks(b, block)[..., :n], -1, axis)

            xp = pad_to_blocks(moved, block)
        q, sb, s_dec = quantize_blocks(xp, blk, rounding, key, None, scale_rounding)
        return q, sb, s_dec, blk, xp, unblock

    def pack(self, w: Float[Array, "n k"], fmt: Format, amax: Array | None = None) -> NVFP4Array:
        return to_nvfp4(w, block=_layout(fmt)[0], amax=amax)

    def quantize_piece(
        self,
        a: Float[Array, "r w"],
        fmt: Format,
        amax: Float[Array, ""],
        key: jax.Array | None,
        offset: Array,
        block: tuple[int, int],
    ) -> tuple[Array, Float[Array, ""]]:
        _, rounding, scale_rounding = _layout(fmt)
        blk = cast(Block, block)
        xp = pad_to_blocks(a, blk)
        v, scale_b, s_dec = scale_blocks(xp, blk, amax, scale_rounding)
        if rounding == "stochastic":
            # (a stochastic format's caller always passes a key)
            q = _e2m1.round_stochastic(v, _e2m1.uniform(cast(jax.Array, key), v.shape, offset))
        else:
            q = _e2m1.round_nearest(v)
        values = from_blocks(q * expand(scale_b, blk), blk)[: a.shape[0], : a.shape[1]]
        return values.astype(jnp.bfloat16), s_dec

    def tensor_decode_scale(self, amax: Float[Array, "*batch"]) -> Float[Array, "*batch"]:
        return jnp.vectorize(lambda m: tensor_scales(m)[1])(amax)

    def packed_product(
        self, x: Array, w: Any, implementation: str, layer: Array | None = None
    ) -> tuple[Float[Array, "*m n"], Array | None] | None:
        if not isinstance(w, NVFP4Array) or len(w.shape) != (2 if layer is None else 3):
            return None
        out = _kernels.frozen_gemm(
            x, w.codes, w.scale_bits, w.block, w.shape[-2:], implementation, layer=layer
        )
        if out is None:
            return None
        scale = w.tensor_scale
        if layer is not None:  # (clamped into range, as the kernel's index)
            scale = lax.dynamic_index_in_dim(scale, layer, keepdims=False)
        return out, scale

    def chunked_gemm(
        self, x: Array, x_scale: Array | None, w: Any, tie: Callable[[Array], Array]
    ) -> Float[Array, "*m n"] | None:
        if not isinstance(w, NVFP4Array) or len(w.shape) != 2:
            return None
        # Only the block scales are decoded before the loop; the codes, inside it.
        w = eqx.tree_at(lambda w: w.scale_bits, w, tie(w.scale_bits))
        k = w.shape[-1]
        out = chunked_dot(x, _chunk_pairs(w, chunk_steps(k)), w.shape[0], k)
        return apply_scales(out, x_scale, w.tensor_scale)

    def quantize_saturated(
        self, a: Float[Array, "..."], fmt: Format, axis: int, key: jax.Array | None
    ) -> tuple[Array, Float[Array, ""], Bool[Array, "..."]]:
        q, sb, s_dec, blk, xp, unblock = self._blocks(a, fmt, axis, key)
        vals = unblock(q * expand(sb, blk)).astype(jnp.bfloat16)
        # Saturated: beyond the largest magnitude of its block, 6 x block scale x s_dec,
        # compared as the integers of their bits (the same order for magnitudes up to
        # inf; a NaN on either side counts nothing, as a float comparison): XLA:CPU
        # would write the float block limits out at full size before the comparison.
        bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
        top = bits(E2M1_MAX * sb * s_dec)
        mag = bits(to_blocks(jnp.abs(xp), blk))
        inf = bits(jnp.float32(jnp.inf))
        sat = (mag > expand(top, blk)) & (mag <= inf) & expand(top >= 0, blk)
        return vals, s_dec, unblock(sat)


NVFP4 = NVFP4Spec()


def _chunk_pairs(w: NVFP4Array, steps: int) -> Pairs:
    """`chunked_dot`'s weight columns decoded from a 2-D `NVFP4Array`, chunk by chunk:
    the values of `w.operand()` (E2M1 value times E4M3 block scale, exact in float32),
    zero past the logical shape. The block scales are decoded once, before the loop."""
    n, k = w.shape
    codes = w.codes
    width = CHUNK * steps  # bytes of codes per row that the steps read
    # (E2M1 value x 2^-14) x (block scale x 2^14): exact, the block value.
    scales = decode_e4m3(w.scale_bits) * jnp.float32(1 / NIBBLE_SCALE)
    if codes.shape[-1] < width:
        codes = jnp.pad(codes, ((0, 0), (0, width - codes.shape[-1])))
        scales = jnp.pad(scales, ((0, 0), (0, width // BLOCK_BYTES - scales.shape[-1])))
    tile = is_tile(w.block)

    def pairs(i):
        c = lax.dynamic_slice_in_dim(codes, i * CHUNK, CHUNK, axis=1)[:n]
        per_chunk = CHUNK // BLOCK_BYTES  # block scales per chunk of codes
        s = lax.dynamic_slice_in_dim(scales, i * per_chunk, per_chunk, axis=1)
        if tile:  # one scale per 16 rows
            s = jnp.broadcast_to(s[:, None], (s.shape[0], BLOCK, s.shape[1]))
            s = s.reshape(-1, s.shape[-1])[:n]
        s = jnp.broadcast_to(s[..., None], (n, per_chunk, BLOCK_BYTES)).reshape(n, CHUNK)
        lo, hi = nibble_values(c)
        even, odd = lo * s, hi * s
        if k % BLOCK:  # a padded block's scale (NaN for a NaN block) must not reach past k
            j = 2 * (i * CHUNK + lax.broadcasted_iota(jnp.int32, (1, CHUNK), 1))
            even = jnp.where(j < k, even, 0.0)
            odd = jnp.where(j + 1 < k, odd, 0.0)
        return even, odd

    return pairs


# --- the row form: what checkpoints of other tools store (Model Optimizer's) ---

#: Elements per block scale along a weight's input features (one E4M3 scale per group).
GROUP_SIZE = BLOCK

#: A weight in rows: `(codes, scale_bits, tensor_scale)` as host arrays, per stacked
#: slice: uint8 codes `[..., out, in/2]` (element `2i` in the low nibble), uint8 bits of
#: the E4M3 block scales `[..., out, in/16]` (row-major, unswizzled: one scale per 16
#: inputs of a row) and the float32 tensor decode scales `[...]`.
Rows = tuple[np.ndarray, np.ndarray, np.ndarray | np.floating]


def to_rows(packed: NVFP4Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`packed` (`[..., out, in]`, `in` a multiple of 16) in rows, unpadded: a 16x16
    tile's scale is repeated over its 16 rows. Decoded by the spec's formula, the rows
    give `packed.dequantize()` bit for bit."""
    out, inn = packed.shape[-2:]
    if inn % GROUP_SIZE:
        raise ValueError(
            f"An NVFP4 weight of {inn} input features has no row form: it needs a multiple "
            f"of {GROUP_SIZE}."
        )
    codes = np.asarray(packed.codes)[..., :out, : inn // 2]
    bits = np.asarray(packed.scale_bits)
    if packed.block == TILE:
        bits = np.repeat(bits, BLOCK, axis=-2)
    return codes, bits[..., :out, :], np.asarray(packed.tensor_scale, np.float32)


def rows_fit(scale_bits: np.ndarray, block: tuple[int, int]) -> bool:
    """Whether row scales `[..., out, in/16]` can be held in `block`: always for 1x16
    blocks; for 16x16 tiles, where each 16-row tile has one scale per column block."""
    if block != TILE:
        return True
    tiles = _tiles(scale_bits)
    return not np.any(tiles != tiles[..., :1, :])


def _tiles(scale_bits: np.ndarray) -> np.ndarray:
    """Row scales as `[..., tiles, 16, in/16]`, the last tile filled up with its last row."""
    pad = -scale_bits.shape[-2] % BLOCK
    if pad:
        last = np.repeat(scale_bits[..., -1:, :], pad, axis=-2)
        scale_bits = np.concatenate([scale_bits, last], axis=-2)
    return scale_bits.reshape(*scale_bits.shape[:-2], -1, BLOCK, scale_bits.shape[-1])


def from_rows(rows: Rows, like: NVFP4Array) -> NVFP4Array:
    """The packed array holding `rows`, in `like`'s layout (block, stack, padding,
    dtype; `like`'s values are not read: it may hold `jax.ShapeDtypeStruct`s). The
    inverse of `to_rows`, bit for bit. Raises `ValueError` where the row scales do not
    fit `like`'s block (`rows_fit`)."""
    codes, bits, tensor_scale = rows
    out, inn = like.shape[-2:]
    full = np.zeros(like.codes.shape, np.uint8)
    full[..., :out, : inn // 2] = codes
    if like.block == TILE:
        if not rows_fit(bits, like.block):
            raise ValueError("The block scales vary within 16-row tiles: not 16x16 blocks.")
        bits = _tiles(bits)[..., 0, :]
    scale_bits = np.zeros(like.scale_bits.shape, np.uint8)
    scale_bits[...] = bits
    return NVFP4Array(
        codes=jnp.asarray(full),
        scales=jnp.asarray(scale_bits),
        tensor_scale=jnp.asarray(
            np.asarray(tensor_scale, np.float32).reshape(like.tensor_scale.shape)
        ),
        block=like.block,
        logical_tail=like.logical_tail,
        dtype=like.dtype,
    )


def tensor_decode_scale(amax) -> np.ndarray:
    """The float32 tensor decode scale `s_dec` NVFP4 gives a tensor of this amax."""
    return np.asarray(tensor_scales(jnp.float32(amax))[1], np.float32)


def amax_for_tensor_scale(scale) -> np.float32:
    """An amax whose tensor decode scale is exactly `scale` (a monotone search from
    `scale x 2688`)."""
    target = np.float32(scale)
    amax = np.float32(target * np.float32(NVFP4_RANGE))
    for _ in range(64):
        got = tensor_decode_scale(amax)
        if got == target:
            return amax
        amax = np.nextafter(amax, np.float32(np.inf if got < target else 0), dtype=np.float32)
    raise RuntimeError(f"nvfp4x: no amax gives the tensor scale {target!r}.")  # pragma: no cover


def requantize_rows(rows: Rows, scale) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One weight's rows (no stack) decoded and quantised again in 1x16 blocks with the
    tensor decode scale `scale` (e.g. the largest of a group that must share one)."""
    codes, bits, tensor_scale = rows
    packed = NVFP4Array(
        codes=jnp.asarray(codes),
        scales=jnp.asarray(bits),
        tensor_scale=jnp.asarray(tensor_scale, jnp.float32),
        block=ROW_BLOCK,
        logical_tail=(2 * codes.shape[-1],),
        dtype=np.float32,
    )
    q = to_nvfp4(packed.dequantize(), amax=jnp.float32(amax_for_tensor_scale(scale)))
    ts = np.asarray(q.tensor_scale, np.float32)
    if ts.tobytes() != np.float32(scale).tobytes():  # pragma: no cover - the search found it
        raise RuntimeError("nvfp4x: requantising missed the tensor scale.")
    return np.asarray(q.codes), np.asarray(q.scale_bits), ts
