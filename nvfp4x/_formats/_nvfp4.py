"""NVFP4 as a GEMM operand format: E2M1 elements, an E4M3 scale per 16 elements (along
the GEMM's contraction axis, or 16x16 tiles of a weight), a float32 tensor scale."""

from typing import cast

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._array import NVFP4Array, to_nvfp4
from .._format._constants import BLOCK, E2M1_MAX, ROW_BLOCK, TILE
from .._format._nvfp4 import (
    SCALE_ROUNDINGS,
    Block,
    Rounding,
    ScaleRounding,
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
    blocks = (ROW_BLOCK, TILE)
    roundings = ("nearest", "stochastic")
    scale_roundings = SCALE_ROUNDINGS
    shared_tensor_scale = True

    def label(self, fmt: Format) -> str:
        block, rounding, scale_rounding = _layout(fmt)
        sr = ", SR" if rounding == "stochastic" else ""
        up = ", scale up" if scale_rounding == "up" else ""
        return f"nvfp4 {block[0]}x{block[1]}{sr}{up}"

    def quantize(
        self, a: Float[Array, "..."], fmt: Format, axis: int, key: jax.Array | None
    ) -> tuple[Array, Float[Array, ""]]:
        block, rounding, scale_rounding = _layout(fmt)
        if block == TILE:
            if a.ndim != 2:
                raise ValueError(
                    f"16x16 blocks need a 2-D operand (a weight), got shape {a.shape}."
                )
            xp = pad_to_blocks(a, TILE)
            q, sb, s_dec = quantize_blocks(xp, TILE, rounding, key, None, scale_rounding)
            vals = from_blocks(q * sb[..., :, None, :, None], TILE)
            return vals[: a.shape[0], : a.shape[1]].astype(jnp.bfloat16), s_dec
        if a.ndim >= 2 and axis % a.ndim == a.ndim - 2:
            # Blocks down the columns (e.g. wgrad's token axis): no transpose needed.
            blk = (BLOCK, 1)
            xp = pad_to_blocks(a, blk)
            q, sb, s_dec = quantize_blocks(xp, blk, rounding, key, None, scale_rounding)
            vals = from_blocks(q * sb[..., :, None, :], blk)[..., : a.shape[-2], :]
            return vals.astype(jnp.bfloat16), s_dec
        moved = jnp.moveaxis(a, axis, -1)
        n = moved.shape[-1]
        xp = pad_to_blocks(moved, block)
        q, sb, s_dec = quantize_blocks(xp, block, rounding, key, None, scale_rounding)
        vals = from_blocks(q * sb[..., None], block)
        return jnp.moveaxis(vals[..., :n], -1, axis).astype(jnp.bfloat16), s_dec

    def pack(self, w: Float[Array, "n k"], fmt: Format, amax: Array | None = None) -> NVFP4Array:
        return to_nvfp4(w, block=_layout(fmt)[0], amax=amax)

    def saturated_frac(self, a: Float[Array, "..."], fmt: Format, axis: int) -> Float[Array, ""]:
        # Saturated: beyond the largest magnitude of its block, 6 x block scale x s_dec.
        # That magnitude is the block's largest |deq| whenever any element hit it.
        blk, _, scale_rounding = _layout(fmt)
        moved = a if blk == TILE else jnp.moveaxis(a, axis, -1)
        padded = pad_to_blocks(moved, blk)
        _, sb, s_dec = quantize_blocks(padded, blk, "nearest", None, None, scale_rounding)
        top = E2M1_MAX * sb * s_dec
        top = top[..., None] if blk[0] == 1 else top[..., :, None, :, None]
        magnitude = to_blocks(jnp.abs(padded), blk)
        return jnp.sum(magnitude > top) / a.size


NVFP4 = NVFP4Spec()
