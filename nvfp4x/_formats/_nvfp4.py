"""NVFP4 as a GEMM operand format: E2M1 elements, an E4M3 scale per 16 elements (along
the GEMM's contraction axis, or 16x16 tiles of a weight), a float32 tensor scale."""

import functools
from typing import cast

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _kernels
from .._array import NVFP4Array, to_nvfp4
from .._numerics._constants import BLOCK, E2M1_MAX, NVFP4_BLOCKS, TILE, is_tile
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
    to_blocks,
)
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
